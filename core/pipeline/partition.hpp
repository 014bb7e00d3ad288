// partition.hpp - which model stages each pipeline stage holds.
//
// The host's model is a sequence of N = L + 2 model stages: 0 the embedding, 1..L the decoder
// blocks, L + 1 the final norm and LM head (the loss is computed there too). A pipeline of S
// stages splits the decoder blocks into S contiguous, non-empty groups; pipeline stage 0 also
// holds the embedding and stage S - 1 the norm and head. With more stages than blocks (S <= L + 2,
// e.g. interleaved virtual stages), the first stage may hold the embedding alone and the last the
// head alone.
#ifndef WEFT_CORE_PIPELINE_PARTITION_HPP
#define WEFT_CORE_PIPELINE_PARTITION_HPP

#include <cstdint>
#include <string>
#include <vector>

namespace weft {
namespace pipeline {

// Pipeline stage p holds model stages [bounds[p], bounds[p + 1]); bounds.front() == 0 and
// bounds.back() == N.
using Partition = std::vector<int64_t>;

// From explicit decoder blocks per pipeline stage (`balance`, each >= 1, summing to
// `num_layers`). Throws std::invalid_argument naming the problem.
Partition partition_from_balance(const std::vector<int64_t>& balance, int64_t num_layers);

// The split of the decoder blocks into `stages` groups that minimises the largest stage cost,
// where `costs` has one entry per model stage (N = num_layers + 2 entries: embedding, blocks,
// head) and a pipeline stage costs the sum of its model stages. Exact (dynamic programming);
// ties go to the split with the earliest boundaries. Throws std::invalid_argument if
// stages < 1, stages > num_layers + 2 or a cost is negative.
Partition balanced_partition(const std::vector<double>& costs, int32_t stages);

// Moves the boundaries of `partition` (one part per virtual stage, each keeping at least one model
// stage) a model stage at a time while that lowers the largest rank's cost (then the sum of the
// squared rank costs), where rank owner[u] holds part u: with parts placed non-contiguously (ZB-V's
// V puts the first and the last part on rank 0), parts balanced one by one leave ranks unbalanced.
// A local search, deterministic, not proven optimal (on the V with uniform blocks it finds a brute
// force's best: Partition.RebalancedForTheOwnersBalancesTheRanksOfAVShapedPlacement). Throws std::invalid_argument unless owner has one entry per part.
Partition rebalance_for_owners(Partition partition, const std::vector<double>& costs, const std::vector<int32_t>& owner);

// The decoder blocks per pipeline stage of `partition` (the inverse of partition_from_balance).
std::vector<int64_t> balance_of(const Partition& partition);

// The cost of each pipeline stage under `partition`.
std::vector<double> stage_costs(const Partition& partition, const std::vector<double>& costs);

// "[embed + blocks 0-2 | blocks 3-5 + head]".
std::string describe(const Partition& partition);

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_PARTITION_HPP
