// Classification data: examples encoded as Llama 3's template does (BOS A, BOS A BOS B), truncated
// longest-first, one padded row each with the label at its last token; the splits and classes.
#include <cstring>

#include <gtest/gtest.h>

#include "core/data/classification.h"
#include "core/data/loader.h"
#include "test_dataset_util.h"

namespace weft {
namespace {

using dataset_test::expect_error;
using dataset_test::FakeTokenizer;
using dataset_test::kBos;
using dataset_test::kEos;
using dataset_test::TempDir;

std::vector<uint32_t> bytes_of(const std::string& text) { return std::vector<uint32_t>(text.begin(), text.end()); }

std::vector<uint32_t> joined(std::initializer_list<std::vector<uint32_t>> parts) {
  std::vector<uint32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(ClassificationData, EncodesTextsAndPairsAsLlama3sTemplate) {
  FakeTokenizer tokenizer;
  EXPECT_EQ(encode_example({"abc", "", false, "x"}, tokenizer, 16, true), joined({{kBos}, bytes_of("abc")}));
  EXPECT_EQ(encode_example({"abc", "de", true, "x"}, tokenizer, 16, true),
            joined({{kBos}, bytes_of("abc"), {kBos}, bytes_of("de")}));
  // Without BOS the pair is joined by EOS.
  EXPECT_EQ(encode_example({"abc", "de", true, "x"}, tokenizer, 16, false), joined({bytes_of("abc"), {kEos}, bytes_of("de")}));
  // An empty text still gives one token to pool at.
  EXPECT_EQ(encode_example({"", "", false, "x"}, tokenizer, 16, false), std::vector<uint32_t>{kEos});
}

TEST(ClassificationData, TruncatesLongestFirstAsTransformers) {
  FakeTokenizer tokenizer;
  bool cut = false;
  // 2 specials + 10 + 4 = 16 > 10: the longer text loses a token at a time until 2 + 4 + 4 fit.
  const auto ids = encode_example({"0123456789", "abcd", true, "x"}, tokenizer, 10, true, &cut);
  EXPECT_TRUE(cut);
  EXPECT_EQ(ids, joined({{kBos}, bytes_of("0123"), {kBos}, bytes_of("abcd")}));
  EXPECT_EQ(encode_example({"0123456789", "abc", true, "x"}, tokenizer, 9, true, &cut),
            joined({{kBos}, bytes_of("0123"), {kBos}, bytes_of("abc")}));
  // On a tie the pair's text gives the token (transformers' longest_first).
  EXPECT_EQ(encode_example({"0123", "abcd", true, "x"}, tokenizer, 9, true, &cut),
            joined({{kBos}, bytes_of("0123"), {kBos}, bytes_of("abc")}));
  EXPECT_EQ(encode_example({"short", "", false, "x"}, tokenizer, 9, true, &cut), joined({{kBos}, bytes_of("short")}));
  EXPECT_FALSE(cut);
}

TEST(ClassificationData, EachExampleIsOnePaddedRowLabeledAtItsLastToken) {
  const auto seqs = PackedSequences::examples("train", {{5, 6, 7}, {9}}, {2, 0}, 4, 99);
  ASSERT_TRUE(seqs.labeled());
  EXPECT_EQ(seqs.n_sequences(), 2);
  EXPECT_EQ(seqs.length(0), 3);
  const Batch b = make_batch(seqs, {0, 1});
  const auto rows = [](std::vector<int64_t> values) { return torch::tensor(values, torch::kLong).reshape({2, 4}); };
  EXPECT_TRUE(torch::equal(b.inputs, rows({5, 6, 7, 99, 9, 99, 99, 99})));
  const int64_t u = kUnlabeledTarget;
  EXPECT_TRUE(torch::equal(b.targets, rows({u, u, 2, u, 0, u, u, u}))) << b.targets;
  expect_error([] { PackedSequences::examples("train", {{1, 2, 3, 4, 5}}, {0}, 4, 0); }, "example 0 has 5 tokens");
  expect_error([] { PackedSequences::examples("train", {{1}}, {0, 1}, 4, 0); }, "1 examples but 2 targets");
}

TEST(ClassificationData, JsonlSplitsExamplesAndNamesItsClasses) {
  TempDir dir;
  std::string jsonl;
  for (int i = 0; i < 40; ++i) jsonl += "{\"text\": \"example " + std::to_string(i) + "\", \"label\": \"" + (i % 3 == 0 ? "cat" : "dog") + "\"}\n";
  DatasetOptions options;
  options.paths = {dir.write("d.jsonl", jsonl)};
  options.seq_len = 32;
  options.heldout_fraction = 0.25;
  FakeTokenizer tokenizer;
  const ClassificationData data = prepare_classification(options, {}, tokenizer);
  EXPECT_EQ(data.labels, (std::vector<std::string>{"cat", "dog"}));
  EXPECT_FALSE(data.regression);
  EXPECT_EQ(data.splits.train->n_sequences(), 30);
  EXPECT_EQ(data.splits.heldout->n_sequences(), 10);
  EXPECT_EQ(data.pad, kEos);
  EXPECT_EQ(static_cast<int64_t>(data.train_labels.size()), 30);
  for (int64_t i = 0; i < 30; ++i) EXPECT_EQ(data.splits.train->target(i), data.train_labels[static_cast<size_t>(i)]);
  // Declared classes fix the ids; a label outside them is named.
  ClassificationOptions declared;
  declared.labels = {"dog", "cat"};
  const ClassificationData swapped = prepare_classification(options, declared, tokenizer);
  for (int64_t i = 0; i < 30; ++i) EXPECT_EQ(swapped.splits.train->target(i), 1 - data.splits.train->target(i));
  declared.labels = {"dog", "bird"};
  expect_error([&] { prepare_classification(options, declared, tokenizer); }, "cat");
}

TEST(ClassificationData, RegressionTargetsHoldTheScoresBits) {
  TempDir dir;
  DatasetOptions options;
  options.paths = {dir.write("d.jsonl", "{\"text\": \"a\", \"label\": 3.75}\n{\"text\": \"b\", \"label\": -1}\n")};
  options.seq_len = 8;
  ClassificationOptions task;
  task.regression = true;
  FakeTokenizer tokenizer;
  const ClassificationData data = prepare_classification(options, task, tokenizer);
  ASSERT_TRUE(data.regression);
  const int64_t bits = data.splits.train->target(0);
  double score = 0;
  std::memcpy(&score, &bits, sizeof score);
  EXPECT_EQ(score, 3.75);
}

TEST(ClassificationData, RefusesAClassOnlyTheHeldOutSplitHas) {
  TempDir dir;
  std::string jsonl;
  for (int i = 0; i < 10; ++i) jsonl += "{\"text\": \"t" + std::to_string(i) + "\", \"label\": \"common\"}\n";
  jsonl += "{\"text\": \"rare\", \"label\": \"rare\"}\n";
  DatasetOptions options;
  options.paths = {dir.write("d.jsonl", jsonl)};
  options.seq_len = 8;
  options.heldout_fraction = 0.5;
  FakeTokenizer tokenizer;
  // Which examples are held out depends on the seed: find one that holds the rare one out.
  bool refused = false;
  for (uint64_t seed = 0; seed < 20 && !refused; ++seed) {
    options.split_seed = seed;
    try {
      prepare_classification(options, {}, tokenizer);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("class 'rare' appears only in the held-out examples"), std::string::npos)
          << e.what();
      refused = true;
    }
  }
  EXPECT_TRUE(refused);
}

}  // namespace
}  // namespace weft
