// SIDCo kernels over plain float32 buffers: one-pass magnitude statistics and threshold
// selection, so threshold estimation costs a couple of memory passes (no abs copy, no sort).
// Magnitudes are |x|; comparisons are done in float32 against a float32 threshold.
#pragma once
#include <cstdint>

namespace deepreduce {
namespace sidco {

// out[0] = number of non-zero entries, out[1] = sum of |x| (float64),
// out[2] = sum of log|x| over the non-zero entries when want_log, else 0.
void abs_stats(const float* x, int64_t n, bool want_log, double* out);
// Sum over the non-zero entries of (|x| - mean)^2 (float64).
double abs_sq_dev(const float* x, int64_t n, double mean);
// Number of entries with |x| > eta (strict) or |x| >= eta (not strict).
int64_t abs_count(const float* x, int64_t n, float eta, bool strict);
// Writes |x_j| for every |x_j| > eta, in order, into out (capacity cap, which must exceed the
// count by one: the spare slot absorbs branch-free writes); returns the count. Never writes past
// out[cap - 1]: a capacity that is too small throws ErrorKind::ARGUMENT.
int64_t abs_exceed(const float* x, int64_t n, float eta, float* out, int64_t cap);
// Writes every position j with |x_j| >= eta, ascending, into out (capacity cap >= count + 1,
// as above); returns the count.
int64_t abs_select(const float* x, int64_t n, float eta, int64_t* out, int64_t cap);

}  // namespace sidco
}  // namespace deepreduce
