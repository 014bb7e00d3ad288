// A model as a GGUF file of the llama architecture, as llama.cpp's converter (convert_hf_to_gguf.py)
// writes one: llama.* metadata from the model's shape, tensors under llama.cpp's names with the q
// and k rows permuted for its RoPE, Llama 3's RoPE scaling as rope_freqs.weight, norms in F32 and
// the matrices in the chosen type (F32, F16, BF16 or Q8_0; a Q8_0 matrix whose rows are not whole
// blocks of 32 falls back to F16, as the converter does), and the tokenizer's metadata.
#pragma once

#include <cstdint>
#include <string>

#include "core/model/llama.h"

namespace weft {

class Tokenizer;

// "f32", "f16", "bf16", "q8_0" (any case) as a ggml type; anything else is an error naming them.
uint32_t gguf_export_type(const std::string& name);

// Writes `model` (its base weights: merge LoRA adapters first; no quantized layers, no
// classification head) to `path`. The tokenizer's metadata (tokenizer.ggml.*, and the chat
// template) comes from `tokenizer_path`: copied from a GGUF file, or built from an HF
// tokenizer.json (byte-level BPE: GPT-2's, SmolLM2's or Llama 3's pre-tokenizer) and the
// tokenizer_config.json beside it. `tokenizer` gives BOS, EOS and whether encoding adds them.
// Throws weft::Error before writing anything for a model or tokenizer it cannot write.
void export_gguf(LlamaForCausalLMImpl& model, const Tokenizer& tokenizer, const std::string& tokenizer_path,
                 const std::string& path, uint32_t type, const std::string& name);

}  // namespace weft
