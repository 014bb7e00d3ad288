// ring_schedule.hpp - ring attention's schedule as data (header-only, no dependencies; checked in
// tests/plugins/context_parallel: every causal pair of chunks exactly once, equal work per rank
// in the balanced layout).
//
// N ranks split each sequence into chunks: contiguous, N chunks and rank r holds chunk r;
// balanced, 2N chunks and rank r holds chunk r then chunk 2N - 1 - r (its local runs 0 and 1).
// At ring step t (0 .. N-1) rank r holds the keys and values of rank (r - t) mod N (they arrived
// from rank r - 1 and leave for rank r + 1) and computes every (query chunk, key chunk) block of
// its queries against them that the causal mask does not hide: the key chunk before the query
// chunk entirely (no mask) or the same chunk (the diagonal, causal).
#ifndef WEFT_PLUGINS_CONTEXT_PARALLEL_RING_SCHEDULE_HPP
#define WEFT_PLUGINS_CONTEXT_PARALLEL_RING_SCHEDULE_HPP

#include <cstdint>
#include <vector>

namespace weft {
namespace context_parallel {

// The global chunk index of local run `run` of rank `rank` (of `size`).
inline int32_t chunk_of(int32_t rank, int32_t size, bool balanced, int32_t run) {
  return balanced && run == 1 ? 2 * size - 1 - rank : rank;
}

inline int32_t runs_per_rank(bool balanced) { return balanced ? 2 : 1; }

struct RingBlock {
  int32_t q_run;    // this rank's local run of queries (0 or 1)
  int32_t k_run;    // the run of the key/value owner's tokens
  int32_t q_chunk;  // their global chunk indices
  int32_t k_chunk;
  bool causal;      // the diagonal block (same chunk): causal mask inside
};

struct RingStep {
  int32_t source;  // whose keys and values this rank holds at this step
  std::vector<RingBlock> blocks;
};

// Rank `rank`'s steps; step 0 is its own keys, and it computes the diagonal blocks first, so
// that every query run's first block writes (rather than merges) its output.
inline std::vector<RingStep> ring_schedule(int32_t size, int32_t rank, bool balanced) {
  std::vector<RingStep> steps;
  const int32_t runs = runs_per_rank(balanced);
  for (int32_t t = 0; t < size; ++t) {
    RingStep step;
    step.source = ((rank - t) % size + size) % size;
    for (int32_t diagonal_pass = 1; diagonal_pass >= 0; --diagonal_pass) {
      for (int32_t q = 0; q < runs; ++q) {
        for (int32_t k = 0; k < runs; ++k) {
          const int32_t qc = chunk_of(rank, size, balanced, q), kc = chunk_of(step.source, size, balanced, k);
          if (kc > qc || (kc == qc) != (diagonal_pass == 1)) continue;
          step.blocks.push_back(RingBlock{q, k, qc, kc, kc == qc});
        }
      }
    }
    steps.push_back(step);
  }
  return steps;
}

}  // namespace context_parallel
}  // namespace weft

#endif
