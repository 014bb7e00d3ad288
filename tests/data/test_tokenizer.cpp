// The built-in byte tokenizer and load_tokenizer("byte").
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/data/byte_tokenizer.h"
#include "core/data/tokenizer.h"
#include "core/util/error.h"

namespace weft {
namespace {

TEST(ByteTokenizer, IdsAreBytesAndTheTwoSpecials) {
  const ByteTokenizer tokenizer;
  EXPECT_EQ(tokenizer.encode("Hi\n"), (std::vector<int32_t>{72, 105, 10}));
  EXPECT_EQ(tokenizer.encode(std::string("\xFF\x00", 2)), (std::vector<int32_t>{255, 0}));
  EXPECT_EQ(tokenizer.vocab_size(), 258);
  EXPECT_EQ(tokenizer.bos_id(), 256);
  EXPECT_EQ(tokenizer.eos_id(), 257);
  EXPECT_EQ(tokenizer.kind(), "byte");
  EXPECT_EQ(tokenizer.encode(""), std::vector<int32_t>{});
}

TEST(ByteTokenizer, LiteralSpecialTokensEncodeToTheirIds) {
  const ByteTokenizer tokenizer;
  EXPECT_EQ(tokenizer.encode("<|begin_of_text|>a<|end_of_text|><|end_of_text|>"),
            (std::vector<int32_t>{256, 97, 257, 257}));
  // Near misses stay bytes.
  EXPECT_EQ(tokenizer.encode("<|end_of_text").size(), 13u);
  EXPECT_EQ(tokenizer.encode("<<|end_of_text|>"), (std::vector<int32_t>{60, 257}));
  EXPECT_EQ(tokenizer.decode({256, 104, 257}), "<|begin_of_text|>h<|end_of_text|>");
}

TEST(ByteTokenizer, RoundTripsRandomBytesAndInvalidUtf8) {
  const ByteTokenizer tokenizer;
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(rng() % 300, '\0');
    for (char& c : text) c = static_cast<char>(rng());
    const auto ids = tokenizer.encode(text);
    ASSERT_EQ(ids.size(), text.size());
    EXPECT_EQ(tokenizer.decode(ids), text);
  }
  const std::string invalid = "\xC0\xAF\xED\xA0\x80\xF4\x90\x80\x80\xE4\xBD";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(invalid)), invalid);
  const std::string mixed = "x<|begin_of_text|>\xFF<|end_of_text|>";
  EXPECT_EQ(tokenizer.decode(tokenizer.encode(mixed)), mixed);
}

TEST(ByteTokenizer, DecodeRejectsIdsOutsideTheVocab) {
  const ByteTokenizer tokenizer;
  EXPECT_THROW(tokenizer.decode({258}), Error);
  EXPECT_THROW(tokenizer.decode({-1}), Error);
  try {
    tokenizer.decode({65, 1000});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1000"), std::string::npos) << e.what();
  }
}

TEST(LoadTokenizer, ByteSpecGivesTheByteTokenizer) {
  const auto tokenizer = load_tokenizer("byte");
  EXPECT_EQ(tokenizer->kind(), "byte");
  EXPECT_EQ(tokenizer->fingerprint(), "byte-v1");
  EXPECT_EQ(tokenizer->encode("ab"), (std::vector<int32_t>{97, 98}));
}

}  // namespace
}  // namespace weft
