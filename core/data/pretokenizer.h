// The pre-tokenizer split patterns of byte-level BPE tokenizers.
//
// HF tokenizer.json files describe the split as a regex with Unicode classes that std::regex
// cannot express, so the two patterns in use are implemented by hand, with the regex's exact
// semantics (alternatives tried left to right, greedy quantifiers with backtracking, and the
// (?!\S) lookahead), over leniently decoded UTF-8 (see unicode.h: an invalid byte is a character
// that is neither letter, number nor white space):
//   Llama 3:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//              ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   GPT-2:    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace weft {

enum class SplitPattern { kLlama3, kGpt2 };

// The regex source strings, exactly as they appear (JSON-unescaped) in tokenizer.json.
extern const std::string_view kLlama3SplitRegex;
extern const std::string_view kGpt2SplitRegex;

// The pattern whose regex source is exactly `regex`, or nullopt for any other regex.
std::optional<SplitPattern> split_pattern_for_regex(std::string_view regex);

// Splits `text` at the pattern's matches, keeping every match and every stretch between matches
// as its own piece (HF's "Isolated" behaviour). The pieces are views into `text`, non-empty, in
// order, and together cover `text` exactly, so no byte is ever lost.
std::vector<std::string_view> split_pretokens(std::string_view text, SplitPattern pattern);

}  // namespace weft
