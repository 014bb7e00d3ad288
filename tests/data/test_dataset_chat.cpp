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
