// Stable, platform-independent 64-bit hashing (FNV-1a + a splitmix finaliser), for seeds
// derived from names and for cache keys. Not cryptographic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace weft {

uint64_t hash64(std::string_view data, uint64_t seed = 0);
// XXH64 of bytes (a few GB/s on one core, platform-independent, not cryptographic): corpus
// caches' payloads, parameters' fingerprints.
uint64_t hash_bytes(const void* data, size_t size, uint64_t seed = 0);
// Mixes a value into a running hash.
uint64_t hash_combine(uint64_t hash, uint64_t value);
// 16 lowercase hex digits.
std::string hex64(uint64_t value);

}  // namespace weft
