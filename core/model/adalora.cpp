#include "core/model/adalora.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/lora.h"
#include "core/model/parallel.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {
namespace {

constexpr const char* kAdaloraFilePrefix = "base_model.model.";
constexpr const char* kParts[] = {"lora_A", "lora_E", "lora_B"};

// The model's AdaLoRA layers by name, in the model's order.
std::vector<std::pair<std::string, LinearImpl*>> adalora_layers(LlamaForCausalLMImpl& model) {
  std::vector<std::pair<std::string, LinearImpl*>> layers;
  for (auto& item : model.named_modules("", /*include_self=*/false)) {
    auto* linear = item.value()->as<LinearImpl>();
    if (linear != nullptr && linear->adapter_as<AdaLoraAdapter>() != nullptr) layers.emplace_back(item.key(), linear);
  }
  return layers;
}

AdaLoraAdapter& ada(LinearImpl& layer) { return *layer.adapter_as<AdaLoraAdapter>(); }

torch::Tensor& part(LinearImpl& layer, const std::string& name) {
  auto& adapter = ada(layer);
  if (name == "lora_A") return adapter.A;
  if (name == "lora_E") return adapter.E;
  return adapter.B;
}

// Indices of the kept triplets of `layer` under `pattern` (all where it has none).
torch::Tensor kept_indices(const RankPattern& pattern, const std::string& layer, int64_t rank) {
  auto it = pattern.find(layer);
  if (it == pattern.end()) return torch::arange(rank, torch::kLong);
  WEFT_CHECK(static_cast<int64_t>(it->second.size()) == rank, "AdaLoRA rank pattern of {}: {} flags for rank {}", layer,
             it->second.size(), rank);
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < rank; ++i) {
    if (it->second[static_cast<size_t>(i)]) kept.push_back(i);
  }
  return torch::tensor(kept, torch::kLong);
}

}  // namespace

int64_t apply_adalora(LlamaForCausalLMImpl& model, const AdaLoraConfig& config, uint64_t seed) {
  return apply_lora(model, LoraConfig{config.spec, config.target_modules, config}, seed);
}

torch::Tensor adalora_orthogonal_regularization(LlamaForCausalLMImpl& model) {
  // P P^T and Q^T Q of every layer; on a split layer the split factor's Gram matrix is a sum over
  // the slices (all of them summed in one sum_over_slices), the whole factor's is local.
  std::vector<torch::Tensor> grams;
  std::vector<SliceSum> split;
  std::vector<size_t> split_at;
  for (auto& [name, layer] : adalora_layers(model)) {
    const auto& a = ada(*layer).A;
    const auto& b = ada(*layer).B;
    const ParameterShard& base = layer->slice();
    for (const int32_t dim : {1, 0}) {  // P [r, in]: split along its input columns; Q [out, r]: its rows
      const auto gram = dim == 1 ? torch::matmul(a, a.t()) : torch::matmul(b.t(), b);
      if (!base.whole() && base.dim == dim) {
        const int64_t local = dim == 1 ? a.size(1) : b.size(0);
        split_at.push_back(grams.size());
        split.push_back({gram, local, local * base.parts});
      }
      grams.push_back(gram);
    }
  }
  if (grams.empty()) return torch::zeros({});
  const auto sums = sum_over_slices(model.options().comm.get(), split);
  for (size_t i = 0; i < split_at.size(); ++i) grams[split_at[i]] = sums[i];
  torch::Tensor total;
  for (const auto& cov : grams) {
    const auto term = torch::norm(cov - torch::eye(cov.size(0), cov.options()));
    total = total.defined() ? total + term : term;
  }
  return total / static_cast<double>(grams.size());
}

bool has_adalora(LlamaForCausalLMImpl& model) { return !adalora_layers(model).empty(); }

RankPattern rank_pattern_of(LlamaForCausalLMImpl& model) {
  RankPattern pattern;
  for (auto& [name, layer] : adalora_layers(model)) {
    if (!ada(*layer).keep.empty()) pattern[name] = ada(*layer).keep;
  }
  return pattern;
}

void apply_rank_pattern(LlamaForCausalLMImpl& model, const RankPattern& pattern) {
  torch::NoGradGuard no_grad;
  for (auto& [name, layer] : adalora_layers(model)) {
    auto it = pattern.find(name);
    if (it == pattern.end()) continue;
    ada(*layer).keep = it->second;
    auto& e = ada(*layer).E;
    WEFT_CHECK(static_cast<int64_t>(it->second.size()) == e.size(0), "AdaLoRA rank pattern of {}: {} flags for rank {}",
               name, it->second.size(), e.size(0));
    std::vector<uint8_t> keep(it->second.begin(), it->second.end());
    const auto mask = torch::tensor(keep, torch::kUInt8).to(torch::kBool).to(e.device()).unsqueeze(1);
    e.masked_fill_(mask.logical_not(), 0.0);
  }
}

void save_adalora_adapter(LlamaForCausalLMImpl& model, const AdaLoraConfig& config, const RankPattern& pattern,
                          const std::string& dir, const std::string& base_model) {
  std::filesystem::create_directories(dir);
  NamedTensors tensors;
  nlohmann::json rank_pattern = nlohmann::json::object();
  for (auto& [name, layer] : adalora_layers(model)) {
    const auto kept = kept_indices(pattern, name, ada(*layer).E.size(0));
    const auto on = [&](const torch::Tensor& t) { return kept.to(t.device()); };
    const auto& a = ada(*layer).A;
    const auto& e = ada(*layer).E;
    const auto& b = ada(*layer).B;
    tensors.emplace_back(kAdaloraFilePrefix + name + ".lora_A", a.detach().index_select(0, on(a)).contiguous());
    tensors.emplace_back(kAdaloraFilePrefix + name + ".lora_E", e.detach().index_select(0, on(e)).contiguous());
    tensors.emplace_back(kAdaloraFilePrefix + name + ".lora_B", b.detach().index_select(1, on(b)).contiguous());
    if (auto it = pattern.find(name); it != pattern.end()) rank_pattern[name + ".lora_E"] = it->second;
  }
  WEFT_CHECK(!tensors.empty(), "save_adalora_adapter: the model has no AdaLoRA adapters");
  add_classification_head(model, tensors);
  save_safetensors(dir + "/adapter_model.safetensors", tensors);
  nlohmann::json adapter_config = {
      {"peft_type", "ADALORA"},
      {"task_type", model.score.is_empty() ? "CAUSAL_LM" : "SEQ_CLS"},
      {"base_model_name_or_path", base_model},
      {"r", config.spec.r},
      {"init_r", config.spec.r},
      {"target_r", config.target_r},
      {"tinit", config.tinit},
      {"tfinal", config.tfinal},
      {"deltaT", config.delta_t},
      {"beta1", config.beta1},
      {"beta2", config.beta2},
      {"orth_reg_weight", config.orth_reg_weight},
      {"total_step", std::max<int64_t>(config.total_step, 1)},
      {"lora_alpha", config.spec.alpha},
      {"lora_dropout", config.spec.dropout},
      {"target_modules", config.target_modules},
      {"rank_pattern", rank_pattern.empty() ? nlohmann::json(nullptr) : rank_pattern},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
  };
  if (!model.score.is_empty()) adapter_config["modules_to_save"] = {"score"};
  write_file_atomically(dir + "/adapter_config.json", adapter_config.dump(2) + "\n");
}

void load_adalora_adapter(LlamaForCausalLMImpl& model, const std::string& dir) {
  RankPattern pattern;
  read_adalora_adapter_config(dir, &pattern);
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  torch::NoGradGuard no_grad;
  const auto layers = adalora_layers(model);
  WEFT_CHECK(!layers.empty(), "load_adalora_adapter: the model has no AdaLoRA adapters");
  for (const auto& [name, layer] : layers) {
    const int64_t rank = ada(*layer).E.size(0);
    const auto kept = kept_indices(pattern, name, rank);
    if (auto it = pattern.find(name); it != pattern.end()) ada(*layer).keep = it->second;
    for (const std::string p : kParts) {
      const std::string key = kAdaloraFilePrefix + name + "." + p;
      WEFT_CHECK(file->contains(key), "{}/adapter_model.safetensors: adapter tensor '{}' is missing", dir, key);
      auto& target = part(*layer, p);
      // The file holds the whole factor's kept triplets; a split layer keeps its slice of them.
      const ParameterShard shard = shard_of(model.options().shards, name + "." + p);
      std::vector<int64_t> whole = target.sizes().vec();
      if (!shard.whole()) whole[static_cast<size_t>(shard.dim)] *= shard.parts;
      const int64_t dim = p == "lora_B" ? 1 : 0;
      std::vector<int64_t> expected = whole;
      expected[static_cast<size_t>(dim)] = kept.numel();
      const auto& info = file->info(key);
      WEFT_CHECK(info.shape == expected, "{}/adapter_model.safetensors: '{}' has shape {} but the model expects {}",
                 dir, key, fmt::join(info.shape, "x"), fmt::join(expected, "x"));
      auto values = torch::zeros(whole, torch::kFloat32);
      if (kept.numel() > 0) values.index_copy_(dim, kept, file->load(key, torch::kFloat32));
      target.copy_(shard_slice(values, shard));
    }
  }
}

RankAllocator::RankAllocator(LlamaForCausalLMImpl& model, AdaLoraConfig config)
    : model_(model), config_(std::move(config)), layers_(adalora_layers(model)) {
  WEFT_CHECK(!layers_.empty(), "the AdaLoRA rank allocator needs a model with AdaLoRA adapters");
  WEFT_CHECK(config_.beta1 > 0 && config_.beta1 < 1 && config_.beta2 > 0 && config_.beta2 < 1,
             "adalora.beta1 and adalora.beta2 must lie in (0, 1), got {} and {}", config_.beta1, config_.beta2);
  WEFT_CHECK(config_.delta_t >= 1, "adalora.deltaT must be >= 1, got {}", config_.delta_t);
  WEFT_CHECK(config_.tinit >= 0 && config_.tfinal >= 0 && config_.tinit < config_.total_step - config_.tfinal,
             "adalora: the budget schedule needs tinit ({}) < total_step ({}) - tfinal ({})", config_.tinit,
             config_.total_step, config_.tfinal);
  for (const auto& [name, layer] : layers_) initial_budget_ += ada(*layer).E.size(0);
  target_budget_ = config_.target_r * static_cast<int64_t>(layers_.size());
}

RankAllocator::Budget RankAllocator::budget_schedule(int64_t step) const {
  if (step <= config_.tinit) return {initial_budget_, false};
  if (step > config_.total_step - config_.tfinal) return {target_budget_, true};
  const double coefficient = 1.0 - static_cast<double>(step - config_.tinit) /
                                       static_cast<double>(config_.total_step - config_.tfinal - config_.tinit);
  const auto budget = static_cast<int64_t>(static_cast<double>(initial_budget_ - target_budget_) *
                                               std::pow(coefficient, 3.0) +
                                           static_cast<double>(target_budget_));
  return {budget, step % config_.delta_t == 0};
}

void RankAllocator::update_importance() {
  torch::NoGradGuard no_grad;
  for (const auto& [name, layer] : layers_) {
    for (const std::string p : kParts) {
      const auto& param = part(*layer, p);
      const auto grad = param.grad().defined() ? param.grad() : torch::zeros_like(param);
      const auto ipt = (param * grad).abs();
      const std::string key = name + "." + p;
      auto& ema = exp_avg_ipt_[key];
      auto& unc = exp_avg_unc_[key];
      if (!ema.defined()) {
        ema = torch::zeros_like(param);
        unc = torch::zeros_like(param);
      }
      ema = config_.beta1 * ema + (1 - config_.beta1) * ipt;  // PEFT's order of operations, for equal rounding
      unc = config_.beta2 * unc + (1 - config_.beta2) * (ipt - ema).abs();
    }
  }
}

RankPattern RankAllocator::mask_to_budget(int64_t budget) {
  torch::NoGradGuard no_grad;
  // Each triplet's score: its Lambda's, plus the means of its P row's and its Q column's. On a
  // split layer the split factor's means are sums over the slices (one sum_over_slices for all
  // layers) over the whole length, so every process scores every triplet as one process does.
  std::vector<torch::Tensor> a_means, b_means, e_scores;
  std::vector<SliceSum> split;
  std::vector<std::pair<size_t, int32_t>> split_at;  // (layer, dim 1: P / dim 0: Q)
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto& [name, layer] = layers_[i];
    const auto score = [&](const char* p) {
      const auto& ema = exp_avg_ipt_[name + "." + p];
      return ema.defined() ? ema * exp_avg_unc_[name + "." + p] : torch::zeros_like(part(*layer, p));
    };
    const ParameterShard& base = layer->slice();
    const auto a = score("lora_A"), b = score("lora_B");
    a_means.push_back(a.mean(1, /*keepdim=*/true));   // [r, 1]
    b_means.push_back(b.mean(0).view({-1, 1}));        // [r, 1]
    e_scores.push_back(score("lora_E").view(-1));      // [r]
    if (!base.whole() && base.dim == 1) {
      split_at.emplace_back(i, 1);
      split.push_back({a.sum(1, /*keepdim=*/true), a.size(1), a.size(1) * base.parts});
    } else if (!base.whole() && base.dim == 0) {
      split_at.emplace_back(i, 0);
      split.push_back({b.sum(0).view({-1, 1}), b.size(0), b.size(0) * base.parts});
    }
  }
  const auto sums = sum_over_slices(model_.options().comm.get(), split);
  for (size_t j = 0; j < split_at.size(); ++j) {
    const auto [i, dim] = split_at[j];
    (dim == 1 ? a_means : b_means)[i] = sums[j] / static_cast<double>(split[j].whole);
  }
  std::vector<torch::Tensor> scores, all;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto triplet = e_scores[i] + torch::cat({a_means[i], b_means[i]}, 1).sum(1);  // [r]
    scores.push_back(triplet);
    all.push_back(triplet.view(-1));
  }
  const int64_t k = initial_budget_ - budget;
  const double threshold =
      k >= 1 ? std::get<0>(torch::kthvalue(torch::cat(all).cpu(), k)).item<double>() : -std::numeric_limits<double>::infinity();
  RankPattern pattern;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto masked = scores[i] <= threshold;
    ada(*layers_[i].second).E.masked_fill_(masked.view({-1, 1}), 0.0);
    const auto keep = masked.logical_not().to(torch::kUInt8).cpu();
    pattern[layers_[i].first] = std::vector<bool>(keep.data_ptr<uint8_t>(), keep.data_ptr<uint8_t>() + keep.numel());
    ada(*layers_[i].second).keep = pattern[layers_[i].first];
  }
  return pattern;
}

void RankAllocator::update_and_allocate(int64_t step) {
  const int64_t final_start = config_.total_step - config_.tfinal;
  if (step < final_start) {
    update_importance();
    const auto b = budget_schedule(step);
    if (b.mask) pattern_ = mask_to_budget(b.budget);
  } else if (step == final_start) {
    pattern_ = mask_to_budget(budget_schedule(step).budget);
    exp_avg_ipt_.clear();
    exp_avg_unc_.clear();
  } else if (!pattern_.empty()) {
    apply_rank_pattern(model_, pattern_);
  }
}

std::map<std::string, int64_t> RankAllocator::ranks() const {
  std::map<std::string, int64_t> out;
  for (const auto& [name, layer] : layers_) {
    auto it = pattern_.find(name);
    out[name] = it == pattern_.end() ? ada(*layer).E.size(0)
                                     : static_cast<int64_t>(std::count(it->second.begin(), it->second.end(), true));
  }
  return out;
}

std::vector<std::pair<std::string, torch::Tensor>> RankAllocator::state() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [key, t] : exp_avg_ipt_) out.emplace_back("adalora.exp_avg_ipt." + key, t.detach().cpu());
  for (const auto& [key, t] : exp_avg_unc_) out.emplace_back("adalora.exp_avg_unc." + key, t.detach().cpu());
  for (const auto& [layer, flags] : pattern_) {
    std::vector<uint8_t> bytes(flags.begin(), flags.end());
    out.emplace_back("adalora.rank_pattern." + layer, torch::tensor(bytes, torch::kUInt8));
  }
  for (const auto& [name, layer] : layers_) {
    for (const std::string p : kParts) out.emplace_back("adalora.param." + name + "." + p, part(*layer, p).detach().cpu());
  }
  return out;
}

std::optional<std::string> RankAllocator::state_parameter(const std::string& name) {
  for (const char* prefix : {"adalora.exp_avg_ipt.", "adalora.exp_avg_unc.", "adalora.param."}) {
    if (name.rfind(prefix, 0) == 0) return name.substr(std::string(prefix).size());
  }
  if (name.rfind("adalora.rank_pattern.", 0) == 0) return "";
  return std::nullopt;
}

void RankAllocator::load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  exp_avg_ipt_.clear();
  exp_avg_unc_.clear();
  pattern_.clear();
  std::map<std::string, torch::Tensor> params;
  const auto device = ada(*layers_.front().second).E.device();
  for (const auto& [name, t] : state) {
    const auto rest = [&](const std::string& prefix) { return name.substr(prefix.size()); };
    if (name.rfind("adalora.exp_avg_ipt.", 0) == 0) {
      exp_avg_ipt_[rest("adalora.exp_avg_ipt.")] = t.to(device);
    } else if (name.rfind("adalora.exp_avg_unc.", 0) == 0) {
      exp_avg_unc_[rest("adalora.exp_avg_unc.")] = t.to(device);
    } else if (name.rfind("adalora.rank_pattern.", 0) == 0) {
      const auto bytes = t.to(torch::kUInt8).contiguous();
      pattern_[rest("adalora.rank_pattern.")] =
          std::vector<bool>(bytes.data_ptr<uint8_t>(), bytes.data_ptr<uint8_t>() + bytes.numel());
    } else if (name.rfind("adalora.param.", 0) == 0) {
      params[rest("adalora.param.")] = t;
    }
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, layer] : layers_) {
    for (const std::string p : kParts) {
      auto it = params.find(name + "." + p);
      WEFT_CHECK(it != params.end(), "AdaLoRA state: no values for {}.{}", name, p);
      auto& target = part(*layer, p);
      WEFT_CHECK(it->second.sizes() == target.sizes(), "AdaLoRA state: {}.{} has shape {}, the model {}", name, p,
                 fmt::join(it->second.sizes(), "x"), fmt::join(target.sizes(), "x"));
      target.copy_(it->second);
    }
    auto flags = pattern_.find(name);
    ada(*layer).keep = flags == pattern_.end() ? std::vector<bool>{} : flags->second;
  }
}

}  // namespace weft
