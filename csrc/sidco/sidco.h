// SIDCo kernels over plain float32 buffers: one-pass magnitude statistics and threshold
// selection, so threshold estimation costs a couple of memory passes (no abs copy, no sort).
// Magnitudes are |x|; comparisons are done in float32 against a float32 threshold.
#pragma once
#include <cstdint>

extern "C" {
// out[0] = number of non-zero entries, out[1] = sum of |x| (float64),
// out[2] = sum of log|x| over the non-zero entries when want_log, else 0.
void dr_sidco_abs_stats(const float* x, int64_t n, int want_log, double* out);
// Sum over the non-zero entries of (|x| - mean)^2 (float64).
double dr_sidco_abs_sq_dev(const float* x, int64_t n, double mean);
// Number of entries with |x| > eta (strict != 0) or |x| >= eta (strict == 0).
int64_t dr_sidco_abs_count(const float* x, int64_t n, float eta, int strict);
// Writes |x_j| for every |x_j| > eta, in order, into out (capacity cap, which must exceed the
// count by one: the spare slot absorbs branch-free writes); returns the count, or -1 if cap is
// too small (never writes past out[cap - 1]).
int64_t dr_sidco_abs_exceed(const float* x, int64_t n, float eta, float* out, int64_t cap);
// Writes every position j with |x_j| >= eta, ascending, into out (capacity cap >= count + 1,
// as above); returns the count, or -1 if cap is too small.
int64_t dr_sidco_abs_select(const float* x, int64_t n, float eta, int64_t* out, int64_t cap);
}
