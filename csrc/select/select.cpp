// Hot-path kernels of deepreduce._select (see select.h for the contracts).
#include "select.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <thread>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace dr_select {
namespace {

constexpr int64_t kMinPerThread = int64_t{1} << 16;  // below this a thread costs more than it saves
constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kExpMask = 0x7F800000u;
constexpr int kSubHists = 4;  // interleaved sub-histograms: runs of one bucket do not serialise

inline uint32_t bits_of(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline uint32_t magnitude_key(float v) { return bits_of(v) & kAbsMask; }

// Chunk c of `chunks` over [0, n), boundaries on multiples of kBlock.
struct Chunks {
  int64_t n;
  int count;
  Chunks(int64_t n_, int threads) : n(n_) {
    int64_t useful = std::max<int64_t>(1, n / kMinPerThread);
    count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
  }
  int64_t begin(int c) const {
    int64_t blocks = (n + kBlock - 1) / kBlock;
    return std::min(n, blocks * c / count * kBlock);
  }
  int64_t end(int c) const { return begin(c + 1); }
};

// Runs body(c) for every chunk, chunk 0 on the calling thread.
void run_chunks(int count, const std::function<void(int)>& body) {
  if (count <= 1) {
    body(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(count - 1);
  for (int c = 1; c < count; ++c) pool.emplace_back(body, c);
  body(0);
  for (auto& t : pool) t.join();
}

inline bool block_finite(const float* g, int64_t len) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < len; ++i) bad |= static_cast<uint32_t>((bits_of(g[i]) & kExpMask) == kExpMask);
  return bad == 0;
}

// Histogram of the magnitude buckets of x[0..len) into sub-histograms h[kSubHists][kHistSize].
inline void count_buckets(const float* x, int64_t len, uint32_t* h) {
  int64_t i = 0;
  for (; i + kSubHists <= len; i += kSubHists) {
    for (int s = 0; s < kSubHists; ++s) ++h[s * kHistSize + (magnitude_key(x[i + s]) >> kHistShift)];
  }
  for (; i < len; ++i) ++h[magnitude_key(x[i]) >> kHistShift];
}

// Adds the uint32 sub-histograms into out (uint64) and clears them.
inline void flush_buckets(uint32_t* h, uint64_t* out) {
  for (int s = 0; s < kSubHists; ++s) {
    for (int64_t b = 0; b < kHistSize; ++b) {
      out[b] += h[s * kHistSize + b];
      h[s * kHistSize + b] = 0;
    }
  }
}

constexpr int64_t kFlushEvery = int64_t{1} << 30;  // uint32 sub-counters never overflow
// Calls emit(i), in order, for every i in [lo, hi) with keep(x[i]). keep must imply
// magnitude_key(x[i]) >= low. Selections keep few entries: 16 keys at a time are compared with
// `low` into a bit mask (SSE2 where available), and only its set bits are visited.
template <class Keep, class Emit>
inline void gather(const float* x, int64_t lo, int64_t hi, uint32_t low, Keep keep, Emit emit) {
  int64_t i = lo;
#ifdef __SSE2__
  const __m128i abs_mask = _mm_set1_epi32(static_cast<int>(kAbsMask));
  const __m128i bound = _mm_set1_epi32(static_cast<int>(low) - 1);  // keys and low are < 2^31
  for (; i + 16 <= hi; i += 16) {
    unsigned mask = 0;
    for (int q = 0; q < 4; ++q) {
      const __m128i v = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 4 * q)), abs_mask);
      mask |= static_cast<unsigned>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(v, bound)))) << (4 * q);
    }
    while (mask) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      if (keep(x[i + j])) emit(i + j);
    }
  }
#endif
  for (; i < hi; ++i)
    if (keep(x[i])) emit(i);
}

}  // namespace

bool scan(const float* g, float* residual, int64_t n, uint64_t* hist, int threads) {
  Chunks chunks(n, threads);
  std::vector<std::vector<uint64_t>> partial(chunks.count);
  std::vector<char> finite(chunks.count, 1);
  run_chunks(chunks.count, [&](int c) {
    const int64_t lo = chunks.begin(c), hi = chunks.end(c);
    std::vector<uint32_t> sub;
    if (hist) {
      partial[c].assign(kHistSize, 0);
      sub.assign(kSubHists * kHistSize, 0);
    }
    int64_t since_flush = 0;
    for (int64_t b = lo; b < hi; b += kBlock) {
      const int64_t len = std::min(kBlock, hi - b);
      if (!block_finite(g + b, len)) {
        finite[c] = 0;
        continue;
      }
      const float* source = g + b;
      if (residual) {
        float* r = residual + b;
        for (int64_t i = 0; i < len; ++i) r[i] += g[b + i];
        source = r;
      }
      if (hist && finite[c]) {
        count_buckets(source, len, sub.data());
        since_flush += len;
        if (since_flush >= kFlushEvery) {
          flush_buckets(sub.data(), partial[c].data());
          since_flush = 0;
        }
      }
    }
    if (hist) flush_buckets(sub.data(), partial[c].data());
  });
  const bool all_finite = std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
  if (!all_finite) {
    if (residual) {  // take the step out again: only the finite blocks were added
      run_chunks(chunks.count, [&](int c) {
        for (int64_t b = chunks.begin(c), hi = chunks.end(c); b < hi; b += kBlock) {
          const int64_t len = std::min(kBlock, hi - b);
          if (!block_finite(g + b, len)) continue;
          float* r = residual + b;
          for (int64_t i = 0; i < len; ++i) r[i] -= g[b + i];
        }
      });
    }
    return false;
  }
  if (hist) {
    std::fill(hist, hist + kHistSize, uint64_t{0});
    for (const auto& p : partial)
      for (int64_t b = 0; b < kHistSize; ++b) hist[b] += p[b];
  }
  return true;
}

void topk(const float* x, int64_t n, int64_t r, const uint64_t* hist, int threads, int64_t* out) {
  std::vector<uint64_t> own;
  if (!hist) {
    own.assign(kHistSize, 0);
    Chunks chunks(n, threads);
    std::vector<std::vector<uint64_t>> partial(chunks.count, std::vector<uint64_t>(kHistSize, 0));
    run_chunks(chunks.count, [&](int c) {
      std::vector<uint32_t> sub(kSubHists * kHistSize, 0);
      for (int64_t b = chunks.begin(c), hi = chunks.end(c); b < hi; b += kFlushEvery) {
        count_buckets(x + b, std::min(kFlushEvery, hi - b), sub.data());
        flush_buckets(sub.data(), partial[c].data());
      }
    });
    for (const auto& p : partial)
      for (int64_t b = 0; b < kHistSize; ++b) own[b] += p[b];
    hist = own.data();
  }
  // The bucket holding the r-th largest magnitude, and how many lie in buckets above it.
  int64_t bucket = kHistSize - 1;
  uint64_t above_bucket = 0;
  for (; bucket > 0; --bucket) {
    if (above_bucket + hist[bucket] >= static_cast<uint64_t>(r)) break;
    above_bucket += hist[bucket];
  }
  const uint32_t low = static_cast<uint32_t>(bucket) << kHistShift;

  // Gather every entry of that bucket and above, per chunk, in position order.
  Chunks chunks(n, threads);
  std::vector<std::vector<int64_t>> pos(chunks.count);
  std::vector<std::vector<uint32_t>> key(chunks.count);
  uint64_t at_or_above = above_bucket + hist[bucket];
  run_chunks(chunks.count, [&](int c) {
    const int64_t lo = chunks.begin(c), hi = chunks.end(c);
    const double share = static_cast<double>(hi - lo) / static_cast<double>(n);
    const size_t guess = static_cast<size_t>(share * static_cast<double>(at_or_above) * 1.25) + 64;
    pos[c].reserve(guess);
    key[c].reserve(guess);
    gather(
        x, lo, hi, low, [low](float v) { return magnitude_key(v) >= low; },
        [&](int64_t i) {
          pos[c].push_back(i);
          key[c].push_back(magnitude_key(x[i]));
        });
  });

  // The cut: the (r - above_bucket)-th largest key inside the bucket.
  std::vector<uint32_t> inside;
  inside.reserve(hist[bucket]);
  for (int c = 0; c < chunks.count; ++c)
    for (uint32_t k : key[c])
      if ((k >> kHistShift) == static_cast<uint32_t>(bucket)) inside.push_back(k);
  const int64_t rank = r - static_cast<int64_t>(above_bucket);  // 1-based, within the bucket
  if (inside.size() != hist[bucket] || rank < 1 || static_cast<uint64_t>(rank) > inside.size())
    throw std::invalid_argument("topk: the histogram does not describe these values");
  std::nth_element(inside.begin(), inside.begin() + (rank - 1), inside.end(), std::greater<uint32_t>());
  const uint32_t cut = inside[rank - 1];

  // Entries above the cut, then the ties at the cut lowest position first: per-chunk counts
  // give every chunk its output offset and its share of the ties.
  std::vector<int64_t> above(chunks.count, 0), ties(chunks.count, 0);
  for (int c = 0; c < chunks.count; ++c) {
    for (uint32_t k : key[c]) {
      above[c] += k > cut;
      ties[c] += k == cut;
    }
  }
  int64_t total_above = 0;
  for (int64_t a : above) total_above += a;
  int64_t ties_left = r - total_above;
  std::vector<int64_t> take(chunks.count, 0), offset(chunks.count, 0);
  int64_t written = 0;
  for (int c = 0; c < chunks.count; ++c) {
    take[c] = std::min(ties[c], ties_left);
    ties_left -= take[c];
    offset[c] = written;
    written += above[c] + take[c];
  }
  run_chunks(chunks.count, [&](int c) {
    int64_t o = offset[c], taken = 0;
    const auto& p = pos[c];
    const auto& k = key[c];
    for (size_t j = 0; j < p.size(); ++j) {
      if (k[j] > cut) {
        out[o++] = p[j];
      } else if (k[j] == cut && taken < take[c]) {
        out[o++] = p[j];
        ++taken;
      }
    }
  });
}

std::vector<int64_t> threshold(const float* x, int64_t n, float t, int threads) {
  Chunks chunks(n, threads);
  std::vector<std::vector<int64_t>> found(chunks.count);
  run_chunks(chunks.count, [&](int c) {
    gather(
        x, chunks.begin(c), chunks.end(c), t > 0.0f ? magnitude_key(t) : 0u, [t](float v) { return std::fabs(v) >= t; },
        [&](int64_t i) { found[c].push_back(i); });
  });
  if (chunks.count == 1) return std::move(found[0]);
  size_t total = 0;
  for (const auto& f : found) total += f.size();
  std::vector<int64_t> out;
  out.reserve(total);
  for (const auto& f : found) out.insert(out.end(), f.begin(), f.end());
  return out;
}

std::string scatter_add_checked(float* out, int64_t numel, const int64_t* idx, const float* val, int64_t n,
                                int threads) {
  if (n == 0) return "";
  Chunks chunks(n, threads);
  std::atomic<bool> ordered{true};
  run_chunks(chunks.count, [&](int c) {
    const int64_t lo = chunks.begin(c), hi = chunks.end(c);
    bool ok = true;
    for (int64_t j = std::max<int64_t>(lo, 1); j < hi; ++j) ok &= idx[j] > idx[j - 1];
    if (!ok) ordered.store(false, std::memory_order_relaxed);
  });
  if (!ordered.load())
    return "container indices are not strictly ascending although the index codec promises ascending order "
           "(an index is repeated or out of order)";
  if (idx[0] < 0 || idx[n - 1] >= numel)
    return "container index out of range for a tensor of " + std::to_string(numel) + " elements";
  scatter_add(out, idx, val, n, threads);
  return "";
}

void scatter_add(float* out, const int64_t* idx, const float* val, int64_t n, int threads) {
  Chunks chunks(n, threads);
  run_chunks(chunks.count, [&](int c) {
    for (int64_t j = chunks.begin(c), hi = chunks.end(c); j < hi; ++j) out[idx[j]] += val[j];
  });
}

}  // namespace dr_select
