// Pipeline partitions (plugins/pipeline/partition): explicit balance, the exact cost-balanced
// split (checked against brute force), and the refusals.
#include <algorithm>
#include <functional>
#include <random>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "partition.hpp"

namespace {

using weft::pipeline::Partition;

TEST(Partition, FromBalanceAddsTheEmbeddingAndHead) {
  // 6 layers: model stages 0 (embed), 1..6 (blocks), 7 (head).
  EXPECT_EQ(weft::pipeline::partition_from_balance({3, 3}, 6), (Partition{0, 4, 8}));
  EXPECT_EQ(weft::pipeline::partition_from_balance({1, 2, 3}, 6), (Partition{0, 2, 4, 8}));
  EXPECT_EQ(weft::pipeline::partition_from_balance({6}, 6), (Partition{0, 8}));
  EXPECT_EQ(weft::pipeline::balance_of({0, 2, 4, 8}), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(weft::pipeline::describe({0, 4, 8}), "[embed + layers 0-2 | layers 3-5 + head]");
  EXPECT_EQ(weft::pipeline::describe({0, 2, 3, 8}), "[embed + layer 0 | layer 1 | layers 2-5 + head]");
}

TEST(Partition, BalanceErrorsNameTheProblem) {
  try {
    weft::pipeline::partition_from_balance({3, 2}, 6);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "balance sums to 5 layers but the model has 6");
  }
  EXPECT_THROW(weft::pipeline::partition_from_balance({6, 0}, 6), std::invalid_argument);
  EXPECT_THROW(weft::pipeline::partition_from_balance({}, 6), std::invalid_argument);
  EXPECT_THROW(weft::pipeline::balanced_partition(std::vector<double>(4, 1.0), 3), std::invalid_argument);
}

TEST(Partition, UniformLayersSplitEvenlyWithTheEndsOnTheLightSide) {
  // Embedding and head cost as much as a layer: 8 units over 2 stages -> 4 + 4.
  const std::vector<double> costs(8, 1.0);
  const Partition p = weft::pipeline::balanced_partition(costs, 2);
  EXPECT_EQ(p, (Partition{0, 4, 8}));
  // A heavy head pulls layers to the first stage.
  std::vector<double> heavy_head(8, 1.0);
  heavy_head.back() = 5.0;  // [5, 1]: 6 | 6 beats [4, 2]: 5 | 7
  EXPECT_EQ(weft::pipeline::balance_of(weft::pipeline::balanced_partition(heavy_head, 2)),
            (std::vector<int64_t>{5, 1}));
}

// The smallest achievable maximum stage cost, by trying every split.
double brute_force_best(const std::vector<double>& costs, int32_t stages) {
  const int64_t layers = static_cast<int64_t>(costs.size()) - 2;
  double best = 1e300;
  std::vector<int64_t> balance(stages, 1);
  // Enumerate compositions of `layers` into `stages` positive parts.
  std::function<void(int32_t, int64_t)> go = [&](int32_t k, int64_t left) {
    if (k == stages - 1) {
      balance[k] = left;
      const auto part = weft::pipeline::partition_from_balance(balance, layers);
      const auto c = weft::pipeline::stage_costs(part, costs);
      best = std::min(best, *std::max_element(c.begin(), c.end()));
      return;
    }
    for (int64_t b = 1; b <= left - (stages - 1 - k); ++b) {
      balance[k] = b;
      go(k + 1, left - b);
    }
  };
  go(0, layers);
  return best;
}

TEST(Partition, BalancedSplitIsOptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.1, 5.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t layers = 1 + static_cast<int64_t>(rng() % 9);
    std::vector<double> costs(static_cast<size_t>(layers + 2));
    for (double& c : costs) c = cost(rng);
    for (int32_t stages = 1; stages <= layers; ++stages) {
      const Partition p = weft::pipeline::balanced_partition(costs, stages);
      ASSERT_EQ(p.size(), static_cast<size_t>(stages + 1));
      for (int64_t b : weft::pipeline::balance_of(p)) EXPECT_GE(b, 1);
      const auto c = weft::pipeline::stage_costs(p, costs);
      EXPECT_NEAR(*std::max_element(c.begin(), c.end()), brute_force_best(costs, stages), 1e-9)
          << "layers " << layers << " stages " << stages;
    }
  }
}

}  // namespace
