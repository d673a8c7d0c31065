// Argument bounds shared by every kernel and binding: the one thread limit, and the one range
// check whose message every entry point uses ("threads = 300 is outside [1, 256]").
#pragma once

#include <cstdint>
#include <string>

#include "common/error.h"

namespace deepreduce {

// Most threads a kernel runs on (deepreduce/backend/parallel.py MAX_THREADS, tested equal).
constexpr int MAX_THREADS = 256;

// Throws ErrorKind::ARGUMENT unless lo <= value <= hi.
inline void check_range(const char* name, uint64_t value, uint64_t lo, uint64_t hi) {
    if (value < lo || value > hi)
        fail(ErrorKind::ARGUMENT, std::string(name) + " = " + std::to_string(value) + " is outside [" +
                                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

inline void check_threads(int threads) {
    if (threads < 1 || threads > MAX_THREADS)
        fail(ErrorKind::ARGUMENT,
             "threads = " + std::to_string(threads) + " is outside [1, " + std::to_string(MAX_THREADS) + "]");
}

}  // namespace deepreduce
