// Bloom filter kernels; see bloom.h for the hash family and the contracts.
#include "bloom.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace deepreduce {
namespace bloom {

namespace {

inline bool test_bit(const uint8_t* bits, uint64_t j) { return (bits[j >> 3] >> (j & 7)) & 1u; }

void check_k(int k) {
    if (k < 1 || k > MAX_K) throw std::invalid_argument("Bloom filter: k must be in [1, 64]");
}

}  // namespace

void positions(const uint64_t* x, size_t n, uint64_t m, int k, uint64_t seed, uint64_t* out) {
    check_k(k);
    if (m == 0) throw std::invalid_argument("Bloom filter: m must be positive");
    uint64_t keys[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = hash_key(seed, i);
    for (size_t a = 0; a < n; ++a)
        for (int i = 0; i < k; ++i) out[a * k + i] = position(x[a], keys[i], m);
}

void build(const uint64_t* idx, size_t n, uint64_t m, int k, uint64_t seed, uint8_t* bits) {
    check_k(k);
    if (n == 0) return;
    if (m == 0) throw std::invalid_argument("Bloom filter: m must be positive to insert indices");
    uint64_t keys[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = hash_key(seed, i);
    for (size_t a = 0; a < n; ++a) {
        const uint64_t x = idx[a];
        for (int i = 0; i < k; ++i) {
            const uint64_t j = position(x, keys[i], m);
            bits[j >> 3] |= static_cast<uint8_t>(1u << (j & 7));
        }
    }
}

void query(const uint8_t* bits, uint64_t m, int k, uint64_t seed, uint64_t d, uint64_t limit,
           std::vector<uint64_t>& out) {
    check_k(k);
    if (m == 0 || d == 0) return;
    uint64_t keys[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = hash_key(seed, i);
    // Blocks of candidates: hash function 0 over the block, then each further function over the
    // survivors only (early exit at the first zero bit), compacting without branches.
    constexpr uint64_t BLOCK = 4096;
    uint64_t buf[BLOCK];
    const uint64_t key0 = keys[0];
    for (uint64_t base = 0; base < d; base += BLOCK) {
        const uint64_t end = std::min(d, base + BLOCK);
        size_t n = 0;
        uint64_t z = key0 + base * GAMMA;
        for (uint64_t x = base; x < end; ++x, z += GAMMA) {
            const uint64_t j = mulhi64(mix64(z), m);
            buf[n] = x;
            n += test_bit(bits, j);
        }
        for (int i = 1; i < k && n; ++i) {
            const uint64_t key = keys[i];
            size_t n2 = 0;
            for (size_t a = 0; a < n; ++a) {
                const uint64_t x = buf[a];
                const uint64_t j = position(x, key, m);
                buf[n2] = x;
                n2 += test_bit(bits, j);
            }
            n = n2;
        }
        out.insert(out.end(), buf, buf + n);
        if (out.size() > limit) return;
    }
}

void select_random(const uint64_t* P, size_t np, size_t r, uint64_t draw_seed, uint64_t* out) {
    if (r > np) throw std::invalid_argument("Bloom P1: more indices requested than positives");
    if (r == 0) return;
    std::vector<std::pair<uint64_t, uint64_t>> pri(np);
    for (size_t a = 0; a < np; ++a) pri[a] = {mix64(draw_seed + (P[a] + 1) * GAMMA), P[a]};
    if (r < np) std::nth_element(pri.begin(), pri.begin() + (r - 1), pri.end());
    for (size_t a = 0; a < r; ++a) out[a] = pri[a].second;
    std::sort(out, out + r);
}

void select_conflict(const uint64_t* P, size_t np, size_t r, uint64_t m, int k, uint64_t seed,
                     uint64_t draw_seed, uint64_t* out) {
    check_k(k);
    if (r > np) throw std::invalid_argument("Bloom P2: more indices requested than positives");
    if (r == 0) return;
    if (m == 0) throw std::invalid_argument("Bloom P2: empty filter with positives");
    uint64_t keys[MAX_K];
    for (int i = 0; i < k; ++i) keys[i] = hash_key(seed, i);

    // Distinct positions of each positive (duplicates within one x collapse).
    std::vector<uint64_t> pos(np * static_cast<size_t>(k));
    std::vector<uint8_t> npos(np);
    for (size_t a = 0; a < np; ++a) {
        uint64_t* row = &pos[a * k];
        int c = 0;
        for (int i = 0; i < k; ++i) {
            const uint64_t j = position(P[a], keys[i], m);
            bool dup = false;
            for (int q = 0; q < c; ++q) dup |= (row[q] == j);
            if (!dup) row[c++] = j;
        }
        npos[a] = static_cast<uint8_t>(c);
    }
    // Conflict sets in CSR form: members of set j ascending (P is ascending).
    std::vector<uint32_t> count(m + 1, 0);
    for (size_t a = 0; a < np; ++a)
        for (int q = 0; q < npos[a]; ++q) ++count[pos[a * k + q] + 1];
    std::vector<uint64_t> start(m + 1, 0);
    for (uint64_t j = 0; j < m; ++j) start[j + 1] = start[j] + count[j + 1];
    std::vector<uint32_t> members(start[m]);
    {
        std::vector<uint64_t> fill(start.begin(), start.end() - 1);
        for (size_t a = 0; a < np; ++a)
            for (int q = 0; q < npos[a]; ++q) members[fill[pos[a * k + q]]++] = static_cast<uint32_t>(a);
    }
    // Non-empty sets ordered by (size, bit): stable counting sort by size over ascending bits.
    uint64_t max_size = 0;
    for (uint64_t j = 0; j < m; ++j) max_size = std::max<uint64_t>(max_size, count[j + 1]);
    std::vector<uint64_t> by_size(max_size + 2, 0);
    for (uint64_t j = 0; j < m; ++j)
        if (count[j + 1]) ++by_size[count[j + 1] + 1];
    for (uint64_t s = 1; s <= max_size + 1; ++s) by_size[s] += by_size[s - 1];
    std::vector<uint64_t> active(by_size[max_size + 1]);
    for (uint64_t j = 0; j < m; ++j)
        if (count[j + 1]) active[by_size[count[j + 1]]++] = j;

    std::vector<uint8_t> chosen(np, 0);
    std::vector<uint32_t> cand;
    size_t nchosen = 0;
    uint64_t draw = 0;
    std::vector<uint64_t> next;
    while (nchosen < r && !active.empty()) {
        next.clear();
        for (uint64_t j : active) {
            if (nchosen == r) break;
            cand.clear();
            for (uint64_t e = start[j]; e < start[j + 1]; ++e)
                if (!chosen[members[e]]) cand.push_back(members[e]);
            if (cand.empty()) continue;
            size_t pick = 0;
            if (cand.size() > 1) {
                ++draw;
                pick = static_cast<size_t>(mulhi64(mix64(draw_seed + draw * GAMMA), cand.size()));
            }
            chosen[cand[pick]] = 1;
            ++nchosen;
            if (cand.size() > 1) next.push_back(j);
        }
        active.swap(next);
    }
    if (nchosen != r) throw std::invalid_argument("Bloom P2: positives do not cover r distinct indices");
    size_t o = 0;
    for (size_t a = 0; a < np; ++a)
        if (chosen[a]) out[o++] = P[a];
}

}  // namespace bloom
}  // namespace deepreduce
