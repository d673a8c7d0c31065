// Seed derivation (BLAKE2b) and Bloom params of the TF pipeline ops (see wire.h).
#include "wire.h"

#include <cstring>

#include "container.h"

namespace deepreduce {
namespace wire {

namespace {

// ------------------------------------------------------------------ BLAKE2b (RFC 7693)
const uint64_t IV[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
                        0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};
const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0}};

inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline void mix(uint64_t* v, int a, int b, int c, int d, uint64_t x, uint64_t y) {
    v[a] = v[a] + v[b] + x;
    v[d] = rotr(v[d] ^ v[a], 32);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 24);
    v[a] = v[a] + v[b] + y;
    v[d] = rotr(v[d] ^ v[a], 16);
    v[c] = v[c] + v[d];
    v[b] = rotr(v[b] ^ v[c], 63);
}

void compress(uint64_t* h, const uint8_t* block, uint64_t counter, bool last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; ++i) {
        m[i] = 0;
        for (int b = 7; b >= 0; --b) m[i] = (m[i] << 8) | block[8 * i + b];
    }
    for (int i = 0; i < 8; ++i) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= counter;   // messages here stay far below 2^64 bytes: the high counter word is 0
    if (last) v[14] = ~v[14];
    for (int round = 0; round < 12; ++round) {
        const uint8_t* s = SIGMA[round % 10];
        mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
        mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
        mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
        mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
        mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
        mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
        mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
        mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i) h[i] ^= v[i] ^ v[i + 8];
}

// BLAKE2b with an 8-byte digest (no key) of `data`, as a little-endian uint64.
uint64_t blake2b_64(const std::string& data) {
    uint64_t h[8];
    std::memcpy(h, IV, sizeof(h));
    h[0] ^= 0x01010000ULL ^ 8;   // digest length 8, no key, fanout 1, depth 1
    const size_t n = data.size();
    const uint8_t* p = reinterpret_cast<const uint8_t*>(data.data());
    size_t done = 0;
    while (n - done > 128) {   // every full block but the last
        compress(h, p + done, done + 128, false);
        done += 128;
    }
    uint8_t last[128] = {};
    std::memcpy(last, p + done, n - done);
    compress(h, last, n, true);
    return h[0];
}

}  // namespace

uint64_t derive_seed(const std::string& digest, const std::string& name, int64_t step, const std::string& purpose) {
    std::string data = digest + name;
    data.push_back('\0');
    uint64_t s = static_cast<uint64_t>(step);
    for (int i = 0; i < 8; ++i, s >>= 8) data.push_back(static_cast<char>(s & 0xFF));
    return blake2b_64(data + purpose);
}

// ------------------------------------------------------------------ Bloom params
const char* const BLOOM_POLICIES[7] = {"naive", "p0", "p1", "p2", "leftmost", "middle", "rightmost"};

int bloom_policy_code(const std::string& policy) {
    for (int i = 0; i < 7; ++i)
        if (policy == BLOOM_POLICIES[i]) return i;
    return -1;
}

bool bloom_draws(int policy) { return policy == 2 || policy == 3; }

void pack_bloom_params(const BloomParams& p, std::string& out) {
    uint8_t buf[2 + 2 * container::VARINT_MAX_BYTES + 8];
    buf[0] = static_cast<uint8_t>(0x10 | p.policy);
    buf[1] = static_cast<uint8_t>(p.k);
    uint8_t* q = container::varint_put(buf + 2, p.size);
    q = container::varint_put(q, p.seed);
    if (bloom_draws(p.policy)) {
        uint64_t d = p.draw_seed;
        for (int i = 0; i < 8; ++i, d >>= 8) *q++ = static_cast<uint8_t>(d & 0xFF);
    }
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(q - buf));
}

std::string unpack_bloom_params(const uint8_t* params, size_t len, BloomParams& p) {
    auto u64 = [&](size_t at) {
        uint64_t v = 0;
        for (int i = 7; i >= 0; --i) v = (v << 8) | params[at + i];
        return v;
    };
    if (len < 2) return "Bloom params have " + std::to_string(len) + " bytes; at least 2 needed";
    const int code = params[0], family = code >> 4, policy = code & 0x0F;
    if (family >= 2 || policy >= 7) {
        static const char* hex = "0123456789abcdef";
        return std::string("Bloom params name unknown family/policy code 0x") + hex[code >> 4] + hex[code & 15];
    }
    p.k = params[1];
    if (p.k < 1 || p.k > 64) return "Bloom params give k = " + std::to_string(p.k) + "; allowed 1..64";
    p.policy = policy;
    p.blocked = family == 1;
    if (!p.blocked) {
        if (len != 26) return "Bloom params have " + std::to_string(len) + " bytes, expected 26";
        p.size = u64(2);
        p.seed = u64(10);
        p.draw_seed = u64(18);
        return "";
    }
    size_t pos = 2;
    std::string err = container::varint_get(params, len, pos, "Bloom blocks", p.size);
    if (err.empty()) err = container::varint_get(params, len, pos, "Bloom hash seed", p.seed);
    if (!err.empty()) return err;
    p.draw_seed = 0;
    if (bloom_draws(policy)) {
        if (len - pos < 8) return "Bloom params end before the draw seed";
        p.draw_seed = u64(pos);
        pos += 8;
    }
    if (pos != len) return "Bloom params have " + std::to_string(len - pos) + " bytes after their last field";
    if (p.size > (uint64_t(1) << 31) - 1)
        return "Bloom params give " + std::to_string(p.size) + " blocks; at most " + std::to_string((1u << 31) - 1);
    return "";
}

// ------------------------------------------------------------------ polyfit
std::string check_polyfit_params(const uint8_t* params, size_t len, int& degree, int& coef_bytes) {
    if (len != 2) return "polyfit parameters have " + std::to_string(len) + " bytes, expected 2";
    degree = params[0];
    coef_bytes = params[1];
    if (degree > 15 || (coef_bytes != 4 && coef_bytes != 8))
        return "polyfit parameters invalid: degree " + std::to_string(degree) + ", coefficient bytes " +
               std::to_string(coef_bytes);
    return "";
}

std::string check_polyfit_lengths(const uint8_t* payload, size_t len, uint64_t count, int degree) {
    auto u32 = [&](size_t at) {
        uint32_t v;
        std::memcpy(&v, payload + at, 4);
        return static_cast<uint64_t>(v);
    };
    (void)degree;   // the coefficient count it implies is checked by dr_polyfit_check
    if (len < 4) return "polyfit value section has " + std::to_string(len) + " bytes; at least 4 expected";
    const uint64_t l = u32(0);
    if (l > count)
        return "polyfit value section claims " + std::to_string(l) + " non-negative values of " +
               std::to_string(count);
    size_t pos = 4;
    for (uint64_t total : {l, count - l}) {
        uint64_t acc = 0;
        while (acc < total) {
            if (pos + 4 > len) return "polyfit value section ends inside its segment table";
            const uint64_t seg = u32(pos);
            pos += 4;
            if (seg == 0 || seg > total - acc) return "polyfit segment lengths do not add up to the value count";
            acc += seg;
        }
    }
    return "";
}

}  // namespace wire
}  // namespace deepreduce
