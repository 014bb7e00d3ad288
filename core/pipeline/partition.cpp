// partition.cpp - explicit and cost-balanced pipeline partitions.
#include "partition.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

namespace weft {
namespace pipeline {

Partition partition_from_balance(const std::vector<int64_t>& balance, int64_t num_layers) {
  if (balance.empty()) throw std::invalid_argument("balance is empty");
  Partition bounds{0};
  int64_t blocks = 0;
  for (size_t p = 0; p < balance.size(); ++p) {
    if (balance[p] < 1) {
      throw std::invalid_argument("balance[" + std::to_string(p) + "] = " + std::to_string(balance[p]) +
                                  ": every stage needs at least one decoder layer");
    }
    blocks += balance[p];
    bounds.push_back(1 + blocks);  // model stage of the first block of the next pipeline stage
  }
  if (blocks != num_layers) {
    throw std::invalid_argument("balance sums to " + std::to_string(blocks) + " layers but the model has " +
                                std::to_string(num_layers));
  }
  bounds.back() = num_layers + 2;  // the last pipeline stage also holds the norm and head
  return bounds;
}

Partition balanced_partition(const std::vector<double>& costs, int32_t stages) {
  const int64_t n = static_cast<int64_t>(costs.size());
  const int64_t layers = n - 2;
  if (n < 3) throw std::invalid_argument("a model needs an embedding, at least one layer and a head");
  if (stages < 1) throw std::invalid_argument("a pipeline needs at least 1 stage");
  if (stages > layers + 2) {
    throw std::invalid_argument(std::to_string(stages) + " pipeline stages need at least " + std::to_string(stages - 2) +
                                " decoder layers (one or more per stage, the embedding and the head alone at the "
                                "ends), the model has " +
                                std::to_string(layers));
  }
  for (double c : costs) {
    if (c < 0) throw std::invalid_argument("a stage cost is negative");
  }
  // More stages than blocks: the first may hold the embedding alone and the last the head alone
  // (as Megatron's account-for-embedding / account-for-loss splits); otherwise every stage keeps
  // at least one block.
  const bool bare_ends = stages > layers;
  // prefix[i] = cost of model stages [0, i).
  std::vector<double> prefix(n + 1, 0.0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  // Pipeline stage boundaries are model stages b_1 < ... < b_{S-1} in [2, n - 1] ([1, n - 1] with
  // bare ends). best[k][b] = the smallest possible max cost of the first k stages when they cover
  // model stages [0, b); choice[k][b] = the start of the k-th stage.
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t lowest = bare_ends ? 1 : 2;
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int64_t>> choice(stages + 1, std::vector<int64_t>(n + 1, -1));
  best[0][0] = 0.0;
  for (int32_t k = 1; k <= stages; ++k) {
    for (int64_t b = 1; b <= n; ++b) {
      const bool last = k == stages;
      if (last != (b == n)) continue;  // only the last stage reaches the head
      if (!last && (b < lowest || b > n - 1)) continue;
      for (int64_t a = (k == 1 ? 0 : lowest); a < b; ++a) {
        if ((k == 1) != (a == 0) || best[k - 1][a] == inf) continue;
        const int64_t blocks = std::min(b, n - 1) - std::max<int64_t>(a, 1);
        const bool bare_end = bare_ends && ((k == 1 && b == 1) || (last && a == n - 1));
        if (blocks < 1 && !bare_end) continue;
        const double cost = std::max(best[k - 1][a], prefix[b] - prefix[a]);
        if (cost < best[k][b]) {
          best[k][b] = cost;
          choice[k][b] = a;
        }
      }
    }
  }
  Partition bounds(stages + 1, 0);
  bounds[stages] = n;
  for (int32_t k = stages; k >= 1; --k) bounds[k - 1] = choice[k][bounds[k]];
  return bounds;
}

Partition rebalance_for_owners(Partition partition, const std::vector<double>& costs, const std::vector<int32_t>& owner) {
  if (owner.size() + 1 != partition.size()) {
    throw std::invalid_argument("rebalance_for_owners: " + std::to_string(owner.size()) + " owners for " +
                                std::to_string(partition.size() - 1) + " parts");
  }
  const int32_t ranks = owner.empty() ? 0 : *std::max_element(owner.begin(), owner.end()) + 1;
  // (largest rank cost, sum of squared rank costs): lower is better.
  const auto score = [&](const Partition& bounds) {
    std::vector<double> load(static_cast<size_t>(ranks), 0.0);
    const std::vector<double> parts = stage_costs(bounds, costs);
    for (size_t u = 0; u < parts.size(); ++u) load[static_cast<size_t>(owner[u])] += parts[u];
    double largest = 0.0, squares = 0.0;
    for (double l : load) {
      largest = std::max(largest, l);
      squares += l * l;
    }
    return std::make_pair(largest, squares);
  };
  auto best = score(partition);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t i = 1; i + 1 < partition.size(); ++i) {
      for (int64_t step : {-1, 1}) {
        Partition candidate = partition;
        candidate[i] += step;
        if (candidate[i] <= candidate[i - 1] || candidate[i] >= candidate[i + 1]) continue;
        const auto s = score(candidate);
        if (s.first < best.first - 1e-12 || (s.first <= best.first + 1e-12 && s.second < best.second - 1e-12)) {
          partition = std::move(candidate);
          best = s;
          moved = true;
        }
      }
    }
  }
  return partition;
}

std::vector<int64_t> balance_of(const Partition& partition) {
  std::vector<int64_t> balance;
  const int64_t n = partition.back();
  for (size_t p = 0; p + 1 < partition.size(); ++p) {
    balance.push_back(std::min(partition[p + 1], n - 1) - std::max<int64_t>(partition[p], 1));
  }
  return balance;
}

std::vector<double> stage_costs(const Partition& partition, const std::vector<double>& costs) {
  std::vector<double> out;
  for (size_t p = 0; p + 1 < partition.size(); ++p) {
    double sum = 0.0;
    for (int64_t i = partition[p]; i < partition[p + 1]; ++i) sum += costs[static_cast<size_t>(i)];
    out.push_back(sum);
  }
  return out;
}

std::string describe(const Partition& partition) {
  const int64_t n = partition.back();
  std::string out = "[";
  for (size_t p = 0; p + 1 < partition.size(); ++p) {
    const int64_t first_block = std::max<int64_t>(partition[p], 1) - 1;
    const int64_t last_block = std::min(partition[p + 1], n - 1) - 2;
    if (p > 0) out += " | ";
    std::vector<std::string> held;
    if (partition[p] == 0) held.push_back("embed");
    if (first_block <= last_block) {
      held.push_back(first_block == last_block ? "layer " + std::to_string(first_block)
                                               : "layers " + std::to_string(first_block) + "-" + std::to_string(last_block));
    }
    if (partition[p + 1] == n) held.push_back("head");
    for (size_t i = 0; i < held.size(); ++i) out += (i > 0 ? " + " : "") + held[i];
  }
  return out + "]";
}

}  // namespace pipeline
}  // namespace weft
