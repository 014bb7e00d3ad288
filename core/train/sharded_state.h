// Checkpoints under a plugin that shards the training state (FLAT_SHARD placements): the
// ranks' shards of AdamW's state are put together into the optimizer that single and ddp save
// (one state per whole trainable parameter), and sliced out of it again at resume. A checkpoint is
// therefore the same files whatever saved it, and resumes at another world size, with another
// placement or under another plugin (and a replicated run's checkpoint resumes sharded).
#pragma once

#include <memory>
#include <vector>

#include <torch/optim/adamw.h>

#include "core/job/options.h"
#include "core/model/llama.h"
#include "core/plugin/host_api.h"

namespace weft {

class Communicator;
struct ProcessGroup;

// An AdamW over the model's whole trainable parameters (make_adamw(trainable_parameters(model)),
// the layout single and ddp save) holding the state of every rank's shards of `sharded`.
// Collective over `group` (the world when null), which must be the group the shards split over
// (zero.so's world: the data-parallel slice of a composed run). Every rank of it gets the whole
// state (all-gathered); the parameters must be whole on the ranks that save.
std::unique_ptr<torch::optim::AdamW> gather_sharded_optimizer(torch::optim::AdamW& sharded,
                                                              const std::vector<PluginHost::ShardedTensor>& shards,
                                                              LlamaForCausalLMImpl& model, const OptimOptions& options,
                                                              Communicator& communicator, ProcessGroup* group = nullptr);

// The reverse, after a checkpoint was restored into `whole` (an AdamW as above) and into the whole
// parameters: each shard's slice of the state goes into `sharded`, and shards with storage of their
// own take their slice of the restored parameters. Local.
void scatter_into_shards(torch::optim::AdamW& whole, torch::optim::AdamW& sharded,
                         const std::vector<PluginHost::ShardedTensor>& shards);

}  // namespace weft
