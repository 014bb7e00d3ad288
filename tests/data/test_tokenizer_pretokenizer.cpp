// Unicode helpers and the hand-written pre-tokenizer split patterns (Llama 3 and GPT-2), on
// hand-worked examples that follow the regexes' semantics.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/data/pretokenizer.h"
#include "core/data/unicode.h"

namespace weft {
namespace {

using Pieces = std::vector<std::string>;

Pieces llama3(std::string_view text) {
  Pieces pieces;
  for (auto piece : split_pretokens(text, SplitPattern::kLlama3)) pieces.emplace_back(piece);
  return pieces;
}

Pieces gpt2(std::string_view text) {
  Pieces pieces;
  for (auto piece : split_pretokens(text, SplitPattern::kGpt2)) pieces.emplace_back(piece);
  return pieces;
}

TEST(Unicode, DecodesValidUtf8WithByteSpans) {
  const auto chars = unicode::decode_utf8_lenient("a\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80");  // a é 你 😀
  ASSERT_EQ(chars.size(), 4u);
  EXPECT_EQ(chars[0].code_point, 0x61u);
  EXPECT_EQ(chars[1].code_point, 0xE9u);
  EXPECT_EQ(chars[2].code_point, 0x4F60u);
  EXPECT_EQ(chars[3].code_point, 0x1F600u);
  EXPECT_EQ(chars[3].byte_offset, 6u);
  EXPECT_EQ(chars[3].byte_length, 4u);
}

TEST(Unicode, InvalidBytesBecomeCharactersOfTheirOwn) {
  // Lone continuation byte, overlong "/", a surrogate, a truncated 3-byte sequence at the end.
  const std::string text = "\x80" "\xC0\xAF" "\xED\xA0\x80" "x" "\xE4\xBD";
  const auto chars = unicode::decode_utf8_lenient(text);
  ASSERT_EQ(chars.size(), 9u);
  EXPECT_EQ(chars[0].code_point, unicode::kInvalidBase + 0x80);
  EXPECT_EQ(chars[1].code_point, unicode::kInvalidBase + 0xC0);
  EXPECT_EQ(chars[3].code_point, unicode::kInvalidBase + 0xED);
  EXPECT_EQ(chars[6].code_point, static_cast<uint32_t>('x'));
  EXPECT_EQ(chars[8].byte_offset, 8u);
  EXPECT_FALSE(unicode::is_letter(chars[0].code_point));
  EXPECT_FALSE(unicode::is_number(chars[0].code_point));
  EXPECT_FALSE(unicode::is_white_space(chars[0].code_point));
}

TEST(Unicode, AppendUtf8InvertsDecoding) {
  std::string text;
  for (uint32_t cp : {0x24u, 0xA2u, 0x20ACu, 0x10348u}) unicode::append_utf8(text, cp);
  EXPECT_EQ(text, "$\xC2\xA2\xE2\x82\xAC\xF0\x90\x8D\x88");
}

TEST(Unicode, CharacterClasses) {
  EXPECT_TRUE(unicode::is_letter('q'));
  EXPECT_TRUE(unicode::is_letter(0xE9));     // é
  EXPECT_TRUE(unicode::is_letter(0x4F60));   // 你 (Lo)
  EXPECT_TRUE(unicode::is_letter(0x02B0));   // ʰ (Lm)
  EXPECT_FALSE(unicode::is_letter('7'));
  EXPECT_FALSE(unicode::is_letter(0x0301));  // combining acute accent (Mn)
  EXPECT_TRUE(unicode::is_number(0x0663));   // Arabic-Indic three (Nd)
  EXPECT_TRUE(unicode::is_number(0x2163));   // Roman numeral four (Nl)
  EXPECT_TRUE(unicode::is_number(0x00BD));   // ½ (No)
  EXPECT_FALSE(unicode::is_number('x'));
  EXPECT_TRUE(unicode::is_white_space(0x3000));  // ideographic space
  EXPECT_TRUE(unicode::is_white_space(0x00A0));  // no-break space
  EXPECT_TRUE(unicode::is_white_space(0x0085));  // next line
  EXPECT_FALSE(unicode::is_white_space(0x200B));  // zero width space is not White_Space
  EXPECT_FALSE(unicode::is_white_space(0x1C));    // nor are the ASCII separators
}

TEST(Unicode, Gpt2ByteMapIsABijectionKeepingPrintableBytes) {
  EXPECT_EQ(unicode::byte_char('A'), static_cast<uint32_t>('A'));
  EXPECT_EQ(unicode::byte_char(' '), 0x120u);   // Ġ
  EXPECT_EQ(unicode::byte_char('\n'), 0x10Au);  // Ċ
  EXPECT_EQ(unicode::byte_char(0x00), 0x100u);
  EXPECT_EQ(unicode::byte_char(0xAD), 0x143u);  // the last unprintable byte
  for (int b = 0; b < 256; ++b) EXPECT_EQ(unicode::char_byte(unicode::byte_char(b)), b);
  EXPECT_EQ(unicode::char_byte(' '), -1);
  EXPECT_EQ(unicode::char_byte(0x144), -1);
}

TEST(SplitPatternRegex, RecognisesOnlyTheTwoKnownPatterns) {
  EXPECT_EQ(split_pattern_for_regex(kLlama3SplitRegex), SplitPattern::kLlama3);
  EXPECT_EQ(split_pattern_for_regex(kGpt2SplitRegex), SplitPattern::kGpt2);
  EXPECT_FALSE(split_pattern_for_regex(R"(\s+)").has_value());
  EXPECT_FALSE(split_pattern_for_regex(std::string(kGpt2SplitRegex) + " ").has_value());
}

TEST(Llama3Split, ContractionsAreCaseInsensitive) {
  EXPECT_EQ(llama3("I'm here"), (Pieces{"I", "'m", " here"}));
  EXPECT_EQ(llama3("HE'S"), (Pieces{"HE", "'S"}));
  EXPECT_EQ(llama3("we'll don'T"), (Pieces{"we", "'ll", " don", "'T"}));
  EXPECT_EQ(llama3("'sup"), (Pieces{"'s", "up"}));
}

TEST(Llama3Split, NumbersInGroupsOfThree) {
  EXPECT_EQ(llama3("12345"), (Pieces{"123", "45"}));
  EXPECT_EQ(llama3("abc1234567def"), (Pieces{"abc", "123", "456", "7", "def"}));
  EXPECT_EQ(llama3("x \xD9\xA3\xD9\xA3"), (Pieces{"x", " ", "\xD9\xA3\xD9\xA3"}));  // Arabic-Indic digits
}

TEST(Llama3Split, OneNonLetterPrefixJoinsTheLetters) {
  EXPECT_EQ(llama3("$hello x\"quoted\""), (Pieces{"$hello", " x", "\"quoted", "\""}));
  // After a space, punctuation is matched by " ?[^\s\p{L}\p{N}]+" instead.
  EXPECT_EQ(llama3("say \"quoted\""), (Pieces{"say", " \"", "quoted", "\""}));
  EXPECT_EQ(llama3(" \thello"), (Pieces{" ", "\thello"}));  // tab is not \r\n, so it may prefix
  EXPECT_EQ(llama3("\nhello"), (Pieces{"\n", "hello"}));     // newline may not
}

TEST(Llama3Split, PunctuationRunsTakeTrailingNewlines) {
  EXPECT_EQ(llama3("hello... world!!\n\nnext"), (Pieces{"hello", "...", " world", "!!\n\n", "next"}));
  EXPECT_EQ(llama3("end.\r\n"), (Pieces{"end", ".\r\n"}));
}

TEST(Llama3Split, WhitespaceLookaheadLeavesOneSpaceForTheNextWord) {
  EXPECT_EQ(llama3("a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(llama3("a    b"), (Pieces{"a", "   ", " b"}));
  EXPECT_EQ(llama3("hi  "), (Pieces{"hi", "  "}));
  EXPECT_EQ(llama3(" 1"), (Pieces{" ", "1"}));
}

TEST(Llama3Split, WhitespaceRunsEndAfterTheirLastNewline) {
  EXPECT_EQ(llama3("x \n\n  y"), (Pieces{"x", " \n\n", " ", " y"}));
  EXPECT_EQ(llama3("x\n \n\t"), (Pieces{"x", "\n \n", "\t"}));
}

TEST(Llama3Split, NonAsciiLettersAndCjk) {
  EXPECT_EQ(llama3("h\xC3\xA9llo w\xC3\xB6rld"), (Pieces{"h\xC3\xA9llo", " w\xC3\xB6rld"}));
  EXPECT_EQ(llama3("\xE6\x88\x91\xE4\xBB\xAC" "ABC 123"), (Pieces{"\xE6\x88\x91\xE4\xBB\xAC" "ABC", " ", "123"}));
  // A no-break space is white space, but not \r\n: it prefixes the word.
  EXPECT_EQ(llama3("a\xC2\xA0" "b"), (Pieces{"a", "\xC2\xA0" "b"}));
}

TEST(Llama3Split, InvalidBytesArePunctuationAndKeptExactly) {
  EXPECT_EQ(llama3("ab\xFF\xFE" "cd"), (Pieces{"ab", "\xFF\xFE", "cd"}));
  EXPECT_EQ(llama3("\xFFword"), (Pieces{"\xFFword"}));
}

TEST(Gpt2Split, ContractionsAreCaseSensitive) {
  EXPECT_EQ(gpt2("you're"), (Pieces{"you", "'re"}));
  EXPECT_EQ(gpt2("HE'S"), (Pieces{"HE", "'", "S"}));
}

TEST(Gpt2Split, NumbersAndLettersTakeOnlyASpacePrefix) {
  EXPECT_EQ(gpt2("12345 678"), (Pieces{"12345", " 678"}));
  EXPECT_EQ(gpt2("$hello"), (Pieces{"$", "hello"}));
  EXPECT_EQ(gpt2("\xE6\x88\x91\xE4\xBB\xAC" "ABC 123"), (Pieces{"\xE6\x88\x91\xE4\xBB\xAC" "ABC", " 123"}));
  EXPECT_EQ(gpt2("a\xC2\xA0" "b"), (Pieces{"a", "\xC2\xA0", "b"}));
}

TEST(Gpt2Split, PunctuationAndNewlinesAreSeparate) {
  EXPECT_EQ(gpt2("hello... world!!\n\nnext"), (Pieces{"hello", "...", " world", "!!", "\n", "\n", "next"}));
}

TEST(Gpt2Split, WhitespaceLookahead) {
  EXPECT_EQ(gpt2("a  b"), (Pieces{"a", " ", " b"}));
  EXPECT_EQ(gpt2("x \n\n  y"), (Pieces{"x", " \n\n ", " y"}));
  EXPECT_EQ(gpt2("h\xC3\xA9llo w\xC3\xB6rld  "), (Pieces{"h\xC3\xA9llo", " w\xC3\xB6rld", "  "}));
}

TEST(SplitPretokens, PiecesCoverArbitraryBytesExactly) {
  std::string text;
  uint32_t state = 12345;
  for (int i = 0; i < 4000; ++i) {
    state = state * 1664525u + 1013904223u;
    text += static_cast<char>(state >> 24);
  }
  for (SplitPattern pattern : {SplitPattern::kLlama3, SplitPattern::kGpt2}) {
    std::string joined;
    for (auto piece : split_pretokens(text, pattern)) {
      EXPECT_FALSE(piece.empty());
      joined += piece;
    }
    EXPECT_EQ(joined, text);
  }
  EXPECT_TRUE(split_pretokens("", SplitPattern::kLlama3).empty());
}

}  // namespace
}  // namespace weft
