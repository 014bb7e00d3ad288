// The built-in byte-level tokenizer (see tokenizer.h for the interface).
#pragma once

#include "core/data/tokenizer.h"

namespace weft {

// Ids 0..255 are the bytes themselves; 256 is <|begin_of_text|> and 257 <|end_of_text|>. Those
// two strings written literally in the text encode to their ids; everything else, including
// invalid UTF-8, encodes byte by byte, so decode(encode(text)) == text for any bytes.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBeginOfText = 256;
  static constexpr int32_t kEndOfText = 257;
  static constexpr int64_t kVocabSize = 258;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return kVocabSize; }
  std::optional<int32_t> bos_id() const override { return kBeginOfText; }
  std::optional<int32_t> eos_id() const override { return kEndOfText; }
  // weft's own framing for models that ship no tokenizer: every document between the two.
  bool adds_bos() const override { return true; }
  bool adds_eos() const override { return true; }
  std::string fingerprint() const override { return "byte-v1"; }
  std::string kind() const override { return "byte"; }
};

}  // namespace weft
