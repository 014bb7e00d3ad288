#include "core/data/pretokenizer.h"

#include <cstdint>
#include <string>

#include "core/data/unicode.h"

namespace weft {

const std::string_view kLlama3SplitRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string_view kGpt2SplitRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::optional<SplitPattern> split_pattern_for_regex(std::string_view regex) {
  if (regex == kLlama3SplitRegex) return SplitPattern::kLlama3;
  if (regex == kGpt2SplitRegex) return SplitPattern::kGpt2;
  return std::nullopt;
}

namespace {

enum CharClass : uint8_t { kLetter = 1, kNumber = 2, kSpace = 4, kNewline = 8 /* \r or \n */ };

struct Char {
  uint32_t code_point;
  uint32_t byte_offset;
  uint8_t classes;
};

uint8_t classify(uint32_t cp) {
  uint8_t classes = 0;
  if (unicode::is_letter(cp)) classes |= kLetter;
  if (unicode::is_number(cp)) classes |= kNumber;
  if (unicode::is_white_space(cp)) classes |= kSpace;
  if (cp == '\r' || cp == '\n') classes |= kNewline;
  return classes;
}

// Matches the alternatives at one position. Every alternative consumes at least one character,
// so a match is reported as its end index and "no match" as the start index itself.
class Matcher {
 public:
  explicit Matcher(const std::vector<Char>& chars) : c_(chars), n_(chars.size()) {}

  size_t match_llama3(size_t i) const {
    if (size_t end = contraction(i, /*ignore_case=*/true); end > i) return end;
    if (size_t end = optional_prefix_then_letters(i); end > i) return end;
    if (size_t end = numbers_up_to_3(i); end > i) return end;
    if (size_t end = space_then_run(i, &Matcher::is_other); end > i) return run(end, kNewline);
    if (size_t end = spaces_through_last_newline(i); end > i) return end;
    return spaces(i);
  }

  size_t match_gpt2(size_t i) const {
    if (size_t end = contraction(i, /*ignore_case=*/false); end > i) return end;
    if (size_t end = space_then_run(i, &Matcher::is_letter); end > i) return end;
    if (size_t end = space_then_run(i, &Matcher::is_number); end > i) return end;
    if (size_t end = space_then_run(i, &Matcher::is_other); end > i) return end;
    return spaces(i);
  }

 private:
  bool has(size_t i, uint8_t classes) const { return i < n_ && (c_[i].classes & classes); }
  bool is_letter(size_t i) const { return has(i, kLetter); }
  bool is_number(size_t i) const { return has(i, kNumber); }
  // [^\s\p{L}\p{N}]
  bool is_other(size_t i) const { return i < n_ && !(c_[i].classes & (kLetter | kNumber | kSpace)); }
  bool is_char(size_t i, uint32_t cp) const { return i < n_ && c_[i].code_point == cp; }

  size_t run(size_t i, uint8_t classes) const {
    while (has(i, classes)) ++i;
    return i;
  }

  bool is_letter_folded(size_t i, char lower, bool ignore_case) const {
    if (is_char(i, static_cast<uint32_t>(lower))) return true;
    if (!ignore_case) return false;
    if (is_char(i, static_cast<uint32_t>(lower - 'a' + 'A'))) return true;
    return lower == 's' && is_char(i, 0x17F);  // LATIN SMALL LETTER LONG S case-folds to 's'
  }

  // '(?:s|t|re|ve|m|ll|d), optionally case-insensitive.
  size_t contraction(size_t i, bool ignore_case) const {
    if (!is_char(i, '\'')) return i;
    for (const char* suffix : {"s", "t", "re", "ve", "m", "ll", "d"}) {
      size_t k = i + 1;
      for (const char* p = suffix; *p && is_letter_folded(k, *p, ignore_case); ++p) ++k;
      if (k - (i + 1) == std::char_traits<char>::length(suffix)) return k;
    }
    return i;
  }

  // [^\r\n\p{L}\p{N}]?\p{L}+
  size_t optional_prefix_then_letters(size_t i) const {
    if (i < n_ && !(c_[i].classes & (kLetter | kNumber | kNewline))) {
      const size_t end = run(i + 1, kLetter);
      return end > i + 1 ? end : i;
    }
    return run(i, kLetter);
  }

  // \p{N}{1,3}
  size_t numbers_up_to_3(size_t i) const {
    size_t end = i;
    while (end - i < 3 && is_number(end)) ++end;
    return end;
  }

  // " ?X+" for a class predicate X that never holds for ' '.
  size_t space_then_run(size_t i, bool (Matcher::*in_class)(size_t) const) const {
    size_t k = (is_char(i, ' ') && (this->*in_class)(i + 1)) ? i + 1 : i;
    while ((this->*in_class)(k)) ++k;
    return k;
  }

  // \s*[\r\n]+ : the white-space run starting at i, cut after its last newline.
  size_t spaces_through_last_newline(size_t i) const {
    const size_t end = run(i, kSpace);
    for (size_t k = end; k > i; --k)
      if (has(k - 1, kNewline)) return k;
    return i;
  }

  // \s+(?!\S)|\s+ : a white-space run, leaving its last character to the next token when a
  // non-space follows (unless the run is a single character).
  size_t spaces(size_t i) const {
    const size_t end = run(i, kSpace);
    if (end == n_ || end - i < 2) return end;
    return end - 1;
  }

  const std::vector<Char>& c_;
  size_t n_;
};

}  // namespace

std::vector<std::string_view> split_pretokens(std::string_view text, SplitPattern pattern) {
  std::vector<Char> chars;
  chars.reserve(text.size());
  for (const auto& decoded : unicode::decode_utf8_lenient(text))
    chars.push_back({decoded.code_point, decoded.byte_offset, classify(decoded.code_point)});
  const auto byte_offset = [&](size_t i) { return i < chars.size() ? chars[i].byte_offset : text.size(); };

  std::vector<std::string_view> pieces;
  const Matcher matcher(chars);
  size_t gap_start = 0;  // start of characters no alternative matched (kept as one piece)
  for (size_t i = 0; i < chars.size();) {
    const size_t end = pattern == SplitPattern::kLlama3 ? matcher.match_llama3(i) : matcher.match_gpt2(i);
    if (end == i) {
      ++i;
      continue;
    }
    if (gap_start < i) pieces.push_back(text.substr(byte_offset(gap_start), byte_offset(i) - byte_offset(gap_start)));
    pieces.push_back(text.substr(byte_offset(i), byte_offset(end) - byte_offset(i)));
    i = gap_start = end;
  }
  if (gap_start < chars.size()) pieces.push_back(text.substr(byte_offset(gap_start)));
  return pieces;
}

}  // namespace weft
