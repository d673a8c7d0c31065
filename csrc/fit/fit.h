// Fit-Poly value codec (deepreduce/values/polyfit.py): signed descending sort, greedy chord
// segmentation and least-squares polynomial fits in a Legendre basis on [-1, 1], over plain
// buffers, and the codec's params rule. The pybind11 module deepreduce._fit and the TF pipeline
// ops (csrc/pipeline) call these functions. Every function checks its bounds and throws
// deepreduce::Error (common/error.h) instead of reading or writing out of range; a payload that
// cannot be decoded is refused with the text of polyfit.py's ContainerError.
//
// Params: u8 degree | u8 coefficient bytes (4 or 8).
// Payload layout (little-endian), identical to deepreduce/values/polyfit.py:
//   u32 l                        number of values >= 0 (they come first in sorted order)
//   u32 len[k]                   segment lengths: positive part until they sum to l, then the
//                                negative part until they sum to n
//   coef[..]                     per segment, min(degree, len-1)+1 Legendre coefficients,
//                                float32 (coef_bytes = 4) or float64 (coef_bytes = 8)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace deepreduce {
namespace fit {

constexpr int MAX_DEGREE = 15;
constexpr size_t PARAMS_BYTES = 2;

struct Params {
    int degree = 5;
    int coef_bytes = 4;
};

// The params bytes of (degree, coef_bytes).
std::string pack_params(const Params& p);
// PolyFit._params: the checked params (ErrorKind::CONTAINER with the core's text).
Params unpack_params(const uint8_t* params, size_t len);

// Stable permutation that sorts v descending by signed value (ties keep input order; +0.0
// sorts before -0.0, as the float32 bit pattern orders them). perm has n entries.
void sort_desc(const float* v, int64_t n, int64_t* perm);

// The automatic segment count per sign for n values: 4 + ceil(log2(n / 1000)) for n > 1000,
// else 4, at most max(1, n / 64) (12 at n = 255,570, the 1% of ResNet-50; 1 below 128
// values). max_segments = 0 means this everywhere.
int auto_segments(int64_t n);

// Upper bound of the payload size of encode.
int64_t payload_bound(int64_t n, int degree, int max_segments, int coef_bytes);

// Encode n values with at most max_segments segments per sign (0: automatic). Writes the sort
// permutation to perm (n entries: decoded value j belongs to input position perm[j]) and the
// payload to out (out_capacity >= payload_bound). Returns the payload size; ErrorKind::ARGUMENT
// for bad arguments, ErrorKind::ENCODE for a fit that cannot be sent.
int64_t encode(const float* values, int64_t n, int degree, int max_segments, int min_points, int coef_bytes,
               int64_t* perm, uint8_t* out, int64_t out_capacity);

// Check that a payload of len bytes can hold n values (its segment table adds up to n, its
// coefficients fill the rest) without writing anything (polyfit.parse_lengths and the length
// check of decode_numpy). Call it before allocating the n outputs of decode, which repeats it.
void check_payload(const uint8_t* payload, int64_t len, int64_t n, int degree, int coef_bytes);

// Decode a payload of len bytes into n float32 values (in sorted order).
void decode(const uint8_t* payload, int64_t len, int64_t n, int degree, int coef_bytes, float* out);

}  // namespace fit
}  // namespace deepreduce
