// Elias-Fano indices (see elias_fano.h).
#include "elias_fano.h"

#include <string>

#include "common/error.h"

namespace deepreduce {
namespace elias_fano {

namespace {

bool bit(const uint8_t* stream, uint64_t pos) {
    return (stream[pos >> 3] >> (pos & 7)) & 1u;
}

}  // namespace

int low_bits(uint64_t r, uint64_t d) {
    if (r == 0 || r >= d) return 0;
    int L = -1;
    for (uint64_t q = d / r; q; q >>= 1) ++L;
    return L;
}

uint64_t stream_bits(uint64_t r, uint64_t d) {
    if (r == 0) return 0;
    const int L = low_bits(r, d);
    return r * static_cast<uint64_t>(L) + r + ((d - 1) >> L);  // r > 0 implies d > 0 on both paths
}

std::vector<uint8_t> encode(const uint64_t* x, uint64_t r, uint64_t d) {
    std::vector<uint8_t> out((stream_bits(r, d) + 7) / 8, 0);
    if (r == 0) return out;
    const int L = low_bits(r, d);
    const uint64_t upper = r * static_cast<uint64_t>(L);
    for (uint64_t i = 0; i < r; ++i) {
        for (int b = 0; b < L; ++b) {  // entry i's low bits: stream bits [i L, (i+1) L)
            const uint64_t pos = i * static_cast<uint64_t>(L) + static_cast<uint64_t>(b);
            out[pos >> 3] |= static_cast<uint8_t>(((x[i] >> b) & 1u) << (pos & 7));
        }
        const uint64_t pos = upper + i + (x[i] >> L);
        out[pos >> 3] |= static_cast<uint8_t>(1u << (pos & 7));
    }
    return out;
}

std::vector<int64_t> decode(const uint8_t* s, uint64_t len, uint64_t params_len, uint64_t r, uint64_t d) {
    const uint64_t total = stream_bits(r, d);
    if (params_len || len != (total + 7) / 8)
        fail(ErrorKind::CONTAINER, "Elias-Fano section has " + std::to_string(len) + " bytes, expected " +
                                       std::to_string((total + 7) / 8) + " for " + std::to_string(r) + " of " +
                                       std::to_string(d) + " indices");
    std::vector<int64_t> out;
    if (r == 0) return out;
    for (uint64_t pos = total; pos < 8 * len; ++pos)
        if (bit(s, pos)) fail(ErrorKind::CONTAINER, "Elias-Fano section has non-zero padding");
    const int L = low_bits(r, d);
    const uint64_t upper = r * static_cast<uint64_t>(L);
    out.reserve(r);
    uint64_t ones = 0;
    for (uint64_t pos = upper; pos < total; ++pos) {
        if (!bit(s, pos)) continue;
        if (ones < r) out.push_back(static_cast<int64_t>((pos - upper - ones) << L));
        ++ones;
    }
    if (ones != r)
        fail(ErrorKind::CONTAINER,
             "Elias-Fano upper bits hold " + std::to_string(ones) + " entries, expected " + std::to_string(r));
    bool ordered = true;
    for (uint64_t i = 0; i < r; ++i) {
        uint64_t low = 0;
        for (int b = 0; b < L; ++b) low |= static_cast<uint64_t>(bit(s, i * static_cast<uint64_t>(L) + b)) << b;
        out[i] |= static_cast<int64_t>(low);
        ordered = ordered && static_cast<uint64_t>(out[i]) < d && (i == 0 || out[i] > out[i - 1]);
    }
    if (!ordered) fail(ErrorKind::CONTAINER, "Elias-Fano section decodes to indices out of range or not increasing");
    return out;
}

}  // namespace elias_fano
}  // namespace deepreduce
