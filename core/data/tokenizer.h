// Tokenizers: text <-> token ids.
//
// Two implementations stand behind one interface:
//  - ByteTokenizer: the built-in byte-level tokenizer for models that ship none: ids 0..255 are the
//    raw bytes, followed by the special tokens <|begin_of_text|> (256) and <|end_of_text|> (257).
//  - BpeTokenizer: HF `tokenizer.json` byte-level BPE as used by Llama 3 (and GPT-2 style models):
//    the pre-tokenizer split regex, byte-to-unicode mapping, ranked merges, `ignore_merges`,
//    added/special tokens matched before pre-tokenization, and the byte-level decoder.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weft {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Encodes text to ids. Special tokens written literally in the text (e.g. "<|end_of_text|>")
  // are recognised as their ids. No BOS/EOS is added: the dataset decides where those go.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;

  // Decodes ids back to text (special tokens are written as their content). Invalid ids throw
  // weft::Error.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;

  // Number of ids, including special tokens (the model's vocab_size must be at least this).
  virtual int64_t vocab_size() const = 0;

  // Ids of the begin/end-of-text tokens, when the tokenizer has them.
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;

  // Whether the checkpoint's own encoding of a text adds them (transformers' tokenizer(text)): the
  // defaults of data.add_bos and data.add_eos. Llama 3 adds BOS; SmolLM2 and GPT-2 add nothing.
  virtual bool adds_bos() const = 0;
  virtual bool adds_eos() const = 0;

  // A stable fingerprint of everything that changes the encoding (used as part of the token
  // cache key): for BPE, a hash of the tokenizer.json contents; for bytes, a constant.
  virtual std::string fingerprint() const = 0;

  // Human-readable kind: "byte" or "bpe".
  virtual std::string kind() const = 0;
};

// Creates a tokenizer from a spec: "byte" for the built-in byte-level tokenizer, a path to an
// HF tokenizer.json (or to a directory containing one), or a GGUF file (the tokenizer in its
// metadata: core/data/gguf_tokenizer.h). Throws weft::Error naming the file and
// the problem on unreadable or malformed input.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

}  // namespace weft
