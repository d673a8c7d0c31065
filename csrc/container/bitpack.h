// Fixed-width bit packing of deepreduce/wire/bitpack.py, in C++: entry i occupies stream bits
// [i*w, (i+1)*w), bit j of the entry is stream bit i*w + j, stream bit p is bit p % 8 of byte
// p / 8, the last byte zero padded. Used by the pybind11 module deepreduce._container (the host
// path of bitpack.pack / unpack) and the TensorFlow ops (permutation sections).
#pragma once

#include <cstddef>
#include <cstdint>

namespace deepreduce {
namespace bitpack {

// Bytes that `count` entries of `width` bits occupy.
size_t packed_size(uint64_t count, int width);

// Pack `count` entries (each below 2^width, width in [1, 64]) into out[0 .. packed_size).
void pack(const uint64_t* values, uint64_t count, int width, uint8_t* out);

// Throws ErrorKind::CONTAINER with bitpack.unpack's text unless `len` bytes hold exactly `count`
// entries of `width` bits (width in [1, 64]). Check before sizing an output from a header's count.
void check(size_t len, int width, uint64_t count);

// Unpack `count` entries of `width` bits from `len` bytes into out (check's error first: then
// nothing is written).
void unpack(const uint8_t* data, size_t len, int width, uint64_t count, uint64_t* out);

}  // namespace bitpack
}  // namespace deepreduce
