// Chat data's rows: one example per row, inputs and targets shifted by one, padding and untrained
// targets ignored; the loader counts a global batch's trained targets over every rank's rows.
// (TRL's tokens and masks on a real template: tools/sft_reference.py.)
#include <gtest/gtest.h>

#include "core/data/chat_data.h"
#include "core/data/loader.h"
#include "test_dataset_util.h"

namespace weft {
namespace {


TEST(ChatData, RowsShiftTheExampleAndIgnorePaddingAndUntrainedTargets) {
  const auto seqs = std::make_shared<const PackedSequences>(PackedSequences::chat(
      "train", {{10, 11, 12, 13}, {20, 21, 22, 23, 24, 25}}, {{0, 0, 1, 1}, {0, 1, 0, 1, 1, 1}}, 5, 99));
  EXPECT_TRUE(seqs->masked());
  EXPECT_EQ(seqs->n_sequences(), 2);
  EXPECT_EQ(seqs->counted_targets(0), 2);
  EXPECT_EQ(seqs->counted_targets(1), 4);
  const Batch b = make_batch(*seqs, {0, 1});
  const int64_t u = kUnlabeledTarget, p = 99;
  const auto rows = [](std::vector<int64_t> values) { return torch::tensor(values).reshape({2, 5}); };
  EXPECT_TRUE(b.inputs.equal(rows({10, 11, 12, p, p, 20, 21, 22, 23, 24})));
  EXPECT_TRUE(b.targets.equal(rows({u, 12, 13, u, u, 21, u, 23, 24, 25})));
  // A global batch of both rows over 2 ranks: each rank's loader counts both rows.
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(BatchLoader(seqs, 2, rank, 2, 1, true).counted_targets(0, 0), 6);
  }
  // Text counts every position.
  EXPECT_EQ(PackedSequences("t", std::vector<uint32_t>(11, 1), 5, 1).counted_targets(0), 5);
}

TEST(ChatData, RefusesRowsItCannotTrainOn) {
  EXPECT_THROW(PackedSequences::chat("train", {{1}}, {{1}}, 4, 0), Error);                 // one token
  EXPECT_THROW(PackedSequences::chat("train", {{1, 2, 3, 4, 5, 6}}, {{1, 1, 1, 1, 1, 1}}, 4, 0), Error);  // > seq_len + 1
  EXPECT_THROW(PackedSequences::chat("train", {{1, 2, 3}}, {{1, 0, 0}}, 4, 0), Error);     // nothing trained
}

// data.packing: one row holds several examples as one stream; each example's positions start at 0,
// its last token predicts nothing (no target across the boundary), padding has position 0.
TEST(ChatData, PackedRowsKeepEachExamplesPositionsAndTargets) {
  const auto seqs = std::make_shared<const PackedSequences>(PackedSequences::chat(
      "train", {{10, 11, 12}, {20, 21, 22, 23}, {30, 31, 32, 33, 34, 35}}, {{0, 1, 1}, {0, 0, 1, 1}, {1, 1, 1, 1, 1, 1}}, 8,
      99, {{1, 0}, {2}}));
  EXPECT_TRUE(seqs->segmented());
  EXPECT_EQ(seqs->n_sequences(), 2);
  EXPECT_EQ(seqs->n_documents(), 3);
  EXPECT_EQ(seqs->counted_targets(0), 4);  // 2 + 2
  EXPECT_EQ(seqs->counted_targets(1), 5);
  const Batch b = make_batch(*seqs, {0, 1});
  const int64_t u = kUnlabeledTarget, p = 99;
  const auto rows = [](std::vector<int64_t> values) { return torch::tensor(values).reshape({2, 8}); };
  EXPECT_TRUE(b.inputs.equal(rows({20, 21, 22, 23, 10, 11, 12, p, 30, 31, 32, 33, 34, 35, p, p})));
  EXPECT_TRUE(b.targets.equal(rows({u, 22, 23, u, 11, 12, u, u, 31, 32, 33, 34, 35, u, u, u})));
  EXPECT_TRUE(b.positions.equal(rows({0, 1, 2, 3, 0, 1, 2, 0, 0, 1, 2, 3, 4, 5, 0, 0})));
  // A row of seq_len + 1 tokens: the last one is a target only, as without packing.
  const auto full = PackedSequences::chat("train", {{1, 2, 3}, {4, 5}}, {{1, 1, 1}, {1, 1}}, 4, 0, {{0, 1}});
  const Batch f = make_batch(full, {0});
  EXPECT_TRUE(f.inputs.equal(torch::tensor(std::vector<int64_t>{1, 2, 3, 4}).reshape({1, 4})));
  EXPECT_TRUE(f.targets.equal(torch::tensor(std::vector<int64_t>{2, 3, u, 5}).reshape({1, 4})));
  // One example per row has no positions (the model's causal rows).
  EXPECT_FALSE(make_batch(PackedSequences::chat("train", {{1, 2}}, {{1, 1}}, 4, 0), {0}).positions.defined());
}

TEST(ChatData, PackedRowsRefuseBinsThatDoNotHoldEveryExampleOnce) {
  const std::vector<std::vector<uint32_t>> examples = {{1, 2, 3}, {4, 5, 6}};
  const std::vector<std::vector<uint8_t>> trained = {{1, 1, 1}, {1, 1, 1}};
  EXPECT_THROW(PackedSequences::chat("train", examples, trained, 4, 0, {{0, 1}}), Error);  // 6 > seq_len + 1
  EXPECT_THROW(PackedSequences::chat("train", examples, trained, 8, 0, {{0}}), Error);      // example 1 in no row
  EXPECT_THROW(PackedSequences::chat("train", examples, trained, 8, 0, {{0}, {0, 1}}), Error);  // twice
  EXPECT_THROW(PackedSequences::chat("train", examples, trained, 8, 0, {{0, 1}, {}}), Error);   // an empty row
  EXPECT_THROW(PackedSequences::chat("train", examples, trained, 8, 0, {{0, 2}}), Error);       // no example 2
}

// TRL's pack_dataset docstring example (seq_length 4, lengths after truncation 4, 2, 3, 1) and its
// best-fit rule: the partly filled bin with the least room that fits, the oldest of equal ones.
TEST(ChatData, BestFitDecreasingBinsAsTrl) {
  using Bins = std::vector<std::vector<int64_t>>;
  EXPECT_EQ(best_fit_decreasing({4, 2, 3, 1}, 4), (Bins{{0}, {2, 3}, {1}}));
  // 6 and 6 open two bins with room 4; 4 fills the older; 3 goes to the other (room 1 left); 2 fits
  // no partly filled bin and opens a third; 1 fills the room of 1 (pack_dataset gives the same).
  EXPECT_EQ(best_fit_decreasing({6, 3, 6, 4, 2, 1}, 10), (Bins{{0, 3}, {2, 1, 5}, {4}}));
  EXPECT_THROW(best_fit_decreasing({5}, 4), Error);
  EXPECT_THROW(best_fit_decreasing({0}, 4), Error);
}

TEST(ChatData, TextPromptCompletionTrainsTheCompletionAndItsEos) {
  const auto byte = load_tokenizer("byte");  // bytes, then BOS 256 and EOS 257, which its text may name
  const Tokenizer& tokenizer = *byte;
  ChatRecord r;
  r.kind = ChatRecord::Kind::kTextPromptCompletion;
  r.prompt_text = "ab";
  r.completion_text = "cd";
  const ChatEncoding e = encode_chat(r, tokenizer, nullptr, true, false);
  ASSERT_EQ(e.tokens.size(), 5u);
  EXPECT_EQ(e.tokens.back(), static_cast<uint32_t>(*tokenizer.eos_id()));
  EXPECT_EQ(e.trained, (std::vector<uint8_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(encode_chat(r, tokenizer, nullptr, false, false).trained, (std::vector<uint8_t>{1, 1, 1, 1, 1}));
  // A completion that ends with the EOS text gets no second one; the checkpoint's BOS comes first.
  r.completion_text = "cd<|end_of_text|>";
  const ChatEncoding framed = encode_chat(r, tokenizer, nullptr, true, true);
  EXPECT_EQ(framed.tokens, (std::vector<uint32_t>{256, 'a', 'b', 'c', 'd', 257}));
  EXPECT_EQ(framed.trained, (std::vector<uint8_t>{0, 0, 0, 1, 1, 1}));
  r.kind = ChatRecord::Kind::kMessages;
  r.messages = {{"user", "a"}, {"assistant", "b"}};
  EXPECT_THROW(encode_chat(r, tokenizer, nullptr, true, false), Error);  // a conversation needs a template
}

}  // namespace
}  // namespace weft
