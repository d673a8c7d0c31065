// Bloom filter kernels of deepreduce: build, query of every position, and the index-selection
// policies P1 (random) and P2 (conflict sets, DeepReduce Algorithm 1).
//
// Pure C++ over plain buffers (no Python types), so the pybind11 module (py_module.cpp) and the
// TensorFlow custom ops wrap the same functions. Every function checks its bounds and reports
// bad input through its return value or a std::invalid_argument, never by crashing.
//
// Hash family (documented in docs/bloom.md; deepreduce/index/bloom.py reproduces it in NumPy):
//   mix64(z)      = SplitMix64 finaliser: z ^= z>>30; z *= 0xbf58476d1ce4e5b9;
//                   z ^= z>>27; z *= 0x94d049bb133111eb; z ^= z>>31        (all mod 2^64)
//   GAMMA         = 0x9e3779b97f4a7c15
//   key_i         = mix64(seed + (i+1)*GAMMA)          i = 0..k-1 (the SplitMix64 stream of `seed`)
//   h_i(x)        = floor(mix64(key_i + x*GAMMA) * m / 2^64)   (Lemire's multiply-shift range map)
// Bit j of the filter is bit (j % 8) of byte j / 8 (LSB first).
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

inline uint64_t mulhi64(uint64_t a, uint64_t b) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(a) * b) >> 64);
}

// key_i of the family for hash function i.
inline uint64_t hash_key(uint64_t seed, int i) { return mix64(seed + static_cast<uint64_t>(i + 1) * GAMMA); }

// h_i(x) given key_i.
inline uint64_t position(uint64_t x, uint64_t key, uint64_t m) { return mulhi64(mix64(key + x * GAMMA), m); }

// Number of bytes of a filter of m bits.
inline uint64_t filter_bytes(uint64_t m) { return (m + 7) / 8; }

// Positions h_0..h_{k-1} of n indices, row-major (n x k). For tests and the NumPy parity check.
void positions(const uint64_t* x, size_t n, uint64_t m, int k, uint64_t seed, uint64_t* out);

// Set the bits of n indices into `bits` (filter_bytes(m) bytes, not cleared here).
void build(const uint64_t* idx, size_t n, uint64_t m, int k, uint64_t seed, uint8_t* bits);

// Append to `out`, ascending, every x in [0, d) whose k bits are all set; stops early once
// `out` holds more than `limit` entries (the caller then knows |P| > limit).
void query(const uint8_t* bits, uint64_t m, int k, uint64_t seed, uint64_t d, uint64_t limit,
           std::vector<uint64_t>& out);

// P1: the r entries of P with the smallest priority mix64(draw_seed + (x+1)*GAMMA) (ties by x),
// written ascending to out. Requires r <= np.
void select_random(const uint64_t* P, size_t np, size_t r, uint64_t draw_seed, uint64_t* out);

// P2 (Algorithm 1, reading documented in docs/bloom.md): r entries of P written ascending to
// out. Requires r <= np and P to be the full positive set of the filter.
void select_conflict(const uint64_t* P, size_t np, size_t r, uint64_t m, int k, uint64_t seed,
                     uint64_t draw_seed, uint64_t* out);

}  // namespace bloom
}  // namespace deepreduce
