// Passes over whole float32 tensors for the pipeline's hot path (deepreduce._select):
// compensation fused with the finiteness scan and the gathering of Top-r candidates, Top-r
// radix selection with the project's tie rule, chunked Top-k (rows of `chunk` elements, split
// among the threads by whole rows), threshold and non-zero selection, and scatter-add decode.
//
// Every other kernel splits its input into `threads` chunks of whole blocks and combines the chunks'
// results in chunk order, so the thread count never changes a result (callers bound threads by
// deepreduce::check_threads, common/checks.h).
#pragma once
#include <cstdint>
#include <vector>

namespace deepreduce {
namespace select {

constexpr int HIST_BITS = 11;               // buckets: top 11 bits of the magnitude pattern
constexpr int HIST_SHIFT = 31 - HIST_BITS;  // sign bit cleared, so 31 significant bits
constexpr int64_t HIST_SIZE = int64_t{1} << HIST_BITS;
constexpr int64_t BLOCK = 4096;                       // a non-finite block is never added to a residual
constexpr int64_t FUSED_MIN_SIZE = int64_t{1} << 14;  // smaller tensors: no sampled bound

enum class Scan { NON_FINITE, FINITE, SELECTED };

// One pass over the gradient g[0..n): checks that it is finite and, with `residual`, writes the
// compensated gradient prior + g into it: `prior` is `residual` itself (in place) or the previous
// residual, read and left intact, so a step that is undone needs no copy of it (Memory.step_buffers).
// If g holds a NaN/Inf, returns NON_FINITE and residual ends holding prior: in place, blocks
// holding one are left alone and the others are taken out again (residual = (residual + g) - g);
// out of place, prior is copied (exact). With 0 < topk_r < n, also writes the Top-r positions of
// the compensated gradient (as topk) into out and returns SELECTED: from FUSED_MIN_SIZE entries on,
// a sample of the compensated gradient (1/16 of it, 1,024 to 65,536 entries) gives a magnitude
// bound about 1.3 r entries reach, the same pass gathers those entries, and the Top-r is resolved
// among them (if fewer than r reach the bound, or the tensor is smaller, topk runs on its own).
Scan scan(const float* g, const float* prior, float* residual, int64_t n, int64_t topk_r, int threads, int64_t* out);

// Ascending positions of the r entries of largest |x| (0 < r < n): every entry above the r-th
// largest magnitude, then the entries equal to it, lowest position first. A radix select on the
// magnitude bit patterns: a histogram of their top HIST_BITS bits finds the bucket of the cut,
// one pass gathers that bucket and above, the cut is resolved among those (a radix select of
// the candidates' keys, digit by digit). Writes r positions.
void topk(const float* x, int64_t n, int64_t r, int threads, int64_t* out);

// Chunked Top-k: ascending positions of the k entries of largest |x| in every chunk [c chunk,
// (c + 1) chunk) and of the tail_k largest in the tail chunk of n mod chunk entries (ties: lowest
// position first; a chunk no longer than its count keeps every entry). Writes
// (n / chunk) min(k, chunk) + min(tail_k, n mod chunk) positions. chunk < 2^32.
void chunk_topk(const float* x, int64_t n, int64_t chunk, int64_t k, int64_t tail_k, int threads, int64_t* out);

// Ascending positions with |x| >= t.
std::vector<int64_t> threshold(const float* x, int64_t n, float t, int threads);

// Ascending positions of the non-zero entries of x (every bit pattern but +0 and -0, so NaN
// counts, as in numpy.flatnonzero): nonzero_counts gives each chunk's count (the caller sizes
// the output from their sum), nonzero writes the positions, branch-free (at half density a
// branch per entry is mispredicted every other time).
std::vector<int64_t> nonzero_counts(const float* x, int64_t n, int threads);
void nonzero(const float* x, int64_t n, const std::vector<int64_t>& counts, int64_t* out);

// out[idx[j]] += val[j] for j < n. The checked form first verifies that idx is strictly
// ascending and inside [0, numel); it throws ErrorKind::CONTAINER (nothing written) if not.
void scatter_add_checked(float* out, int64_t numel, const int64_t* idx, const float* val, int64_t n, int threads);
void scatter_add(float* out, const int64_t* idx, const float* val, int64_t n, int threads);
// out[idx[j]] += val[j] for distinct idx in any order, after checking every idx is inside
// [0, numel): ErrorKind::ARGUMENT "scatter_add: index i at j is outside [0, numel)" (the first
// such j; nothing written) if not. Distinctness is the caller's.
void scatter_add_in_range(float* out, int64_t numel, const int64_t* idx, const float* val, int64_t n, int threads);

// QSGD encode (deepreduce/values/qsgd.py: the same float64 arithmetic in the same order, so the
// same bytes): per bucket of `bucket` values (min(bucket, n) when larger) the float32 L2 norm
// rounded up, its squares summed pairwise like qsgd.bucket_norms; then q_i = sign(v_i) *
// min(floor(z_i) + [u_i < z_i - floor(z_i)], levels) with z_i = levels |v_i| / norm and u_i the
// counter-based uniform draw i of `seed` (hashing.counter_uniform), and the receiver's value
// norm * q_i / levels as float32 into recon. Writes ceil(n / bucket) norms and n levels into
// q8 (levels <= 127) or q16. Returns false, with the outputs unspecified, if a norm is not finite.
bool qsgd_encode(const float* v, int64_t n, int levels, int64_t bucket, uint64_t seed, int threads, float* norms,
                 int8_t* q8, int16_t* q16, float* recon);

// Bin-mean codes (deepreduce/values/binmean.py) for up to 16 bins: the equal-count start (the value
// of stable rank r gets floor(r bins / n), found with nth_element and the ties' input order),
// then `iterations` Lloyd steps, each bin's float64 mean summed in input order as numpy's
// bincount sums it and each value moved to the cut interval it is at or above, so the same codes
// and means as the NumPy code. Writes n codes and `bins` float32 means (0 for an empty bin).
// Returns false, writing nothing defined, if a value is not finite (the caller's sort path).
bool binmean_codes(const float* v, int64_t n, int bins, int iterations, float* means, uint8_t* codes);

}  // namespace select
}  // namespace deepreduce
