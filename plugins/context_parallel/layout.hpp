// layout.hpp - which ranks of context_parallel.so split the same sequences (header-only, no
// dependencies, tested in tests/plugins/context_parallel).
//
// world = cp x dp: ranks [g * cp, (g + 1) * cp) form sequence group g (they hold the same rows of
// each global batch, each its cp-th of every sequence), so the all-to-alls of a group stay on
// neighbouring ranks (one machine, where a machine holds a multiple of cp ranks); g is the
// data-parallel rank.
#ifndef WEFT_PLUGINS_CONTEXT_PARALLEL_LAYOUT_HPP
#define WEFT_PLUGINS_CONTEXT_PARALLEL_LAYOUT_HPP

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace weft {
namespace context_parallel {

struct Layout {
  int32_t sequence_size = 1;   // cp: ranks per sequence group
  int32_t sequence_rank = 0;   // this rank's place in its group (its share of each sequence)
  int32_t data_parallel_size = 1;
  int32_t data_parallel_rank = 0;
  std::vector<std::vector<int32_t>> groups;  // every sequence group's world ranks, in group order
};

// Throws std::invalid_argument naming plugin.size when cp does not divide the world.
inline Layout layout_of(int32_t world, int32_t rank, int32_t cp) {
  if (cp < 1 || world % cp != 0) {
    throw std::invalid_argument("plugin.size = " + std::to_string(cp) + " must divide the world size " +
                                std::to_string(world) + " (world = size x data-parallel ranks)");
  }
  Layout l;
  l.sequence_size = cp;
  l.sequence_rank = rank % cp;
  l.data_parallel_size = world / cp;
  l.data_parallel_rank = rank / cp;
  for (int32_t g = 0; g < world / cp; ++g) {
    std::vector<int32_t> group;
    for (int32_t r = 0; r < cp; ++r) group.push_back(g * cp + r);
    l.groups.push_back(group);
  }
  return l;
}

}  // namespace context_parallel
}  // namespace weft

#endif
