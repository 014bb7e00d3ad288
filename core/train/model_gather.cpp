#include "core/train/model_gather.h"

#include <algorithm>

#include <torch/torch.h>

#include "core/dist/process_groups.h"
#include "core/model/adalora.h"
#include "core/model/prompt_tuning.h"
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
  const bool staged = held.min().item<int64_t>() == 0;  // some rank lacks some stage
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
  staged_ = flag[1].item<int64_t>() > 0;
  split_ = staged_ || sliced_;
  const int64_t layers = local_.config().num_hidden_layers;
  if (staged_) {
    // Each stage's parameters are listed in the same order by every rank that holds the stage:
    // share how each rank holds them (with slices: which), then every slice has one owner.
    int64_t most = 0;
    for (int64_t s = 0; s < num_stages; ++s) {
      if (local_.holds_stage(s)) most = std::max<int64_t>(most, static_cast<int64_t>(stage_parameters(local_, s).size()));
    }
    auto most_all = torch::tensor({most}, torch::kLong);
    auto max_op = communicator_.all_reduce(world, most_all, c10d::ReduceOp::MAX);
    communicator_.wait(max_op);
    most = std::max<int64_t>(most_all.item<int64_t>(), 1);
    auto table = torch::zeros({world.size, num_stages, most, 3}, torch::kLong);
    for (int64_t s = 0; s < num_stages; ++s) {
      if (!local_.holds_stage(s)) continue;
      int64_t j = 0;
      for (auto& item : local_.named_parameters()) {
        if (stage_of_parameter(item.key(), layers) != s) continue;
        const ParameterShard shard = shard_of(local_.options().shards, item.key());
        table[world.rank][s][j][0] = shard.parts;
        table[world.rank][s][j][1] = shard.index;
        table[world.rank][s][j][2] = shard.dim;
        ++j;
      }
    }
    auto table_sum = communicator_.all_reduce(world, table, c10d::ReduceOp::SUM);
    communicator_.wait(table_sum);
    const auto t = table.accessor<int64_t, 4>();
    stage_slices_.assign(static_cast<size_t>(world.size), {});
    for (int32_t r = 0; r < world.size; ++r) {
      stage_slices_[r].assign(static_cast<size_t>(num_stages), std::vector<std::array<int64_t, 3>>(static_cast<size_t>(most)));
      for (int64_t s = 0; s < num_stages; ++s) {
        for (int64_t j = 0; j < most; ++j) stage_slices_[r][s][j] = {t[r][s][j][0], t[r][s][j][1], t[r][s][j][2]};
      }
    }
    for (int64_t s = 0; s < num_stages; ++s) {
      if (!local_.holds_stage(s)) continue;
      size_t j = 0;
      for (auto& item : local_.named_parameters()) {
        if (stage_of_parameter(item.key(), layers) != s) continue;
        if (slice_owner(s, j, stage_slices_[world.rank][s][j][1]) == world.rank) writes_.insert(item.key());
        ++j;
      }
    }
    return;
  }
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
  // The lowest rank holding a parameter's slice writes it.
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i].key();
    int32_t first = -1;
    for (int32_t r = 0; r < world.size && first < 0; ++r) {
      if (sliced_ && slices_[static_cast<size_t>(r)][i] != slices_[static_cast<size_t>(world.rank)][i]) continue;
      first = r;
    }
    if (first == world.rank) writes_.insert(name);
  }
}

int32_t ModelGather::slice_owner(int64_t stage, size_t j, int64_t index) const {
  for (size_t r = 0; r < stage_slices_.size(); ++r) {
    const auto& entry = stage_slices_[r][static_cast<size_t>(stage)][j];
    if (entry[0] > 0 && entry[1] == index) return static_cast<int32_t>(r);
  }
  return -1;
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
    options.sequence_parallel.reset();
    options.context.reset();
    full_ = LlamaForCausalLM(local_.config(), options);
    if (lora_) apply_lora(*full_, *lora_, 0);
    add_prompt_parameter(*full_);  // prompt tuning: the prompt's place (its values are gathered)
  }
  if (sliced_ && !staged_) {
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
  // Staged (and perhaps sliced): every slice of every stage's parameters from its owner to rank 0,
  // in the same (stage, parameter, slice) order on both ends.
  const int64_t stages = local_.num_stages();
  const auto& table = stage_slices_;
  auto parts_of = [&](int64_t s, size_t j) -> std::array<int64_t, 3> {
    for (const auto& rank_table : table) {
      if (rank_table[static_cast<size_t>(s)][j][0] > 0) return rank_table[static_cast<size_t>(s)][j];
    }
    fail("no rank holds model stage {}; cannot save the model", s);
  };
  // Where this process computes (where its parameters are); rank 0 gathers there, then copies.
  const torch::Device device = local_.parameters().empty() ? torch::Device(torch::kCPU) : local_.parameters()[0].device();
  for (int64_t s = 0; s < stages; ++s) {
    const auto sources = local_.holds_stage(s) ? stage_parameters(local_, s) : std::vector<torch::Tensor>{};
    const size_t count = world.rank == 0 ? stage_parameters(*full_, s).size() : sources.size();
    std::vector<torch::Tensor> targets = world.rank == 0 ? stage_parameters(*full_, s) : std::vector<torch::Tensor>{};
    // Non-zero ranks only know their own stages' parameter counts; rank 0 the whole model's.
    for (size_t j = 0; j < count || (world.rank != 0 && j < sources.size()); ++j) {
      const auto [parts, index_unused, dim] = parts_of(s, j);
      (void)index_unused;
      std::vector<torch::Tensor> pieces(static_cast<size_t>(parts));
      for (int64_t k = 0; k < parts; ++k) {
        const int32_t owner = slice_owner(s, j, k);
        WEFT_CHECK(owner >= 0, "saving: slice {} of parameter {} of stage {} is held by no rank", k, j, s);
        if (world.rank == 0) {
          if (owner == 0) {
            pieces[static_cast<size_t>(k)] = sources.at(j).detach();
            continue;
          }
          const torch::Tensor& whole = targets.at(j);
          std::vector<int64_t> shape = whole.sizes().vec();
          const int64_t size = shape[static_cast<size_t>(dim)];
          shape[static_cast<size_t>(dim)] = (k + 1) * size / parts - k * size / parts;
          // On the device the owner sends from (the whole model is on the CPU): both ends of the
          // pair take the same route (NCCL for CUDA tensors), and rank 0's own slice joins them.
          pieces[static_cast<size_t>(k)] = torch::empty(shape, whole.options().device(device));
          auto received = communicator_.recv(world, pieces[static_cast<size_t>(k)], owner, static_cast<int32_t>(s));
          communicator_.wait(received);
        } else if (owner == world.rank) {
          auto sent = communicator_.send(world, sources.at(j).detach().contiguous(), 0, static_cast<int32_t>(s));
          communicator_.wait(sent);
        }
      }
      if (world.rank == 0) {
        WEFT_CHECK(j < targets.size(), "stage {}: more parameters held than the whole model has", s);
        targets[j].copy_(parts == 1 ? pieces[0] : torch::cat(pieces, dim));
      }
    }
  }
  if (world.rank == 0 && lora_ && lora_->adalora) apply_rank_pattern(*full_, rank_pattern_of(local_));
  return world.rank == 0 ? full_.get() : nullptr;
}

}  // namespace weft
