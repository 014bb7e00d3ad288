#include "core/train/sharded_state.h"

#include <algorithm>

#include <torch/torch.h>

#include "core/dist/process_groups.h"
#include "core/model/lora.h"
#include "core/train/optimizer.h"
#include "core/util/error.h"

namespace weft {

using torch::optim::AdamWParamState;

std::unique_ptr<torch::optim::AdamW> gather_sharded_optimizer(torch::optim::AdamW& sharded,
                                                              const std::vector<PluginHost::ShardedTensor>& shards,
                                                              LlamaForCausalLMImpl& model, const OptimOptions& options,
                                                              Communicator& communicator, ProcessGroup* group) {
  torch::NoGradGuard no_grad;
  auto whole = make_adamw(trainable_parameters(model), options);
  ProcessGroup& world = group ? *group : communicator.world();
  const int64_t ranks = world.size, count = static_cast<int64_t>(shards.size());
  // Every rank's range of every parameter, and whether it has stepped yet (no state before the
  // first step: then nothing is saved, as for an unsharded optimizer).
  auto ranges = torch::zeros({3 * count}, torch::kLong);
  for (int64_t i = 0; i < count; ++i) {
    const auto& s = shards[static_cast<size_t>(i)];
    ranges[3 * i] = s.begin;
    ranges[3 * i + 1] = s.count;
    ranges[3 * i + 2] = adamw_state(sharded, s.shard.defined() ? s.shard : s.whole) != nullptr ? 1 : 0;
  }
  auto all = torch::zeros({ranks * 3 * count}, torch::kLong);
  Operation exchange = communicator.all_gather(world, all, ranges);
  communicator.wait(exchange);
  all = all.view({ranks, count, 3});
  for (int64_t i = 0; i < count; ++i) {
    const auto& s = shards[static_cast<size_t>(i)];
    if (all.select(2, 2).select(1, i).min().item<int64_t>() == 0) continue;  // not stepped on some rank
    const AdamWParamState* mine = adamw_state(sharded, s.shard.defined() ? s.shard : s.whole);
    if (!s.shard.defined()) {  // whole on every rank: the same state everywhere
      set_adamw_state(*whole, s.whole, mine->step(), mine->exp_avg().clone(), mine->exp_avg_sq().clone());
      continue;
    }
    const int64_t widest = all.select(2, 1).select(1, i).max().item<int64_t>();
    auto send = torch::zeros({2 * widest}, s.shard.options());
    send.narrow(0, 0, s.count).copy_(mine->exp_avg().reshape({-1}));
    send.narrow(0, widest, s.count).copy_(mine->exp_avg_sq().reshape({-1}));
    auto received = torch::empty({ranks * 2 * widest}, s.shard.options());
    Operation gather = communicator.all_gather(world, received, send);
    communicator.wait(gather);
    received = received.view({ranks, 2, widest});
    auto exp_avg = torch::zeros({s.whole.numel()}, s.shard.options());
    auto exp_avg_sq = torch::zeros({s.whole.numel()}, s.shard.options());
    for (int64_t r = 0; r < ranks; ++r) {
      const int64_t begin = all[r][i][0].item<int64_t>(), n = all[r][i][1].item<int64_t>();
      if (n == 0) continue;
      exp_avg.narrow(0, begin, n).copy_(received[r][0].narrow(0, 0, n));
      exp_avg_sq.narrow(0, begin, n).copy_(received[r][1].narrow(0, 0, n));
    }
    set_adamw_state(*whole, s.whole, mine->step(), exp_avg.view(s.whole.sizes()), exp_avg_sq.view(s.whole.sizes()));
  }
  return whole;
}

void scatter_into_shards(torch::optim::AdamW& whole, torch::optim::AdamW& sharded,
                         const std::vector<PluginHost::ShardedTensor>& shards) {
  torch::NoGradGuard no_grad;
  for (const auto& s : shards) {
    if (s.own_storage) s.shard.copy_(s.whole.detach().reshape({-1}).narrow(0, s.begin, s.count));
    const AdamWParamState* state = adamw_state(whole, s.whole);
    if (state == nullptr) continue;  // the checkpoint's optimizer had not stepped this parameter
    WEFT_CHECK(state->exp_avg().numel() == s.whole.numel(), "checkpoint: the optimizer state of {} has {} elements, the "
               "parameter {}", s.name, state->exp_avg().numel(), s.whole.numel());
    if (!s.shard.defined()) {
      set_adamw_state(sharded, s.whole, state->step(), state->exp_avg().clone(), state->exp_avg_sq().clone());
      continue;
    }
    set_adamw_state(sharded, s.shard, state->step(), state->exp_avg().reshape({-1}).narrow(0, s.begin, s.count).clone(),
              state->exp_avg_sq().reshape({-1}).narrow(0, s.begin, s.count).clone());
  }
}

}  // namespace weft
