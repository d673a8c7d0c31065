// Fixed-width bit packing (see bitpack.h): 64-bit words at a time instead of bit by bit.
#include "bitpack.h"

#include <cstring>

#include "common/error.h"

namespace deepreduce {
namespace bitpack {
namespace {
constexpr bool HOST_IS_LITTLE_ENDIAN =
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;  // 8-byte loads read the stream's order
}  // namespace

size_t packed_size(uint64_t count, int width) {
    return static_cast<size_t>((count * width + 7) / 8);
}

void pack(const uint64_t* values, uint64_t count, int width, uint8_t* out) {
    uint64_t acc = 0;  // the stream's bits not yet written, LSB first
    int filled = 0;    // how many of them
    uint8_t* o = out;
    for (uint64_t i = 0; i < count; ++i) {
        const uint64_t v = values[i];
        acc |= v << filled;
        if (filled + width >= 64) {  // a whole word: write it (little-endian bytes)
            for (int b = 0; b < 8; ++b) o[b] = static_cast<uint8_t>(acc >> (8 * b));
            o += 8;
            acc = filled ? v >> (64 - filled) : 0;
            filled += width - 64;
        } else {
            filled += width;
        }
    }
    for (int b = 0; 8 * b < filled; ++b) o[b] = static_cast<uint8_t>(acc >> (8 * b));
}

void check(size_t len, int width, uint64_t count) {
    if (width < 1 || width > 64)
        fail(ErrorKind::CONTAINER, "bit width must be in [1, 64], got " + std::to_string(width));
    const unsigned __int128 bits = static_cast<unsigned __int128>(count) * static_cast<unsigned>(width);
    const unsigned __int128 need = (bits + 7) / 8;
    if (need != len)
        fail(ErrorKind::CONTAINER, "packed section has " + std::to_string(len) + " bytes, expected " +
                                       std::to_string(static_cast<uint64_t>(need)) + " for " + std::to_string(count) +
                                       " entries of " + std::to_string(width) + " bits");
}

void unpack(const uint8_t* data, size_t len, int width, uint64_t count, uint64_t* out) {
    check(len, width, count);
    const uint64_t mask = width == 64 ? ~uint64_t(0) : (uint64_t(1) << width) - 1;
    uint64_t i = 0;
    if (width <= 56 && HOST_IS_LITTLE_ENDIAN) {  // one 8-byte window holds every entry (shift <= 7, 7 + 56 <= 63)
        for (; i < count; ++i) {
            const uint64_t bit = i * static_cast<uint64_t>(width);
            const size_t byte = static_cast<size_t>(bit >> 3);
            if (byte + 8 > len) break;  // the last entries: the byte-wise loop below
            uint64_t word;
            std::memcpy(&word, data + byte, 8);
            out[i] = (word >> (bit & 7)) & mask;
        }
    }
    for (; i < count; ++i) {
        const uint64_t bit = i * static_cast<uint64_t>(width);
        uint64_t v = 0;
        for (int got = 0; got < width;) {  // byte by byte: at most 9 bytes per entry
            const uint64_t p = bit + static_cast<uint64_t>(got);
            const int offset = static_cast<int>(p & 7);
            const int take = width - got < 8 - offset ? width - got : 8 - offset;
            const uint64_t part = (static_cast<uint64_t>(data[p >> 3]) >> offset) & ((uint64_t(1) << take) - 1);
            v |= part << got;
            got += take;
        }
        out[i] = v;
    }
}

}  // namespace bitpack
}  // namespace deepreduce
