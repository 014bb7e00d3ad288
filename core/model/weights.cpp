#include "core/model/weights.h"

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/hash.h"

namespace weft {
namespace {

bool is_lora_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

bool is_norm_weight(const std::string& name) { return name.find("norm.weight") != std::string::npos; }

}  // namespace

std::string module_leaf_name(const std::string& module_path) {
  const auto dot = module_path.rfind('.');
  return dot == std::string::npos ? module_path : module_path.substr(dot + 1);
}

void init_weights(LlamaForCausalLMImpl& model, uint64_t seed, double std) {
  torch::NoGradGuard no_grad;
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    if (is_lora_parameter(name)) continue;
    auto& param = item.value();
    if (is_norm_weight(name)) {
      param.fill_(1.0);
      continue;
    }
    auto generator = at::make_generator<at::CPUGeneratorImpl>(hash64(name, seed));
    const ParameterShard shard = shard_of(model.options().shards, name);
    if (shard.whole()) {
      param.normal_(0.0, std, generator);
    } else {  // this process's slice of the whole tensor's values
      std::vector<int64_t> full = param.sizes().vec();
      full[shard.dim] = full[shard.dim] * shard.parts;
      auto whole = torch::empty(full, param.options());
      whole.normal_(0.0, std, generator);
      param.copy_(shard_slice(whole, shard));
    }
  }
}

void load_weights(LlamaForCausalLMImpl& model, const std::string& path) {
  const auto checkpoint = SafetensorsCheckpoint::open(path);
  torch::NoGradGuard no_grad;
  std::vector<std::string> missing;
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    if (is_lora_parameter(name)) continue;
    if (!checkpoint.contains(name)) {
      missing.push_back(name);
      continue;
    }
    auto& param = item.value();
    const auto& info = checkpoint.info(name);
    const ParameterShard shard = shard_of(model.options().shards, name);
    std::vector<int64_t> expected = param.sizes().vec();
    if (!shard.whole()) expected[shard.dim] *= shard.parts;
    WEFT_CHECK(info.shape == expected, "{}: tensor '{}' has shape {} but the model expects {}", path, name,
               fmt::join(info.shape, "x"), fmt::join(expected, "x"));
    if (shard.whole()) {
      param.copy_(checkpoint.load(name, torch::kFloat32));
    } else {  // only this process's slice leaves the memory-mapped file
      const auto [start, length] = shard.range(info.shape[static_cast<size_t>(shard.dim)]);
      param.copy_(checkpoint.load_slice(name, shard.dim, start, length, torch::kFloat32));
    }
  }
  WEFT_CHECK(missing.empty(), "{}: {} model tensors are missing from the checkpoint, e.g. '{}'", path,
             missing.size(), missing.empty() ? "" : missing.front());
}

std::vector<std::pair<std::string, torch::Tensor>> hf_state(LlamaForCausalLMImpl& model, torch::Dtype dtype) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (auto& item : model.named_parameters()) {
    if (is_lora_parameter(item.key())) continue;
    tensors.emplace_back(item.key(), item.value().detach().to(dtype).contiguous());
  }
  return tensors;
}

void save_pretrained(LlamaForCausalLMImpl& model, const std::string& dir, torch::Dtype dtype,
                     uint64_t max_shard_bytes) {
  std::filesystem::create_directories(dir);
  ModelConfig config = model.config();
  config.torch_dtype = dtype == torch::kBFloat16 ? "bfloat16" : dtype == torch::kFloat16 ? "float16" : "float32";
  write_file_atomically(dir + "/config.json", to_hf_config_json(config));
  save_safetensors_sharded(dir, hf_state(model, dtype), max_shard_bytes);
}

}  // namespace weft
