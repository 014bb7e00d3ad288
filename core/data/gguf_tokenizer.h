// The tokenizer a GGUF file carries in its metadata (tokenizer.ggml.*), as a byte-level BPE
// tokenizer (core/data/bpe_tokenizer.h): the tokens (their ids are their positions), the ranked
// merges, control tokens (token type 3) as special added tokens and user-defined ones (4) as added
// tokens, and the pre-tokenizer `tokenizer.ggml.pre` names: "smollm", "gpt-2" and "default" split
// as GPT-2 does, "llama-bpe" as Llama 3 does (with its ignore_merges). BOS and EOS are the
// metadata's ids, added when tokenizer.ggml.add_bos_token (add_eos_token) says so. This is the tokenizer.json transformers' GGUF loader builds from the same file.
// A SentencePiece model (tokenizer.ggml.model "llama") or another pre-tokenizer is an error
// naming it.
#pragma once

#include <memory>
#include <string>

#include "core/data/tokenizer.h"

namespace weft {

class GgufFile;  // core/io/gguf.h

std::unique_ptr<Tokenizer> gguf_tokenizer(const GgufFile& file);
// The same for the file at `path`.
std::unique_ptr<Tokenizer> load_gguf_tokenizer(const std::string& path);

}  // namespace weft
