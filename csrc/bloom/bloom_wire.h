// The wire rules of the Bloom index codec (deepreduce/index/bloom.py BloomIndex): its params
// (pack and checked unpack), the block count of a filter, which positives the policies choose,
// and the codec's encode and decode over the kernels of bloom.h. The TF pipeline ops
// (csrc/pipeline) and the pybind11 module deepreduce._bloom call these; the Python codec calls the
// params rules through the module when it is built.
//
// Wire params of the blocked family: 0x10 | policy u8 | k u8 | blocks varint | hash seed varint |
// draw seed u64 LE (p1/p2 only). SplitMix64 params (format v1, decode only, 26 bytes): policy u8 |
// k u8 | m u64 | hash seed u64 | draw seed u64.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bloom.h"

namespace deepreduce {
namespace bloom {

// bloom.POLICIES in wire-code order.
enum Policy { NAIVE = 0, P0 = 1, P1 = 2, P2 = 3, LEFTMOST = 4, MIDDLE = 5, RIGHTMOST = 6, POLICY_COUNT = 7 };
extern const char* const POLICIES[POLICY_COUNT];

// The code of a policy name; ErrorKind::ARGUMENT for an unknown one.
int policy_code(const std::string& name);
// p1 and p2 carry a draw seed.
inline bool draws(int policy) {
    return policy == P1 || policy == P2;
}
// The receiver queries only the first `count` positives for these policies (the header's value count).
inline bool prefix_policy(int policy) {
    return policy == NAIVE || policy == LEFTMOST || policy == P0;
}

struct Params {
    Family family = Family::BLOCKED;
    int policy = P0;
    int k = 0;
    uint64_t size = 0;  // blocks (blocked) or m (splitmix)
    uint64_t seed = 0;
    uint64_t draw_seed = 0;  // 0 unless draws(policy)
    uint64_t filter_bytes() const {
        return family == Family::BLOCKED ? size * blocked::BLOCK_BYTES : bloom::filter_bytes(size);
    }
};

// bloom.pack_params: the params of a blocked filter.
std::string pack_params(const Params& p);

// bloom.unpack_params: the params of either family, checked (ErrorKind::CONTAINER names the bad field).
Params unpack_params(const uint8_t* params, size_t len);

// bloom.filter_params' block count for r indices at `keys_per_block`: ceil(r / keys_per_block)
// (at least 1; 0 for r = 0); ErrorKind::ENCODE beyond blocked::MAX_BLOCKS.
uint64_t blocks_for(uint64_t r, double keys_per_block);

// BloomIndex._select: the positives of P (a query's: its first P.count positives) the policy keeps
// for r values, ascending (all of P for p0).
std::vector<uint64_t> choose(const Params& p, const Positives& P, size_t r);

// BloomIndex.encode of r ascending positions of a tensor of numel elements: the params, the
// filter and the positions that carry values (`chosen`, ascending).
struct Encoded {
    std::string params;
    std::vector<uint8_t> filter;
    std::vector<uint64_t> chosen;
};
Encoded encode(const uint64_t* positions, size_t r, uint64_t numel, int policy, int k, double keys_per_block,
               uint64_t hash_seed, uint64_t draw_seed, int threads);

// BloomIndex.decode: the `count` positions a container's params and filter section stand for
// (ErrorKind::CONTAINER, with the core's text, if they cannot). The query is bounded by
// positive_limit (bloom.h) first, so the work is bounded by what the filter's own rate allows;
// the positives are a bitmap of numel bits, so the memory is bounded by the tensor (P2 adds its
// conflict sets, O(numel + filter bits)). Running out of memory (std::bad_alloc) is a
// CONTAINER error that names the claim, never an exception of another kind.
std::vector<uint64_t> decode(const uint8_t* params, size_t params_len, const uint8_t* section, size_t len,
                             uint64_t count, uint64_t numel, int threads);

}  // namespace bloom
}  // namespace deepreduce
