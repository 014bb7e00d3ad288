// The model's side of named_state.h: what a rank writes from its model and optimizer, and how it
// restores its part of a checkpoint's tensors into them.
#include "core/train/named_state.h"

#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/lora.h"
#include "core/model/parallel.h"
#include "core/train/optimizer.h"
#include "core/util/error.h"

namespace weft {
namespace fs = std::filesystem;

using named_state_format::kPieces;
using named_state_format::kSteps;
using named_state_format::rank_file;
using torch::optim::AdamWParamState;

std::vector<std::pair<std::string, torch::Tensor>> checkpoint_parameters(LlamaForCausalLMImpl& model, bool lora) {
  if (lora) return trainable_parameters(model);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

void save_optimizer_state(const std::string& path, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer) {
  NamedTensors tensors;
  nlohmann::json steps = nlohmann::json::object();
  for (const auto& [name, parameter] : trainable_parameters(model)) {
    const AdamWParamState* state = adamw_state(optimizer, parameter);
    if (state == nullptr) continue;
    tensors.emplace_back(name + ".exp_avg", state->exp_avg().to(torch::kFloat32));
    tensors.emplace_back(name + ".exp_avg_sq", state->exp_avg_sq().to(torch::kFloat32));
    steps[name] = state->step();
  }
  save_safetensors(path, tensors, {{"format", "weft-adamw"}, {kSteps, steps.dump()}});
}

void save_local_state(const std::string& path, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                      const std::vector<std::string>& parameters) {
  std::set<std::string> wanted(parameters.begin(), parameters.end());
  NamedTensors tensors;
  nlohmann::json steps = nlohmann::json::object();
  for (auto& item : model.named_parameters()) {
    if (wanted.erase(item.key()) == 0) continue;
    const torch::Tensor& parameter = item.value();
    tensors.emplace_back(item.key(), parameter.detach().to(torch::kFloat32));
    const AdamWParamState* state = adamw_state(optimizer, parameter);
    if (state == nullptr) continue;  // not stepped yet
    tensors.emplace_back(item.key() + ".exp_avg", state->exp_avg().to(torch::kFloat32));
    tensors.emplace_back(item.key() + ".exp_avg_sq", state->exp_avg_sq().to(torch::kFloat32));
    steps[item.key()] = state->step();
  }
  WEFT_CHECK(wanted.empty(), "checkpoint: the model has no parameter '{}' to save as a rank's own", *wanted.begin());
  save_safetensors(path, tensors, {{"format", "weft-local"}, {kSteps, steps.dump()}});
}

void restore_local_state(const std::string& path, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                         const std::vector<std::string>& parameters) {
  const auto file = SafetensorsFile::open(path);
  nlohmann::json steps = nlohmann::json::object();
  if (const auto it = file->metadata().find(kSteps); it != file->metadata().end()) {
    steps = nlohmann::json::parse(it->second, nullptr, /*allow_exceptions=*/false);
    WEFT_CHECK(steps.is_object(), "{}: metadata {} is not a JSON object", path, kSteps);
  }
  const std::set<std::string> wanted(parameters.begin(), parameters.end());
  torch::NoGradGuard no_grad;
  const auto load = [&](const std::string& name, const torch::Tensor& like) {
    WEFT_CHECK(file->contains(name), "{}: no tensor '{}'", path, name);
    torch::Tensor values = file->load(name);
    WEFT_CHECK(values.sizes() == like.sizes(), "{}: '{}' has shape {}, the model's is {}", path, name,
               fmt::join(values.sizes(), "x"), fmt::join(like.sizes(), "x"));
    return values.to(like.options());
  };
  for (auto& item : model.named_parameters()) {
    if (wanted.count(item.key()) == 0) continue;
    torch::Tensor parameter = item.value();
    parameter.copy_(load(item.key(), parameter));
    const auto step = steps.find(item.key());
    if (step == steps.end()) continue;
    WEFT_CHECK(step->is_number_integer() && step->get<int64_t>() >= 0, "{}: the step count of '{}' is not a count",
               path, item.key());
    set_adamw_state(optimizer, parameter, step->get<int64_t>(), load(item.key() + ".exp_avg", parameter),
                    load(item.key() + ".exp_avg_sq", parameter));
  }
}

void save_rank_shard(const std::string& dir, int32_t rank, LlamaForCausalLMImpl& model,
                     torch::optim::AdamW& optimizer, bool lora, const std::function<bool(const std::string&)>& writes,
                     const std::vector<StatePiece>& extra) {
  NamedTensors tensors;
  nlohmann::json pieces = nlohmann::json::object(), steps = nlohmann::json::object();
  // Where this rank's `local` part of a tensor split like parameter `name` lies in the whole.
  const auto piece_of = [&](const std::string& name, const torch::Tensor& local) {
    const ParameterShard shard = name.empty() ? ParameterShard{} : shard_of(model.options().shards, name);
    std::vector<int64_t> shape = local.sizes().vec();
    int64_t start = 0;
    if (!shard.whole()) {
      shape[static_cast<size_t>(shard.dim)] *= shard.parts;  // tensor-parallel slices are equal
      const auto [begin, length] = shard.range(shape[static_cast<size_t>(shard.dim)]);
      WEFT_CHECK(length == local.size(shard.dim), "checkpoint: the slice {} of {} of '{}' is not 1/{} of it",
                 shard.index, shard.parts, name, shard.parts);
      start = begin;
    }
    return nlohmann::json{{"shape", shape}, {"dim", shard.dim}, {"start", start}};
  };
  for (const auto& piece : extra) {
    if (piece.parameter.empty() ? rank != 0 : !writes(piece.parameter)) continue;
    tensors.emplace_back(piece.name, piece.tensor.detach().cpu().contiguous());
    pieces[piece.name] = piece_of(piece.parameter, piece.tensor);
  }
  for (const auto& [name, parameter] : checkpoint_parameters(model, lora)) {
    if (!writes(name)) continue;
    const nlohmann::json piece = piece_of(name, parameter);
    tensors.emplace_back(name, parameter.detach().to(torch::kFloat32));
    pieces[name] = piece;
    if (const AdamWParamState* state = adamw_state(optimizer, parameter)) {
      tensors.emplace_back(name + ".exp_avg", state->exp_avg().to(torch::kFloat32));
      tensors.emplace_back(name + ".exp_avg_sq", state->exp_avg_sq().to(torch::kFloat32));
      pieces[name + ".exp_avg"] = piece;
      pieces[name + ".exp_avg_sq"] = piece;
      steps[name] = state->step();
    }
  }
  save_safetensors((fs::path(dir) / rank_file(rank)).string(), tensors,
                   {{"format", "weft-shard"}, {kPieces, pieces.dump()}, {kSteps, steps.dump()}});
}

// This rank's part (shard_of) of the whole tensor `name`, which belongs to `parameter`, shaped as
// `like`.
at::Tensor NamedState::part_for(LlamaForCausalLMImpl& model, const std::string& parameter, const std::string& name,
                                const at::Tensor& like) const {
  auto values = whole(name);
  WEFT_CHECK(values.has_value(), "checkpoint '{}' has no tensor '{}'", dir_, name);
  at::Tensor part = *values;
  const ParameterShard shard = shard_of(model.options().shards, parameter);
  if (!shard.whole()) {
    WEFT_CHECK(shard.dim < part.dim(), "checkpoint '{}': '{}' has {} dimensions", dir_, name, part.dim());
    const auto [start, length] = shard.range(part.size(shard.dim));
    part = part.narrow(shard.dim, start, length);
  }
  WEFT_CHECK(part.sizes() == like.sizes(), "checkpoint '{}': '{}' is {} here but {} in the checkpoint{}", dir_, name,
             fmt::join(like.sizes(), "x"), fmt::join(values->sizes(), "x"),
             shard.whole() ? "" : fmt::format(" (this rank's slice {} of {})", shard.index, shard.parts));
  return part.contiguous();
}

at::Tensor NamedState::part_like(LlamaForCausalLMImpl& model, const std::string& parameter,
                                const std::string& name) const {
  if (parameter.empty()) {
    auto values = whole(name);
    WEFT_CHECK(values.has_value(), "checkpoint '{}' has no tensor '{}'", dir_, name);
    return *values;
  }
  const auto parameters = model.named_parameters();
  const auto* like = parameters.find(parameter);
  WEFT_CHECK(like != nullptr, "checkpoint '{}': '{}' belongs to parameter '{}', which this model does not have", dir_,
             name, parameter);
  return part_for(model, parameter, name, *like);
}

void NamedState::restore_parameters(LlamaForCausalLMImpl& model, bool lora) const {
  WEFT_CHECK(sharded_, "checkpoint '{}': its model is an HF directory, read by load_weights", dir_);
  torch::NoGradGuard no_grad;
  for (auto& [name, parameter] : checkpoint_parameters(model, lora)) {
    parameter.copy_(part_for(model, name, name, parameter));
  }
}

void NamedState::restore_optimizer(LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer) const {
  torch::NoGradGuard no_grad;
  for (auto& [name, parameter] : trainable_parameters(model)) {
    const auto count = step(name);
    if (!count) continue;  // not stepped when the checkpoint was saved
    set_adamw_state(optimizer, parameter, *count, part_for(model, name, name + ".exp_avg", parameter).to(parameter.options()),
                    part_for(model, name, name + ".exp_avg_sq", parameter).to(parameter.options()));
  }
}

}  // namespace weft
