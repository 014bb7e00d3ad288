// The device mesh of composed runs (core/dist/mesh.h): sizes resolved from [mesh], the rank layout
// (tp fastest, pp slowest) and the slices each dimension's groups are made of.
#include <gtest/gtest.h>

#include "core/dist/mesh.h"
#include "core/util/error.h"

namespace weft {
namespace {

std::array<bool, Mesh::kDims> owning(std::initializer_list<int> dims) {
  std::array<bool, Mesh::kDims> owned{};
  for (int d : dims) owned[static_cast<size_t>(d)] = true;
  return owned;
}

TEST(Mesh, RanksVaryFastestAlongTensorParallelismAndSlowestAlongPipelineStages) {
  const Mesh mesh({2, 2, 1, 2});  // pp 2 x dp 2 x tp 2
  EXPECT_EQ(mesh.world(), 8);
  EXPECT_EQ(mesh.describe(), "pp 2 x dp 2 x tp 2");
  EXPECT_EQ(mesh.coords(5), (std::array<int32_t, 4>{1, 0, 0, 1}));  // ((1 * 2 + 0) * 1 + 0) * 2 + 1
  for (int32_t r = 0; r < 8; ++r) EXPECT_EQ(mesh.rank_of(mesh.coords(r)), r);
  EXPECT_EQ(mesh.slices(Mesh::kTP), (std::vector<std::vector<int32_t>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(mesh.slices(Mesh::kDP), (std::vector<std::vector<int32_t>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(mesh.slices(Mesh::kPP), (std::vector<std::vector<int32_t>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(mesh.slices(Mesh::kCP).size(), 8u);  // size 1: every rank alone
  EXPECT_EQ(mesh.slice_of(6, Mesh::kDP), 2);
  EXPECT_EQ(mesh.slice_of(6, Mesh::kPP), 2);
}

// Nodes of consecutive ranks (torchrun, Slurm): tp fastest stays within a node when its size
// divides the ranks per node; the slower dimensions cross nodes.
TEST(Mesh, TensorParallelismStaysWithinANodeWhenItsSizeDividesTheRanksPerNode) {
  const Mesh mesh({2, 2, 1, 2});  // pp 2 x dp 2 x tp 2 on 8 ranks
  EXPECT_FALSE(mesh.crosses_nodes(Mesh::kTP, 2));  // 4 nodes of 2: tp within
  EXPECT_TRUE(mesh.crosses_nodes(Mesh::kDP, 2));
  EXPECT_TRUE(mesh.crosses_nodes(Mesh::kPP, 2));
  EXPECT_FALSE(mesh.crosses_nodes(Mesh::kDP, 4));  // 2 nodes of 4: tp and dp within, pp across
  EXPECT_TRUE(mesh.crosses_nodes(Mesh::kPP, 4));
  EXPECT_FALSE(mesh.crosses_nodes(Mesh::kCP, 1));  // size 1: nothing to cross
  const Mesh wide({1, 1, 1, 4});                   // tp 4 on 2 nodes of 2: each tp group spans both
  EXPECT_TRUE(wide.crosses_nodes(Mesh::kTP, 2));
  const Mesh odd({1, 2, 1, 3});  // tp 3 on nodes of 2: ranks 0-2 are on nodes 0 and 1
  EXPECT_TRUE(odd.crosses_nodes(Mesh::kTP, 2));
  EXPECT_THROW(odd.crosses_nodes(Mesh::kTP, 0), Error);
}

TEST(Mesh, UnsetSizesTakeWhatIsLeftWhenThatIsUnambiguous) {
  // dp takes the rest by default.
  EXPECT_EQ(Mesh::resolve({2, 0, 0, 2}, owning({Mesh::kPP, Mesh::kTP, Mesh::kDP}), 8).describe(), "pp 2 x dp 2 x tp 2");
  // tensor_parallel,gpipe with mesh.tp given: the pipeline (owned) takes the rest, dp stays 1.
  EXPECT_EQ(Mesh::resolve({0, 0, 0, 2}, owning({Mesh::kPP, Mesh::kTP}), 4).describe(), "pp 2 x tp 2");
  // Dimensions no plugin owns are 1 when unset.
  EXPECT_EQ(Mesh::resolve({0, 0, 0, 0}, owning({Mesh::kTP}), 4).describe(), "tp 4");
}

TEST(Mesh, SizesThatCannotLayTheWorldOutAreRefusedWithTheReason) {
  auto message = [](std::array<int32_t, 4> sizes, std::array<bool, 4> owned, int32_t world) {
    try {
      Mesh::resolve(sizes, owned, world);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message({0, 0, 0, 0}, owning({Mesh::kPP, Mesh::kTP}), 4).find("ambiguous: set mesh.pp and mesh.tp"),
            std::string::npos);
  EXPECT_NE(message({3, 0, 0, 0}, owning({Mesh::kPP}), 4).find("multiply to 3, which does not divide the world size 4"),
            std::string::npos);
  EXPECT_NE(message({2, 2, 0, 2}, owning({Mesh::kPP, Mesh::kTP, Mesh::kDP}), 4).find("multiply to 8"),
            std::string::npos);
  EXPECT_NE(message({2, 1, 0, 1}, owning({Mesh::kPP, Mesh::kTP}), 4).find("has 2 ranks but the run has 4"),
            std::string::npos);
  EXPECT_NE(message({-1, 0, 0, 0}, owning({Mesh::kPP}), 4).find("mesh.pp = -1"), std::string::npos);
}

}  // namespace
}  // namespace weft
