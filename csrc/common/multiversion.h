// DR_MULTIVERSION: compile a hot loop twice, for AVX2 and for the baseline x86-64, and pick one
// at load time (GCC's target_clones) where the compiler supports it. The "avx2" target enables
// no FMA, so floating-point expressions are never contracted: both clones compute the same bits.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define DR_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define DR_MULTIVERSION
#endif
