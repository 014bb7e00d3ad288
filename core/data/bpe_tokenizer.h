// Byte-level BPE from a Hugging Face tokenizer.json (see tokenizer.h for the interface).
//
// Supported (what Llama 3 and GPT-2 style tokenizers use), anything else is rejected with a
// weft::Error naming the file:
//  - model: type "BPE" with vocab {token: id}, merges as "a b" strings or ["a", "b"] pairs
//    (rank = position in the list; a later duplicate overrides an earlier one, as in HF),
//    ignore_merges (a pre-token found whole in the vocab is emitted as is), unk_token (used for
//    bytes whose character is not in the vocab; without it such a byte is an error). dropout,
//    continuing_subword_prefix, end_of_word_suffix and byte_fallback must be unset.
//  - normalizer: none.
//  - pre_tokenizer: ByteLevel (use_regex true = the GPT-2 split, add_prefix_space false), or a
//    Sequence of Split{pattern: {Regex: P}, behavior: Isolated, invert: false} steps ending in
//    ByteLevel; P must be the Llama 3 or GPT-2 pattern (see pretokenizer.h).
//  - decoder: ByteLevel.
//  - added_tokens: matched in the raw text before pre-tokenization, leftmost then longest first,
//    special or not; lstrip, rstrip and single_word must be false.
//
// bos_id/eos_id: when the post_processor is (or contains, in a Sequence) a TemplateProcessing
// whose "single" template starts (ends) with a SpecialToken, that token is BOS (EOS). Otherwise
// BOS is the token "<|begin_of_text|>" and EOS "<|end_of_text|>" (Llama 3), falling back to
// "<|endoftext|>" for both (GPT-2); nullopt when none exists. adds_bos/adds_eos: whether that
// template has them (no post_processor: neither).
//
// encode() caches the ids of each pre-token (a bounded per-word cache behind a mutex), so a
// BpeTokenizer may be shared between threads.
#pragma once

#include <memory>
#include <string>

#include "core/data/tokenizer.h"

namespace weft {

class BpeTokenizer final : public Tokenizer {
 public:
  // Builds the tokenizer from the contents of a tokenizer.json; `source` (the file name) is
  // named in error messages. Throws weft::Error on malformed or unsupported contents.
  BpeTokenizer(std::string_view json_text, const std::string& source);
  // The same, with BOS and EOS, and whether encoding adds them, given (a GGUF file's metadata, a
  // tokenizer_config.json) where set rather than found as described above.
  struct SpecialIds {
    std::optional<int32_t> bos, eos;
    std::optional<bool> adds_bos, adds_eos;
  };
  BpeTokenizer(std::string_view json_text, const std::string& source, const SpecialIds& special);
  ~BpeTokenizer() override;

  // Reads and parses a tokenizer.json file, and the tokenizer_config.json beside it where there is
  // one (transformers' file: its bos_token and eos_token name BOS and EOS, its add_bos_token and
  // add_eos_token say whether encoding adds them). Throws weft::Error if either cannot be read or
  // names a token the vocabulary does not have.
  static std::unique_ptr<BpeTokenizer> from_file(const std::string& path);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  std::optional<int32_t> bos_id() const override;
  std::optional<int32_t> eos_id() const override;
  // The post_processor's template starts (ends) with a special token.
  bool adds_bos() const override;
  bool adds_eos() const override;
  // 16 hex digits: weft::hash64 of the tokenizer.json contents.
  std::string fingerprint() const override;
  std::string kind() const override { return "bpe"; }

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weft
