#include "core/model/weights.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>

#include <torch/torch.h>

#include "core/io/gguf.h"
#include "core/io/safetensors.h"
#include "core/model/gguf_model.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/hash.h"

namespace weft {
namespace {

bool is_lora_parameter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

bool is_norm_weight(const std::string& name) { return name.find("norm.weight") != std::string::npos; }

// The quantized linear layers (they hold no `weight` parameter) under their weight's HF name.
std::vector<std::pair<std::string, LinearImpl*>> quantized_layers(LlamaForCausalLMImpl& model) {
  std::vector<std::pair<std::string, LinearImpl*>> out;
  for (auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = item.value()->as<LinearImpl>();
    if (linear != nullptr && linear->quantized()) out.emplace_back(item.key() + ".weight", linear);
  }
  return out;
}

// The device the model's tensors are on (every stage holds a parameter: a norm at least).
torch::Device model_device(LlamaForCausalLMImpl& model) {
  const auto parameters = model.parameters();
  return parameters.empty() ? torch::Device(torch::kCPU) : parameters.front().device();
}

// The whole layer's [out, in] shape, of which `linear` holds a slice.
std::vector<int64_t> whole_shape(const LinearImpl& linear) {
  return {linear.spec().out_features, linear.spec().in_features};
}

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
  // Quantized layers: the same values, quantized one tensor at a time on the model's device.
  const auto device = model_device(model);
  for (auto& [name, linear] : quantized_layers(model)) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(hash64(name, seed));
    auto whole = torch::empty(whole_shape(*linear));
    whole.normal_(0.0, std, generator);
    linear->set_weight(whole, device);
  }
}

namespace {

// What load_weights reads from: a safetensors checkpoint, or a GGUF file under HF names.
struct WeightSource {
  std::function<bool(const std::string&)> contains;
  std::function<std::vector<int64_t>(const std::string&)> shape;
  std::function<torch::Tensor(const std::string&, torch::Dtype)> load;
  std::function<torch::Tensor(const std::string&, int64_t dim, int64_t start, int64_t length, torch::Dtype)> load_slice;
};

WeightSource weight_source(const std::string& path) {
  if (is_gguf_path(path)) {
    auto file = GgufFile::open(path);
    auto weights = std::make_shared<GgufWeights>(file, gguf_model_config(*file));
    return {[weights](const std::string& name) { return weights->contains(name); },
            [weights](const std::string& name) { return weights->shape(name); },
            [weights](const std::string& name, torch::Dtype dtype) { return weights->load(name, dtype); },
            [weights](const std::string& name, int64_t dim, int64_t start, int64_t length, torch::Dtype dtype) {
              return weights->load(name).narrow(dim, start, length).to(dtype).contiguous();  // dequantized whole
            }};
  }
  auto checkpoint = std::make_shared<SafetensorsCheckpoint>(SafetensorsCheckpoint::open(path));
  return {[checkpoint](const std::string& name) { return checkpoint->contains(name); },
          [checkpoint](const std::string& name) { return checkpoint->info(name).shape; },
          [checkpoint](const std::string& name, torch::Dtype dtype) { return checkpoint->load(name, dtype); },
          [checkpoint](const std::string& name, int64_t dim, int64_t start, int64_t length, torch::Dtype dtype) {
            return checkpoint->load_slice(name, dim, start, length, dtype);
          }};
}

}  // namespace

void load_weights(LlamaForCausalLMImpl& model, const std::string& path, uint64_t seed, double init_std) {
  const WeightSource checkpoint = weight_source(path);
  torch::NoGradGuard no_grad;
  std::vector<std::string> missing;
  for (auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    if (is_lora_parameter(name)) continue;
    if (name == "score.weight" && !checkpoint.contains(name)) {  // a causal LM's checkpoint: a new head
      auto generator = at::make_generator<at::CPUGeneratorImpl>(hash64(name, seed));
      item.value().copy_(torch::empty(item.value().sizes()).normal_(0.0, init_std, generator));
      continue;
    }
    if (!checkpoint.contains(name)) {
      missing.push_back(name);
      continue;
    }
    auto& param = item.value();
    const std::vector<int64_t> shape = checkpoint.shape(name);
    const ParameterShard shard = shard_of(model.options().shards, name);
    std::vector<int64_t> expected = param.sizes().vec();
    if (!shard.whole()) expected[shard.dim] *= shard.parts;
    WEFT_CHECK(shape == expected, "{}: tensor '{}' has shape {} but the model expects {}", path, name,
               fmt::join(shape, "x"), fmt::join(expected, "x"));
    if (shard.whole()) {
      param.copy_(checkpoint.load(name, param.scalar_type()));  // fp32, or a bf16-stored frozen matrix
    } else {  // only this process's slice leaves the memory-mapped file
      const auto [start, length] = shard.range(shape[static_cast<size_t>(shard.dim)]);
      param.copy_(checkpoint.load_slice(name, shard.dim, start, length, param.scalar_type()));
    }
  }
  // Quantized layers: each tensor is quantized as it leaves the file, and this process keeps its slice.
  const auto device = model_device(model);
  for (auto& [name, linear] : quantized_layers(model)) {
    if (!checkpoint.contains(name)) {
      missing.push_back(name);
      continue;
    }
    const std::vector<int64_t> shape = checkpoint.shape(name);
    const auto expected = whole_shape(*linear);
    WEFT_CHECK(shape == expected, "{}: tensor '{}' has shape {} but the model expects {}", path, name,
               fmt::join(shape, "x"), fmt::join(expected, "x"));
    // A slice is quantized as part of its whole tensor (one at a time), so that every split holds
    // the unsplit model's quantized values.
    linear->set_weight(checkpoint.load(name, torch::kFloat32), device);
  }
  WEFT_CHECK(missing.empty(), "{}: {} model tensors are missing from the checkpoint, e.g. '{}'", path,
             missing.size(), missing.empty() ? "" : missing.front());
}

std::vector<std::pair<std::string, torch::Tensor>> hf_state(LlamaForCausalLMImpl& model, torch::Dtype dtype) {
  const auto quantized = quantized_layers(model);
  WEFT_CHECK(quantized.empty(),
             "the base weights are quantized (model.quantize), so the full-precision model is not here to save ('{}' "
             "and {} more); save the adapters, or merge them (lora.save_merged) into dequantized weights",
             quantized.front().first, quantized.size() - 1);
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
