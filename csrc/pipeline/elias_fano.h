// The Elias-Fano index codec (deepreduce/index/elias_fano.py EliasFanoIndex) in C++: the same
// bit stream (r indices of [0, d): their L = floor(log2(d / r)) low bits packed LSB first, then
// the unary bitmap of the high parts, padded to a byte) and the same checks on decode, each
// raising ErrorKind::CONTAINER with the Python codec's text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace deepreduce {
namespace elias_fano {

constexpr uint8_t WIRE_ID = 6;  // EliasFanoIndex.wire_id

// elias_fano.low_bits and stream_bits: the low bits per index and the stream's bits before padding.
int low_bits(uint64_t r, uint64_t d);
uint64_t stream_bits(uint64_t r, uint64_t d);

// The index section of the r strictly ascending positions of [0, d).
std::vector<uint8_t> encode(const uint64_t* ascending, uint64_t r, uint64_t d);

// The r positions (strictly ascending, inside [0, d)) of an index section of `len` bytes; a
// section with params (`params_len` > 0), of the wrong length, with non-zero padding, with
// another count of upper bits or decoding out of order or range is refused.
std::vector<int64_t> decode(const uint8_t* section, uint64_t len, uint64_t params_len, uint64_t r, uint64_t d);

}  // namespace elias_fano
}  // namespace deepreduce
