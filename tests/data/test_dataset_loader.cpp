// BatchLoader and EvalLoader: sharding over ranks, epoch permutations, random access.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "core/data/loader.h"
#include "core/util/error.h"
#include "test_dataset_util.h"

namespace weft {
namespace {

using dataset_test::expect_error;
using Indices = std::vector<int64_t>;

constexpr int64_t kSeqLen = 4;

// Tokens 0, 1, 2, ...: sequence i's inputs are 4i..4i+3, so a row names its sequence.
std::shared_ptr<const PackedSequences> counting_sequences(int64_t n_sequences) {
  std::vector<uint32_t> tokens(n_sequences * kSeqLen + 1);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i);
  return std::make_shared<const PackedSequences>("train", std::move(tokens), kSeqLen, 1);
}

// The sequence index of each row of a batch.
Indices row_sequences(const Batch& batch) {
  Indices seqs;
  for (int64_t r = 0; r < batch.rows(); ++r) seqs.push_back(batch.inputs[r][0].item<int64_t>() / kSeqLen);
  return seqs;
}

TEST(DatasetLoader, BatchesHoldShiftedInt64Rows) {
  const BatchLoader loader(counting_sequences(20), 6, 0, 1, 0, /*shuffle=*/false);
  EXPECT_EQ(loader.batches_per_epoch(), 3);  // 20 / 6, remainder dropped
  const Batch b = loader.batch(0, 1);
  EXPECT_EQ(b.inputs.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.inputs.sizes(), (std::vector<int64_t>{6, kSeqLen}));
  EXPECT_EQ(b.target_tokens(), 6 * kSeqLen);
  EXPECT_EQ(row_sequences(b), (Indices{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(b.inputs[0][0].item<int64_t>(), 24);
  EXPECT_EQ(b.inputs[0][3].item<int64_t>(), 27);
  EXPECT_EQ(b.targets[0][3].item<int64_t>(), 28);
  EXPECT_TRUE(torch::equal(b.targets, b.inputs + 1));
  EXPECT_TRUE(torch::equal(loader.batch(5, 1).inputs, b.inputs));  // no shuffle: epochs equal
}

TEST(DatasetLoader, RankShardsAreDisjointAndConcatenateToTheGlobalBatch) {
  const auto seqs = counting_sequences(25);
  for (const bool shuffle : {false, true}) {
    const BatchLoader single(seqs, 6, 0, 1, 9, shuffle);
    for (const int world : {1, 2, 3, 6}) {
      std::vector<BatchLoader> ranks;
      for (int r = 0; r < world; ++r) ranks.emplace_back(seqs, 6, r, world, 9, shuffle);
      for (int64_t epoch = 0; epoch < 2; ++epoch) {
        for (int64_t i = 0; i < single.batches_per_epoch(); ++i) {
          std::vector<at::Tensor> inputs, targets;
          for (const auto& loader : ranks) {
            const Batch b = loader.batch(epoch, i);
            EXPECT_EQ(b.rows(), 6 / world);
            inputs.push_back(b.inputs);
            targets.push_back(b.targets);
          }
          const Batch whole = single.batch(epoch, i);
          EXPECT_TRUE(torch::equal(torch::cat(inputs), whole.inputs))
              << "world " << world << " epoch " << epoch << " batch " << i;
          EXPECT_TRUE(torch::equal(torch::cat(targets), whole.targets));
          const auto ids = row_sequences(whole);
          EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size());
        }
      }
    }
  }
}

// All sequence indices of an epoch, in batch order.
Indices epoch_sequences(const BatchLoader& loader, int64_t epoch) {
  Indices all;
  for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
    const auto ids = loader.sequence_indices(epoch, i);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  return all;
}

TEST(DatasetLoader, ShuffledEpochsDifferButAreReproducible) {
  const auto seqs = counting_sequences(40);
  const BatchLoader loader(seqs, 8, 0, 1, 1234, true);
  const Indices e0 = epoch_sequences(loader, 0);
  const Indices e1 = epoch_sequences(loader, 1);
  EXPECT_EQ(e0.size(), 40u);
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), 40u);  // each sequence once
  EXPECT_NE(e0, e1);
  Indices in_order(40);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_NE(e0, in_order);
  const BatchLoader same(seqs, 8, 0, 1, 1234, true);
  EXPECT_EQ(epoch_sequences(same, 1), e1);
  EXPECT_EQ(epoch_sequences(same, 0), e0);
  const BatchLoader other_seed(seqs, 8, 0, 1, 1235, true);
  EXPECT_NE(epoch_sequences(other_seed, 0), e0);
  // Row indices agree with the tensors.
  EXPECT_EQ(row_sequences(loader.batch(1, 2)), Indices(e1.begin() + 16, e1.begin() + 24));
}

TEST(DatasetLoader, RandomAccessDoesNotDependOnHistory) {
  const auto seqs = counting_sequences(30);
  const BatchLoader fresh(seqs, 6, 1, 2, 77, true);
  const Batch direct = fresh.batch(3, 2);
  const BatchLoader used(seqs, 6, 1, 2, 77, true);
  for (int64_t epoch = 0; epoch < 5; ++epoch) {
    for (int64_t i = 0; i < used.batches_per_epoch(); ++i) used.batch(epoch, i);
  }
  used.batch(0, 4);
  EXPECT_TRUE(torch::equal(used.batch(3, 2).inputs, direct.inputs));
  EXPECT_TRUE(torch::equal(used.batch(3, 2).targets, direct.targets));
  EXPECT_TRUE(torch::equal(fresh.batch(0, 4).inputs, used.batch(0, 4).inputs));
}

TEST(DatasetLoader, RejectsBadShapes) {
  const auto seqs = counting_sequences(10);
  expect_error([&] { BatchLoader(seqs, 8, 0, 3, 0, false); },
               "batch_size 8 cannot be split over 3 ranks");
  expect_error([&] { BatchLoader(seqs, 12, 0, 2, 0, false); },
               "train split has 10 sequences of 4 tokens, fewer than one batch of 12");
  expect_error([&] { BatchLoader(seqs, 4, 2, 2, 0, false); }, "rank 2 is outside a world of 2");
  expect_error([&] { BatchLoader(seqs, 0, 0, 1, 0, false); }, "batch_size must be positive");
  expect_error([&] { BatchLoader(nullptr, 4, 0, 1, 0, false); }, "needs a split");
  const BatchLoader loader(seqs, 4, 0, 1, 0, true);
  expect_error([&] { loader.batch(0, 2); }, "batch index 2 is outside the epoch's 2 batches");
  expect_error([&] { loader.batch(-1, 0); }, "epoch must be >= 0");
}

TEST(DatasetLoader, EvalCoversEverySequenceOnceIncludingThePartialBatch) {
  const auto seqs = counting_sequences(20);
  for (const int world : {1, 2, 3, 6}) {
    Indices seen;
    int64_t tokens = 0;
    for (int r = 0; r < world; ++r) {
      const EvalLoader loader(seqs, 6, r, world);
      ASSERT_EQ(loader.num_batches(), 4);
      for (int64_t i = 0; i < loader.num_batches(); ++i) {
        const Batch b = loader.batch(i);
        EXPECT_EQ(b.inputs.size(1), kSeqLen);
        EXPECT_TRUE(torch::equal(b.targets, b.inputs + 1));
        const auto ids = row_sequences(b);
        EXPECT_EQ(ids, loader.sequence_indices(i));
        seen.insert(seen.end(), ids.begin(), ids.end());
        tokens += b.target_tokens();
      }
    }
    std::sort(seen.begin(), seen.end());
    Indices all(20);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(seen, all) << "world " << world;
    EXPECT_EQ(tokens, 20 * kSeqLen);
  }
  // The last global batch holds sequences 18 and 19; over 6 ranks, ranks 2 and 5 get one each.
  EXPECT_EQ(EvalLoader(seqs, 6, 2, 6).sequence_indices(3), (Indices{18}));
  EXPECT_EQ(EvalLoader(seqs, 6, 5, 6).sequence_indices(3), (Indices{19}));
  const Batch empty = EvalLoader(seqs, 6, 0, 6).batch(3);
  EXPECT_EQ(empty.inputs.sizes(), (std::vector<int64_t>{0, kSeqLen}));
  EXPECT_EQ(empty.target_tokens(), 0);
  // A split smaller than one global batch is still evaluated.
  EXPECT_EQ(EvalLoader(counting_sequences(3), 8, 0, 2).sequence_indices(0), (Indices{0}));
  expect_error([&] { EvalLoader(seqs, 6, 0, 1).batch(4); }, "evaluation batch index 4");
  expect_error([&] { EvalLoader(seqs, 6, 0, 4); }, "batch_size 6 cannot be split over 4 ranks");
}

}  // namespace
}  // namespace weft
