// Document split, packing into sequences, and prepare_dataset end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "core/data/dataset.h"
#include "core/util/error.h"
#include "test_dataset_util.h"

namespace weft {
namespace {

using dataset_test::expect_error;
using dataset_test::FakeTokenizer;
using dataset_test::TempDir;
using Indices = std::vector<int64_t>;

TEST(DatasetSplit, SeededPermutationIsAPortableFunctionOfTheSeed) {
  const auto p = seeded_permutation(10, 42);
  Indices sorted = p;
  std::sort(sorted.begin(), sorted.end());
  Indices identity(10);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(sorted, identity);
  EXPECT_EQ(seeded_permutation(10, 42), p);
  EXPECT_NE(seeded_permutation(10, 43), p);
  // Pinned: std::mt19937_64 output is fixed by the standard, so these never change.
  EXPECT_EQ(p, (Indices{1, 7, 9, 0, 3, 8, 4, 2, 5, 6}));
  EXPECT_TRUE(seeded_permutation(0, 1).empty());
  EXPECT_EQ(seeded_permutation(1, 1), (Indices{0}));
}

void expect_disjoint_cover(const DocumentSplit& split, int64_t n) {
  EXPECT_TRUE(std::is_sorted(split.train.begin(), split.train.end()));
  EXPECT_TRUE(std::is_sorted(split.heldout.begin(), split.heldout.end()));
  Indices all = split.train;
  all.insert(all.end(), split.heldout.begin(), split.heldout.end());
  std::sort(all.begin(), all.end());
  Indices identity(n);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(all, identity);  // disjoint (no duplicates) and covering
}

TEST(DatasetSplit, HoldsOutTheRoundedFractionDisjointAndCovering) {
  const auto split = split_documents(100, 0.1, 7);
  EXPECT_EQ(split.heldout.size(), 10u);
  EXPECT_EQ(split.train.size(), 90u);
  expect_disjoint_cover(split, 100);
  EXPECT_EQ(split_documents(10, 0.25, 1).heldout.size(), 3u);   // round(2.5) = 3
  EXPECT_EQ(split_documents(10, 0.01, 1).heldout.size(), 1u);   // at least one
  EXPECT_EQ(split_documents(2, 0.9, 1).heldout.size(), 1u);     // at most n - 1
  EXPECT_EQ(split_documents(5, 0.0, 1).train, (Indices{0, 1, 2, 3, 4}));
  EXPECT_TRUE(split_documents(5, 0.0, 1).heldout.empty());
  expect_disjoint_cover(split_documents(7, 0.5, 3), 7);
}

TEST(DatasetSplit, SameSeedSameSplitOtherSeedOtherSplit) {
  const auto a = split_documents(200, 0.2, 11);
  const auto b = split_documents(200, 0.2, 11);
  const auto c = split_documents(200, 0.2, 12);
  EXPECT_EQ(a.heldout, b.heldout);
  EXPECT_EQ(a.train, b.train);
  EXPECT_NE(a.heldout, c.heldout);
  // The held-out set is the first round(f*n) entries of the seeded permutation.
  auto order = seeded_permutation(200, 11);
  Indices first(order.begin(), order.begin() + 40);
  std::sort(first.begin(), first.end());
  EXPECT_EQ(a.heldout, first);
}

TEST(DatasetSplit, RejectsImpossibleFractions) {
  expect_error([] { split_documents(1, 0.1, 0); },
               "heldout_fraction 0.1 needs at least 2 documents, the dataset has 1");
  expect_error([] { split_documents(10, 1.0, 0); }, "heldout_fraction must be in [0, 1), got 1");
  expect_error([] { split_documents(10, -0.5, 0); }, "heldout_fraction must be in [0, 1)");
  EXPECT_EQ(split_documents(1, 0.0, 0).train, (Indices{0}));
}

TokenizedCorpus corpus_of(std::vector<std::vector<uint32_t>> docs) {
  TokenizedCorpus corpus;
  for (const auto& doc : docs) {
    corpus.tokens.insert(corpus.tokens.end(), doc.begin(), doc.end());
    corpus.offsets.push_back(corpus.tokens.size());
  }
  return corpus;
}

TEST(DatasetPacking, SequencesAreOverlappingWindowsShiftedByOne) {
  const auto corpus = corpus_of({{10, 11, 12}, {20, 21}, {30, 31, 32, 33, 34}});
  const auto packed = pack_documents(corpus, {0, 2}, 3, "train");
  EXPECT_EQ(packed.tokens(), (std::vector<uint32_t>{10, 11, 12, 30, 31, 32, 33, 34}));
  EXPECT_EQ(packed.n_documents(), 2);
  EXPECT_EQ(packed.n_tokens(), 8);
  EXPECT_EQ(packed.n_sequences(), 2);  // (8 - 1) / 3; token 34 is only ever a target
  int64_t inputs[3], targets[3];
  packed.copy_sequence(0, inputs, targets);
  EXPECT_EQ(Indices(inputs, inputs + 3), (Indices{10, 11, 12}));
  EXPECT_EQ(Indices(targets, targets + 3), (Indices{11, 12, 30}));
  packed.copy_sequence(1, inputs, targets);
  EXPECT_EQ(Indices(inputs, inputs + 3), (Indices{30, 31, 32}));
  EXPECT_EQ(Indices(targets, targets + 3), (Indices{31, 32, 33}));
  // Exactly seq_len + 1 tokens make one sequence.
  EXPECT_EQ(pack_documents(corpus, {1, 0}, 4, "x").n_sequences(), 1);
}

TEST(DatasetPacking, TooSmallSplitNamesSplitTokensAndSeqLen) {
  const auto corpus = corpus_of({{1, 2}, {3, 4}});
  expect_error([&] { pack_documents(corpus, {0, 1}, 4, "held-out"); },
               "held-out split has 4 tokens (2 documents), fewer than seq_len + 1 = 5");
  expect_error([&] { pack_documents(corpus, {0, 1}, 0, "train"); }, "seq_len must be positive");
}

DatasetOptions options_for(const std::string& path) {
  DatasetOptions options;
  options.paths = {path};
  options.seq_len = 8;
  return options;
}

TEST(DatasetPrepare, SplitsPacksAndSummarises) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 20; ++i) text += "paragraph " + std::to_string(100 + i) + "\n\n";
  const auto path = dir.write("corpus.txt", text);  // 20 documents of 1 + 13 + 1 tokens
  FakeTokenizer tok;
  auto options = options_for(path);
  options.heldout_fraction = 0.25;
  options.split_seed = 5;
  options.cache_dir = dir.path("cache");
  const auto splits = prepare_dataset(options, tok);
  ASSERT_TRUE(splits.train && splits.heldout);
  const auto& s = splits.summary;
  EXPECT_EQ(s.files, 1);
  EXPECT_EQ(s.documents, 20);
  EXPECT_EQ(s.tokens, 20 * 15);
  EXPECT_EQ(s.train_documents, 15);
  EXPECT_EQ(s.heldout_documents, 5);
  EXPECT_EQ(s.train_tokens, 15 * 15);
  EXPECT_EQ(s.heldout_tokens, 5 * 15);
  EXPECT_EQ(s.train_sequences, (15 * 15 - 1) / 8);
  EXPECT_EQ(s.heldout_sequences, (5 * 15 - 1) / 8);
  EXPECT_FALSE(s.cache_hit);
  EXPECT_NE(s.describe().find("20 documents, 300 tokens (tokenized, cached)"), std::string::npos)
      << s.describe();

  // The held-out stream is its documents in original order.
  const auto split = split_documents(20, 0.25, 5);
  std::string heldout_text;
  for (const auto d : split.heldout) heldout_text += "paragraph " + std::to_string(100 + d);
  std::string decoded;
  for (const uint32_t id : splits.heldout->tokens()) {
    if (id < 256) decoded.push_back(static_cast<char>(id));
  }
  EXPECT_EQ(decoded, heldout_text);

  const auto again = prepare_dataset(options, tok);
  EXPECT_TRUE(again.summary.cache_hit);
  EXPECT_EQ(again.train->tokens(), splits.train->tokens());
  EXPECT_EQ(again.heldout->tokens(), splits.heldout->tokens());
  EXPECT_NE(again.summary.describe().find("(cache hit)"), std::string::npos);
}

TEST(DatasetPrepare, NoHeldOutSplitWithZeroFraction) {
  TempDir dir;
  const auto path = dir.write("a.txt", "0123456789abcdef");
  FakeTokenizer tok;
  auto options = options_for(path);
  options.text_document = "file";
  const auto splits = prepare_dataset(options, tok);
  EXPECT_EQ(splits.heldout, nullptr);
  EXPECT_EQ(splits.train->n_tokens(), 18);
  EXPECT_EQ(splits.train->n_sequences(), 2);
  EXPECT_TRUE(splits.summary.cache_path.empty());
}

TEST(DatasetPrepare, RejectsBadOptionsAndTooSmallSplits) {
  TempDir dir;
  const auto path = dir.write("a.txt", "abc\n\ndef\n\nghi");
  FakeTokenizer tok;
  auto options = options_for(path);
  options.seq_len = 0;
  expect_error([&] { prepare_dataset(options, tok); }, "seq_len must be positive, got 0");
  options = options_for(path);
  options.format = "parquet";
  expect_error([&] { prepare_dataset(options, tok); }, "unknown dataset format 'parquet'");
  options = options_for(path);
  options.text_document = "sentence";
  expect_error([&] { prepare_dataset(options, tok); }, "unknown text_document mode 'sentence'");
  options = options_for(path);
  options.heldout_fraction = 0.3;  // 1 of 3 documents: 5 tokens, seq_len 8
  expect_error([&] { prepare_dataset(options, tok); },
               "held-out split has 5 tokens (1 documents), fewer than seq_len + 1 = 9");
  options.text_document = "file";
  expect_error([&] { prepare_dataset(options, tok); }, "needs at least 2 documents");
}

}  // namespace
}  // namespace weft
