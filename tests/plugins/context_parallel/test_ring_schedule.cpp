// ring_schedule.hpp, context_parallel.so's ring attention as data: over all ranks and steps every
// (query chunk, key chunk) pair the causal mask keeps is computed exactly once, by the rank that
// holds the queries while it holds the keys; the balanced layout gives every rank the same work,
// the contiguous one does not; each rank's diagonal blocks come first.
#include <map>
#include <set>
#include <utility>

#include <gtest/gtest.h>

#include "../../../plugins/context_parallel/ring_schedule.hpp"

namespace {

using weft::context_parallel::chunk_of;
using weft::context_parallel::ring_schedule;
using weft::context_parallel::runs_per_rank;

void expect_covers_the_causal_triangle_once(int32_t size, bool balanced) {
  const int32_t chunks = size * runs_per_rank(balanced);
  std::map<std::pair<int32_t, int32_t>, int> computed;
  for (int32_t rank = 0; rank < size; ++rank) {
    const auto steps = ring_schedule(size, rank, balanced);
    ASSERT_EQ(static_cast<int32_t>(steps.size()), size);
    std::set<int32_t> sources;
    for (int32_t t = 0; t < size; ++t) {
      const auto& step = steps[static_cast<size_t>(t)];
      EXPECT_EQ(step.source, ((rank - t) % size + size) % size) << "keys arrive from rank - 1 each step";
      sources.insert(step.source);
      for (const auto& b : step.blocks) {
        EXPECT_EQ(b.q_chunk, chunk_of(rank, size, balanced, b.q_run)) << "queries stay on their rank";
        EXPECT_EQ(b.k_chunk, chunk_of(step.source, size, balanced, b.k_run)) << "keys are the source's";
        EXPECT_LE(b.k_chunk, b.q_chunk) << "no block the causal mask hides";
        EXPECT_EQ(b.causal, b.k_chunk == b.q_chunk);
        ++computed[{b.q_chunk, b.k_chunk}];
      }
    }
    EXPECT_EQ(static_cast<int32_t>(sources.size()), size) << "every rank's keys visit every rank";
    // Step 0 starts with the diagonals, so each query run's first block writes its output.
    ASSERT_FALSE(steps[0].blocks.empty());
    EXPECT_TRUE(steps[0].blocks[0].causal);
  }
  for (int32_t qc = 0; qc < chunks; ++qc) {
    for (int32_t kc = 0; kc <= qc; ++kc) EXPECT_EQ((computed[{qc, kc}]), 1) << "chunk pair " << qc << ", " << kc;
  }
  EXPECT_EQ(static_cast<int32_t>(computed.size()), chunks * (chunks + 1) / 2);
}

int64_t blocks_of(int32_t size, int32_t rank, bool balanced) {
  int64_t n = 0;
  for (const auto& step : ring_schedule(size, rank, balanced)) n += static_cast<int64_t>(step.blocks.size());
  return n;
}

TEST(RingSchedule, BalancedCoversEveryCausalBlockOnce) {
  for (int32_t size : {1, 2, 3, 4, 8}) expect_covers_the_causal_triangle_once(size, true);
}

TEST(RingSchedule, ContiguousCoversEveryCausalBlockOnce) {
  for (int32_t size : {1, 2, 3, 4, 8}) expect_covers_the_causal_triangle_once(size, false);
}

TEST(RingSchedule, BalancedRanksDoEqualWork) {
  for (int32_t size : {2, 4, 8}) {
    // 2N chunks: 2N (2N + 1) / 2 blocks, of which 2N diagonals (half the work of a full block).
    for (int32_t rank = 0; rank < size; ++rank) {
      EXPECT_EQ(blocks_of(size, rank, true), 2 * size + 1) << size << " ranks, rank " << rank;
      int64_t diagonals = 0;
      for (const auto& step : ring_schedule(size, rank, true)) {
        for (const auto& b : step.blocks) diagonals += b.causal ? 1 : 0;
      }
      EXPECT_EQ(diagonals, 2);
    }
  }
}

TEST(RingSchedule, ContiguousRankRDoesRPlusOneBlocks) {
  for (int32_t rank = 0; rank < 4; ++rank) EXPECT_EQ(blocks_of(4, rank, false), rank + 1);
}

}  // namespace
