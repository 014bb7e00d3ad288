// Model weights: seeded initialisation, loading from HF safetensors or GGUF, saving to HF safetensors.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "core/model/llama.h"

namespace weft {

// Initialises every parameter deterministically from (seed, parameter name), so a parameter gets
// the same values whichever stages a process holds: linear and embedding weights ~ N(0, std),
// norm weights = 1. LoRA adapters are left as they are. Quantized layers (model.quantize) get the
// same values, quantized one tensor at a time.
void init_weights(LlamaForCausalLMImpl& model, uint64_t seed, double std);

// Loads HF-named tensors from a safetensors file, directory or index, or from a GGUF file of the
// llama architecture (core/model/gguf_model.h: dequantized, under HF names), into the parameters
// this model holds (converted to fp32). Missing tensors and shape mismatches are errors naming the
// tensor; a checkpoint's lm_head.weight is ignored when embeddings are tied. Quantized layers are
// quantized tensor by tensor as they leave the file: the full-precision model is never held.
// A classification head (score.weight) the file lacks (a causal LM's checkpoint, whose lm_head is
// then unused) is initialised as init_weights(model, seed, init_std) would, as transformers does
// for LlamaForSequenceClassification from a causal LM.
void load_weights(LlamaForCausalLMImpl& model, const std::string& path, uint64_t seed = 0, double init_std = 0.02);

// The base model's tensors under HF names (LoRA adapters excluded), in `dtype`. A model with
// quantized layers is refused (merge_lora dequantizes them).
std::vector<std::pair<std::string, torch::Tensor>> hf_state(LlamaForCausalLMImpl& model,
                                                            torch::Dtype dtype = torch::kFloat32);

// Writes `dir`/config.json and the weights as HF safetensors (sharded above `max_shard_bytes`),
// so the directory loads back here and in other tools that read HF checkpoints.
void save_pretrained(LlamaForCausalLMImpl& model, const std::string& dir,
                     torch::Dtype dtype = torch::kFloat32, uint64_t max_shard_bytes = 2ull << 30);

// The last path component of an HF name, e.g. "q_proj" for "model.layers.0.self_attn.q_proj".
std::string module_leaf_name(const std::string& module_path);

}  // namespace weft
