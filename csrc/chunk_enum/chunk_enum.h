// The chunk_enum index section (deepreduce/index/chunk_enum.py) in C++: each chunk's subset of
// offsets as its rank in the combinatorial number system, rank = sum_i C(c_i, i) over the
// ascending offsets c_1 < ... < c_h (or over the complement's when h > L / 2), written in
// B(L, h) = bit_length(C(L, h) - 1) bits, LSB first, chunk after chunk in one bit stream; a
// chunk whose table would exceed `table_entries` entries goes as a bitmap of L bits or as fixed
// offsets of width_for(L - 1) bits, whichever is smaller. The Python module is the definition
// (and the fallback); these functions write and read the same bits and refuse the same sections
// with the same texts (tests/test_chunk_enum_native.py).
//
// Ranks are fixed-width multi-limb integers (64-bit limbs, least significant first) read from a
// table of binomials C(c, i) for i <= rows, c < length, built once per (length, rows) and shared
// by every shorter chunk or smaller count it covers (a few kept per process).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace deepreduce {
namespace chunk_enum {

enum class Mode { ENUM = 0, BITMAP = 1, FIXED = 2 };

struct Layout {
    Mode mode;
    int64_t bits;    // of one chunk
    int64_t ranked;  // offsets enumerated: min(count, length - count)
};

// layout() of chunk_enum.py for a chunk of `length` elements holding `count` offsets.
Layout layout(int64_t length, int64_t count, int64_t table_entries);

// The section of `chunks` chunks, ceil(bits / 8) bytes: local holds sum(counts) offsets,
// strictly ascending within each chunk, below its length (else an ARGUMENT error naming the first
// chunk that breaks it, before anything is written; also for counts outside [0, length]). The
// chunks are split over `threads` threads (the same bytes).
std::vector<uint8_t> pack(const int64_t* local, const int64_t* counts, const int64_t* lengths, int64_t chunks,
                          int64_t table_entries, int threads);

// The sum(counts) offsets of a section into out; CONTAINER errors (the Python texts) for a
// section of the wrong length, non-zero padding, a rank >= C(L, h), a bitmap holding another
// count; the first in stream order is raised. Chunks are split over `threads` threads.
void unpack(const uint8_t* section, size_t size, const int64_t* counts, const int64_t* lengths, int64_t chunks,
            int64_t table_entries, int threads, int64_t* out);

}  // namespace chunk_enum
}  // namespace deepreduce
