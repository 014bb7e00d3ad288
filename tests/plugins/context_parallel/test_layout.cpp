// context_parallel.so's layout (plugins/context_parallel/layout.hpp): which ranks split the same
// sequences, and the refusal of a size that does not divide the world. The plugin itself runs
// against single.so in the conformance checks registered beside this file.
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../../../plugins/context_parallel/layout.hpp"

namespace {

using weft::context_parallel::layout_of;

TEST(ContextParallelLayout, NeighbouringRanksSplitTheSameSequences) {
  const auto l = layout_of(/*world=*/6, /*rank=*/4, /*cp=*/2);
  EXPECT_EQ(l.sequence_size, 2);
  EXPECT_EQ(l.sequence_rank, 0);
  EXPECT_EQ(l.data_parallel_size, 3);
  EXPECT_EQ(l.data_parallel_rank, 2);
  const std::vector<std::vector<int32_t>> groups{{0, 1}, {2, 3}, {4, 5}};
  EXPECT_EQ(l.groups, groups);
  const auto whole = layout_of(4, 3, 4);
  EXPECT_EQ(whole.sequence_rank, 3);
  EXPECT_EQ(whole.data_parallel_size, 1);
  EXPECT_EQ(whole.groups.size(), 1u);
  const auto none = layout_of(3, 2, 1);  // size 1: data parallelism alone
  EXPECT_EQ(none.sequence_rank, 0);
  EXPECT_EQ(none.data_parallel_rank, 2);
}

TEST(ContextParallelLayout, ASizeThatDoesNotDivideTheWorldIsRefused) {
  try {
    layout_of(6, 0, 4);
    FAIL() << "4 does not divide 6";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("plugin.size = 4 must divide the world size 6"), std::string::npos) << e.what();
  }
  EXPECT_THROW(layout_of(4, 0, 0), std::invalid_argument);
}

}  // namespace
