// Deterministic seeds of deepreduce/wire/seeding.py: every random choice (Random-r, QSGD
// rounding, the Bloom P1/P2 draws) draws from a seed derived from (config digest, tensor name,
// step, purpose), the same on every rank and in every binding.
#pragma once

#include <cstdint>
#include <string>

namespace deepreduce {
namespace seeding {

// The little-endian uint64 of BLAKE2b-64 (RFC 7693, no key) of
// digest || name (UTF-8) || 0x00 || step as int64 LE || purpose (UTF-8).
uint64_t derive_seed(const std::string& digest, const std::string& name, int64_t step, const std::string& purpose);

}  // namespace seeding
}  // namespace deepreduce
