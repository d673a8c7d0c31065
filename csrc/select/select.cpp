// Hot-path kernels of deepreduce._select (see select.h for the contracts).
#include "select.h"

#include "bloom/bloom.h"  // mix64 and GAMMA: the one C++ definition of SplitMix64
#include "common/error.h"
#include "common/multiversion.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace deepreduce {
namespace select {
namespace {

constexpr int64_t MIN_PER_THREAD = int64_t{1} << 16;  // below this a thread costs more than it saves
constexpr uint32_t ABS_MASK = 0x7FFFFFFFu;
constexpr uint32_t EXP_MASK = 0x7F800000u;
constexpr int SUB_HISTS = 4;  // interleaved sub-histograms: runs of one bucket do not serialise

inline uint32_t bits_of(float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u;
}

inline uint32_t magnitude_key(float v) {
    return bits_of(v) & ABS_MASK;
}

// Chunk c of `chunks` over [0, n), boundaries on multiples of BLOCK.
struct Chunks {
    int64_t n;
    int count;
    Chunks(int64_t n_, int threads) : n(n_) {
        int64_t useful = std::max<int64_t>(1, n / MIN_PER_THREAD);
        count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
    }
    int64_t begin(int c) const {
        int64_t blocks = (n + BLOCK - 1) / BLOCK;
        return std::min(n, blocks * c / count * BLOCK);
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
    for (int64_t i = 0; i < len; ++i) bad |= static_cast<uint32_t>((bits_of(g[i]) & EXP_MASK) == EXP_MASK);
    return bad == 0;
}

// Histogram of the magnitude buckets of x[0..len) into sub-histograms h[SUB_HISTS][HIST_SIZE].
inline void count_buckets(const float* x, int64_t len, uint32_t* h) {
    int64_t i = 0;
    for (; i + SUB_HISTS <= len; i += SUB_HISTS) {
        for (int s = 0; s < SUB_HISTS; ++s) ++h[s * HIST_SIZE + (magnitude_key(x[i + s]) >> HIST_SHIFT)];
    }
    for (; i < len; ++i) ++h[magnitude_key(x[i]) >> HIST_SHIFT];
}

// Adds the uint32 sub-histograms into out (uint64) and clears them.
inline void flush_buckets(uint32_t* h, uint64_t* out) {
    for (int s = 0; s < SUB_HISTS; ++s) {
        for (int64_t b = 0; b < HIST_SIZE; ++b) {
            out[b] += h[s * HIST_SIZE + b];
            h[s * HIST_SIZE + b] = 0;
        }
    }
}

constexpr int64_t FLUSH_EVERY = int64_t{1} << 30;  // uint32 sub-counters never overflow
// Calls emit(i), in order, for every i in [lo, hi) with keep(x[i]). keep must imply
// magnitude_key(x[i]) >= low. Selections keep few entries: 16 keys at a time are compared with
// `low` into a bit mask (SSE2 where available), and only its set bits are visited.
template <class Keep, class Emit>
inline void gather(const float* x, int64_t lo, int64_t hi, uint32_t low, Keep keep, Emit emit) {
    int64_t i = lo;
#ifdef __SSE2__
    const __m128i abs_mask = _mm_set1_epi32(static_cast<int>(ABS_MASK));
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

// Entries with magnitude key >= a bound, per chunk in position order.
struct Candidates {
    std::vector<std::vector<int64_t>> pos;
    std::vector<std::vector<uint32_t>> key;
    explicit Candidates(int chunks) : pos(chunks), key(chunks) {}
    int64_t size() const {
        int64_t total = 0;
        for (const auto& p : pos) total += static_cast<int64_t>(p.size());
        return total;
    }
    void reserve(int c, int64_t guess) {
        pos[c].reserve(static_cast<size_t>(guess));
        key[c].reserve(static_cast<size_t>(guess));
    }
    void gather_from(int c, const float* x, int64_t lo, int64_t hi, uint32_t low) {
        gather(
            x, lo, hi, low, [low](float v) { return magnitude_key(v) >= low; },
            [&](int64_t i) {
                pos[c].push_back(i);
                key[c].push_back(magnitude_key(x[i]));
            });
    }
};

// The r-th largest of `keys` (1 <= r <= keys.size()) by radix select: a histogram of one digit
// (11, 11, then the last 9 bits) finds the digit of the cut, and only the keys with that digit
// move on. Linear and branch-light where nth_element's partitioning mispredicts; below
// RADIX_MIN keys, nth_element (the histograms' fixed cost would dominate).
constexpr size_t RADIX_MIN = 4096;
uint32_t radix_cut(std::vector<uint32_t> keys, int64_t r) {
    if (keys.size() < RADIX_MIN) {
        std::nth_element(keys.begin(), keys.begin() + (r - 1), keys.end(), std::greater<uint32_t>());
        return keys[r - 1];
    }
    constexpr int SHIFT[3] = {20, 9, 0};
    constexpr uint32_t DIGITS[3] = {2048, 2048, 512};
    std::vector<int64_t> hist(2048);
    uint32_t prefix = 0;
    for (int level = 0; level < 3; ++level) {
        const int shift = SHIFT[level];
        const uint32_t mask = DIGITS[level] - 1;
        std::fill(hist.begin(), hist.end(), 0);
        for (uint32_t k : keys) ++hist[(k >> shift) & mask];
        uint32_t digit = mask;
        int64_t above = 0;
        for (; digit > 0 && above + hist[digit] < r; --digit) above += hist[digit];
        r -= above;  // the cut is the r-th largest of the keys with this digit
        prefix |= digit << shift;
        if (level == 2) break;
        size_t kept = 0;
        for (uint32_t k : keys) {  // branch-free compaction of the keys with this digit
            keys[kept] = k;
            kept += ((k >> shift) & mask) == digit;
        }
        keys.resize(kept);
    }
    return prefix;
}

// Writes the r positions of largest key among the candidates (which must hold every entry of
// the tensor above the r-th largest key, and at least r entries): every key above the cut,
// then the ties at the cut lowest position first, ascending.
void finish_topk(const Candidates& cand, int64_t r, int64_t* out) {
    const int chunks = static_cast<int>(cand.pos.size());
    std::vector<uint32_t> keys;
    keys.reserve(static_cast<size_t>(cand.size()));
    for (const auto& k : cand.key) keys.insert(keys.end(), k.begin(), k.end());
    const uint32_t cut = radix_cut(std::move(keys), r);
    // Per-chunk counts give every chunk its output offset and its share of the ties.
    std::vector<int64_t> above(chunks, 0), ties(chunks, 0), take(chunks, 0), offset(chunks, 0);
    int64_t total_above = 0;
    for (int c = 0; c < chunks; ++c) {
        for (uint32_t k : cand.key[c]) {
            above[c] += k > cut;
            ties[c] += k == cut;
        }
        total_above += above[c];
    }
    int64_t ties_left = r - total_above, written = 0;
    for (int c = 0; c < chunks; ++c) {
        take[c] = std::min(ties[c], ties_left);
        ties_left -= take[c];
        offset[c] = written;
        written += above[c] + take[c];
    }
    run_chunks(chunks, [&](int c) {
        int64_t o = offset[c], taken = 0;
        const auto& p = cand.pos[c];
        const auto& k = cand.key[c];
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

// The sample: SAMPLE_LEN-entry blocks, evenly spaced, 1/SAMPLE_SHARE of the tensor but at least
// 4 and at most 256 blocks (1,024 to 65,536 entries). Resolving the bound costs a selection over
// the sample, so it must stay small beside the tensor: a fixed 65,536-entry sample made the
// fused pass slower than histogram + gather below a few million entries.
constexpr int64_t SAMPLE_LEN = 256, SAMPLE_SHARE = 16, MIN_SAMPLE_BLOCKS = 4, MAX_SAMPLE_BLOCKS = 256;
static_assert(FUSED_MIN_SIZE == SAMPLE_SHARE * MIN_SAMPLE_BLOCKS * SAMPLE_LEN, "the smallest fused tensor's sample");

// A key bound that, judging from a sample of evenly spaced blocks of the compensated
// gradient, about 1.3 r entries reach; 0 when the tensor is too small to sample.
uint32_t sampled_bound(const float* g, const float* residual, int64_t n, int64_t r) {
    if (n < FUSED_MIN_SIZE) return 0;
    const int64_t blocks = std::clamp(n / (SAMPLE_SHARE * SAMPLE_LEN), MIN_SAMPLE_BLOCKS, MAX_SAMPLE_BLOCKS);
    std::vector<uint32_t> sample;
    sample.reserve(static_cast<size_t>(blocks * SAMPLE_LEN));
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t start = (n - SAMPLE_LEN) * b / (blocks - 1);
        for (int64_t i = start; i < start + SAMPLE_LEN; ++i)
            sample.push_back(magnitude_key(residual ? residual[i] + g[i] : g[i]));
    }
    const double expected = static_cast<double>(r) * static_cast<double>(sample.size()) / static_cast<double>(n);
    const int64_t rank = std::min<int64_t>(static_cast<int64_t>(sample.size()),
                                           static_cast<int64_t>(1.25 * expected + 4.0 * std::sqrt(expected) + 16.0));
    std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<uint32_t>());
    return sample[rank - 1];
}

std::vector<uint64_t> histogram(const float* x, int64_t n, int threads) {
    Chunks chunks(n, threads);
    std::vector<std::vector<uint64_t>> partial(chunks.count, std::vector<uint64_t>(HIST_SIZE, 0));
    run_chunks(chunks.count, [&](int c) {
        std::vector<uint32_t> sub(SUB_HISTS * HIST_SIZE, 0);
        for (int64_t b = chunks.begin(c), hi = chunks.end(c); b < hi; b += FLUSH_EVERY) {
            count_buckets(x + b, std::min(FLUSH_EVERY, hi - b), sub.data());
            flush_buckets(sub.data(), partial[c].data());
        }
    });
    std::vector<uint64_t> hist(HIST_SIZE, 0);
    for (const auto& p : partial)
        for (int64_t b = 0; b < HIST_SIZE; ++b) hist[b] += p[b];
    return hist;
}

// r += g over one block (in place).
void add_block(float* __restrict r, const float* __restrict g, int64_t len) {
    for (int64_t i = 0; i < len; ++i) r[i] += g[i];
}

// out = p + g over one block, out distinct from both (the journaled step's second buffer).
void add_block(float* __restrict out, const float* __restrict p, const float* __restrict g, int64_t len) {
    for (int64_t i = 0; i < len; ++i) out[i] = p[i] + g[i];
}

}  // namespace

Scan scan(const float* g, const float* prior, float* residual, int64_t n, int64_t topk_r, int threads, int64_t* out) {
    Chunks chunks(n, threads);
    const bool fuse = topk_r > 0 && topk_r < n;
    const uint32_t low = fuse ? sampled_bound(g, prior, n, topk_r) : 0;
    const bool gathering = fuse && low > 0;
    Candidates cand(chunks.count);
    std::vector<char> finite(chunks.count, 1);
    run_chunks(chunks.count, [&](int c) {
        const int64_t lo = chunks.begin(c), hi = chunks.end(c);
        if (gathering) cand.reserve(c, (hi - lo) * (topk_r + topk_r / 2) / n + 64);
        for (int64_t b = lo; b < hi; b += BLOCK) {
            const int64_t len = std::min(BLOCK, hi - b);
            if (!block_finite(g + b, len)) {
                finite[c] = 0;
                continue;
            }
            const float* source = g;
            if (residual) {
                if (prior == residual) {
                    add_block(residual + b, g + b, len);
                } else {
                    add_block(residual + b, prior + b, g + b, len);
                }
                source = residual;
            }
            if (gathering && finite[c]) cand.gather_from(c, source, b, b + len, low);
        }
    });
    if (!std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; })) {
        if (residual && prior != residual) {  // out of place: the residual is what it was
            std::memcpy(residual, prior, sizeof(float) * static_cast<size_t>(n));
        } else if (residual) {  // take the step out again: only the finite blocks were added
            run_chunks(chunks.count, [&](int c) {
                for (int64_t b = chunks.begin(c), hi = chunks.end(c); b < hi; b += BLOCK) {
                    const int64_t len = std::min(BLOCK, hi - b);
                    if (!block_finite(g + b, len)) continue;
                    float* r = residual + b;
                    for (int64_t i = 0; i < len; ++i) r[i] -= g[b + i];
                }
            });
        }
        return Scan::NON_FINITE;
    }
    if (!fuse) return Scan::FINITE;
    const float* source = residual ? residual : g;
    if (gathering && cand.size() >= topk_r) {
        finish_topk(cand, topk_r, out);
    } else {  // tensor too small to sample, or the sample's bound was too high: select on its own
        topk(source, n, topk_r, threads, out);
    }
    return Scan::SELECTED;
}

void topk(const float* x, int64_t n, int64_t r, int threads, int64_t* out) {
    // One pass where a sample's bound holds r entries (most tensors): gather what reaches it.
    // finish_topk picks the same r positions from any superset of the entries at or above the
    // cut, so the result is the histogram path's, position for position.
    const uint32_t sampled = sampled_bound(x, nullptr, n, r);
    if (sampled > 0 && r > 0 && r < n) {
        Chunks chunks(n, threads);
        Candidates cand(chunks.count);
        run_chunks(chunks.count, [&](int c) {
            const int64_t lo = chunks.begin(c), hi = chunks.end(c);
            cand.reserve(c, (hi - lo) * (r + r / 2) / n + 64);
            cand.gather_from(c, x, lo, hi, sampled);
        });
        if (cand.size() >= r) {
            finish_topk(cand, r, out);
            return;
        }
    }
    const std::vector<uint64_t> hist = histogram(x, n, threads);
    // The bucket holding the r-th largest magnitude: gather it and everything above.
    int64_t bucket = HIST_SIZE - 1;
    uint64_t above_bucket = 0;
    for (; bucket > 0; --bucket) {
        if (above_bucket + hist[bucket] >= static_cast<uint64_t>(r)) break;
        above_bucket += hist[bucket];
    }
    const uint32_t low = static_cast<uint32_t>(bucket) << HIST_SHIFT;
    const int64_t at_or_above = static_cast<int64_t>(above_bucket + hist[bucket]);
    Chunks chunks(n, threads);
    Candidates cand(chunks.count);
    run_chunks(chunks.count, [&](int c) {
        const int64_t lo = chunks.begin(c), hi = chunks.end(c);
        cand.reserve(c, static_cast<int64_t>(static_cast<double>(hi - lo) / static_cast<double>(n) * at_or_above) + 64);
        cand.gather_from(c, x, lo, hi, low);
    });
    finish_topk(cand, r, out);
}

void chunk_topk(const float* x, int64_t n, int64_t chunk, int64_t k, int64_t tail_k, int threads, int64_t* out) {
    const int64_t rows = n / chunk, tail = n - rows * chunk;
    const int64_t keep = std::min(k, chunk), tail_keep = std::min(tail_k, tail);
    // One row: the keys at or above a bound that every 8th key's order statistic gives (about
    // 1.5 kc of them; all of the row where fewer than kc reach it) are gathered with their columns,
    // in ascending column order; the kc-th largest among them is the cut (nth_element on a copy),
    // and the gathered entries above it and the first (room) equal to it are kept: the tie rule,
    // in order.
    struct Scratch {
        std::vector<uint32_t> keys, order;
        std::vector<int64_t> columns;
    };
    auto row = [&](int64_t start, int64_t len, int64_t kc, int64_t* o, Scratch& t) {
        if (kc >= len) {
            for (int64_t j = 0; j < len; ++j) o[j] = start + j;
            return;
        }
        if (kc <= 0) return;
        const float* v = x + start;
        t.keys.clear();
        t.columns.clear();
        const int64_t want = kc + kc / 2 + 1;  // keys the bound should let through
        if (len >= 256 && 8 * want < len) {
            t.order.clear();
            for (int64_t j = 0; j < len; j += 8) t.order.push_back(magnitude_key(v[j]));
            const int64_t pick = std::max<int64_t>(1, want / 8);
            std::nth_element(t.order.begin(), t.order.end() - pick, t.order.end());
            const uint32_t bound = *(t.order.end() - pick);
            for (int64_t j = 0; j < len; ++j) {
                const uint32_t key = magnitude_key(v[j]);
                if (key >= bound) {
                    t.keys.push_back(key);
                    t.columns.push_back(j);
                }
            }
        }
        if (static_cast<int64_t>(t.keys.size()) < kc) {  // no bound, or too few reached it: the whole row
            t.keys.clear();
            t.columns.clear();
            for (int64_t j = 0; j < len; ++j) {
                t.keys.push_back(magnitude_key(v[j]));
                t.columns.push_back(j);
            }
        }
        const int64_t m = static_cast<int64_t>(t.keys.size());
        t.order.assign(t.keys.begin(), t.keys.end());
        std::nth_element(t.order.begin(), t.order.begin() + (m - kc), t.order.end());
        const uint32_t cut = t.order[m - kc];
        int64_t above = 0;
        for (int64_t j = m - kc; j < m; ++j) above += t.order[j] > cut;
        int64_t room = kc - above, w = 0;
        for (int64_t j = 0; j < m; ++j) {
            const uint32_t key = t.keys[j];
            if (key > cut || (key == cut && room-- > 0)) o[w++] = start + t.columns[j];
        }
    };
    const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, rows / 64)));
    run_chunks(count, [&](int c) {
        Scratch keys;
        const int64_t lo = rows * c / count, hi = rows * (c + 1) / count;
        for (int64_t r = lo; r < hi; ++r) row(r * chunk, chunk, keep, out + r * keep, keys);
        if (c == count - 1 && tail > 0) row(rows * chunk, tail, tail_keep, out + rows * keep, keys);
    });
}

std::vector<int64_t> threshold(const float* x, int64_t n, float t, int threads) {
    Chunks chunks(n, threads);
    std::vector<std::vector<int64_t>> found(chunks.count);
    const uint32_t low = t > 0.0f ? magnitude_key(t) : 0u;
    run_chunks(chunks.count, [&](int c) {
        gather(
            x, chunks.begin(c), chunks.end(c), low, [t](float v) { return std::fabs(v) >= t; },
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

std::vector<int64_t> nonzero_counts(const float* x, int64_t n, int threads) {
    Chunks chunks(n, threads);
    std::vector<int64_t> counts(chunks.count, 0);
    run_chunks(chunks.count, [&](int c) {
        int64_t count = 0;
        for (int64_t i = chunks.begin(c), hi = chunks.end(c); i < hi; ++i) count += magnitude_key(x[i]) != 0;
        counts[c] = count;
    });
    return counts;
}

void nonzero(const float* x, int64_t n, const std::vector<int64_t>& counts, int64_t* out) {
    Chunks chunks(n, static_cast<int>(counts.size()));
    std::vector<int64_t> offset(counts.size() + 1, 0);
    for (size_t c = 0; c < counts.size(); ++c) offset[c + 1] = offset[c] + counts[c];
    constexpr int64_t RUN = 64;
    run_chunks(chunks.count, [&](int c) {
        int64_t i = chunks.begin(c), o = offset[c];
        const int64_t hi = chunks.end(c), end = offset[c + 1];
        // Branch-free: every position is written at o, and kept by advancing o when it is non-zero.
        // A run of RUN entries advances o at most RUN times, so while RUN slots of this chunk's
        // share of out are left its writes stay inside it; the rest is done with a branch.
        while (i + RUN <= hi && end - o >= RUN) {
            for (int64_t j = i; j < i + RUN; ++j) {
                out[o] = j;
                o += magnitude_key(x[j]) != 0;
            }
            i += RUN;
        }
        for (; i < hi; ++i)
            if (magnitude_key(x[i]) != 0) out[o++] = i;
    });
}

void scatter_add_checked(float* out, int64_t numel, const int64_t* idx, const float* val, int64_t n, int threads) {
    if (n == 0) return;
    Chunks chunks(n, threads);
    std::atomic<bool> ordered{true};
    run_chunks(chunks.count, [&](int c) {
        const int64_t lo = chunks.begin(c), hi = chunks.end(c);
        bool ok = true;
        for (int64_t j = std::max<int64_t>(lo, 1); j < hi; ++j) ok &= idx[j] > idx[j - 1];
        if (!ok) ordered.store(false, std::memory_order_relaxed);
    });
    if (!ordered.load())
        fail(ErrorKind::CONTAINER,
             "container indices are not strictly ascending although the index codec promises ascending order "
             "(an index is repeated or out of order)");
    if (idx[0] < 0 || idx[n - 1] >= numel)
        fail(ErrorKind::CONTAINER,
             "container index out of range for a tensor of " + std::to_string(numel) + " elements");
    scatter_add(out, idx, val, n, threads);
}

void scatter_add(float* out, const int64_t* idx, const float* val, int64_t n, int threads) {
    Chunks chunks(n, threads);
    run_chunks(chunks.count, [&](int c) {
        for (int64_t j = chunks.begin(c), hi = chunks.end(c); j < hi; ++j) out[idx[j]] += val[j];
    });
}

void scatter_add_in_range(float* out, int64_t numel, const int64_t* idx, const float* val, int64_t n, int threads) {
    for (int64_t j = 0; j < n; ++j)
        if (idx[j] < 0 || idx[j] >= numel)
            fail(ErrorKind::ARGUMENT, "scatter_add: index " + std::to_string(idx[j]) + " at " + std::to_string(j) +
                                          " is outside [0, " + std::to_string(numel) + ")");
    scatter_add(out, idx, val, n, threads);
}

namespace {

// qsgd.bucket_norms for one bucket: float64 squares padded with zeros to `width`, summed by
// adding neighbours level by level (an odd level gets a zero appended), sqrt, float32 rounded up.
// `scratch` holds width + 1 doubles.
float bucket_norm(const float* v, int64_t len, int64_t width, std::vector<double>& scratch) {
    for (int64_t i = 0; i < len; ++i) scratch[i] = static_cast<double>(v[i]) * static_cast<double>(v[i]);
    std::fill(scratch.begin() + len, scratch.begin() + width, 0.0);
    for (int64_t w = width; w > 1;) {
        if (w % 2) scratch[w++] = 0.0;  // scratch has room: w < width only after a halving
        for (int64_t j = 0; j < w / 2; ++j) scratch[j] = scratch[2 * j] + scratch[2 * j + 1];
        w /= 2;
    }
    const double exact = std::sqrt(scratch[0]);
    const float norm = static_cast<float>(exact);
    return static_cast<double>(norm) < exact ? std::nextafter(norm, INFINITY) : norm;
}

// Levels and receiver's values of v[begin, end), a bucket of norm nu > 0. Branch-free per value
// (signs and rounding draws are random): the level's magnitude as an integer, negated for a
// negative value, and the receiver's value from that integer. Compiled for AVX2 too (floor is
// one instruction there instead of a libm call); both clones round identically.
DR_MULTIVERSION
void quantise_bucket(const float* v, int64_t begin, int64_t end, double nu, double s, uint64_t seed, int8_t* q8,
                     int16_t* q16, float* recon) {
    for (int64_t i = begin; i < end; ++i) {
        const double z = s * std::fabs(static_cast<double>(v[i])) / nu;
        const double floor = std::floor(z);
        const uint64_t draw = deepreduce::bloom::mix64(static_cast<uint64_t>(i + 1) * deepreduce::bloom::GAMMA + seed);
        const double noise = static_cast<double>(draw >> 40) * 0x1p-24;  // UNIFORM_BITS = 24
        const double up = static_cast<double>(noise < z - floor);
        const int32_t magnitude = static_cast<int32_t>(std::min(floor + up, s));
        const int32_t q = std::signbit(v[i]) ? -magnitude : magnitude;
        if (q8 != nullptr)
            q8[i] = static_cast<int8_t>(q);
        else
            q16[i] = static_cast<int16_t>(q);
        recon[i] = static_cast<float>(nu * static_cast<double>(q) / s);
    }
}

}  // namespace

bool qsgd_encode(const float* v, int64_t n, int levels, int64_t bucket, uint64_t seed, int threads, float* norms,
                 int8_t* q8, int16_t* q16, float* recon) {
    const int64_t width = std::min<int64_t>(bucket, std::max<int64_t>(n, 1));
    const int64_t buckets = (n + width - 1) / width;
    const double s = static_cast<double>(levels);
    const Chunks chunks(n, threads);  // the thread count; each takes a run of whole buckets
    std::atomic<bool> finite{true};
    run_chunks(chunks.count, [&](int c) {
        std::vector<double> scratch(static_cast<size_t>(width) + 1);
        const int64_t first = buckets * c / chunks.count, last = buckets * (c + 1) / chunks.count;
        for (int64_t b = first; b < last; ++b) {  // the bucket's norm, then its levels (in cache)
            const int64_t begin = b * width, end = std::min(n, begin + width);
            norms[b] = bucket_norm(v + begin, end - begin, width, scratch);
            if (!std::isfinite(norms[b])) {
                finite = false;
                return;
            }
            const double nu = static_cast<double>(norms[b]);
            if (!(nu > 0)) {  // an all-zero bucket: every level and value is 0
                for (int64_t i = begin; i < end; ++i) {
                    if (q8 != nullptr)
                        q8[i] = 0;
                    else
                        q16[i] = 0;
                    recon[i] = 0.0f;
                }
                continue;
            }
            quantise_bucket(v, begin, end, nu, s, seed, q8, q16, recon);
        }
    });
    return finite;
}

bool binmean_codes(const float* v, int64_t n, int bins, int iterations, float* means_out, uint8_t* codes) {
    if (bins < 1 || bins > 16) fail(ErrorKind::ARGUMENT, "binmean_codes: bins must be in [1, 16]");
    for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(v[i])) return false;
    std::fill(codes, codes + n, uint8_t{0});
    std::vector<int64_t> starts;  // the bin starts ceil(b n / bins) below n (repeats kept, as numpy's)
    for (int64_t b = 1; b < bins; ++b) {
        const int64_t s = (b * n + bins - 1) / bins;
        if (s < n) starts.push_back(s);
    }
    if (!starts.empty()) {
        std::vector<float> order(v, v + n);
        int64_t done = 0;
        for (const int64_t s : starts) {
            std::nth_element(order.begin() + done, order.begin() + s, order.end());
            done = s;
            const float t = order[s];  // the value of stable rank s
            int64_t below = 0;
            for (int64_t i = 0; i < n; ++i) {
                below += v[i] < t;
                codes[i] = static_cast<uint8_t>(codes[i] + (v[i] > t));
            }
            // ties of t: the first s - below in input order rank below s, the rest reach it
            for (int64_t i = 0, tie = 0; i < n; ++i) {
                if (v[i] != t) continue;
                if (tie++ >= s - below) codes[i] = static_cast<uint8_t>(codes[i] + 1);
            }
        }
    }
    double sums[16] = {}, means[16], cuts[16];
    int64_t sizes[16] = {};
    int held[16];
    for (int64_t i = 0; i < n; ++i) {  // np.bincount: one float64 sum per bin, in input order
        sums[codes[i]] += static_cast<double>(v[i]);
        ++sizes[codes[i]];
    }
    for (int step = 0;; ++step) {
        int count = 0;
        for (int b = 0; b < bins; ++b) {
            means[b] = sums[b] / static_cast<double>(std::max<int64_t>(sizes[b], 1));
            if (sizes[b]) held[count++] = b;
        }
        if (step == iterations) break;
        for (int j = 0; j + 1 < count; ++j) cuts[j] = (means[held[j + 1]] + means[held[j]]) / 2;
        std::fill(sums, sums + bins, 0.0);
        std::fill(sizes, sizes + bins, int64_t{0});
        for (int64_t i = 0; i < n; ++i) {                   // the bin whose cut interval the value is at or above,
            const double wide = static_cast<double>(v[i]);  // summed for the next step as above
            int at = 0;
            for (int j = 0; j + 1 < count; ++j) at += wide >= cuts[j];
            const int code = held[at];
            codes[i] = static_cast<uint8_t>(code);
            sums[code] += wide;
            ++sizes[code];
        }
    }
    for (int b = 0; b < bins; ++b) means_out[b] = static_cast<float>(means[b]);
    return true;
}

}  // namespace select
}  // namespace deepreduce
