// Bloom filter kernels of deepreduce: build, query of every position, and the index-selection
// policies P1 (random) and P2 (conflict sets, DeepReduce Algorithm 1).
//
// Pure C++ over plain buffers (no Python types), so the pybind11 module (py_module.cpp) and the
// TensorFlow custom ops wrap the same functions. Every function checks its arguments and reports
// bad input by throwing deepreduce::Error (common/error.h), never by reading out of bounds;
// threads are bounded by deepreduce::MAX_THREADS (common/checks.h).
//
// Two hash families (documented in docs/bloom.md; deepreduce/index/bloom.py reproduces both in
// NumPy). All arithmetic is modulo 2^64; mix64 is the SplitMix64 finaliser
//   mix64(z) = z ^= z>>30; z *= 0xbf58476d1ce4e5b9; z ^= z>>27; z *= 0x94d049bb133111eb; z ^ z>>31
// and GAMMA = 0x9e3779b97f4a7c15.
//
// Blocked family (container format v2, written by every encoder): m = 512 * blocks bits.
//   key           = mix64(seed + GAMMA)
//   h(x)          = mix64(key + x*GAMMA)                      one 64-bit hash per index
//   block(x)      = ((h >> 32) * blocks) >> 32                 blocks < 2^31, so the product < 2^63
//   g_0           = h & 0xffffffff;  g_{i+1} = (g_i * 0x5bd1e995) & 0xffffffff   (31-bit multiplier)
//   bit_i(x)      = 512 * block(x) + (g_i >> 23)              i = 0..k-1, all in one 64-byte block
// Only multiply, add, xor, shift and mask on 64-bit integers: the same hash runs as integer tensor ops.
//
// SplitMix64 family (container format v1, decode only): k independent hashes over m bits,
//   key_i = mix64(seed + (i+1)*GAMMA);  h_i(x) = floor(mix64(key_i + x*GAMMA) * m / 2^64).
//
// Bit j of a filter is bit (j % 8) of byte j / 8 (LSB first) in both families.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace deepreduce {
namespace bloom {

constexpr uint64_t GAMMA = 0x9e3779b97f4a7c15ULL;
constexpr int MAX_K = 64;

inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// Number of bytes of a filter of m bits, without overflow for any m.
inline uint64_t filter_bytes(uint64_t m) {
    return m / 8 + (m % 8 != 0);
}

// ------------------------------------------------------------------ positives
// A set of positions of [0, d): a bitmap (bit x % 64 of words[x / 64]), d / 8 bytes however many
// positions it holds. The queries write the positives P of a filter here and the policies read
// them from here: a list of uint64 positions took 8 bytes per positive, 64 times the bitmap when
// every position is one (an all-ones filter), and the receiver's memory is then bounded by the
// tensor it expects, not by what a filter claims.
struct Positives {
    uint64_t d = 0;
    uint64_t count = 0;  // after a query: min(|P|, limit + 1); the bitmap holds all of P when count <= limit
    std::vector<uint64_t> words;

    // The empty set over [0, d).
    void reset(uint64_t d_);
    bool has(uint64_t x) const { return (words[x >> 6] >> (x & 63)) & 1u; }
    void add(uint64_t x) { words[x >> 6] |= uint64_t(1) << (x & 63); }  // count is the caller's
    // fn(x) for every position, ascending; stops early when fn returns false.
    template <class F>
    void each(F fn) const {
        for (uint64_t w = 0; w < words.size(); ++w)
            for (uint64_t bits = words[w]; bits; bits &= bits - 1)
                if (!fn(w * 64 + static_cast<uint64_t>(__builtin_ctzll(bits)))) return;
    }
};

// The positions of ranks [from, from + n) of P (ascending) into out; requires from + n <= |P|.
void list_positives(const Positives& P, uint64_t from, uint64_t n, uint64_t* out);

// ------------------------------------------------------------------ blocked family (v2)
namespace blocked {

constexpr uint64_t BLOCK_BITS = 512;
constexpr uint64_t BLOCK_BYTES = 64;
constexpr uint32_t PROBE_MUL = 0x5bd1e995u;
constexpr uint64_t MAX_BLOCKS = (uint64_t(1) << 31) - 1;

inline uint64_t key(uint64_t seed) {
    return mix64(seed + GAMMA);
}
inline uint64_t hash(uint64_t x, uint64_t key) {
    return mix64(key + x * GAMMA);
}
inline uint64_t block(uint64_t h, uint64_t blocks) {
    return ((h >> 32) * blocks) >> 32;
}
inline uint32_t next_probe(uint32_t g) {
    return g * PROBE_MUL;
}

// Global bit positions bit_0..bit_{k-1} of n indices, row-major (n x k).
void positions(const uint64_t* x, size_t n, uint64_t blocks, int k, uint64_t seed, uint64_t* out);

// Set the bits of n indices into `bits` (blocks * 64 bytes, not cleared here); `threads` threads.
void build(const uint64_t* idx, size_t n, uint64_t blocks, int k, uint64_t seed, uint8_t* bits, int threads);

// The positives P of [0, d) into `out` (reset to [0, d)), stopping once more than `limit` are found:
// out.count = min(|P|, limit + 1), and the first out.count positions of out are the first of P
// (`threads` threads; the result does not depend on the thread count). `simd`: use the AVX2 code
// where the CPU has it (same result; false forces the portable loop, for tests that compare the two).
void query(const uint8_t* bits, uint64_t blocks, int k, uint64_t seed, uint64_t d, uint64_t limit, int threads,
           Positives& out, bool simd = true);

}  // namespace blocked

// ------------------------------------------------------------------ SplitMix64 family (v1, decode only)
namespace splitmix {

inline uint64_t mulhi64(uint64_t a, uint64_t b) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline uint64_t hash_key(uint64_t seed, int i) {
    return mix64(seed + static_cast<uint64_t>(i + 1) * GAMMA);
}
inline uint64_t position(uint64_t x, uint64_t key, uint64_t m) {
    return mulhi64(mix64(key + x * GAMMA), m);
}

// Positions h_0..h_{k-1} of n indices, row-major (n x k).
void positions(const uint64_t* x, size_t n, uint64_t m, int k, uint64_t seed, uint64_t* out);

// As blocked::query, for a filter of m bits.
void query(const uint8_t* bits, uint64_t m, int k, uint64_t seed, uint64_t d, uint64_t limit, int threads,
           Positives& out);

}  // namespace splitmix

// ------------------------------------------------------------------ policies
enum class Family { SPLITMIX = 0, BLOCKED = 1 };

// The policies read P.count as |P|: P must hold every positive (a query's count <= its limit).
//
// P1: the r entries of P with the smallest priority mix64(draw_seed + (x+1)*GAMMA) (distinct for
// distinct x), written ascending to out. Requires r <= |P|. Found by a radix selection of the r-th
// smallest priority (16 bits per pass over P) and one more pass: no memory per positive.
void select_random(const Positives& P, size_t r, uint64_t draw_seed, uint64_t* out);
// The same over a list of positives P[0 .. np), strictly ascending (the pybind11 module's form).
void select_random(const uint64_t* P, size_t np, size_t r, uint64_t draw_seed, uint64_t* out);

// P2 (Algorithm 1, reading documented in docs/bloom.md): r entries of P written ascending to
// out. Requires r <= |P| < 2^32 and P the full positive set of the filter; `size` is m (splitmix)
// or the block count (blocked). Memory: the positives grouped by block (4 bytes each while
// d <= 2^32, else 8) and the conflict sets still open after the singletons (the same per
// (set, member) pair, plus about 0.2 bytes for the index of unchosen members).
void select_conflict(Family family, const Positives& P, size_t r, uint64_t size, int k, uint64_t seed,
                     uint64_t draw_seed, uint64_t* out);
// The same over a list of positives P[0 .. np), strictly ascending (the pybind11 module's form).
void select_conflict(Family family, const uint64_t* P, size_t np, size_t r, uint64_t size, int k, uint64_t seed,
                     uint64_t draw_seed, uint64_t* out);

// ------------------------------------------------------------------ receiver bounds
// Constants of positive_limit (docs/reliability.md, "Bloom filters: positives and work").
constexpr double POSITIVE_MARGIN = 2.0;        // accepted false positives: this times the expected ...
constexpr uint64_t POSITIVE_SLACK = 64;        // ... plus this many
constexpr double MAX_PROBE_RATE = 2.0;         // every policy and family: k * rate at most this
constexpr uint64_t MAX_PROBES_PER_BIT = 2;     // P2 with k >= 2: k * r at most this times m
constexpr uint64_t MAX_KEYS_PER_SET_BIT = 64;  // P2: r at most this times the set bits

// The receiver's bound on a filter that claims to hold r keys (at most r: the header's count, which
// for P0 is |P|). The filter's own false-positive rate is the chance that the k probes of a position
// never inserted all hit set bits: the mean over blocks of (set bits / 512)^k (blocked),
// (set bits / m)^k (splitmix). An honest filter has its r keys plus Binomial(d - r, rate) false
// positives among d positions, so the receiver accepts at most
//   min(d, r + ceil(POSITIVE_MARGIN * rate * d) + POSITIVE_SLACK)
// positives: the return value (the query's limit). Refused, for every policy and both families: a
// filter with more than k * r set bits (each set bit is a probe of one of the r keys), and one with
// k * rate > MAX_PROBE_RATE, far fuller than any encoder fills a filter of k hashes (blocked
// encoders keep k * rate <= 0.76, v1 ones about k / 2^k; a v1 filter with all of its 8 bits set and
// k = 7 otherwise made 100 bytes claim every position of a 2^28-element tensor). With `conflict`
// (P2: its conflict sets hold k |P| (bit, positive) pairs, visited in about r / set bits passes) it
// also refuses a filter no encoder sizes: k >= 2 with k * r > MAX_PROBES_PER_BIT * m, or
// r > MAX_KEYS_PER_SET_BIT * set bits. Errors are ErrorKind::ARGUMENT with the core's text (the
// codec, bloom_wire.h decode, reports them as ContainerError "Bloom decode: ..."; deepreduce/index/
// bloom.py positive_limit is the twin for the NumPy and torch paths). `bits` is the whole filter:
// 64 * size bytes (blocked) or filter_bytes(size) (splitmix).
uint64_t positive_limit(Family family, const uint8_t* bits, uint64_t size, int k, uint64_t r, uint64_t d,
                        bool conflict);

}  // namespace bloom
}  // namespace deepreduce
