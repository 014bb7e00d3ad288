// The host's step services (core/plugin/step/services.h), bound to one process's run.
// StrategySession creates one PluginHost per plugin and tells it, as the run proceeds, which model
// and which step the services refer to.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <toml++/toml.h>
#include "core/plugin/step/services.h"

#include "core/model/parallel.h"

namespace weft {

class BatchLoader;
class EvalLoader;
class LlamaForCausalLMImpl;
class Communicator;
class Mesh;
struct ProcessGroup;
struct ModelConfig;

class PluginHost {
 public:
  // plugin_name prefixes log lines; plugin_config is the [plugin] section of the run's config, its
  // sub-table [plugin.<plugin_name>], where present, overriding it key by key for this plugin;
  // communicator provides the world group (it must outlive this object).
  PluginHost(std::string plugin_name, toml::table plugin_config, Communicator& communicator);
  ~PluginHost();
  PluginHost(const PluginHost&) = delete;
  PluginHost& operator=(const PluginHost&) = delete;

  // The handle the step's services take (sdk::Host); valid for this object's life.
  weft_host* handle();

  // The [plugin] keys the plugin has asked for, in order, each with the value it got (configured,
  // or the plugin's default): its effective settings.
  const std::vector<std::pair<std::string, std::string>>& settings_read() const;

  // The model's shape for model_info and profile_stages (before plan; bf16: the compute dtype;
  // seq_len and batch_rows: the run's sequence length and train.batch_size).
  void set_model_info(const ModelConfig& config, torch::Dtype compute_dtype, int64_t seq_len, int64_t batch_rows);
  // Context parallelism (the plan's context_parallel_*): batch() returns
  // this rank's tokens of every row from now on (ContextSplit::token_runs; size 1: whole rows).
  void set_context_split(int64_t rank, int64_t size, ContextLayout layout = ContextLayout::kContiguous);
  // The model the services refer to (after it is built). Enumerates the parameters it holds.
  void set_model(LlamaForCausalLMImpl* model);
  // The training step that batch() serves: micro-batch m of the step is global batch
  // index * micro_batches + m of `epoch` from `loader`.
  void begin_train_step(const BatchLoader* loader, int64_t epoch, int64_t index, int32_t micro_batches);
  // The evaluation batch that batch() serves (micro-batch 0 only).
  void begin_eval_step(const EvalLoader* loader, int64_t index);
  // Ends the current step (batch() is refused until the next begin_*).
  void end_step();

  // What this rank's plugin communicated through the host's collectives and transfers since the
  // last call (which resets it): operations issued, their payload bytes (the data this rank
  // contributes or receives: the tensor of all_reduce/broadcast/send/recv, the input of
  // reduce_scatter/all_gather/all_to_all) and the wall time spent blocked in work_wait.
  struct CommStats {
    int64_t operations = 0;
    int64_t bytes = 0;
    double wait_seconds = 0.0;
  };
  CommStats take_comm_stats();
  // The wall time this rank's plugin spent inside the host's forward and loss services
  // (forward_seconds) and its backward service (backward_seconds) since the last call (which
  // resets them). Timed only where the model computes on the CPU (`timed`): on a GPU the services
  // return once the work is queued.
  struct ComputeStats {
    double forward_seconds = 0.0;
    double backward_seconds = 0.0;
    bool timed = false;
  };
  ComputeStats take_compute_stats();
  // How this rank's loss service computed causal-LM losses so far: 1 in row chunks from the final
  // norm's output alone (model.chunked_loss), 0 from whole logits at least once, -1 none computed.
  int chunked_loss() const;
  // The values the plugin reported with report_metric since the last call (which clears them).
  std::map<std::string, double> take_step_metrics();
  // ABI 2.1 ("weft_state_tensor"): the plugin's training state the host keeps for it, by name (the
  // same on every rank), for checkpoints; and a checkpoint's, given back: tensors the plugin made
  // already get their values now, the others when it makes them.
  std::vector<std::pair<std::string, at::Tensor>> plugin_state() const;
  // The parameters placed LOCAL over more than one rank, by name (ABI 2.1): each rank's own.
  std::vector<std::string> local_parameters() const;
  // The group the flat shards cover when the plugin shards over part of its dimension (HSDP), else null.
  ProcessGroup* flat_shard_group() const;
  void restore_plugin_state(const std::vector<std::pair<std::string, at::Tensor>>& saved);
  // The loss service's extra factor on the loss it returns for backward (fp16 loss scaling).
  void set_loss_scale(double scale);
  // Per-sequence evaluation: from now on, the loss of every evaluation row whose sequence index
  // is known (the targets batch() handed out) is also summed by sequence, out of `sequences`.
  // A classification model also sums each sequence's head outputs (its `outputs` logits at the
  // pooled position; take_sequence_outputs).
  void record_sequence_losses(int64_t sequences, int64_t outputs = 0);
  // Stops recording and returns, by sequence index, the summed token losses this rank computed
  // and how many times it computed each (float64 tensors of `sequences` entries).
  std::pair<at::Tensor, at::Tensor> take_sequence_losses();
  // After take_sequence_losses, with outputs > 0: the summed head outputs [sequences, outputs]
  // (float64), counted as the losses are.
  at::Tensor take_sequence_outputs();
  // Calls the registered grad-ready callback machinery's bookkeeping (tests).
  int64_t parameter_count() const;

  // --- sharded training state (host_shards.cpp) ---
  // Records the flat shard the plugin chose for parameter `index` (after set_model): refuses a
  // range outside the parameter; a whole range without flags means "not sharded". Allocates the
  // gradient shard of a trainable parameter and the own storage of a releasable shard.
  void set_flat_shard(int64_t index, const weft_flat_shard& shard);
  // What the optimizer updates, per trainable parameter in the model's order: the parameter
  // itself, or for a sharded one its master shard, whose .grad() is the gradient shard the plugin
  // writes. `matrix`: the whole parameter has two or more dimensions (AdamW decays those).
  struct TrainingTensor {
    std::string name;
    at::Tensor tensor;
    bool matrix = false;
  };
  std::vector<TrainingTensor> training_tensors() const;
  // Per trainable parameter, in the model's order: the parameter, and where it is sharded, its
  // master shard and the flat range [begin, begin + count) it holds (checkpoints gather and slice
  // the optimizer state with these).
  struct ShardedTensor {
    std::string name;
    at::Tensor whole;  // the parameter (whole while the plugin keeps it so)
    at::Tensor shard;  // its master shard; undefined when not sharded
    int64_t begin = 0, count = 0;
    bool own_storage = false;  // a RELEASABLE shard: storage of its own, not a view of `whole`
  };
  std::vector<ShardedTensor> trainable_shards() const;
  // True when some parameter's training state is sharded.
  bool sharded() const;
  // True when some parameter's shard is WEFT_FLAT_SHARD_RELEASABLE (the plugin frees and gathers it).
  bool releases_parameters() const;
  // While true (the host's materialize_parameters(1)), parameter_materialize gives fp32 whole
  // parameters whatever WEFT_FLAT_SHARD_COMPUTE_DTYPE says.
  void set_materialize_masters(bool masters);
  // Zeroes every gradient shard (after the optimizer step).
  void zero_grad_shards();
  // Bytes this rank's parameters and gradients hold now (between steps: what persists): whole
  // parameters not released plus releasable shards' own storage; whole gradients plus gradient
  // shards.
  std::pair<int64_t, int64_t> parameter_and_gradient_bytes() const;
  // The host's memory estimate per model stage, which stage_memory serves (before the model).
  void set_stage_memory(std::vector<weft_stage_memory> stages);

  struct State;  // defined in host_api.cpp; `weft_host` points to it

 private:
  std::unique_ptr<State> state_;
};

}  // namespace weft
