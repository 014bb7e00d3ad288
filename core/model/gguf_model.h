// A GGUF file of the llama architecture (llama.cpp's, Ollama's) as weft's model: its shape from
// the metadata, its tensors under Hugging Face's names, dequantized to fp32, with the q and k
// projections' rows in transformers' order again (llama.cpp's converter permutes them for its
// RoPE), as transformers' GGUF loader reads the same file.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include "core/io/gguf.h"
#include "core/model/config.h"

namespace weft {

class GgufFile;  // core/io/gguf.h

// The model's shape from the metadata: general.architecture "llama" and its llama.* keys (block
// count, embedding and feed-forward lengths, head counts, context length, RMS epsilon, RoPE base),
// the vocabulary from the token embedding, tied embeddings when there is no output.weight, BOS and
// EOS from tokenizer.ggml.*. Llama 3's RoPE scaling, stored as rope_freqs.weight, is read back as
// the rope_scaling that produces it. Anything else (another architecture, a RoPE scaling type
// weft does not run) is one error naming the key.
ModelConfig gguf_model_config(const GgufFile& file);
// The same for the file at `path` (opened and validated: core/io/gguf.h).
ModelConfig load_gguf_model_config(const std::string& path);

// llama.cpp's name for the tensor transformers names `hf_name` (model.layers.3.self_attn.q_proj.weight
// -> blk.3.attn_q.weight), "" for a tensor GGUF's llama architecture does not hold.
std::string gguf_tensor_name(const std::string& hf_name);

// The file's tensors under HF names (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight,
// ...). A tensor that is not part of the model weft builds is an error naming it.
class GgufWeights {
 public:
  GgufWeights(std::shared_ptr<const GgufFile> file, const ModelConfig& config);
  const std::string& path() const;
  bool contains(const std::string& hf_name) const { return names_.count(hf_name) != 0; }
  std::vector<int64_t> shape(const std::string& hf_name) const;
  // Dequantized to fp32 (then converted to `dtype`), q/k rows un-permuted.
  at::Tensor load(const std::string& hf_name, at::ScalarType dtype = at::kFloat) const;
  std::vector<std::string> names() const;

 private:
  std::shared_ptr<const GgufFile> file_;
  ModelConfig config_;
  std::unordered_map<std::string, std::string> names_;  // HF name -> GGUF name
};

}  // namespace weft
