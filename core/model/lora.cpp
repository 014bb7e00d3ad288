#include "core/model/lora.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/hash.h"

namespace weft {
namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

bool is_lora_name(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

}  // namespace

std::vector<std::string> lora_targetable_modules() {
  return {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"};
}

int64_t apply_lora(LlamaForCausalLMImpl& model, const LoraConfig& config, uint64_t seed) {
  const auto valid = lora_targetable_modules();
  for (const auto& target : config.target_modules) {
    WEFT_CHECK(std::find(valid.begin(), valid.end(), target) != valid.end(),
               "lora.target_modules: unknown module '{}' (valid: {})", target, fmt::join(valid, ", "));
  }
  if (config.adalora) {
    WEFT_CHECK(config.adalora->target_r >= 0 && config.adalora->target_r <= config.spec.r,
               "adalora: target_r ({}) must be between 0 and init_r ({})", config.adalora->target_r, config.spec.r);
  }
  for (auto& param : model.parameters()) param.set_requires_grad(false);
  // A classification head is new: it trains whole beside the adapters (PEFT's modules_to_save for
  // task_type SEQ_CLS).
  if (!model.score.is_empty()) model.score->weight.set_requires_grad(true);
  int64_t adapted = 0;
  for (auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = item.value()->as<LinearImpl>();
    if (!linear) continue;
    const auto leaf = module_leaf_name(item.key());
    if (std::find(config.target_modules.begin(), config.target_modules.end(), leaf) ==
        config.target_modules.end()) {
      continue;
    }
    if (config.adalora) {
      linear->add_adalora(config.spec, hash64(item.key(), seed));
    } else {
      linear->add_lora(config.spec, hash64(item.key(), seed));
    }
    ++adapted;
  }
  WEFT_CHECK(adapted > 0,
             "lora.target_modules [{}] matched no layer of this model", fmt::join(config.target_modules, ", "));
  return adapted;
}

void save_lora_adapter(LlamaForCausalLMImpl& model, const LoraConfig& config, const std::string& dir,
                       const std::string& base_model) {
  if (config.adalora) return save_adalora_adapter(model, *config.adalora, rank_pattern_of(model), dir, base_model);
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (auto& item : model.named_parameters()) {
    if (!is_lora_name(item.key())) continue;
    tensors.emplace_back(kPeftPrefix + item.key(), item.value().detach().contiguous());
  }
  WEFT_CHECK(!tensors.empty(), "save_lora_adapter: the model has no LoRA adapters");
  add_classification_head(model, tensors);
  save_safetensors(dir + "/adapter_model.safetensors", tensors);
  nlohmann::json adapter_config = {
      {"peft_type", "LORA"},
      {"task_type", model.score.is_empty() ? "CAUSAL_LM" : "SEQ_CLS"},
      {"base_model_name_or_path", base_model},
      {"r", config.spec.r},
      {"lora_alpha", config.spec.alpha},
      {"lora_dropout", config.spec.dropout},
      {"target_modules", config.target_modules},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
  };
  if (!model.score.is_empty()) adapter_config["modules_to_save"] = {"score"};
  write_file_atomically(dir + "/adapter_config.json", adapter_config.dump(2) + "\n");
}

void add_classification_head(LlamaForCausalLMImpl& model, std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  if (!model.score.is_empty()) tensors.emplace_back(std::string(kPeftPrefix) + "score.weight", model.score->weight.detach().contiguous());
}

void load_classification_head(LlamaForCausalLMImpl& model, const std::string& dir) {
  if (model.score.is_empty()) return;
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  const std::string name = std::string(kPeftPrefix) + "score.weight";
  if (!file->contains(name)) return;
  const auto& info = file->info(name);
  WEFT_CHECK(info.shape == model.score->weight.sizes().vec(),
             "{}/adapter_model.safetensors: the classification head '{}' has shape {} but the model's has {}", dir, name,
             fmt::join(info.shape, "x"), fmt::join(model.score->weight.sizes().vec(), "x"));
  torch::NoGradGuard no_grad;
  model.score->weight.copy_(file->load(name, torch::kFloat32));
}

void load_lora_adapter(LlamaForCausalLMImpl& model, const std::string& dir) {
  load_classification_head(model, dir);
  if (has_adalora(model)) return load_adalora_adapter(model, dir);
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    if (!is_lora_name(item.key())) continue;
    const std::string name = kPeftPrefix + item.key();
    WEFT_CHECK(file->contains(name), "{}/adapter_model.safetensors: adapter tensor '{}' is missing", dir, name);
    const auto& info = file->info(name);
    const ParameterShard shard = shard_of(model.options().shards, item.key());
    std::vector<int64_t> expected = item.value().sizes().vec();
    if (!shard.whole()) expected[static_cast<size_t>(shard.dim)] *= shard.parts;
    WEFT_CHECK(info.shape == expected, "{}/adapter_model.safetensors: '{}' has shape {} but the model expects {}", dir,
               name, fmt::join(info.shape, "x"), fmt::join(expected, "x"));
    if (shard.whole()) {
      item.value().copy_(file->load(name, torch::kFloat32));
    } else {  // this process's slice (tensor parallelism)
      const auto [start, length] = shard.range(info.shape[static_cast<size_t>(shard.dim)]);
      item.value().copy_(file->load_slice(name, shard.dim, start, length, torch::kFloat32));
    }
  }
}

void merge_lora(LlamaForCausalLMImpl& model) {
  for (auto& module : model.modules(/*include_self=*/false)) {
    if (auto* linear = module->as<LinearImpl>()) linear->merge_lora();
  }
}

std::vector<std::pair<std::string, torch::Tensor>> trainable_parameters(LlamaForCausalLMImpl& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& item : model.named_parameters()) {
    if (item.value().requires_grad()) out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace weft
