// Tokenizing datasets into a corpus, and the on-disk token cache.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/data/corpus.h"
#include "core/data/dataset.h"
#include "core/util/error.h"
#include "core/util/hash.h"
#include "test_dataset_util.h"

namespace weft {
namespace {

using dataset_test::expect_error;
using dataset_test::FakeTokenizer;
using dataset_test::framed;
using dataset_test::kBos;
using dataset_test::kEos;
using dataset_test::TempDir;
using dataset_test::token_bytes;
using Tokens = std::vector<uint32_t>;

Tokens concat(std::initializer_list<Tokens> parts) {
  Tokens all;
  for (const auto& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

// The documents of a corpus, as token vectors.
std::vector<Tokens> documents_of(const TokenizedCorpus& corpus) {
  std::vector<Tokens> docs;
  for (int64_t d = 0; d < corpus.n_documents(); ++d) {
    docs.emplace_back(corpus.tokens.begin() + corpus.offsets[d],
                      corpus.tokens.begin() + corpus.offsets[d + 1]);
  }
  return docs;
}

CorpusOptions options_for(std::vector<std::string> paths, std::string cache_dir = "") {
  CorpusOptions options;
  options.paths = std::move(paths);
  options.cache_dir = std::move(cache_dir);
  return options;
}

TEST(DatasetCorpus, HashIsXxh64) {
  // Reference values of XXH64 with seed 0.
  EXPECT_EQ(hash_bytes("", 0), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(hash_bytes("a", 1), 0xD24EC4F1A98C6E5BULL);
  EXPECT_EQ(hash_bytes("abc", 3), 0x44BC2CF5AD770999ULL);
  const std::string long_text = "Nobody inspects the spammish repetition";
  EXPECT_EQ(hash_bytes(long_text.data(), long_text.size()), 0xFBCEA83C8A378BF1ULL);
}

TEST(DatasetCorpus, TextDocumentsAreFramedWithBosAndEos) {
  TempDir dir;
  const auto path = dir.write("a.txt", "ab\n\ncd\n");
  FakeTokenizer tok;
  auto options = options_for({path});
  EXPECT_EQ(documents_of(load_corpus(options, tok).corpus),
            (std::vector<Tokens>{{kBos, 'a', 'b', kEos}, {kBos, 'c', 'd', kEos}}));

  options.text_document = TextDocumentMode::kFile;
  options.add_bos = false;
  EXPECT_EQ(documents_of(load_corpus(options, tok).corpus),
            (std::vector<Tokens>{{'a', 'b', '\n', '\n', 'c', 'd', '\n', kEos}}));

  // Flags only add ids the tokenizer has.
  FakeTokenizer no_specials("fake", /*has_bos=*/false, /*has_eos=*/false);
  options.text_document = TextDocumentMode::kLine;
  options.add_bos = true;
  EXPECT_EQ(documents_of(load_corpus(options, no_specials).corpus),
            (std::vector<Tokens>{{'a', 'b'}, {'c', 'd'}}));
}

// data.add_bos / add_eos unset: the tokenizer's checkpoint decides (Llama 3 adds BOS, SmolLM2
// nothing); set, they override it either way.
TEST(DatasetCorpus, UnsetFramingIsWhatTheTokenizersCheckpointDoes) {
  const FakeTokenizer frames, smollm2("fake", /*has_bos=*/true, /*has_eos=*/true, /*frames=*/false);
  DatasetOptions options;
  options.seq_len = 4;
  EXPECT_TRUE(options.corpus_options(frames).add_bos);
  EXPECT_TRUE(options.corpus_options(frames).add_eos);
  EXPECT_FALSE(options.corpus_options(smollm2).add_bos);
  EXPECT_FALSE(options.corpus_options(smollm2).add_eos);
  options.add_bos = true;
  options.add_eos = false;
  EXPECT_TRUE(options.corpus_options(smollm2).add_bos);
  EXPECT_FALSE(options.corpus_options(frames).add_eos);
  TempDir dir;
  options.paths = {dir.write("a.txt", "ab\n\ncd\n")};
  options.add_bos.reset();
  options.add_eos.reset();
  EXPECT_EQ(documents_of(load_corpus(options.corpus_options(smollm2), smollm2).corpus),
            (std::vector<Tokens>{{'a', 'b'}, {'c', 'd'}}));
}

TEST(DatasetCorpus, MixedDirectoryReadsEachFileInSortedOrder) {
  TempDir dir;
  dir.write("d/b.jsonl", "{\"text\": \"j1\"}\n{\"text\": \"j2\"}\n");
  dir.write("d/a.txt", "t1\n\nt2");
  dir.write("d/c.u16", token_bytes({1, 2, kEos, 3}, 2));  // split after eos
  dir.write("d/e.u32", token_bytes({9, 8, 7}, 4));
  FakeTokenizer tok;
  const auto load = load_corpus(options_for({dir.path("d")}), tok);
  EXPECT_EQ(load.n_files, 4);
  EXPECT_FALSE(load.cache_hit);
  EXPECT_TRUE(load.cache_path.empty());
  EXPECT_EQ(documents_of(load.corpus),
            (std::vector<Tokens>{framed("t1"), framed("t2"), framed("j1"), framed("j2"),
                                 {1, 2, kEos}, {3}, {9, 8, 7}}));
}

TEST(DatasetCorpus, TokenFilesWithoutEosAreCutIntoChunks) {
  TempDir dir;
  Tokens ids(10000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = i % 250;
  const auto path = dir.write("t.bin", token_bytes(ids, 4));
  FakeTokenizer tok;
  const auto corpus = load_corpus(options_for({path}), tok).corpus;
  EXPECT_EQ(corpus.tokens, ids);
  EXPECT_EQ(corpus.offsets, (std::vector<uint64_t>{0, 8192, 10000}));
}

TEST(DatasetCorpus, MaxDocumentsKeepsTheFirstDocumentsAcrossFiles) {
  TempDir dir;
  const auto a = dir.write("a.txt", "1\n2\n3");
  const auto b = dir.write("b.u16", token_bytes({4, kEos, 5, kEos}, 2));
  FakeTokenizer tok;
  auto options = options_for({a, b});
  options.text_document = TextDocumentMode::kLine;
  options.max_documents = 4;
  EXPECT_EQ(documents_of(load_corpus(options, tok).corpus),
            (std::vector<Tokens>{framed("1"), framed("2"), framed("3"), {4, kEos}}));
  options.max_documents = 2;
  EXPECT_EQ(load_corpus(options, tok).corpus.n_documents(), 2);
  options.max_documents = -1;
  expect_error([&] { load_corpus(options, tok); }, "max_documents must be >= 0");
}

TEST(DatasetCorpus, ErrorsNameTheFileAndProblem) {
  TempDir dir;
  FakeTokenizer tok;
  const auto bad_jsonl = dir.write("bad.jsonl", "{\"text\": \"a\"}\n\n{\"text\": 3}\n");
  expect_error([&] { load_corpus(options_for({bad_jsonl}), tok); },
               bad_jsonl + ":3: field 'text' is number");
  const auto bad_size = dir.write("bad.u32", "12345");
  expect_error([&] { load_corpus(options_for({bad_size}), tok); },
               "size 5 bytes is not a multiple of 4");
  const auto bad_id = dir.write("bad.u16", token_bytes({1, 258}, 2));
  expect_error([&] { load_corpus(options_for({bad_id}), tok); },
               "token file '" + bad_id + "': token 258 at index 1 (byte offset 2)");
  const auto blank = dir.write("blank.txt", "\n  \n");
  expect_error([&] { load_corpus(options_for({blank}), tok); }, "dataset has no documents");
  expect_error([&] { load_corpus(options_for({dir.path("nope")}), tok); }, "does not exist");
}

TEST(DatasetCorpus, ParallelTokenizationMatchesSerial) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 3000; ++i) text += "line " + std::to_string(i * 7919 % 1000) + "\n";
  const auto path = dir.write("many.txt", text);
  FakeTokenizer tok;
  auto options = options_for({path});
  options.text_document = TextDocumentMode::kLine;
  options.tokenize_threads = 1;
  const auto serial = load_corpus(options, tok).corpus;
  options.tokenize_threads = 4;
  const auto parallel = load_corpus(options, tok).corpus;
  EXPECT_EQ(serial.n_documents(), 3000);
  EXPECT_EQ(parallel.tokens, serial.tokens);
  EXPECT_EQ(parallel.offsets, serial.offsets);
}

TEST(DatasetCorpus, SecondLoadHitsTheCacheWithIdenticalTokens) {
  TempDir dir;
  const auto path = dir.write("a.jsonl", "{\"text\": \"hello\"}\n{\"text\": \"world\"}\n");
  const std::string cache = dir.path("cache");
  FakeTokenizer tok;
  const auto first = load_corpus(options_for({path}, cache), tok);
  EXPECT_FALSE(first.cache_hit);
  EXPECT_TRUE(std::filesystem::exists(first.cache_path));
  EXPECT_EQ(std::filesystem::path(first.cache_path).parent_path(), std::filesystem::path(cache));
  EXPECT_EQ(first.cache_path, corpus_cache_path(options_for({path}, cache), tok));
  EXPECT_EQ(tok.encode_calls, 2);

  const auto second = load_corpus(options_for({path}, cache), tok);
  EXPECT_TRUE(second.cache_hit);
  EXPECT_EQ(tok.encode_calls, 2);  // nothing tokenized again
  EXPECT_EQ(second.cache_path, first.cache_path);
  EXPECT_EQ(second.corpus.tokens, concat({framed("hello"), framed("world")}));
  EXPECT_EQ(second.corpus.offsets, first.corpus.offsets);
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(cache),
                          std::filesystem::directory_iterator()),
            1);
}

TEST(DatasetCorpus, ChangedInputsOptionsOrTokenizerMissTheCache) {
  TempDir dir;
  const auto path = dir.write("a.txt", "one\n\ntwo");
  const std::string cache = dir.path("cache");
  FakeTokenizer tok("fake-v1");
  const auto base = load_corpus(options_for({path}, cache), tok);
  ASSERT_TRUE(load_corpus(options_for({path}, cache), tok).cache_hit);

  FakeTokenizer other_tok("fake-v2");
  const auto other = load_corpus(options_for({path}, cache), other_tok);
  EXPECT_FALSE(other.cache_hit);
  EXPECT_NE(other.cache_path, base.cache_path);

  auto no_eos = options_for({path}, cache);
  no_eos.add_eos = false;
  EXPECT_FALSE(load_corpus(no_eos, tok).cache_hit);
  auto by_line = options_for({path}, cache);
  by_line.text_document = TextDocumentMode::kLine;
  EXPECT_FALSE(load_corpus(by_line, tok).cache_hit);

  dir.write("a.txt", "one\n\nTWO");  // same size, new contents
  const auto changed = load_corpus(options_for({path}, cache), tok);
  EXPECT_FALSE(changed.cache_hit);
  EXPECT_NE(changed.cache_path, base.cache_path);
  EXPECT_EQ(changed.corpus.tokens, concat({framed("one"), framed("TWO")}));
  EXPECT_TRUE(load_corpus(options_for({path}, cache), tok).cache_hit);
}

TEST(DatasetCorpus, TruncatedOrCorruptCacheIsRebuilt) {
  TempDir dir;
  const auto path = dir.write("a.txt", "alpha\n\nbeta\n\ngamma");
  const std::string cache = dir.path("cache");
  FakeTokenizer tok;
  const auto first = load_corpus(options_for({path}, cache), tok);
  const auto expected = first.corpus.tokens;
  const auto size = std::filesystem::file_size(first.cache_path);

  std::filesystem::resize_file(first.cache_path, size - 3);
  const auto rebuilt = load_corpus(options_for({path}, cache), tok);
  EXPECT_FALSE(rebuilt.cache_hit);
  EXPECT_EQ(rebuilt.corpus.tokens, expected);
  EXPECT_EQ(std::filesystem::file_size(first.cache_path), size);

  {  // Flip one token byte: the size still matches, the checksum does not.
    std::fstream file(first.cache_path, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(size) - 2);
    file.put('\x7f');
  }
  TokenizedCorpus ignored;
  std::string problem;
  const uint64_t key = std::stoull(
      std::filesystem::path(first.cache_path).stem().string().substr(12), nullptr, 16);
  EXPECT_FALSE(read_corpus_cache(first.cache_path, key, &ignored, &problem));
  EXPECT_EQ(problem, "checksum mismatch");
  EXPECT_FALSE(load_corpus(options_for({path}, cache), tok).cache_hit);

  const auto again = load_corpus(options_for({path}, cache), tok);
  EXPECT_TRUE(again.cache_hit);
  EXPECT_EQ(again.corpus.tokens, expected);
}

TEST(DatasetCorpus, CacheFileRoundTripsAndRejectsWrongKeys) {
  TempDir dir;
  TokenizedCorpus corpus;
  corpus.tokens = {5, 6, 7, 8, 9};
  corpus.offsets = {0, 2, 5};
  const auto path = dir.path("sub/c.bin");
  write_corpus_cache(path, 42, corpus);
  TokenizedCorpus read;
  std::string problem;
  ASSERT_TRUE(read_corpus_cache(path, 42, &read, &problem)) << problem;
  EXPECT_EQ(read.tokens, corpus.tokens);
  EXPECT_EQ(read.offsets, corpus.offsets);
  EXPECT_FALSE(read_corpus_cache(path, 43, &read, &problem));
  EXPECT_EQ(problem, "cache key does not match its file name");
  dir.write("junk.bin", "not a cache file at all, but long enough for a header...");
  EXPECT_FALSE(read_corpus_cache(dir.path("junk.bin"), 42, &read, &problem));
  EXPECT_EQ(problem, "not a weft token cache (bad magic)");
}

// About 5M tokens: tokenizing is fast, and prepare_dataset from the cache (hash inputs, read
// and verify the cache, split, pack) takes well under a second.
TEST(DatasetCorpus, FiveMillionTokenDatasetLoadsQuicklyFromTheCache) {
  TempDir dir;
  std::string text;
  text.reserve(5'100'000);
  for (int i = 0; text.size() < 5'000'000; ++i) {
    text += "document number " + std::to_string(i) + " with some filler text to make it longer";
    text += (i % 3 == 2) ? "\n\n" : "\n";
  }
  DatasetOptions options;
  options.paths = {dir.write("big.txt", text)};
  options.cache_dir = dir.path("cache");
  options.seq_len = 2048;
  options.heldout_fraction = 0.01;
  FakeTokenizer tok;
  const auto built = prepare_dataset(options, tok);
  const auto cached = prepare_dataset(options, tok);
  ASSERT_FALSE(built.summary.cache_hit);
  ASSERT_TRUE(cached.summary.cache_hit);
  EXPECT_GT(cached.summary.tokens, 5'000'000);
  EXPECT_EQ(cached.train->tokens(), built.train->tokens());
  EXPECT_EQ(cached.heldout->tokens(), built.heldout->tokens());
  std::printf("[ timing   ] %s\n[ timing   ] %s\n", built.summary.describe().c_str(),
              cached.summary.describe().c_str());
  EXPECT_LT(cached.summary.seconds, 1.0);
}

}  // namespace
}  // namespace weft
