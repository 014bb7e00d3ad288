// BpeTokenizer on small tokenizer.json files written by the tests, and load_tokenizer's handling
// of paths and malformed files.
#include <atomic>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/data/bpe_tokenizer.h"
#include "core/data/chat_template.h"
#include "core/data/tokenizer.h"
#include "core/data/unicode.h"
#include "core/util/error.h"

namespace weft {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;
namespace fs = std::filesystem;

const char* const kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's byte-level spelling of raw bytes (" " -> "Ġ").
std::string byte_level(std::string_view bytes) {
  std::string out;
  for (unsigned char b : bytes) unicode::append_utf8(out, unicode::byte_char(b));
  return out;
}

// Ids 0..255 for the 256 byte tokens (id = byte value), then `extra` tokens from 256 on.
json byte_vocab(std::initializer_list<std::string> extra = {}) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, static_cast<char>(b)))] = b;
  int next = 256;
  for (const auto& token : extra) vocab[byte_level(token)] = next++;
  return vocab;
}

json gpt2_pre_tokenizer() {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
}

json llama3_pre_tokenizer() {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"}, {"pattern", {{"Regex", kLlama3Regex}}}, {"behavior", "Isolated"}, {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
}

json added_token(int id, const std::string& content, bool special = true) {
  return {{"id", id},          {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},   {"normalized", false}, {"special", special}};
}

json tokenizer_json(json vocab, json merges, json pre_tokenizer = gpt2_pre_tokenizer()) {
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"ignore_merges", false},
            {"vocab", vocab},
            {"merges", merges}}}};
}

class BpeTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() /
           ("weft_test_tokenizer_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& contents) {
    const fs::path path = dir_ / name;
    fs::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << contents;
    return path.string();
  }

  std::unique_ptr<Tokenizer> load(const json& tokenizer) {
    return load_tokenizer(write("tokenizer.json", tokenizer.dump()));
  }

  // Loads `contents` and expects a weft::Error whose message names the file and `problem`.
  void expect_load_error(const std::string& contents, const std::string& problem) {
    const std::string path = write("bad.json", contents);
    try {
      load_tokenizer(path);
      ADD_FAILURE() << "loaded without error; expected: " << problem;
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path), std::string::npos) << message;
      EXPECT_NE(message.find(problem), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  }

  fs::path dir_;
};

TEST_F(BpeTokenizerTest, MergeRankDecidesBetweenOverlappingPairs) {
  auto vocab = byte_vocab({"ab", "bc"});  // ab = 256, bc = 257
  const auto ab_first = load(tokenizer_json(vocab, {"a b", "b c"}));
  EXPECT_EQ(ab_first->encode("abc"), (Ids{256, 'c'}));
  const auto bc_first = load(tokenizer_json(vocab, {"b c", "a b"}));
  EXPECT_EQ(bc_first->encode("abc"), (Ids{'a', 257}));
  EXPECT_EQ(bc_first->decode(bc_first->encode("abc")), "abc");
}

TEST_F(BpeTokenizerTest, MergesRepeatUntilNoneApplies) {
  // ll = 256, he = 257, hell = 258, hello = 259, aa = 260
  auto vocab = byte_vocab({"ll", "he", "hell", "hello", "aa"});
  const auto tokenizer = load(tokenizer_json(vocab, {"l l", "h e", "he ll", "hell o", "a a"}));
  EXPECT_EQ(tokenizer->encode("hello"), (Ids{259}));
  EXPECT_EQ(tokenizer->encode("hell"), (Ids{258}));
  EXPECT_EQ(tokenizer->encode("hellhello"), (Ids{258, 259}));
  EXPECT_EQ(tokenizer->encode("aaa"), (Ids{260, 'a'}));  // leftmost first among equal ranks
  EXPECT_EQ(tokenizer->encode("aaaa"), (Ids{260, 260}));
  // " hello" is one GPT-2 pre-token; no merge joins its space, so it stays a token of its own.
  EXPECT_EQ(tokenizer->encode("hello hello"), (Ids{259, ' ', 259}));
}

TEST_F(BpeTokenizerTest, MergesAcceptPairArrays) {
  auto vocab = byte_vocab({"a b", "a bc"});  // tokens containing a space (Ġ in byte level)
  json merges = json::array({json::array({byte_level("a"), byte_level(" ")}),
                             json::array({byte_level("a "), byte_level("b")})});
  vocab[byte_level("a ")] = 258;
  const auto tokenizer = load(tokenizer_json(vocab, merges, llama3_pre_tokenizer()));
  // Llama 3 splits "xa b" as "xa", " b": no merge applies across them.
  EXPECT_EQ(tokenizer->encode("xa b"), (Ids{'x', 'a', ' ', 'b'}));
  EXPECT_EQ(tokenizer->decode({256}), "a b");
}

TEST_F(BpeTokenizerTest, HandWrittenFileWithSmallVocab) {
  const std::string contents = R"({
    "added_tokens": [],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "\u0120": 4, "\u0120c": 5},
              "merges": [["a", "b"], "\u0120 c"]}
  })";
  const auto tokenizer = load_tokenizer(write("small.json", contents));
  EXPECT_EQ(tokenizer->kind(), "bpe");
  EXPECT_EQ(tokenizer->vocab_size(), 6);
  EXPECT_EQ(tokenizer->encode("ab c"), (Ids{3, 5}));
  EXPECT_EQ(tokenizer->encode("ba  c"), (Ids{1, 0, 4, 5}));
  EXPECT_EQ(tokenizer->decode({3, 4, 5}), "ab  c");
  EXPECT_FALSE(tokenizer->bos_id().has_value());
  EXPECT_FALSE(tokenizer->eos_id().has_value());
  try {
    tokenizer->encode("abd");
    ADD_FAILURE() << "no error for a byte outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("0x64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"d\""), std::string::npos) << e.what();
  }
}

TEST_F(BpeTokenizerTest, IgnoreMergesEmitsWholeWordsFoundInTheVocab) {
  auto vocab = byte_vocab({" world", "wo"});  // " world" = 256 has no merge path; wo = 257
  auto tokenizer_json_value = tokenizer_json(vocab, {"w o"}, llama3_pre_tokenizer());
  const auto merging = load(tokenizer_json_value);
  EXPECT_EQ(merging->encode(" world"), (Ids{' ', 257, 'r', 'l', 'd'}));
  tokenizer_json_value["model"]["ignore_merges"] = true;
  const auto ignoring = load(tokenizer_json_value);
  EXPECT_EQ(ignoring->encode(" world"), (Ids{256}));
  EXPECT_EQ(ignoring->encode(" worlds"), (Ids{' ', 257, 'r', 'l', 'd', 's'}));  // not whole: merges
  EXPECT_EQ(ignoring->encode("hello world"), (Ids{'h', 'e', 'l', 'l', 'o', 256}));
}

TEST_F(BpeTokenizerTest, AddedTokensAreMatchedBeforePreTokenization) {
  auto value = tokenizer_json(byte_vocab({"he"}), {"h e"});
  value["added_tokens"] = {added_token(300, "<|end|>"), added_token(301, "<|end|>\n", false)};
  const auto tokenizer = load(value);
  EXPECT_EQ(tokenizer->vocab_size(), 302);
  EXPECT_EQ(tokenizer->encode("he<|end|>he"), (Ids{256, 300, 256}));
  EXPECT_EQ(tokenizer->encode("a <|end|> b"), (Ids{'a', ' ', 300, ' ', 'b'}));
  EXPECT_EQ(tokenizer->encode("x<|end|>\ny"), (Ids{'x', 301, 'y'}));  // longest match first
  EXPECT_EQ(tokenizer->encode("<|end|<|end|>"), (Ids{'<', '|', 'e', 'n', 'd', '|', 300}));
  EXPECT_EQ(tokenizer->decode({'a', 300, 301, 256}), "a<|end|><|end|>\nhe");
  EXPECT_THROW(tokenizer->decode({290}), Error);  // a gap in the ids
  EXPECT_THROW(tokenizer->decode({302}), Error);
  EXPECT_THROW(tokenizer->decode({-3}), Error);
}

TEST_F(BpeTokenizerTest, DecodeInvertsEncodeOnArbitraryText) {
  auto value = tokenizer_json(byte_vocab({"th", "the", " the", "in", "ing", "\xC3\xA9"}),
                              {"t h", "th e", "Ġ the", "i n", "in g", "Ã ©"}, llama3_pre_tokenizer());
  value["added_tokens"] = {added_token(300, "<|begin_of_text|>"), added_token(301, "<|end_of_text|>")};
  const std::vector<std::string> alphabet = {
      "a", "e", "t", "h", "i", "n", "g", "T", "S", "'", "s", " ", "  ", "\n", "\r\n", "\t", "1", "42", "!",
      ".", "\"", "\xC3\xA9", "\xC3\xB6", "\xE4\xBD\xA0", "\xF0\x9F\x98\x80", "\xC2\xA0", "\xE3\x80\x80",
      "\xD9\xA3", "\xCC\x81", "<|begin_of_text|>", "<|end_of_text|>", "<|", "\xFF", "\xC3", "\x80", "the", " the"};
  std::mt19937 rng(11);
  for (const json& pre : {llama3_pre_tokenizer(), gpt2_pre_tokenizer()}) {
    value["pre_tokenizer"] = pre;
    const auto tokenizer = load(value);
    for (int trial = 0; trial < 300; ++trial) {
      std::string text;
      for (size_t n = rng() % 40; n > 0; --n) text += alphabet[rng() % alphabet.size()];
      const auto ids = tokenizer->encode(text);
      ASSERT_EQ(tokenizer->decode(ids), text) << "pre_tokenizer " << pre.dump();
    }
  }
}

TEST_F(BpeTokenizerTest, EncodesTheSameWordTheSameWayEveryTime) {  // exercises the word cache
  const auto tokenizer = load(tokenizer_json(byte_vocab({"th", "the"}), {"t h", "th e"}));
  const Ids once = tokenizer->encode("the then the");
  EXPECT_EQ(once, (Ids{257, ' ', 257, 'n', ' ', 257}));
  EXPECT_EQ(tokenizer->encode("the then the"), once);
}

TEST_F(BpeTokenizerTest, BosAndEosFromLlama3PostProcessor) {
  auto value = tokenizer_json(byte_vocab(), json::array(), llama3_pre_tokenizer());
  value["added_tokens"] = {added_token(300, "<|begin_of_text|>"), added_token(301, "<|end_of_text|>"),
                           added_token(302, "<|eot_id|>")};
  const json template_processing = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"special_tokens",
       {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {300}}, {"tokens", {"<|begin_of_text|>"}}}}}}};
  value["post_processor"] = {{"type", "Sequence"},
                             {"processors", {{{"type", "ByteLevel"}, {"add_prefix_space", true}}, template_processing}}};
  const auto tokenizer = load(value);
  EXPECT_EQ(tokenizer->bos_id(), 300);
  EXPECT_EQ(tokenizer->eos_id(), 301);
  EXPECT_EQ(tokenizer->vocab_size(), 303);
  EXPECT_TRUE(tokenizer->adds_bos());  // Llama 3's framing: BOS, no EOS
  EXPECT_FALSE(tokenizer->adds_eos());
}

TEST_F(BpeTokenizerTest, BosAndEosFromTemplateOrEndOfText) {
  auto value = tokenizer_json(byte_vocab(), json::array());
  value["added_tokens"] = {added_token(256, "<|endoftext|>")};
  const auto gpt2 = load(value);
  EXPECT_EQ(gpt2->bos_id(), 256);
  EXPECT_EQ(gpt2->eos_id(), 256);
  EXPECT_FALSE(gpt2->adds_bos());  // no post-processor: a text is encoded as it is
  EXPECT_FALSE(gpt2->adds_eos());

  value["added_tokens"] = {added_token(256, "<|endoftext|>"), added_token(257, "<s>"), added_token(258, "</s>")};
  value["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                  {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}}};
  const auto templated = load(value);
  EXPECT_EQ(templated->bos_id(), 257);
  EXPECT_EQ(templated->eos_id(), 258);
  EXPECT_TRUE(templated->adds_bos());
  EXPECT_TRUE(templated->adds_eos());
}

// SmolLM2's files: tokenizer.json's template adds nothing, and tokenizer_config.json beside it names
// BOS <|im_start|> and EOS <|im_end|> (not <|endoftext|>, the GPT-2 fallback); add_bos_token turns
// the framing on where a checkpoint's config says so.
TEST_F(BpeTokenizerTest, TokenizerConfigBesideItNamesBosAndEosAndTheFraming) {
  auto value = tokenizer_json(byte_vocab(), json::array());
  value["added_tokens"] = {added_token(256, "<|endoftext|>"), added_token(257, "<|im_start|>"),
                           added_token(258, "<|im_end|>")};
  value["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  const std::string path = write("smol/tokenizer.json", value.dump());
  const auto bare = load_tokenizer(path);
  EXPECT_EQ(bare->bos_id(), 256);
  EXPECT_FALSE(bare->adds_bos());
  write("smol/tokenizer_config.json",
        R"({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": true}})");
  const auto smol = load_tokenizer(path);
  EXPECT_EQ(smol->bos_id(), 257);
  EXPECT_EQ(smol->eos_id(), 258);
  EXPECT_FALSE(smol->adds_bos());
  EXPECT_FALSE(smol->adds_eos());
  EXPECT_NE(smol->fingerprint(), bare->fingerprint());  // a token cache of the other framing is not reused
  write("smol/tokenizer_config.json", R"({"bos_token": "<|im_start|>", "add_bos_token": true})");
  EXPECT_TRUE(load_tokenizer(path)->adds_bos());
  write("smol/tokenizer_config.json", R"({"bos_token": "<s>"})");
  try {
    load_tokenizer(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: bos_token '<s>' is not in the vocabulary"), std::string::npos)
        << e.what();
  }
}

// The chat template beside a tokenizer.json: tokenizer_config.json's chat_template (a string, or
// transformers' list of named templates), chat_template.jinja first where both exist; none, and
// the byte tokenizer, have none. Rendering as transformers does: trim_blocks, the messages,
// add_generation_prompt, bos_token; a template's raise_exception and a template that does not parse
// are one error naming where it came from. (Against transformers' apply_chat_template on real
// templates: Reference.Gguf*.)
TEST_F(BpeTokenizerTest, TheChatTemplateBesideTheTokenizerRendersAsTransformersDoes) {
  auto value = tokenizer_json(byte_vocab(), json::array());
  value["added_tokens"] = {added_token(256, "<|endoftext|>"), added_token(257, "<|im_start|>"),
                           added_token(258, "<|im_end|>")};
  const std::string path = write("chat/tokenizer.json", value.dump());
  const auto tokenizer = load_tokenizer(path);
  EXPECT_EQ(load_chat_template(path, *tokenizer), nullptr);
  EXPECT_EQ(load_chat_template("byte", *tokenizer), nullptr);
  const std::string chatml =
      "{% for message in messages %}\n{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
      "'<|im_end|>\\n'}}\n{% endfor %}\n{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  write("chat/tokenizer_config.json", json({{"chat_template", chatml}}).dump());
  const auto chat = load_chat_template(path, *tokenizer);
  ASSERT_NE(chat, nullptr);
  const std::vector<ChatMessage> messages = {{"system", "Be brief."}, {"user", "Hi"}};
  // trim_blocks drops the newline after {% ... %}, not after {{ ... }} (jinja2 renders these same strings).
  EXPECT_EQ(chat->render(messages, false), "<|im_start|>system\nBe brief.<|im_end|>\n\n<|im_start|>user\nHi<|im_end|>\n\n");
  EXPECT_EQ(chat->render(messages, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n\n<|im_start|>user\nHi<|im_end|>\n\n<|im_start|>assistant\n");
  EXPECT_EQ(tokenizer->encode(chat->render({{"user", "Hi"}}, false)),
            (Ids{257, 'u', 's', 'e', 'r', '\n', 'H', 'i', 258, '\n', '\n'}));

  write("chat/tokenizer_config.json",
        json({{"chat_template", {{{"name", "tool_use"}, {"template", "tools"}}, {{"name", "default"}, {"template", "{{ bos_token }}default"}}}}})
            .dump());
  EXPECT_EQ(load_chat_template(path, *tokenizer)->render(messages, false), "<|endoftext|>default");
  write("chat/chat_template.jinja", "jinja {{ messages | length }}");
  EXPECT_EQ(load_chat_template(path, *tokenizer)->render(messages, false), "jinja 2");
  fs::remove(dir_ / "chat/chat_template.jinja");

  write("chat/tokenizer_config.json",
        json({{"chat_template", "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"}}).dump());
  const auto strict = load_chat_template(path, *tokenizer);
  EXPECT_EQ(strict->render({{"user", "Hi"}}, false), "ok");
  try {
    strict->render(messages, false);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chat template of " + (dir_ / "chat/tokenizer_config.json").string() + ": "),
              std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("user first"), std::string::npos) << e.what();
  }
  write("chat/tokenizer_config.json", json({{"chat_template", "{% for m in messages %}unclosed"}}).dump());
  try {
    load_chat_template(path, *tokenizer);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not parse"), std::string::npos) << e.what();
  }
}

TEST_F(BpeTokenizerTest, FingerprintHashesTheFileContents) {
  const std::string contents = tokenizer_json(byte_vocab(), json::array()).dump();
  const auto a = load_tokenizer(write("a/tokenizer.json", contents));
  const auto b = load_tokenizer(write("b/tokenizer.json", contents));
  const auto c = load_tokenizer(write("c/tokenizer.json", contents + " "));
  EXPECT_EQ(a->fingerprint().size(), 16u);
  EXPECT_EQ(a->fingerprint().find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
  EXPECT_NE(a->fingerprint(), c->fingerprint());
}

TEST_F(BpeTokenizerTest, LoadsFromADirectory) {
  write("model/tokenizer.json", tokenizer_json(byte_vocab({"ab"}), {"a b"}).dump());
  const auto tokenizer = load_tokenizer((dir_ / "model").string());
  EXPECT_EQ(tokenizer->kind(), "bpe");
  EXPECT_EQ(tokenizer->encode("ab"), (Ids{256}));
}

TEST_F(BpeTokenizerTest, MissingFilesAreReported) {
  const std::string missing = (dir_ / "nope.json").string();
  try {
    load_tokenizer(missing);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not found"), std::string::npos) << e.what();
  }
  fs::create_directories(dir_ / "empty");
  EXPECT_THROW(load_tokenizer((dir_ / "empty").string()), Error);
}

TEST_F(BpeTokenizerTest, MalformedFilesAreRejectedWithOneLine) {
  const json good = tokenizer_json(byte_vocab({"ab"}), {"a b"});
  expect_load_error("{ \"model\": ", "invalid JSON");
  expect_load_error("[1, 2]", "not a JSON object");
  expect_load_error("{}", "missing \"model\"");

  auto bad = good;
  bad["model"]["type"] = "WordPiece";
  expect_load_error(bad.dump(), "model type \"WordPiece\" is not supported");
  bad = good;
  bad["model"]["merges"] = {"a zz"};
  expect_load_error(bad.dump(), "model.merges[0]: token \"zz\" is not in the vocabulary");
  bad = good;
  bad["model"]["merges"] = {"a b", "abc"};
  expect_load_error(bad.dump(), "model.merges[1] \"abc\" is not two tokens");
  bad = good;
  bad["model"]["vocab"]["zz"] = "seven";
  expect_load_error(bad.dump(), "model.vocab[\"zz\"] is not a valid token id");
  bad = good;
  bad["model"]["vocab"]["zz"] = 1 << 30;
  expect_load_error(bad.dump(), "model.vocab[\"zz\"] is not a valid token id");
  bad = good;
  bad["added_tokens"] = {added_token(-5, "<s>")};
  expect_load_error(bad.dump(), "added token \"<s>\" has an invalid id");
  bad = good;
  bad["model"]["dropout"] = 0.1;
  expect_load_error(bad.dump(), "model.dropout is not supported");
  bad = good;
  bad["pre_tokenizer"] = llama3_pre_tokenizer();
  bad["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = R"(\w+|\s+)";
  expect_load_error(bad.dump(), R"(unsupported pre-tokenizer regex "\\w+|\\s+")");
  bad = good;
  bad["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_load_error(bad.dump(), "pre_tokenizer \"Whitespace\" is not supported");
  bad = good;
  bad["normalizer"] = {{"type", "NFC"}};
  expect_load_error(bad.dump(), "normalizer \"NFC\" is not supported");
  bad = good;
  bad.erase("decoder");
  expect_load_error(bad.dump(), "decoder \"none\" is not supported");
  bad = good;
  bad["added_tokens"] = {added_token(300, "<mask>")};
  bad["added_tokens"][0]["lstrip"] = true;
  expect_load_error(bad.dump(), "added token \"<mask>\": lstrip=true is not supported");
  bad = good;
  bad["added_tokens"] = {{{"id", 300}, {"content", 7}}};
  expect_load_error(bad.dump(), "unexpected structure");
  // Two tokens with one id: decoding that id would be ambiguous.
  bad = good;
  bad["model"]["vocab"][byte_level("zz")] = 256;  // "ab" has 256
  expect_load_error(bad.dump(), "model.vocab gives id 256 to two tokens");
  bad = good;
  bad["added_tokens"] = {added_token(300, "<s>"), added_token(300, "</s>")};
  expect_load_error(bad.dump(), "added_tokens gives id 300 to two tokens, \"<s>\" and \"</s>\"");
}

TEST_F(BpeTokenizerTest, GarbageFileErrorQuotesNoRawBytes) {
  // A binary file given as the tokenizer: the JSON parser's message quotes what it read last,
  // which must reach the terminal escaped (\xNN), in one line.
  const std::string garbage("\x89PNG\r\n\x1a\n\x00\x01\xff\xfe\x1b[31mred", 20);
  expect_load_error(garbage, "invalid JSON");
  try {
    load_tokenizer(write("bad.json", garbage));
  } catch (const Error& e) {
    const std::string message = e.what();
    for (unsigned char c : message) {
      EXPECT_TRUE(c >= 0x20 && c < 0x7F) << "raw byte " << static_cast<int>(c) << " in: " << message;
    }
    EXPECT_NE(message.find("\\x"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace weft
