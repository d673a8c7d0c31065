// Fit-Poly value codec kernel: signed descending sort, greedy chord segmentation and
// least-squares polynomial fits in a Legendre basis on [-1, 1], over plain buffers.
//
// This is the C API shared by the pybind11 module (py_module.cpp) and the TensorFlow custom
// ops. Every function checks its bounds and returns a negative DR_FIT_E* code instead of
// reading or writing out of range; dr_fit_error_message() names the problem.
//
// Payload layout (little-endian), identical to deepreduce/values/polyfit.py:
//   u32 l                        number of values >= 0 (they come first in sorted order)
//   u32 len[k]                   segment lengths: positive part until they sum to l, then the
//                                negative part until they sum to n
//   coef[..]                     per segment, min(degree, len-1)+1 Legendre coefficients,
//                                float32 (coef_bytes = 4) or float64 (coef_bytes = 8)
#ifndef DEEPREDUCE_FIT_H_
#define DEEPREDUCE_FIT_H_

#include <cstdint>

#ifdef __cplusplus
extern "C" {
#endif

enum {
  DR_FIT_OK = 0,
  DR_FIT_E_ARG = -1,        // invalid argument (degree, segment count, coefficient width)
  DR_FIT_E_CAPACITY = -2,   // output buffer too small
  DR_FIT_E_LENGTH = -3,     // payload length does not match its segment table
  DR_FIT_E_SEGMENTS = -4,   // segment lengths are zero or do not add up to l and n
  DR_FIT_E_SINGULAR = -5,   // normal equations not positive definite (cannot happen for
                            // distinct abscissae; reported rather than hidden)
  DR_FIT_E_NONFINITE = -6,  // a coefficient or value is NaN/Inf
};

const char* dr_fit_error_message(int code);

// Stable permutation that sorts v descending by signed value (ties keep input order;
// +0.0 sorts before -0.0, as the float32 bit pattern orders them). perm has n entries.
int dr_sort_desc(const float* v, int64_t n, int64_t* perm);

// The automatic segment count per sign for n values: 4 + ceil(log2(n / 1000)) for n > 1000,
// else 4, at most max(1, n / 64) (12 at n = 255,570, the 1% of ResNet-50; 1 below 128
// values). max_segments = 0 means this everywhere.
int dr_polyfit_auto_segments(int64_t n);

// Upper bound of the payload size of dr_polyfit_encode.
int64_t dr_polyfit_payload_bound(int64_t n, int degree, int max_segments, int coef_bytes);

// Encode n values with at most max_segments segments per sign (0: automatic). Writes the sort permutation to perm (n entries: decoded value j belongs to
// input position perm[j]) and the payload to out. Returns the payload size or a negative code.
int64_t dr_polyfit_encode(const float* values, int64_t n, int degree, int max_segments,
                          int min_points, int coef_bytes, int64_t* perm, uint8_t* out,
                          int64_t out_capacity);

// Check that a payload of len bytes can hold n values (its segment table adds up to n, its
// coefficients fill the rest) without writing anything: 0 or a negative code. Call it before
// allocating the n outputs of dr_polyfit_decode, which repeats the check.
int dr_polyfit_check(const uint8_t* payload, int64_t len, int64_t n, int degree, int coef_bytes);
// Decode a payload of len bytes into n float32 values (in sorted order). 0 or a negative code.
int dr_polyfit_decode(const uint8_t* payload, int64_t len, int64_t n, int degree,
                      int coef_bytes, float* out);

#ifdef __cplusplus
}
#endif

#endif  // DEEPREDUCE_FIT_H_
