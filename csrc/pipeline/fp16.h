// The float16 of the fp16 value codec (deepreduce/values/fp16.py: numpy's astype(float16)):
// IEEE binary16, rounded to nearest, ties to even, subnormals kept.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace deepreduce {
namespace fp16 {

constexpr float MAX = 65504.0f;

inline uint16_t from_float(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u);  // Inf, NaN
    if (a >= 0x477FF000u) return sign | 0x7C00u;                                    // 65520 and up: Inf
    if (a < 0x38800000u) {  // below 2^-14: a multiple of 2^-24, scaled exactly, rounded to even
        float mag;
        std::memcpy(&mag, &a, 4);
        return sign | static_cast<uint16_t>(std::nearbyint(mag * 16777216.0f));
    }
    uint32_t h = (a - 0x38000000u) >> 13;  // exponent rebiased 127 -> 15, the top 10 mantissa bits
    const uint32_t rest = a & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent: still right
    return sign | static_cast<uint16_t>(h);
}

inline float to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

}  // namespace fp16
}  // namespace deepreduce
