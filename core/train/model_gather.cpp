#include "core/train/model_gather.h"

#include <torch/torch.h>

#include "core/dist/process_groups.h"
#include "core/model/adalora.h"
#include "core/util/error.h"

namespace weft {
namespace {

// The parameters of `model` owned by model stage `stage`, in registration order (the same order
// on every rank, whatever stages it holds).
std::vector<torch::Tensor> stage_parameters(LlamaForCausalLMImpl& model, int64_t stage) {
  std::vector<torch::Tensor> out;
  const int64_t layers = model.config().num_hidden_layers;
  for (auto& item : model.named_parameters()) {
    if (stage_of_parameter(item.key(), layers) == stage) out.push_back(item.value());
  }
  return out;
}

}  // namespace

ModelGather::ModelGather(LlamaForCausalLMImpl& local, Communicator& communicator, std::optional<LoraConfig> lora)
    : local_(local), communicator_(communicator), lora_(std::move(lora)) {
  auto& world = communicator_.world();
  const int64_t num_stages = local_.num_stages();
  auto held = torch::zeros({world.size, num_stages}, torch::kLong);  // which model stages each rank holds
  for (int64_t s = 0; s < num_stages; ++s) held[world.rank][s] = local_.holds_stage(s) ? 1 : 0;
  auto held_sum = communicator_.all_reduce(world, held, c10d::ReduceOp::SUM);
  communicator_.wait(held_sum);
  bool staged = false;
  for (int32_t r = 0; r < world.size; ++r) {
    held_.emplace_back();
    for (int64_t s = 0; s < num_stages; ++s) {
      held_.back().push_back(held[r][s].item<int64_t>() != 0);
      staged = staged || !held_.back().back();
    }
  }
  // Every rank's (parts, index) of each of its parameters (same list on every rank when no
  // stage is split).
  const auto params = local_.named_parameters();
  auto slices = torch::zeros({world.size, static_cast<int64_t>(params.size()), 2}, torch::kLong);
  for (size_t i = 0; i < params.size(); ++i) {
    const ParameterShard shard = shard_of(local_.options().shards, params[i].key());
    slices[world.rank][static_cast<int64_t>(i)][0] = shard.parts;
    slices[world.rank][static_cast<int64_t>(i)][1] = shard.index;
    sliced_ = sliced_ || !shard.whole();
  }
  auto flag = torch::tensor({sliced_ ? 1L : 0L, staged ? 1L : 0L});
  auto flag_sum = communicator_.all_reduce(world, flag, c10d::ReduceOp::SUM);
  communicator_.wait(flag_sum);
  sliced_ = flag[0].item<int64_t>() > 0;
  WEFT_CHECK(!(sliced_ && flag[1].item<int64_t>() > 0),
             "saving a model split into pipeline stages and tensor-parallel slices at once is not supported yet");
  if (sliced_) {
    auto slices_sum = communicator_.all_reduce(world, slices, c10d::ReduceOp::SUM);
    communicator_.wait(slices_sum);
    for (int32_t r = 0; r < world.size; ++r) {
      slices_.emplace_back();
      for (size_t i = 0; i < params.size(); ++i) {
        slices_.back().emplace_back(static_cast<int32_t>(slices[r][static_cast<int64_t>(i)][0].item<int64_t>()),
                                    static_cast<int32_t>(slices[r][static_cast<int64_t>(i)][1].item<int64_t>()));
      }
    }
  }
  staged_ = flag[1].item<int64_t>() > 0;
  split_ = staged_ || sliced_;
  // The lowest rank holding a parameter's stage (and, when sliced, its slice) writes it.
  const int64_t layers = local_.config().num_hidden_layers;
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].key();
    const int64_t stage = stage_of_parameter(name, layers);
    int32_t first = -1;
    for (int32_t r = 0; r < world.size && first < 0; ++r) {
      if (!held_[static_cast<size_t>(r)][static_cast<size_t>(stage)]) continue;
      if (sliced_ && slices_[static_cast<size_t>(r)][i] != slices_[static_cast<size_t>(world.rank)][i]) continue;
      first = r;
    }
    if (first == world.rank) writes_.insert(name);
  }
}

LlamaForCausalLMImpl* ModelGather::gather() {
  auto& world = communicator_.world();
  if (!split_) return world.rank == 0 ? &local_ : nullptr;
  torch::NoGradGuard no_grad;
  if (!full_ && world.rank == 0) {
    ModelOptions options = local_.options();
    options.stages = StageRange{};
    options.shards.clear();
    options.comm.reset();
    options.tensor_sequence.reset();
    options.sequence.reset();
    full_ = LlamaForCausalLM(local_.config(), options);
    if (lora_) apply_lora(*full_, *lora_, 0);
  }
  if (sliced_) {
    // Every parameter, in the same order everywhere: all-gather the slices, keep one per index.
    const auto params = local_.named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string& name = params[i].key();
      const ParameterShard mine = shard_of(local_.options().shards, name);
      const auto input = params[i].value().detach().contiguous();
      std::vector<int64_t> gathered_shape = input.sizes().vec();
      gathered_shape.insert(gathered_shape.begin(), world.size);
      const auto gathered = torch::empty(gathered_shape, input.options());
      auto gather = communicator_.all_gather(world, gathered.view({-1}), input.view({-1}));
      communicator_.wait(gather);
      if (world.rank != 0) continue;
      torch::Tensor target = full_->named_parameters()[name];
      if (mine.whole()) {
        target.copy_(input);
        continue;
      }
      std::vector<torch::Tensor> parts(static_cast<size_t>(mine.parts));
      for (int32_t r = 0; r < world.size; ++r) {
        const auto [count, index] = slices_[static_cast<size_t>(r)][i];
        if (count == mine.parts && !parts[static_cast<size_t>(index)].defined()) parts[static_cast<size_t>(index)] = gathered[r];
      }
      for (const auto& part : parts) WEFT_CHECK(part.defined(), "saving: a slice of '{}' is held by no rank", name);
      target.copy_(torch::cat(parts, mine.dim));
    }
    if (world.rank == 0 && lora_ && lora_->adalora) apply_rank_pattern(*full_, rank_pattern_of(local_));
    return world.rank == 0 ? full_.get() : nullptr;
  }
  const int64_t stages = local_.num_stages();
  // The owner of each model stage: the lowest rank that holds it.
  std::vector<int32_t> owner(static_cast<size_t>(stages), -1);
  for (int64_t s = 0; s < stages; ++s) {
    for (int32_t r = 0; r < world.size && owner[s] < 0; ++r) {
      if (held_[static_cast<size_t>(r)][static_cast<size_t>(s)]) owner[s] = r;
    }
    WEFT_CHECK(owner[s] >= 0, "no rank holds model stage {}; cannot save the model", s);
  }
  if (world.rank != 0) {
    for (int64_t s = 0; s < stages; ++s) {
      if (owner[s] != world.rank) continue;
      for (auto& p : stage_parameters(local_, s)) {
        auto sent = communicator_.send(world, p.detach().contiguous(), 0, static_cast<int32_t>(s));
        communicator_.wait(sent);
      }
    }
    return nullptr;
  }
  for (int64_t s = 0; s < stages; ++s) {
    auto targets = stage_parameters(*full_, s);
    if (owner[s] == 0) {
      auto sources = stage_parameters(local_, s);
      WEFT_CHECK(sources.size() == targets.size(), "stage {}: {} parameters here, {} in the whole model", s,
                 sources.size(), targets.size());
      for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(sources[i]);
      continue;
    }
    for (auto& p : targets) {
      auto received = communicator_.recv(world, p.detach(), owner[s], static_cast<int32_t>(s));
      communicator_.wait(received);
    }
  }
  return full_.get();
}

}  // namespace weft
