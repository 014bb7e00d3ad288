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

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

}  // namespace weft
