// LoRA fine-tuning: adapters on selected linear layers, PEFT-compatible files, merging.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/model/adalora.h"
#include "core/model/llama.h"

namespace weft {

struct LoraConfig {
  LoraSpec spec;
  std::vector<std::string> target_modules{"q_proj", "k_proj", "v_proj", "o_proj"};
  // AdaLoRA (train.mode = "adalora"): set, the adapters are AdaLoRA's SVD-form ones (adalora.h)
  // with these settings (its spec and target_modules equal the ones above), and every function
  // below works on them; unset, plain LoRA.
  std::optional<AdaLoraConfig> adalora;
};

// Linear layers LoRA can target.
std::vector<std::string> lora_targetable_modules();

// Adds adapters to every weft::Linear whose leaf name is in target_modules and freezes every
// other parameter (only adapters train). A's initialisation is seeded by (seed, layer name).
// Returns the number of adapted layers; an unknown target name is an error listing valid ones.
int64_t apply_lora(LlamaForCausalLMImpl& model, const LoraConfig& config, uint64_t seed);

// Writes PEFT's adapter_model.safetensors (names "base_model.model.<layer>.lora_A.weight") and
// adapter_config.json into `dir` (AdaLoRA's files for an AdaLoRA config: save_adalora_adapter with
// the layers' rank pattern).
void save_lora_adapter(LlamaForCausalLMImpl& model, const LoraConfig& config, const std::string& dir,
                       const std::string& base_model = "");

// Loads adapter weights saved by save_lora_adapter (or PEFT) into a model with matching adapters
// (AdaLoRA's, load_adalora_adapter, where the model has AdaLoRA adapters).
void load_lora_adapter(LlamaForCausalLMImpl& model, const std::string& dir);

// The adapters' shape from dir/adapter_config.json (PEFT's: r, lora_alpha, lora_dropout,
// target_modules). Throws weft::Error naming the file when it is missing or malformed, or is not
// a LoRA adapter.
LoraConfig read_lora_adapter_config(const std::string& dir);

// Sequence classification (a model with a `score` head, trained whole beside the adapters): the head
// is saved with them as PEFT saves modules_to_save ("base_model.model.score.weight", task_type
// "SEQ_CLS", modules_to_save ["score"]) and loaded back from `dir`'s adapter_model.safetensors
// (an adapter without it leaves the head as it is). Nothing for a causal LM.
void add_classification_head(LlamaForCausalLMImpl& model, std::vector<std::pair<std::string, torch::Tensor>>& tensors);
void load_classification_head(LlamaForCausalLMImpl& model, const std::string& dir);

// Folds every adapter into its base weight (W += alpha/r B A) and removes the adapters; the
// model then computes the same function with plain weights. Quantized layers (model.quantize)
// become their dequantized weights, adapted or not.
void merge_lora(LlamaForCausalLMImpl& model);

// Parameters with requires_grad, in the model's (deterministic) order, with their names.
std::vector<std::pair<std::string, torch::Tensor>> trainable_parameters(LlamaForCausalLMImpl& model);

}  // namespace weft
