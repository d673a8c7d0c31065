// The wire pieces the TensorFlow pipeline ops need besides the container (csrc/container):
// the seed derivation of deepreduce/wire/seeding.py (BLAKE2b, RFC 7693), the Bloom index codec's
// params of deepreduce/index/bloom.py, the polyfit params and segment-table check of
// deepreduce/values/polyfit.py (the fixed-width bit packing is csrc/container/bitpack.h).
// Pure C++; the op tests check every byte and every error text against the core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace deepreduce {
namespace wire {

// seeding.derive_seed: the little-endian uint64 of BLAKE2b-64(digest || name || 0x00 ||
// step as int64 LE || purpose).
uint64_t derive_seed(const std::string& digest, const std::string& name, int64_t step, const std::string& purpose);

// bloom.POLICIES in wire-code order; -1 for an unknown name.
extern const char* const BLOOM_POLICIES[7];
int bloom_policy_code(const std::string& policy);
bool bloom_draws(int policy);   // p1, p2 carry a draw seed

struct BloomParams {
    bool blocked = true;        // false: the SplitMix64 family of format v1
    int policy = 0;             // index into BLOOM_POLICIES
    int k = 0;
    uint64_t size = 0;          // blocks (blocked) or m (splitmix)
    uint64_t seed = 0;
    uint64_t draw_seed = 0;
    uint64_t filter_bytes() const { return blocked ? size * 64 : size / 8 + (size % 8 != 0); }
};

// bloom.pack_params (blocked family) appended to out.
void pack_bloom_params(const BloomParams& p, std::string& out);

// bloom.unpack_params: "" or the ContainerError text.
std::string unpack_bloom_params(const uint8_t* params, size_t len, BloomParams& p);

// polyfit.PolyFit._params: "" or the ContainerError text.
std::string check_polyfit_params(const uint8_t* params, size_t len, int& degree, int& coef_bytes);

// polyfit.parse_lengths: whether the segment table of a payload backs `count` values ("" or the
// ContainerError text).
std::string check_polyfit_lengths(const uint8_t* payload, size_t len, uint64_t count, int degree);

}  // namespace wire
}  // namespace deepreduce
