// Bloom filter kernels; see bloom.h for the hash families and the contracts.
#include "bloom.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>

#include "common/checks.h"
#include "common/error.h"

// The hash pass of the blocked query is compiled twice (AVX2 and baseline); both compute the
// same integers.
#include "common/multiversion.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define DR_AVX2_QUERY 1
#else
#define DR_AVX2_QUERY 0
#endif

namespace deepreduce {
namespace bloom {

namespace {

void check_k(int k) {
    if (k < 1 || k > MAX_K) fail(ErrorKind::ARGUMENT, "Bloom filter: k must be in [1, 64]");
}

void check_blocks(uint64_t blocks) {
    if (blocks > blocked::MAX_BLOCKS) fail(ErrorKind::ARGUMENT, "Bloom filter: more than 2^31 - 1 blocks");
}

void check_ascending(const uint64_t* P, size_t np, const char* what) {
    for (size_t a = 1; a < np; ++a)
        if (P[a] <= P[a - 1]) fail(ErrorKind::ARGUMENT, std::string(what) + ": positives must be strictly ascending");
}

inline bool test_bit(const uint8_t* bits, uint64_t j) {
    return (bits[j >> 3] >> (j & 7)) & 1u;
}

// Work below this many items per thread is not worth a thread.
constexpr uint64_t MIN_PER_THREAD = uint64_t(1) << 16;

// fn(t, lo, hi) over `parts` contiguous ranges of [0, n); rethrows the first exception.
template <class F>
void run_parts(uint64_t n, int parts, F fn) {
    if (parts <= 1) {
        fn(0, uint64_t(0), n);
        return;
    }
    std::vector<std::thread> pool;
    std::vector<std::exception_ptr> errors(parts);
    for (int t = 0; t < parts; ++t) {
        const uint64_t lo = n / parts * t + std::min<uint64_t>(t, n % parts);
        const uint64_t hi = lo + n / parts + (static_cast<uint64_t>(t) < n % parts);
        pool.emplace_back([&, t, lo, hi] {
            try {
                fn(t, lo, hi);
            } catch (...) {
                errors[t] = std::current_exception();
            }
        });
    }
    for (auto& th : pool) th.join();
    for (auto& e : errors)
        if (e) std::rethrow_exception(e);
}

int parts_for(uint64_t n, int threads) {
    return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(threads, n / MIN_PER_THREAD)));
}

// Where a query range writes its positives: their bits in the shared bitmap (a range covers
// whole words, so no two threads write one word) and their count.
struct BitSink {
    uint64_t* words;
    uint64_t count = 0;
    void set(uint64_t x) { words[x >> 6] |= uint64_t(1) << (x & 63); }
    // base + cand[0 .. c): a batch's positives
    void add(uint64_t base, const uint32_t* cand, size_t c) {
        for (size_t a = 0; a < c; ++a) set(base + cand[a]);
        count += c;
    }
    void add(const uint64_t* x, size_t c) {
        for (size_t a = 0; a < c; ++a) set(x[a]);
        count += c;
    }
};

// Query [0, d) into `out` by word-aligned ranges, one per thread, each range(lo, hi, limit, sink)
// setting its ascending positives (stopping once it holds more than `limit`). A range stops early
// only after more than `limit` positives of its own, so the ranges before it hold all of theirs:
// the first min(|P|, limit + 1) set bits are the first positives whatever the thread count.
template <class Range>
void query_by_ranges(uint64_t d, uint64_t limit, int threads, Range range, Positives& out) {
    out.reset(d);
    const int parts = parts_for(d, threads);
    std::vector<uint64_t> counts(static_cast<size_t>(parts), 0);
    run_parts(out.words.size(), parts, [&](int t, uint64_t lo, uint64_t hi) {
        BitSink sink{out.words.data()};
        range(lo * 64, std::min(hi * 64, d), limit, sink);
        counts[t] = sink.count;
    });
    uint64_t total = 0;  // at most d: each position is counted by one range
    for (uint64_t c : counts) total += c;
    out.count = limit < total ? limit + 1 : total;
}

// ---------------------------------------------------------------- blocked family
constexpr size_t BATCH = 512;

// Hash pass over one batch of consecutive indices (vectorises: no loads, no branches).
DR_MULTIVERSION
void hash_batch(uint64_t z0, size_t n, uint64_t blocks, uint32_t* blk, uint32_t* g) {
    for (size_t i = 0; i < n; ++i) {
        const uint64_t h = mix64(z0 + i * GAMMA);
        blk[i] = static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(h >> 32)) * blocks) >> 32);
        g[i] = static_cast<uint32_t>(h);
    }
}

inline uint32_t probe_bit(const uint8_t* block, uint32_t g) {
    const uint32_t p = g >> 23;
    return (block[p >> 3] >> (p & 7)) & 1u;
}

// Probes 2..k-1 of the c candidates that passed probes 0 and 1 (blk[a], g[a] = g_2, cand[a] its
// offset in a batch of n): each further probe on the survivors only, compacting in place without
// branches, or all probes at once when most survived (a dense filter). Returns the positives' count.
size_t further_probes(const uint8_t* bits, int k, size_t n, size_t c, uint32_t* blk, uint32_t* g, uint32_t* cand) {
    if (2 * c > n && k > 2) {
        size_t c2 = 0;
        for (size_t a = 0; a < c; ++a) {
            const uint8_t* block = bits + static_cast<uint64_t>(blk[a]) * blocked::BLOCK_BYTES;
            uint32_t ok = 1, ga = g[a];
            for (int j = 2; j < k; ++j, ga = blocked::next_probe(ga)) ok &= probe_bit(block, ga);
            cand[c2] = cand[a];
            c2 += ok;
        }
        return c2;
    }
    for (int j = 2; j < k && c; ++j) {
        size_t c2 = 0;
        for (size_t a = 0; a < c; ++a) {
            const uint32_t ok = probe_bit(bits + static_cast<uint64_t>(blk[a]) * blocked::BLOCK_BYTES, g[a]);
            cand[c2] = cand[a];
            blk[c2] = blk[a];
            g[c2] = blocked::next_probe(g[a]);
            c2 += ok;
        }
        c = c2;
    }
    return c;
}

// Probes of one hashed batch: probes 0 and 1 on every index (same cache line), then the others on
// the survivors. Returns the count of positives, their offsets in cand.
size_t probe_batch(const uint8_t* bits, int k, size_t n, uint32_t* blk, uint32_t* g, uint32_t* cand) {
    size_t c = 0;
    for (size_t i = 0; i < n; ++i) {
        const uint8_t* block = bits + static_cast<uint64_t>(blk[i]) * blocked::BLOCK_BYTES;
        const uint32_t g1 = blocked::next_probe(g[i]);
        const uint32_t ok = probe_bit(block, g[i]) & (k < 2 || probe_bit(block, g1));
        cand[c] = static_cast<uint32_t>(i);
        blk[c] = blk[i];
        g[c] = blocked::next_probe(g1);
        c += ok;
    }
    return further_probes(bits, k, n, c, blk, g, cand);
}

void blocked_query_range(const uint8_t* bits, uint64_t blocks, int k, uint64_t key, uint64_t lo, uint64_t hi,
                         uint64_t limit, BitSink& out) {
    alignas(64) uint32_t blk[BATCH], g[BATCH], cand[BATCH];
    for (uint64_t base = lo; base < hi; base += BATCH) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(BATCH, hi - base));
        hash_batch(key + base * GAMMA, n, blocks, blk, g);
        out.add(base, cand, probe_batch(bits, k, n, blk, g, cand));
        if (out.count > limit) return;
    }
}

#if DR_AVX2_QUERY
// The same query with AVX2 on 8 indices at a time: the hash in 64-bit lanes (a 64-bit multiply is
// three 32-bit ones, as AVX2 has no 64-bit multiply), probes 0 and 1 as two gathers of 32-bit
// words (bit p of a block is bit p & 31 of its little-endian word p >> 5), the survivors
// compacted by a permutation looked up from the 8-bit mask, probes 2.. on 8 survivors at a time.
// Same integers, same positives. Needs blocks <= 2^27 (word offsets fit a signed 32-bit gather).
#define DR_AVX2 __attribute__((target("avx2,popcnt")))

DR_AVX2 inline __m256i mul64(__m256i a, uint64_t c) {  // a * c mod 2^64 in each 64-bit lane
    const __m256i lo = _mm256_set1_epi64x(static_cast<int64_t>(c & 0xffffffffu));
    const __m256i hi = _mm256_set1_epi64x(static_cast<int64_t>(c >> 32));
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), lo), _mm256_mul_epu32(a, hi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, lo), _mm256_slli_epi64(cross, 32));
}

DR_AVX2 inline __m256i mix64x4(__m256i z) {
    z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xbf58476d1ce4e5b9ULL);
    z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94d049bb133111ebULL);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

// Lane order of the 32-bit halves: the low words of a's four 64-bit lanes, then b's.
DR_AVX2 inline __m256i low_words(__m256i a, __m256i b) {
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    return _mm256_blend_epi32(_mm256_permutevar8x32_epi32(a, even), _mm256_permutevar8x32_epi32(b, even), 0xf0);
}

// COMPRESS[mask]: the lanes of the set bits of mask, in order, one byte each.
struct CompressTable {
    uint64_t lanes[256];
    constexpr CompressTable() : lanes() {
        for (int m = 0; m < 256; ++m) {
            uint64_t v = 0;
            int o = 0;
            for (int i = 0; i < 8; ++i)
                if (m >> i & 1) v |= uint64_t(i) << (8 * o++);
            lanes[m] = v;
        }
    }
};
constexpr CompressTable COMPRESS;

DR_AVX2 inline void compress_store(uint32_t* dst, __m256i v, int mask) {
    const __m256i perm = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(COMPRESS.lanes[mask])));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(v, perm));
}

DR_AVX2 inline __m256i probe_words(const int* words, __m256i word_base, __m256i p) {  // bit p of each block, in bit 0
    const __m256i w = _mm256_i32gather_epi32(words, _mm256_add_epi32(word_base, _mm256_srli_epi32(p, 5)), 4);
    return _mm256_srlv_epi32(w, _mm256_and_si256(p, _mm256_set1_epi32(31)));
}

// further_probes on 8 candidates at a time: probes 2..k-1 of each, stopping once all 8 failed.
DR_AVX2 size_t further_probes_avx2(const int* words, int k, size_t c, const uint32_t* blk, const uint32_t* g,
                                   uint32_t* cand) {
    if (k <= 2) return c;
    const __m256i mul = _mm256_set1_epi32(static_cast<int>(blocked::PROBE_MUL));
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    size_t c2 = 0;
    for (size_t a = 0; a < c; a += 8) {
        // lanes past c hold stale entries: read block 0 for them, drop them from the mask
        const __m256i valid =
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<size_t>(c - a, 8))), lanes);
        const __m256i word_base =
            _mm256_and_si256(valid, _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + a)), 4));
        __m256i ga = _mm256_load_si256(reinterpret_cast<const __m256i*>(g + a));
        __m256i ok = one;
        for (int j = 2; j < k; ++j) {
            ok = _mm256_and_si256(ok, probe_words(words, word_base, _mm256_srli_epi32(ga, 23)));
            if (_mm256_testz_si256(ok, one)) break;
            ga = _mm256_mullo_epi32(ga, mul);
        }
        const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_and_si256(valid, _mm256_slli_epi32(ok, 31))));
        const __m256i offsets = _mm256_load_si256(reinterpret_cast<const __m256i*>(cand + a));
        compress_store(cand + c2, offsets, mask);  // c2 <= a: writes only what was read
        c2 += static_cast<size_t>(_mm_popcnt_u32(static_cast<unsigned>(mask)));
    }
    return c2;
}

// Hash pass of a batch: block and g_0 of n indices from z = key + x0 * GAMMA (8 at a time; the
// tail's extra lanes are hashed too, their blocks are valid), each block's line prefetched when
// the filter is large (the probe pass then finds the lines on their way).
DR_AVX2 void hash_batch_avx2(uint64_t z0, size_t n, uint64_t blocks, const uint8_t* prefetch, uint32_t* blk,
                             uint32_t* g0) {
    const __m256i vblocks = _mm256_set1_epi64x(static_cast<int64_t>(blocks));
    const __m256i z_step = _mm256_set1_epi64x(static_cast<int64_t>(4 * GAMMA));
    __m256i z = _mm256_add_epi64(_mm256_set1_epi64x(static_cast<int64_t>(z0)),
                                 _mm256_setr_epi64x(0, static_cast<int64_t>(GAMMA), static_cast<int64_t>(2 * GAMMA),
                                                    static_cast<int64_t>(3 * GAMMA)));
    for (size_t i = 0; i < n; i += 8) {
        const __m256i ha = mix64x4(z);
        z = _mm256_add_epi64(z, z_step);
        const __m256i hb = mix64x4(z);
        z = _mm256_add_epi64(z, z_step);
        _mm256_store_si256(reinterpret_cast<__m256i*>(blk + i),
                           low_words(_mm256_srli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(ha, 32), vblocks), 32),
                                     _mm256_srli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(hb, 32), vblocks), 32)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(g0 + i), low_words(ha, hb));
        if (prefetch)
            for (int j = 0; j < 8; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(prefetch) + uint64_t(blk[i + j]) * 64, _MM_HINT_T0);
    }
}

DR_AVX2 void blocked_query_range_avx2(const uint8_t* bits, uint64_t blocks, int k, uint64_t key, uint64_t lo,
                                      uint64_t hi, uint64_t limit, BitSink& out) {
    alignas(64) uint32_t hblk[BATCH], hg[BATCH];
    alignas(64) uint32_t blk[BATCH + 8], g[BATCH + 8], cand[BATCH + 8];  // + 8: compress_store's spill
    const int* words = reinterpret_cast<const int*>(bits);
    const uint8_t* prefetch = blocks * blocked::BLOCK_BYTES > (uint64_t(256) << 10) ? bits : nullptr;
    const __m256i mul = _mm256_set1_epi32(static_cast<int>(blocked::PROBE_MUL));
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (uint64_t base = lo; base < hi; base += BATCH) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(BATCH, hi - base));
        hash_batch_avx2(key + base * GAMMA, n, blocks, prefetch, hblk, hg);
        size_t c = 0;
        for (size_t i = 0; i < n; i += 8) {
            const __m256i block = _mm256_load_si256(reinterpret_cast<const __m256i*>(hblk + i));
            const __m256i g0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hg + i));
            const __m256i g1 = _mm256_mullo_epi32(g0, mul);
            const __m256i word_base = _mm256_slli_epi32(block, 4);
            __m256i ok = probe_words(words, word_base, _mm256_srli_epi32(g0, 23));
            if (k >= 2) ok = _mm256_and_si256(ok, probe_words(words, word_base, _mm256_srli_epi32(g1, 23)));
            int mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_slli_epi32(ok, 31)));
            if (n - i < 8) mask &= (1 << (n - i)) - 1;
            compress_store(cand + c, _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), lanes), mask);
            compress_store(blk + c, block, mask);
            compress_store(g + c, _mm256_mullo_epi32(g1, mul), mask);
            c += static_cast<size_t>(_mm_popcnt_u32(static_cast<unsigned>(mask)));
        }
        out.add(base, cand, further_probes_avx2(words, k, c, blk, g, cand));
        if (out.count > limit) return;
    }
}

bool avx2_query_usable(uint64_t blocks) {
    static const bool cpu = __builtin_cpu_supports("avx2");
    return cpu && blocks <= (uint64_t(1) << 27);
}
#else
bool avx2_query_usable(uint64_t) {
    return false;
}
#endif

// Insert idx[lo, hi) into the blocked filter `bits`; ATOMIC when other threads insert at once.
// The arguments are plain locals, so the byte stores cannot make the compiler reload them.
template <bool ATOMIC>
void insert_range(const uint64_t* idx, uint64_t lo, uint64_t hi, uint64_t blocks, int k, uint64_t key, uint8_t* bits) {
    for (uint64_t a = lo; a < hi; ++a) {
        const uint64_t h = blocked::hash(idx[a], key);
        uint8_t* blk = bits + blocked::block(h, blocks) * blocked::BLOCK_BYTES;
        uint32_t g = static_cast<uint32_t>(h);
        for (int i = 0; i < k; ++i, g = blocked::next_probe(g)) {
            const uint32_t p = g >> 23;
            const uint8_t mask = static_cast<uint8_t>(1u << (p & 7));
            if (ATOMIC)
                __atomic_fetch_or(&blk[p >> 3], mask, __ATOMIC_RELAXED);
            else
                blk[p >> 3] |= mask;
        }
    }
}

// ---------------------------------------------------------------- SplitMix64 family
void splitmix_query_range(const uint8_t* bits, uint64_t m, int k, const uint64_t* keys, uint64_t lo, uint64_t hi,
                          uint64_t limit, BitSink& out) {
    // Blocks of candidates: hash function 0 over the block, then each further function over the
    // survivors only (early exit at the first zero bit), compacting without branches.
    uint64_t buf[BATCH];
    for (uint64_t base = lo; base < hi; base += BATCH) {
        const uint64_t end = std::min<uint64_t>(hi, base + BATCH);
        size_t n = 0;
        uint64_t z = keys[0] + base * GAMMA;
        for (uint64_t x = base; x < end; ++x, z += GAMMA) {
            buf[n] = x;
            n += test_bit(bits, splitmix::mulhi64(mix64(z), m));
        }
        for (int i = 1; i < k && n; ++i) {
            size_t n2 = 0;
            for (size_t a = 0; a < n; ++a) {
                const uint64_t x = buf[a];
                buf[n2] = x;
                n2 += test_bit(bits, splitmix::position(x, keys[i], m));
            }
            n = n2;
        }
        out.add(buf, n);
        if (out.count > limit) return;
    }
}

// ---------------------------------------------------------------- P2 conflict sets
// Algorithm 1 visits the conflict sets in (size, bit) order, so its first pass serves every
// singleton set, in bit order, before any larger one; a singleton never draws and never stays
// for a later pass. The blocked family uses this: one streaming pass over the blocks serves the
// singletons as it meets them (phase A) and stops at r, which is where P2 ends when enough
// positives have a private bit. Otherwise (fig11's gradients at fpr 0.01: the singletons cover
// 97-99% of the positives, r is 98-99.6% of them) only the sets probed by members still
// unchosen are built and handed to the general greedy (phase B), which continues the same first
// pass. The v1 family builds every set and runs the greedy from the start. Same choices, byte
// for byte, either way.
//
// Members are the set bits of a bitmap, of type Pos (uint32_t while they fit, else uint64_t): the
// positives themselves for a query's bitmap (Members below), ranks into the list for a list of
// positives; either way ascending members are ascending positions, so the draws pick the same
// positives. Which members are chosen is a bitmap too. Per positive that is 4 bytes of grouping,
// 4 per (set, member) pair still open after the singletons and an eighth of a byte; a hash is
// recomputed rather than stored.

// The members P1 and P2 work on: the set bits m of `set`, each standing for the position at(m):
// m itself for a query's bitmap, list[m] for an ascending list of positives (set: [0, |list|)).
struct Members {
    const Positives& set;
    const uint64_t* list = nullptr;
    uint64_t at(uint64_t m) const { return list ? list[m] : m; }
};

// Conflict sets in CSR form, in ascending bit order: set s is the filter's bit bit[s], has size[s]
// members, of which members[start[s] .. start[s+1]) (ascending) are listed: all of them, or
// those not chosen when the greedy starts (then every bit of a listed member is a set).
template <class Pos>
struct ConflictSets {
    std::vector<uint64_t> start{0}, bit;
    std::vector<Pos> members;
    std::vector<uint32_t> size;
};

// Per-thread scratch of P2, reused across calls so that a call does not fault in fresh pages;
// released after a call that left it above SCRATCH_KEEP bytes (kept up to a few million
// positives, so a pool of threads that each ran P2 holds little).
constexpr size_t SCRATCH_KEEP = size_t(16) << 20;

template <class Pos>
struct Scratch {
    std::vector<Pos> member;       // the positives grouped by block, ascending within a block
    std::vector<uint32_t> ends;    // where each non-empty block's group ends, ascending
    std::vector<uint32_t> bucket;  // the counting sort's bounds, one per block
    Positives chosen;              // the positives chosen so far

    size_t bytes() const {
        return sizeof(Pos) * member.capacity() + 4 * (ends.capacity() + bucket.capacity()) +
               8 * chosen.words.capacity();
    }
};

// fn(p) for each distinct bit p (within its block) of the k probes from g_0 = g.
template <class F>
inline void distinct_probes(uint32_t g, int k, F fn) {
    uint64_t seen[blocked::BLOCK_BITS / 64] = {};
    for (int i = 0; i < k; ++i, g = blocked::next_probe(g)) {
        const uint32_t p = g >> 23;
        const uint64_t bit = uint64_t(1) << (p & 63);
        if (!(seen[p >> 6] & bit)) {
            seen[p >> 6] |= bit;
            fn(p);
        }
    }
}

// Group the positives by block: a stable counting sort (hashing each positive twice rather than
// storing its hash), or a sort of (block, position) when the block count dwarfs the positives
// (a hostile container's; then the pairs take less than the filter's bytes).
template <class Pos>
void group_by_block(const Members& M, uint64_t blocks, uint64_t key, Scratch<Pos>& s) {
    const Positives& P = M.set;
    const size_t np = static_cast<size_t>(P.count);
    const auto block_of = [&](uint64_t x) {
        return static_cast<uint32_t>(blocked::block(blocked::hash(M.at(x), key), blocks));
    };
    s.member.resize(np);
    s.ends.clear();
    if (blocks <= 4 * static_cast<uint64_t>(np) + 4096) {
        s.bucket.assign(blocks + 1, 0);
        uint32_t* bucket = s.bucket.data();
        P.each([&](uint64_t x) { return ++bucket[block_of(x) + 1], true; });
        for (uint64_t b = 0; b < blocks; ++b) bucket[b + 1] += bucket[b];
        Pos* member = s.member.data();
        P.each([&](uint64_t x) { return member[bucket[block_of(x)]++] = static_cast<Pos>(x), true; });
        for (uint64_t b = 0; b < blocks; ++b)  // bucket[b] is now the end of block b's group
            if (bucket[b] != (b ? bucket[b - 1] : 0)) s.ends.push_back(bucket[b]);
    } else {
        std::vector<std::pair<uint32_t, Pos>> keyed;
        keyed.reserve(np);
        P.each([&](uint64_t x) { return keyed.emplace_back(block_of(x), static_cast<Pos>(x)), true; });
        std::sort(keyed.begin(), keyed.end());
        for (size_t e = 0; e < np; ++e) {
            s.member[e] = keyed[e].second;
            if (e + 1 == np || keyed[e + 1].first != keyed[e].first) s.ends.push_back(static_cast<uint32_t>(e + 1));
        }
    }
}

// Phase B's sets from the block of grouped positives [lo, hi) once its singletons are served:
// a member still unchosen now stays unchosen until phase B (its singletons lie in its block),
// and a set whose members are all chosen gives nothing and draws nothing when the greedy visits
// it. So only the sets probed by an unchosen member matter: appended in ascending bit, with the
// full size (count, the order key) and the unchosen members, ascending (a counting sort by bit:
// one pass counts, one places).
template <class Pos>
void collect_open(const Members& M, const Scratch<Pos>& s, size_t lo, size_t hi, uint64_t blocks, int k, uint64_t key,
                  const uint32_t* count, const Positives& chosen, ConflictSets<Pos>& open) {
    constexpr uint32_t BITS = blocked::BLOCK_BITS;
    uint32_t listed[BITS] = {};
    bool any = false;
    for (size_t e = lo; e < hi; ++e) {
        if (chosen.has(s.member[e])) continue;
        any = true;
        distinct_probes(static_cast<uint32_t>(blocked::hash(M.at(s.member[e]), key)), k,
                        [&](uint32_t p) { ++listed[p]; });
    }
    if (!any) return;
    const uint64_t base = blocked::block(blocked::hash(M.at(s.member[lo]), key), blocks) * blocked::BLOCK_BITS;
    uint64_t at[BITS];
    uint64_t end = open.members.size();
    for (uint32_t p = 0; p < BITS; ++p) {
        if (!listed[p]) continue;
        at[p] = end;
        end += listed[p];
        open.start.push_back(end);
        open.bit.push_back(base + p);
        open.size.push_back(count[p]);
    }
    open.members.resize(end);
    for (size_t e = lo; e < hi; ++e) {
        const Pos x = s.member[e];
        if (chosen.has(x)) continue;
        distinct_probes(static_cast<uint32_t>(blocked::hash(M.at(x), key)), k,
                        [&](uint32_t p) { open.members[at[p]++] = x; });
    }
}

// Phase A: per block (ascending), count the distinct members of each bit (stamp holds e + 1 of
// the last member that counted it, so a member repeating a bit counts once), then serve the
// singleton sets in bit order: each chooses its member unless already chosen. Returns true once
// nchosen reaches r (r >= 1); otherwise `open` holds phase B's sets.
template <class Pos>
bool serve_singletons(const Members& M, const Scratch<Pos>& s, uint64_t blocks, int k, uint64_t key, size_t r,
                      Positives& chosen, size_t& nchosen, ConflictSets<Pos>& open) {
    constexpr uint32_t BITS = blocked::BLOCK_BITS;
    uint32_t count[BITS] = {}, stamp[BITS] = {};
    Pos owner[BITS], served[BITS];
    const Pos* member = s.member.data();
    size_t n = nchosen;  // a local: the compiler cannot keep it in a register across the stores
    for (size_t b = 0, lo = 0; b < s.ends.size(); lo = s.ends[b++]) {
        const size_t hi = s.ends[b];
        uint64_t touched[BITS / 64] = {};
        for (size_t e = lo; e < hi; ++e) {
            const uint32_t tag = static_cast<uint32_t>(e + 1);
            uint32_t g = static_cast<uint32_t>(blocked::hash(M.at(member[e]), key));
            for (int i = 0; i < k; ++i, g = blocked::next_probe(g)) {
                const uint32_t p = g >> 23;
                count[p] += stamp[p] != tag;
                stamp[p] = tag;
                owner[p] = member[e];
                touched[p >> 6] |= uint64_t(1) << (p & 63);
            }
        }
        size_t ns = 0;  // the block's singleton owners, ascending bit (branch-free compaction)
        for (uint32_t w = 0; w < BITS / 64; ++w) {
            for (uint64_t bits = touched[w]; bits; bits &= bits - 1) {
                const uint32_t p = w * 64 + static_cast<uint32_t>(__builtin_ctzll(bits));
                served[ns] = owner[p];
                ns += count[p] == 1;
            }
        }
        for (size_t i = 0; i < ns; ++i) {
            n += !chosen.has(served[i]);
            chosen.add(served[i]);
            if (n == r) {
                nchosen = n;
                return true;
            }
        }
        collect_open(M, s, lo, hi, blocks, k, key, count, chosen, open);
        std::fill(count, count + BITS, 0);
    }
    nchosen = n;
    return false;
}

// The sorted distinct bits of the k SplitMix64 probes of x; returns how many.
int splitmix_bits(uint64_t x, const uint64_t* keys, int k, uint64_t m, uint64_t* bits) {
    for (int i = 0; i < k; ++i) bits[i] = splitmix::position(x, keys[i], m);
    std::sort(bits, bits + k);
    return static_cast<int>(std::unique(bits, bits + k) - bits);
}

// SplitMix64 family (v1 containers): every set, by a counting sort over the m bits when they are
// no more than the (bit, member) pairs, else by sorting the pairs.
template <class Pos>
ConflictSets<Pos> splitmix_sets(const Members& M, uint64_t m, int k, uint64_t seed) {
    const Positives& P = M.set;
    uint64_t keys[MAX_K], bits[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = splitmix::hash_key(seed, i);
    ConflictSets<Pos> sets;
    if (m <= static_cast<uint64_t>(k) * P.count + 4096) {
        std::vector<uint64_t> at(m + 1, 0);  // pairs of bit b: at[b] .. at[b + 1]
        P.each([&](uint64_t x) {
            const int n = splitmix_bits(M.at(x), keys, k, m, bits);
            for (int i = 0; i < n; ++i) ++at[bits[i] + 1];
            return true;
        });
        for (uint64_t b = 0; b < m; ++b) {
            if (at[b + 1]) {
                sets.bit.push_back(b);
                sets.size.push_back(static_cast<uint32_t>(at[b + 1]));
            }
            at[b + 1] += at[b];
            if (at[b + 1] != at[b]) sets.start.push_back(at[b + 1]);
        }
        sets.members.resize(at[m]);
        P.each([&](uint64_t x) {
            const int n = splitmix_bits(M.at(x), keys, k, m, bits);
            for (int i = 0; i < n; ++i) sets.members[at[bits[i]]++] = static_cast<Pos>(x);
            return true;
        });
        return sets;
    }
    std::vector<std::pair<uint64_t, Pos>> pairs;
    pairs.reserve(static_cast<size_t>(k) * P.count);
    P.each([&](uint64_t x) {
        const int n = splitmix_bits(M.at(x), keys, k, m, bits);
        for (int i = 0; i < n; ++i) pairs.emplace_back(bits[i], static_cast<Pos>(x));
        return true;
    });
    std::sort(pairs.begin(), pairs.end());
    sets.members.reserve(pairs.size());
    for (size_t e = 0; e < pairs.size(); ++e) {
        if (e == 0 || pairs[e].first != pairs[e - 1].first) sets.bit.push_back(pairs[e].first);
        if (e > 0 && pairs[e].first != pairs[e - 1].first) sets.start.push_back(e);
        sets.members.push_back(pairs[e].second);
    }
    if (!pairs.empty()) sets.start.push_back(pairs.size());
    for (size_t s = 0; s + 1 < sets.start.size(); ++s)
        sets.size.push_back(static_cast<uint32_t>(sets.start[s + 1] - sets.start[s]));
    return sets;
}

// The position of the i-th (from 0) set bit of w.
inline uint32_t select_bit(uint64_t w, uint64_t i) {
    for (; i; --i) w &= w - 1;
    return static_cast<uint32_t>(__builtin_ctzll(w));
}

// The members not yet chosen of each listed conflict set, ascending, indexed so that finding the
// i-th of a set and removing a chosen member from a set cost O(log set size): per set, one bit
// per listed member (set: chosen; the slots past the last member start set) in whole words, and
// a Fenwick tree over those words counting the set bits (node j of a set covers the j & -j words
// up to word j). About 0.19 bytes per listed member. Rescanning a set's members on every visit
// instead made an all-ones filter cost passes x positives. The NumPy twin is _Unchosen in
// deepreduce/index/bloom.py.
template <class Pos>
class Unchosen {
  public:
    explicit Unchosen(const ConflictSets<Pos>& sets)
        : sets_(sets), live_(sets.size.size()), first_word_(sets.size.size() + 1, 0) {
        for (size_t s = 0; s < live_.size(); ++s) {
            const uint64_t n = sets.start[s + 1] - sets.start[s];
            live_[s] = static_cast<uint32_t>(n);
            first_word_[s + 1] = first_word_[s] + (n + 63) / 64;
        }
        taken_.assign(first_word_.back(), 0);
        removed_.assign(first_word_.back(), 0);
        for (size_t s = 0; s < live_.size(); ++s) {
            const uint64_t used = live_[s] % 64;  // slots used in the set's last word (0: all 64)
            if (!used) continue;
            const uint64_t last = first_word_[s + 1] - 1;  // word W of the set: only Fenwick node W covers it
            taken_[last] = ~uint64_t(0) << used;
            removed_[last] = static_cast<uint32_t>(64 - used);
        }
    }

    uint32_t live(uint32_t s) const { return live_[s]; }

    // The i-th (from 0, i < live(s)) unchosen member of set s: a Fenwick descent to its word (node
    // j covers 64 (j & -j) slots, of which that minus removed are unchosen), then a bit select.
    Pos nth(uint32_t s, uint64_t i) const {
        const uint64_t lo = first_word_[s], words = first_word_[s + 1] - lo;
        uint64_t at = 0;
        for (uint64_t step = uint64_t(1) << (63 - __builtin_clzll(words)); step; step >>= 1) {
            if (at + step > words) continue;
            const uint64_t free = 64 * step - removed_[lo + at + step - 1];
            if (free <= i) {
                at += step;
                i -= free;
            }
        }
        return sets_.members[sets_.start[s] + 64 * at + select_bit(~taken_[lo + at], i)];
    }

    // Mark `member` chosen in the set of filter bit `bit`, if a listed set holds it.
    void remove(uint64_t bit, Pos member) {
        const auto set = std::lower_bound(sets_.bit.begin(), sets_.bit.end(), bit);
        if (set == sets_.bit.end() || *set != bit) return;
        const size_t s = static_cast<size_t>(set - sets_.bit.begin());
        const Pos* first = sets_.members.data() + sets_.start[s];
        const Pos* last = sets_.members.data() + sets_.start[s + 1];
        const Pos* at = std::lower_bound(first, last, member);
        if (at == last || *at != member) return;
        const uint64_t slot = static_cast<uint64_t>(at - first), lo = first_word_[s];
        const uint64_t words = first_word_[s + 1] - lo, mask = uint64_t(1) << (slot % 64);
        if (taken_[lo + slot / 64] & mask) return;
        taken_[lo + slot / 64] |= mask;
        --live_[s];
        for (uint64_t j = slot / 64 + 1; j <= words; j += j & (~j + 1)) ++removed_[lo + j - 1];
    }

  private:
    const ConflictSets<Pos>& sets_;
    std::vector<uint32_t> live_;
    std::vector<uint64_t> first_word_, taken_;
    std::vector<uint32_t> removed_;
};

// Algorithm 1 over conflict sets ordered by (size, bit), continuing from `chosen` (the chosen
// positives) and `nchosen`: passes over the active sets; each set gives one not yet chosen member
// (drawn when it has several), and stays for the next pass while it had several; stop at r.
// `probes(member, out)` writes the member's k filter bits (the sets it belongs to).
template <class Pos, typename Probes>
void greedy_select(const ConflictSets<Pos>& sets, size_t r, uint64_t draw_seed, int k, const Probes& probes,
                   Positives& chosen, size_t& nchosen) {
    const size_t nsets = sets.size.size();
    std::vector<uint32_t> active(nsets);  // by (size, bit): the sets are in ascending bit order
    for (size_t s = 0; s < nsets; ++s) active[s] = static_cast<uint32_t>(s);
    const uint32_t max_size = nsets ? *std::max_element(sets.size.begin(), sets.size.end()) : 0;
    if (max_size <= 4 * static_cast<uint64_t>(nsets) + 4096) {  // a stable counting sort by size
        std::vector<size_t> by_size(static_cast<size_t>(max_size) + 2, 0);
        for (size_t s = 0; s < nsets; ++s) ++by_size[sets.size[s] + 1];
        for (size_t z = 1; z < by_size.size(); ++z) by_size[z] += by_size[z - 1];
        for (size_t s = 0; s < nsets; ++s) active[by_size[sets.size[s]]++] = static_cast<uint32_t>(s);
    } else {  // few sets of many members (an all-ones filter's): a count per size would dwarf them
        std::stable_sort(active.begin(), active.end(),
                         [&](uint32_t a, uint32_t b) { return sets.size[a] < sets.size[b]; });
    }

    Unchosen<Pos> unchosen(sets);
    std::vector<uint32_t> next;
    uint64_t bits[MAX_K];
    uint64_t draw = 0;
    while (nchosen < r && !active.empty()) {
        next.clear();
        for (uint32_t s : active) {
            if (nchosen == r) break;
            const uint32_t ncand = unchosen.live(s);
            if (ncand == 0) continue;
            uint64_t pick = 0;
            if (ncand > 1) {  // draw among the candidates (ascending), keep the set for the next pass
                ++draw;
                pick = splitmix::mulhi64(mix64(draw_seed + draw * GAMMA), ncand);
                next.push_back(s);
            }
            const Pos member = unchosen.nth(s, pick);
            probes(member, bits);
            std::sort(bits, bits + k);  // a member repeating a bit is in that set once
            for (int i = 0; i < k; ++i)
                if (i == 0 || bits[i] != bits[i - 1]) unchosen.remove(bits[i], member);
            chosen.add(member);
            ++nchosen;
        }
        active.swap(next);
    }
    if (nchosen != r) fail(ErrorKind::ARGUMENT, "Bloom P2: positives do not cover r distinct indices");
}

// select_conflict with members of type Pos.
template <class Pos>
void select_conflict_as(Family family, const Members& M, size_t r, uint64_t size, int k, uint64_t seed,
                        uint64_t draw_seed, uint64_t* out) {
    thread_local Scratch<Pos> scratch;
    struct Release {  // keep the scratch for the next call unless it grew too large
        Scratch<Pos>& s;
        ~Release() {
            if (s.bytes() > SCRATCH_KEEP) s = Scratch<Pos>{};
        }
    } release{scratch};
    Positives& chosen = scratch.chosen;
    chosen.reset(M.set.d);
    size_t nchosen = 0;
    if (family == Family::BLOCKED) {
        const uint64_t key = blocked::key(seed);
        group_by_block(M, size, key, scratch);
        ConflictSets<Pos> open;
        if (!serve_singletons(M, scratch, size, k, key, r, chosen, nchosen, open)) {
            if (sizeof(Pos) * scratch.member.capacity() > SCRATCH_KEEP) std::vector<Pos>().swap(scratch.member);
            greedy_select(
                open, r, draw_seed, k,
                [&](Pos x, uint64_t* bits) {
                    const uint64_t at = M.at(x);
                    blocked::positions(&at, 1, size, k, seed, bits);
                },
                chosen, nchosen);
        }
    } else {
        greedy_select(
            splitmix_sets<Pos>(M, size, k, seed), r, draw_seed, k,
            [&](Pos x, uint64_t* bits) {
                const uint64_t at = M.at(x);
                splitmix::positions(&at, 1, size, k, seed, bits);
            },
            chosen, nchosen);
    }
    size_t o = 0;
    chosen.each([&](uint64_t x) { return out[o++] = M.at(x), true; });
}

}  // namespace

// ---------------------------------------------------------------- blocked family
namespace blocked {

void positions(const uint64_t* x, size_t n, uint64_t blocks, int k, uint64_t seed, uint64_t* out) {
    check_k(k);
    check_blocks(blocks);
    if (blocks == 0 && n) fail(ErrorKind::ARGUMENT, "Bloom filter: no blocks to place indices in");
    const uint64_t kk = key(seed);
    for (size_t a = 0; a < n; ++a) {
        const uint64_t h = hash(x[a], kk);
        const uint64_t base = block(h, blocks) * BLOCK_BITS;
        uint32_t g = static_cast<uint32_t>(h);
        for (int i = 0; i < k; ++i, g = next_probe(g)) out[a * k + i] = base + (g >> 23);
    }
}

void build(const uint64_t* idx, size_t n, uint64_t blocks, int k, uint64_t seed, uint8_t* bits, int threads) {
    check_k(k);
    check_blocks(blocks);
    check_threads(threads);
    if (n == 0) return;
    if (blocks == 0) fail(ErrorKind::ARGUMENT, "Bloom filter: no blocks to insert indices into");
    const uint64_t kk = key(seed);
    const int parts = parts_for(n, threads);
    run_parts(n, parts, [&](int, uint64_t lo, uint64_t hi) {
        if (parts > 1)
            insert_range<true>(idx, lo, hi, blocks, k, kk, bits);
        else
            insert_range<false>(idx, lo, hi, blocks, k, kk, bits);
    });
}

void query(const uint8_t* bits, uint64_t blocks, int k, uint64_t seed, uint64_t d, uint64_t limit, int threads,
           Positives& out, bool simd) {
    check_k(k);
    check_blocks(blocks);
    check_threads(threads);
    out.reset(d);
    if (blocks == 0 || d == 0) return;
    const uint64_t kk = key(seed);
    const bool avx2 = simd && avx2_query_usable(blocks);
    query_by_ranges(
        d, limit, threads,
        [&](uint64_t lo, uint64_t hi, uint64_t lim, BitSink& o) {
#if DR_AVX2_QUERY
            if (avx2) return blocked_query_range_avx2(bits, blocks, k, kk, lo, hi, lim, o);
#endif
            blocked_query_range(bits, blocks, k, kk, lo, hi, lim, o);
        },
        out);
}

}  // namespace blocked

// ---------------------------------------------------------------- SplitMix64 family
namespace splitmix {

void positions(const uint64_t* x, size_t n, uint64_t m, int k, uint64_t seed, uint64_t* out) {
    check_k(k);
    if (m == 0 && n) fail(ErrorKind::ARGUMENT, "Bloom filter: m must be positive");
    uint64_t keys[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = hash_key(seed, i);
    for (size_t a = 0; a < n; ++a)
        for (int i = 0; i < k; ++i) out[a * k + i] = position(x[a], keys[i], m);
}

void query(const uint8_t* bits, uint64_t m, int k, uint64_t seed, uint64_t d, uint64_t limit, int threads,
           Positives& out) {
    check_k(k);
    check_threads(threads);
    out.reset(d);
    if (m == 0 || d == 0) return;
    uint64_t keys[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = hash_key(seed, i);
    query_by_ranges(
        d, limit, threads,
        [&](uint64_t lo, uint64_t hi, uint64_t lim, BitSink& o) {
            splitmix_query_range(bits, m, k, keys, lo, hi, lim, o);
        },
        out);
}

}  // namespace splitmix

// ---------------------------------------------------------------- positives
void Positives::reset(uint64_t d_) {
    d = d_;
    count = 0;
    words.assign(static_cast<size_t>(d_ / 64 + (d_ % 64 != 0)), 0);
}

void list_positives(const Positives& P, uint64_t from, uint64_t n, uint64_t* out) {
    if (n > P.count || from > P.count - n) fail(ErrorKind::ARGUMENT, "Bloom positives: ranks beyond the positives");
    if (n == 0) return;
    uint64_t rank = 0, o = 0;
    for (uint64_t w = 0; w < P.words.size(); ++w) {
        uint64_t bits = P.words[w];
        const uint64_t c = static_cast<uint64_t>(__builtin_popcountll(bits));
        if (rank + c <= from) {  // the whole word lies before the first rank wanted
            rank += c;
            continue;
        }
        for (; bits; bits &= bits - 1, ++rank) {
            if (rank < from) continue;
            out[o++] = w * 64 + static_cast<uint64_t>(__builtin_ctzll(bits));
            if (o == n) return;
        }
    }
}

// ---------------------------------------------------------------- policies
namespace {

// The members [0, np) of a list of np ascending positives (checked).
Positives ranks_of(const uint64_t* P, size_t np, const char* what) {
    check_ascending(P, np, what);
    Positives all;
    all.reset(np);
    for (uint64_t w = 0; w < np / 64; ++w) all.words[w] = ~uint64_t(0);
    if (np % 64) all.words[np / 64] = (uint64_t(1) << (np % 64)) - 1;
    all.count = np;
    return all;
}

void select_random_in(const Members& M, size_t r, uint64_t draw_seed, uint64_t* out) {
    const Positives& P = M.set;
    if (r > P.count) fail(ErrorKind::ARGUMENT, "Bloom P1: more indices requested than positives");
    if (r == 0) return;
    const auto priority = [&](uint64_t m) { return mix64(draw_seed + (M.at(m) + 1) * GAMMA); };
    // The threshold is the rank-th smallest (from 1) of the priorities whose top `known` bits are
    // `prefix`: each pass counts them by their next 16 bits, until few enough remain to collect.
    constexpr int RADIX = 16;
    constexpr uint64_t FEW = uint64_t(1) << 16;
    uint64_t prefix = 0, rank = r, candidates = P.count;
    int known = 0;
    const auto candidate = [&](uint64_t v) { return known == 0 || v >> (64 - known) == prefix; };
    std::vector<uint64_t> hist;
    while (candidates > FEW) {
        hist.assign(uint64_t(1) << RADIX, 0);
        const int shift = 64 - known - RADIX;
        P.each([&](uint64_t m) {
            const uint64_t v = priority(m);
            if (candidate(v)) ++hist[(v >> shift) & ((uint64_t(1) << RADIX) - 1)];
            return true;
        });
        uint64_t b = 0;
        while (hist[b] < rank) rank -= hist[b++];
        prefix = prefix << RADIX | b;
        known += RADIX;
        candidates = hist[b];  // after 64 bits: one priority
    }
    std::vector<uint64_t> few;
    few.reserve(static_cast<size_t>(candidates));
    P.each([&](uint64_t m) {
        const uint64_t v = priority(m);
        if (candidate(v)) few.push_back(v);
        return true;
    });
    std::nth_element(few.begin(), few.begin() + static_cast<std::ptrdiff_t>(rank - 1), few.end());
    const uint64_t threshold = few[rank - 1];
    size_t o = 0;  // exactly r priorities are at most the threshold: they are distinct
    P.each([&](uint64_t m) {
        if (priority(m) <= threshold) out[o++] = M.at(m);
        return o < r;
    });
}

void select_conflict_in(Family family, const Members& M, size_t r, uint64_t size, int k, uint64_t seed,
                        uint64_t draw_seed, uint64_t* out) {
    check_k(k);
    if (r > M.set.count) fail(ErrorKind::ARGUMENT, "Bloom P2: more indices requested than positives");
    if (M.set.count >= (uint64_t(1) << 32)) fail(ErrorKind::ARGUMENT, "Bloom P2: at most 2^32 - 1 positives");
    if (r == 0) return;
    if (size == 0) fail(ErrorKind::ARGUMENT, "Bloom P2: empty filter with positives");
    if (family == Family::BLOCKED) check_blocks(size);
    if (M.set.d <= (uint64_t(1) << 32))
        select_conflict_as<uint32_t>(family, M, r, size, k, seed, draw_seed, out);
    else
        select_conflict_as<uint64_t>(family, M, r, size, k, seed, draw_seed, out);
}

}  // namespace

void select_random(const Positives& P, size_t r, uint64_t draw_seed, uint64_t* out) {
    select_random_in(Members{P}, r, draw_seed, out);
}

void select_random(const uint64_t* P, size_t np, size_t r, uint64_t draw_seed, uint64_t* out) {
    const Positives ranks = ranks_of(P, np, "Bloom P1");
    select_random_in(Members{ranks, P}, r, draw_seed, out);
}

void select_conflict(Family family, const Positives& P, size_t r, uint64_t size, int k, uint64_t seed,
                     uint64_t draw_seed, uint64_t* out) {
    select_conflict_in(family, Members{P}, r, size, k, seed, draw_seed, out);
}

void select_conflict(Family family, const uint64_t* P, size_t np, size_t r, uint64_t size, int k, uint64_t seed,
                     uint64_t draw_seed, uint64_t* out) {
    check_k(k);
    if (np >= (uint64_t(1) << 32)) fail(ErrorKind::ARGUMENT, "Bloom P2: at most 2^32 - 1 positives");
    const Positives ranks = ranks_of(P, np, "Bloom P2");
    select_conflict_in(family, Members{ranks, P}, r, size, k, seed, draw_seed, out);
}

// ---------------------------------------------------------------- receiver bounds
namespace {

// x^k by k multiplications: the same bits as the Python twin's loop.
double power(double x, int k) {
    double t = 1.0;
    for (int i = 0; i < k; ++i) t *= x;
    return t;
}

uint64_t popcount(const uint8_t* p, uint64_t n) {
    uint64_t count = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        count += static_cast<uint64_t>(__builtin_popcountll(w));
    }
    for (; i < n; ++i) count += static_cast<uint64_t>(__builtin_popcount(p[i]));
    return count;
}

std::string number(double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3g", x);
    return buf;
}

}  // namespace

uint64_t positive_limit(Family family, const uint8_t* bits, uint64_t size, int k, uint64_t r, uint64_t d,
                        bool conflict) {
    check_k(k);
    uint64_t set_bits = 0;
    double rate = 0;
    unsigned __int128 m = size;
    if (family == Family::BLOCKED) {
        check_blocks(size);
        m *= blocked::BLOCK_BITS;
        std::array<uint64_t, blocked::BLOCK_BITS + 1> hist{};  // blocks by their set bits
        for (uint64_t b = 0; b < size; ++b) {
            const uint64_t c = popcount(bits + b * blocked::BLOCK_BYTES, blocked::BLOCK_BYTES);
            ++hist[c];
            set_bits += c;
        }
        double sum = 0;
        for (uint64_t c = 0; c <= blocked::BLOCK_BITS; ++c)
            if (hist[c]) sum += static_cast<double>(hist[c]) * power(static_cast<double>(c) / 512.0, k);
        if (size) rate = sum / static_cast<double>(size);
    } else {
        set_bits = popcount(bits, filter_bytes(size));
        if (size) rate = power(static_cast<double>(set_bits) / static_cast<double>(size), k);
    }
    if (static_cast<unsigned __int128>(set_bits) > static_cast<unsigned __int128>(k) * r)
        fail(ErrorKind::ARGUMENT,
             "Bloom filter has " + std::to_string(set_bits) + " bits set; " + std::to_string(r) +
                 " keys of k = " + std::to_string(k) + " hashes set at most " +
                 std::to_string(static_cast<unsigned __int128>(k) * r > ~uint64_t(0) ? ~uint64_t(0) : k * r));
    if (k * rate > MAX_PROBE_RATE)
        fail(ErrorKind::ARGUMENT, "Bloom filter claims " + std::to_string(r) + " keys with k = " + std::to_string(k) +
                                      " hashes at its false-positive rate " + number(rate) +
                                      ": k * rate above 2, a filter far fuller than its k was chosen for");
    if (conflict) {
        const std::string keys = "Bloom P2 filter claims " + std::to_string(r) + " keys";
        if (k >= 2 && static_cast<unsigned __int128>(k) * r > MAX_PROBES_PER_BIT * m)
            fail(ErrorKind::ARGUMENT, keys + " with k = " + std::to_string(k) + " hashes in " +
                                          std::to_string(static_cast<uint64_t>(m)) +
                                          " bits: k * r above twice the bits, beyond any encoder's sizing");
        if (static_cast<unsigned __int128>(r) > static_cast<unsigned __int128>(MAX_KEYS_PER_SET_BIT) * set_bits)
            fail(ErrorKind::ARGUMENT, keys + " on " + std::to_string(set_bits) +
                                          " set bits: more than 64 keys per set bit, beyond any encoder's sizing");
    }
    const double extra = POSITIVE_MARGIN * rate * static_cast<double>(d);
    if (extra >= static_cast<double>(d)) return d;
    const unsigned __int128 limit =
        static_cast<unsigned __int128>(r) + static_cast<uint64_t>(std::ceil(extra)) + POSITIVE_SLACK;
    return limit > d ? d : static_cast<uint64_t>(limit);
}

}  // namespace bloom
}  // namespace deepreduce
