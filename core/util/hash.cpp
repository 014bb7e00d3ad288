#include "core/util/hash.h"

#include <fmt/format.h>

namespace weft {
namespace {

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}


// XXH64 (public domain algorithm by Yann Collet), reading little-endian words.
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL,
                   kP3 = 0x165667B19E3779F9ULL, kP4 = 0x85EBCA77C2B2AE63ULL,
                   kP5 = 0x27D4EB2F165667C5ULL;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

uint64_t load_le(const unsigned char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t(p[i]) << (8 * i);
  return value;
}

uint64_t xxh_round(uint64_t acc, uint64_t input) { return rotl(acc + input * kP2, 31) * kP1; }

uint64_t xxh_merge(uint64_t acc, uint64_t value) { return (acc ^ xxh_round(0, value)) * kP1 + kP4; }

}  // namespace

uint64_t hash64(std::string_view data, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull ^ splitmix(seed);
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return splitmix(h);
}

uint64_t hash_combine(uint64_t hash, uint64_t value) { return splitmix(hash ^ splitmix(value)); }

uint64_t hash_bytes(const void* data, size_t size, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + size;
  uint64_t h;
  if (size >= 32) {
    uint64_t v1 = seed + kP1 + kP2, v2 = seed + kP2, v3 = seed, v4 = seed - kP1;
    for (; p + 32 <= end; p += 32) {
      v1 = xxh_round(v1, load_le(p, 8));
      v2 = xxh_round(v2, load_le(p + 8, 8));
      v3 = xxh_round(v3, load_le(p + 16, 8));
      v4 = xxh_round(v4, load_le(p + 24, 8));
    }
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = xxh_merge(xxh_merge(xxh_merge(xxh_merge(h, v1), v2), v3), v4);
  } else {
    h = seed + kP5;
  }
  h += size;
  for (; p + 8 <= end; p += 8) h = rotl(h ^ xxh_round(0, load_le(p, 8)), 27) * kP1 + kP4;
  if (p + 4 <= end) {
    h = rotl(h ^ (load_le(p, 4) * kP1), 23) * kP2 + kP3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (*p * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

}  // namespace weft
