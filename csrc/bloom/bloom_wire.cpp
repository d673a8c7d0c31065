// The Bloom index codec's wire rules (see bloom_wire.h).
#include "bloom_wire.h"

#include <cmath>
#include <new>

#include "common/error.h"
#include "container.h"  // the varints of the params

namespace deepreduce {
namespace bloom {

namespace {

constexpr int FAMILY_COUNT = 2;  // the family code in the params' high nibble: splitmix 0, blocked 1
constexpr size_t SPLITMIX_PARAMS = 26;
constexpr size_t DRAW_BYTES = 8;

uint64_t u64_le(const uint8_t* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}

[[noreturn]] void container_error(const std::string& message) {
    fail(ErrorKind::CONTAINER, message);
}

}  // namespace

const char* const POLICIES[POLICY_COUNT] = {"naive", "p0", "p1", "p2", "leftmost", "middle", "rightmost"};

int policy_code(const std::string& name) {
    for (int i = 0; i < POLICY_COUNT; ++i)
        if (name == POLICIES[i]) return i;
    fail(ErrorKind::ARGUMENT, "unknown Bloom policy '" + name + "'");
}

std::string pack_params(const Params& p) {
    uint8_t buf[2 + 2 * container::VARINT_MAX_BYTES + DRAW_BYTES];
    buf[0] = static_cast<uint8_t>(0x10 | p.policy);
    buf[1] = static_cast<uint8_t>(p.k);
    uint8_t* q = container::varint_put(buf + 2, p.size);
    q = container::varint_put(q, p.seed);
    if (draws(p.policy)) {
        uint64_t d = p.draw_seed;
        for (size_t i = 0; i < DRAW_BYTES; ++i, d >>= 8) *q++ = static_cast<uint8_t>(d & 0xFF);
    }
    return std::string(reinterpret_cast<const char*>(buf), static_cast<size_t>(q - buf));
}

Params unpack_params(const uint8_t* params, size_t len) {
    if (len < 2) container_error("Bloom params have " + std::to_string(len) + " bytes; at least 2 needed");
    const int code = params[0], family = code >> 4, policy = code & 0x0F;
    if (family >= FAMILY_COUNT || policy >= POLICY_COUNT) {
        static const char* hex = "0123456789abcdef";
        container_error(std::string("Bloom params name unknown family/policy code 0x") + hex[code >> 4] +
                        hex[code & 15]);
    }
    Params p;
    p.k = params[1];
    if (p.k < 1 || p.k > MAX_K)
        container_error("Bloom params give k = " + std::to_string(p.k) + "; allowed 1.." + std::to_string(MAX_K));
    p.policy = policy;
    p.family = family == 1 ? Family::BLOCKED : Family::SPLITMIX;
    if (p.family == Family::SPLITMIX) {
        if (len != SPLITMIX_PARAMS)
            container_error("Bloom params have " + std::to_string(len) + " bytes, expected " +
                            std::to_string(SPLITMIX_PARAMS));
        p.size = u64_le(params + 2);
        p.seed = u64_le(params + 10);
        p.draw_seed = u64_le(params + 18);
        return p;
    }
    size_t pos = 2;
    p.size = container::varint_get(params, len, pos, "Bloom blocks");
    p.seed = container::varint_get(params, len, pos, "Bloom hash seed");
    if (draws(policy)) {
        if (len - pos < DRAW_BYTES) container_error("Bloom params end before the draw seed");
        p.draw_seed = u64_le(params + pos);
        pos += DRAW_BYTES;
    }
    if (pos != len) container_error("Bloom params have " + std::to_string(len - pos) + " bytes after their last field");
    if (p.size > blocked::MAX_BLOCKS)
        container_error("Bloom params give " + std::to_string(p.size) + " blocks; at most " +
                        std::to_string(blocked::MAX_BLOCKS));
    return p;
}

uint64_t blocks_for(uint64_t r, double keys_per_block) {
    if (!(keys_per_block > 0)) fail(ErrorKind::ARGUMENT, "Bloom keys per block must be positive");
    if (r == 0) return 0;
    const double blocks = std::ceil(static_cast<double>(r) / keys_per_block);
    if (blocks > static_cast<double>(blocked::MAX_BLOCKS)) {
        const std::string count = blocks < 0x1p64 ? std::to_string(static_cast<uint64_t>(blocks)) : "2**64 or more";
        fail(ErrorKind::ENCODE, "Bloom filter for " + std::to_string(r) + " indices needs " + count +
                                    " blocks; at most " + std::to_string(blocked::MAX_BLOCKS));
    }
    return blocks < 1 ? 1 : static_cast<uint64_t>(blocks);
}

std::vector<uint64_t> choose(const Params& p, const Positives& P, size_t r) {
    const uint64_t np = P.count;
    std::vector<uint64_t> out;
    switch (p.policy) {
        case P0:
            out.resize(static_cast<size_t>(np));
            list_positives(P, 0, np, out.data());
            return out;
        case P1:
        case P2: {
            out.resize(r);
            if (r == 0) return out;
            if (p.policy == P1)
                select_random(P, r, p.draw_seed, out.data());
            else
                select_conflict(p.family, P, r, p.size, p.k, p.seed, p.draw_seed, out.data());
            return out;
        }
        default: {  // a window of r positives: naive and leftmost the first, middle, rightmost the last
            if (r > np) fail(ErrorKind::ARGUMENT, "Bloom policy window: more indices requested than positives");
            const uint64_t offset = p.policy == RIGHTMOST ? np - r : p.policy == MIDDLE ? (np - r) / 2 : 0;
            out.resize(r);
            list_positives(P, offset, r, out.data());
            return out;
        }
    }
}

Encoded encode(const uint64_t* positions, size_t r, uint64_t numel, int policy, int k, double keys_per_block,
               uint64_t hash_seed, uint64_t draw_seed, int threads) {
    Params p;
    p.policy = policy;
    p.k = k;
    p.size = blocks_for(r, keys_per_block);
    p.seed = hash_seed;
    p.draw_seed = draws(policy) ? draw_seed : 0;
    Encoded out;
    out.params = pack_params(p);
    out.filter.assign(p.filter_bytes(), 0);
    Positives P;
    try {
        if (r > 0) {
            blocked::build(positions, r, p.size, p.k, p.seed, out.filter.data(), threads);
            const bool first_r = policy == NAIVE || policy == LEFTMOST;  // the sender knows r: no need to look further
            blocked::query(out.filter.data(), p.size, p.k, p.seed, numel, first_r ? r : numel, threads, P);
        }
        out.chosen = choose(p, P, r);
    } catch (const Error& e) {  // a kernel's refusal, as the codec words it
        fail(ErrorKind::ENCODE, std::string("Bloom encode: ") + e.what());
    }
    return out;
}

std::vector<uint64_t> decode(const uint8_t* params, size_t params_len, const uint8_t* section, size_t len,
                             uint64_t count, uint64_t numel, int threads) {
    const Params p = unpack_params(params, params_len);
    if (len != p.filter_bytes())
        container_error(
            "Bloom section has " + std::to_string(len) + " bytes, expected " + std::to_string(p.filter_bytes()) +
            " for " +
            (p.family == Family::BLOCKED ? std::to_string(p.size) + " blocks" : "m = " + std::to_string(p.size)));
    if (p.family == Family::SPLITMIX && p.size % 8 && (section[len - 1] >> (p.size % 8)))
        container_error("Bloom section has bits set beyond m");
    if (p.size == 0) {
        if (count) container_error("empty Bloom filter cannot carry " + std::to_string(count) + " indices");
        return {};
    }
    Positives P;
    try {
        // The filter's own bound (and P2's refusals) for every policy; the prefix policies need
        // only the first `count` positives.
        uint64_t limit = positive_limit(p.family, section, p.size, p.k, count, numel, p.policy == P2);
        if (prefix_policy(p.policy)) limit = count;
        if (p.family == Family::BLOCKED)
            blocked::query(section, p.size, p.k, p.seed, numel, limit, threads, P);
        else
            splitmix::query(section, p.size, p.k, p.seed, numel, limit, threads, P);
        const uint64_t npos = P.count;
        if (p.policy == P0 && npos != count)
            container_error("Bloom P0 filter has " + std::to_string(npos) + (npos > count ? "+" : "") +
                            " positives, header says " + std::to_string(count));
        if (npos < count)
            container_error("Bloom filter has " + std::to_string(npos) + " positives, fewer than the " +
                            std::to_string(count) + " values sent");
        if (npos > limit && !prefix_policy(p.policy))
            container_error("Bloom " + std::string(POLICIES[p.policy]) + " filter has more than " +
                            std::to_string(limit) + " positives: more than a filter holding " + std::to_string(count) +
                            " keys has at its own false-positive rate");
        return choose(p, P, static_cast<size_t>(count));
    } catch (const Error& e) {  // a kernel's refusal of what the container says, as the codec words it
        if (e.kind() == ErrorKind::CONTAINER) throw;
        container_error(std::string("Bloom decode: ") + e.what());
    } catch (const std::bad_alloc&) {  // what the claim needs (a bitmap of numel bits, P2's sets) is not there
        container_error(
            "Bloom decode ran out of memory: a " + std::string(POLICIES[p.policy]) + " filter of " +
            (p.family == Family::BLOCKED ? std::to_string(p.size) + " blocks" : "m = " + std::to_string(p.size)) +
            " and k = " + std::to_string(p.k) + " claims " + std::to_string(count) + " keys over " +
            std::to_string(numel) + " positions");
    }
}

}  // namespace bloom
}  // namespace deepreduce
