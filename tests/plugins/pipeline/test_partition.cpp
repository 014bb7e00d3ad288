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
  try {  // 2 layers: at most 4 stages (embedding | layer | layer | head)
    weft::pipeline::balanced_partition(std::vector<double>(4, 1.0), 5);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "5 pipeline stages need at least 3 decoder layers (one or more per stage, the embedding "
                           "and the head alone at the ends), the model has 2");
  }
}

TEST(Partition, MoreStagesThanLayersStandTheEmbeddingOrTheHeadAlone) {
  // 6 layers in 8 parts (4 stages x 2 interleaved chunks): every model stage is a part.
  const std::vector<double> costs(8, 1.0);
  const Partition all = weft::pipeline::balanced_partition(costs, 8);
  EXPECT_EQ(all, (Partition{0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(weft::pipeline::balance_of(all), (std::vector<int64_t>{0, 1, 1, 1, 1, 1, 1, 0}));
  EXPECT_EQ(weft::pipeline::describe(all),
            "[embed | layer 0 | layer 1 | layer 2 | layer 3 | layer 4 | layer 5 | head]");
  // 7 parts: the costlier end stands alone (here the head), the other keeps its layer (two layers
  // together, 3.2, would cost more than the head's 3).
  std::vector<double> heavy_head(8, 1.6);
  heavy_head.front() = 1.0;
  heavy_head.back() = 3.0;
  const Partition seven = weft::pipeline::balanced_partition(heavy_head, 7);
  EXPECT_EQ(seven, (Partition{0, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(weft::pipeline::describe(seven), "[embed + layer 0 | layer 1 | layer 2 | layer 3 | layer 4 | layer 5 | head]");
  // No more stages than layers: every stage keeps a layer, however light the ends.
  std::vector<double> heavy_ends(8, 1.0);
  heavy_ends.front() = heavy_ends.back() = 10.0;
  for (int64_t b : weft::pipeline::balance_of(weft::pipeline::balanced_partition(heavy_ends, 6))) EXPECT_GE(b, 1);
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

// The smallest achievable maximum stage cost, by trying every set of boundaries: each stage
// keeps a layer, except that with more stages than layers the first may hold the embedding alone
// and the last the head alone.
double brute_force_best(const std::vector<double>& costs, int32_t stages) {
  const int64_t n = static_cast<int64_t>(costs.size()), layers = n - 2;
  const bool bare_ends = stages > layers;
  double best = 1e300;
  Partition bounds{0};
  std::function<void(int64_t)> go = [&](int64_t from) {
    if (static_cast<int32_t>(bounds.size()) == stages) {
      bounds.push_back(n);
      const auto balance = weft::pipeline::balance_of(bounds);
      bool valid = true;
      for (size_t p = 0; p < balance.size(); ++p) {
        const bool end = p == 0 || p + 1 == balance.size();
        valid = valid && (balance[p] >= 1 || (bare_ends && end && balance[p] == 0 && bounds[p + 1] - bounds[p] == 1));
      }
      if (valid) {
        const auto c = weft::pipeline::stage_costs(bounds, costs);
        best = std::min(best, *std::max_element(c.begin(), c.end()));
      }
      bounds.pop_back();
      return;
    }
    for (int64_t b = from; b <= n - 1; ++b) {
      bounds.push_back(b);
      go(b + 1);
      bounds.pop_back();
    }
  };
  go(1);
  return best;
}

TEST(Partition, BalancedSplitIsOptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost(0.1, 5.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t layers = 1 + static_cast<int64_t>(rng() % 9);
    std::vector<double> costs(static_cast<size_t>(layers + 2));
    for (double& c : costs) c = cost(rng);
    for (int32_t stages = 1; stages <= layers + 2; ++stages) {
      const Partition p = weft::pipeline::balanced_partition(costs, stages);
      ASSERT_EQ(p.size(), static_cast<size_t>(stages + 1));
      const auto balance = weft::pipeline::balance_of(p);
      for (size_t i = 0; i < balance.size(); ++i) {
        const bool bare_end = stages > layers && (i == 0 || i + 1 == balance.size()) && p[i + 1] - p[i] == 1;
        EXPECT_GE(balance[i], bare_end ? 0 : 1) << "layers " << layers << " stages " << stages;
      }
      const auto c = weft::pipeline::stage_costs(p, costs);
      EXPECT_NEAR(*std::max_element(c.begin(), c.end()), brute_force_best(costs, stages), 1e-9)
          << "layers " << layers << " stages " << stages;
    }
  }
}

}  // namespace

// ZB-V's V (2 ranks: rank 0 holds parts 0 and 3, rank 1 parts 1 and 2) over the embedding, 6 equal
// blocks and the head: parts balanced one by one leave rank 1 four blocks and rank 0 two plus the
// ends; rebalanced for the owners, each rank holds three blocks, and the result is the best split
// a brute force over every boundary finds.
TEST(Partition, RebalancedForTheOwnersBalancesTheRanksOfAVShapedPlacement) {
  const std::vector<double> costs{0.2, 1, 1, 1, 1, 1, 1, 0.2};
  const std::vector<int32_t> owner{0, 1, 1, 0};
  const Partition per_part = weft::pipeline::balanced_partition(costs, 4);
  const Partition ranks = weft::pipeline::rebalance_for_owners(per_part, costs, owner);
  const auto load = [&](const Partition& p) {
    const std::vector<double> parts = weft::pipeline::stage_costs(p, costs);
    return std::max(parts[0] + parts[3], parts[1] + parts[2]);
  };
  EXPECT_NEAR(load(ranks), 3.4, 1e-9);  // three blocks and both ends; rank 1 three blocks
  double best = 1e9;
  for (int64_t a = 1; a < 8; ++a) {
    for (int64_t b = a + 1; b < 8; ++b) {
      for (int64_t c = b + 1; c < 8; ++c) best = std::min(best, load({0, a, b, c, 8}));
    }
  }
  EXPECT_NEAR(load(ranks), best, 1e-9);
  EXPECT_GT(load(per_part), load(ranks));
  EXPECT_THROW(weft::pipeline::rebalance_for_owners(per_part, costs, {0, 1}), std::invalid_argument);
}
