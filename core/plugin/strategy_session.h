// One strategy for this process, with a C++ face: the rest of the host (the trainer, the evaluator,
// generation) calls these methods and never sees a plugin's C ABI. Behind it: the plugin libraries
// (loaded, or the built-in single), and the host's step for them (core/plugin/abi2.cpp,
// abi2_pipeline.cpp), whose methods the session calls, served by a PluginHost. Every method throws weft::Error naming the plugin when it fails.
#pragma once

#include <algorithm>
#include <cstdint>
#include <array>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <toml++/toml.h>
#include "core/plugin/step/services.h"

#include "core/dist/mesh.h"
#include "core/model/llama.h"
#include "core/model/parallel.h"
#include "core/plugin/host_api.h"
#include "core/plugin/library.h"

namespace weft {

class BatchLoader;
class EvalLoader;
class Communicator;

// Where the plugin puts this rank: the model stages it holds and its data-parallel coordinates.
struct Placement {
  StageSet stages;  // one range, or a pipeline rank's virtual stages
  int data_parallel_rank = 0;
  int data_parallel_size = 1;
  int context_parallel_rank = 0;  // the plan's context_parallel_*: this rank's share of every sequence
  int context_parallel_size = 1;
  bool split_backward = false;  // the plugin splits backward passes (input, then weight gradients)
};

// Bytes one rank will hold at its peak, by kind: the host's one-process estimate of the stages and
// slices the plugin chose, adjusted by the plugin (memory_plan).
struct MemoryPlan {
  int64_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, buffers = 0;
  int64_t total() const { return parameters + gradients + optimizer + activations + buffers; }
};

// What one step did on this rank.
struct StepReport {
  double loss = 0.0;                      // the step's mean loss (the same on every rank)
  PluginHost::CommStats comm;             // this rank's communication during the step
  PluginHost::ComputeStats compute;       // its time in the host's forward/loss and backward
  std::map<std::string, double> metrics;  // what the plugin reported (report_metric)
};

// One held-out batch's token-weighted loss, summed over the ranks that share it.
struct EvalSums {
  double loss_sum = 0.0;
  int64_t tokens = 0;
};

class StrategySession {
 public:
  // Loads the plugin (`path_or_name`; "" means single, which is built into the host) and creates
  // its instance, which validates its [plugin] settings and the world size. Throws weft::Error on
  // any refusal, before the model is built. `communicator` must outlive the session.
  //
  // Composition: `path_or_name` may name several plugins, comma-separated ("tensor_parallel,gpipe");
  // each owns one dimension of the device mesh (its table's mesh_dimensions), sized by `mesh`
  // ([mesh] pp, dp, cp, tp in Mesh's order; 0 = unset, see Mesh::resolve), and reads the [plugin]
  // settings (its [plugin.<name>] table first). One step runs them all: the pipeline plugin's, else
  // the tensor-parallel one's, else the context-parallel one's, executing the others' layouts over
  // their mesh slices (compose).
  StrategySession(const std::string& path_or_name, toml::table plugin_config, Communicator& communicator,
                  std::array<int32_t, 4> mesh = {0, 0, 0, 0});
  ~StrategySession();  // destroys the instance; the library stays loaded
  StrategySession(const StrategySession&) = delete;
  StrategySession& operator=(const StrategySession&) = delete;

  // The library whose step runs (the one plugin when alone).
  const PluginLibrary& library() const { return *library_; }
  // The plugins' names, the step's first ("tensor_parallel" alone, "gpipe+tensor_parallel" composed).
  std::string names() const;
  // The mesh of a composed run; null alone.
  const Mesh* mesh() const { return mesh_ ? &*mesh_ : nullptr; }
  // "ddp 2.0.0 (ABI 2.5) from /path/ddp.so"
  std::string describe() const;
  // What every rank must agree on: the plugin's name, version and negotiated ABI.
  std::string fingerprint() const;

  // --- before the model is built ---
  // Tells the plugin the model's shape and the run's batch geometry, and asks where this rank
  // stands (the one-process layout for a plugin without a plan).
  Placement place(const ModelConfig& config, torch::Dtype compute_dtype, int64_t seq_len, int64_t batch_rows);
  // How this rank holds each parameter of `stages` (empty: every tensor whole).
  ShardMap shards(const ModelConfig& config, const StageSet& stages);
  // This rank's memory plan for `stages` (the host's estimate of each model stage as this rank
  // holds it) over the stages in `held`, micro-batches of `rows` sequences of seq_len; the
  // plugin adjusts it (memory_plan). No communication.
  MemoryPlan memory_plan(const std::vector<weft_stage_memory>& stages, const StageSet& held, int32_t micro_batches,
                         int64_t rows, int64_t seq_len);
  // The communication the model runs at its fixed points, or null for a plugin without any.
  std::shared_ptr<const CommHook> comm_hook();
  // Context parallelism: the sequence split the plan chose (context_parallel_*), its all-to-all
  // the step's context_exchange, or its attention core the step's context_attention; nullptr
  // when the plan keeps whole sequences.
  std::shared_ptr<const ContextSplit> context_split();
  // Megatron sequence parallelism the plan chose, its collectives the step's sequence_region; nullptr when the residual stream keeps whole sequences.
  std::shared_ptr<const SequenceShards> sequence_parallel();
  int64_t sequence_parallel_size() const { return sequence_parallel_.size; }
  // Tokens per row of the hidden states between stages on this rank (stage_tokens):
  // seq_len over the plan's sequence splits.
  int64_t stage_tokens(int64_t seq_len) const {
    return seq_len / std::max<int64_t>(1, context_.size) / std::max<int64_t>(1, sequence_parallel_.size);
  }
  // Whether the plan has the plugin run the attention core over split sequences.
  bool plugin_attention() const { return plugin_attention_ && context_.size > 1; }

  // --- after ---
  // The model the host services refer to (built, weights loaded); runs the plugin's setup.
  void attach(LlamaForCausalLMImpl& model);
  // One optimizer step's forward and backward passes: `micro_batches` micro-batches of `loader`
  // from global batch step_in_epoch x micro_batches of `epoch`. Gradients are left for the
  // optimizer.
  StepReport train_step(const BatchLoader& loader, int64_t global_step, int64_t epoch, int64_t step_in_epoch,
                        int32_t micro_batches, int64_t seq_len);
  // Held-out batch `index` of `loader`, forward only.
  EvalSums eval_batch(const EvalLoader& loader, int64_t index, int64_t global_step, int64_t epoch, int64_t seq_len);
  // The global squared gradient norm from this rank's share.
  double global_grad_norm_sq(double local_sq);
  // What the optimizer updates (the parameters, or their shards under a plugin that shards the
  // training state: the step's flat_shard, asked in attach), and whether anything is sharded.
  std::vector<PluginHost::TrainingTensor> training_tensors() const { return state_host_->training_tensors(); }
  bool shards_training_state() const { return state_host_->sharded(); }
  // Whether a plugin may release parameters between uses (WEFT_FLAT_SHARD_RELEASABLE shards).
  bool releases_parameters() const { return host_->releases_parameters() || state_host_->releases_parameters(); }
  // The process group the training state is sharded over: the sharding plugin's mesh dimension in a
  // composed run, null (the world) alone.
  ProcessGroup* state_group() const { return state_group_; }
  std::vector<PluginHost::ShardedTensor> trainable_shards() const { return state_host_->trainable_shards(); }
  // Bytes of this rank's parameters and gradients now (PluginHost::parameter_and_gradient_bytes).
  std::pair<int64_t, int64_t> parameter_and_gradient_bytes() const { return state_host_->parameter_and_gradient_bytes(); }
  // ABI 2 plugins keep training state of their own in the host (weft_state_tensor): checkpoints
  // carry it (the same on every rank) and a resume gives it back.
  bool keeps_plugin_state() const { return true; }
  std::vector<std::pair<std::string, at::Tensor>> plugin_state() const { return host_->plugin_state(); }
  void restore_plugin_state(const std::vector<std::pair<std::string, at::Tensor>>& saved) {
    host_->restore_plugin_state(saved);
  }
  // The parameters each rank holds as its own (ABI 2.1 LOCAL placements over several ranks):
  // checkpoints keep every rank's values and optimizer state of them (set up after setup()).
  std::vector<std::string> local_parameters() const { return host_->local_parameters(); }
  // PluginHost::chunked_loss of the step's host.
  int chunked_loss() const { return host_->chunked_loss(); }
  // After the optimizer step (whether it ran or fp16 skipped it): zeroes the gradient shards and
  // lets the plugin act (e.g. all-gather the updated shards, hooks at "step.end"); their
  // communication and metrics go into the step's `report`. Collective.
  void after_optimizer_step(StepReport& report);
  // Every parameter whole (true, e.g. to save the model) or back to the plugin's layout (false).
  // Collective; nothing where the step keeps every parameter whole anyway.
  void materialize_parameters(bool whole);
  // fp16: the factor the host's loss service multiplies every training loss by before the
  // plugin's backward (1: none). The plugin sees the scaled gradients; the trainer unscales them.
  void set_loss_scale(double scale);
  // This rank's communication through the plugin since the last call (which resets it).
  PluginHost::CommStats take_comm_stats();
  // Per-sequence evaluation (PluginHost::record_sequence_losses / take_sequence_losses).
  void record_sequence_losses(int64_t sequences, int64_t outputs = 0);
  std::pair<at::Tensor, at::Tensor> take_sequence_losses();
  at::Tensor take_sequence_outputs();

 private:
  // One plugin of the run: its library, the PluginHost serving it, its instance (the step's only) and,
  // composed, the mesh dimension it owns.
  struct Member {
    std::shared_ptr<PluginLibrary> library;
    std::unique_ptr<PluginHost> host;
    std::unique_ptr<sdk::Strategy> step;  // the host's step (create_abi2_step), the step's member only
    int dimension = -1;
  };
  void check(weft_status* status, const char* what) const;
  // Runs `body` (a call into the step), throwing weft::Error "plugin <name> (<path>): <what>: ..." on failure.
  void call(const char* what, const std::function<void()>& body) const;
  void check_settings_read(const toml::table& plugin_config) const;
  // Several plugins on the mesh: one step, that of the plugin owning pp, else tp, else cp.
  void compose(const std::vector<std::shared_ptr<PluginLibrary>>& libraries, const toml::table& plugin_config,
               Communicator& communicator, std::array<int32_t, 4> requested);
  std::vector<const Member*> members() const;  // the step's plugin, then its companions
  // The plugin that splits sequences (a context-parallel companion, else the step's own).
  const std::string& context_plugin() const;

  Member step_;                   // the plugin whose step runs (alone: the one plugin)
  std::vector<Member> companions_;  // composed: the plugins whose layouts that step executes (no instance)
  std::string context_plugin_;    // the context-parallel companion's name, if any
  std::optional<Mesh> mesh_;      // composed runs only
  Communicator* communicator_ = nullptr;
  std::shared_ptr<PluginLibrary> library_;  // step_'s
  PluginHost* host_ = nullptr;              // step_'s
  // The host that serves the optimizer's tensors (the step's, which shards them under FLAT_SHARD).
  PluginHost* state_host_ = nullptr;
  ProcessGroup* state_group_ = nullptr;
  sdk::Strategy* instance_ = nullptr;  // step_'s step
  LlamaForCausalLMImpl* model_ = nullptr;
  ContextSplit context_;       // the plan's context split, without callbacks
  bool plugin_attention_ = false;  // the plugin computes the attention core ("attention.core")
  SequenceShards sequence_parallel_;  // Megatron sequence parallelism, without its collective
};

}  // namespace weft
