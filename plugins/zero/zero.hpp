// zero.hpp - zero.so: sharded data parallelism (ZeRO stages 1-3, FSDP-style), on the SDK alone.
//
// Every rank sees its own rows of each global batch (plan: data_parallel_size = world size) and
// keeps 1/N of the training state: flat_shard gives each trainable parameter an even flat shard
// (flat_layout.hpp; uneven sizes: the last ranks' shards are shorter), so the host keeps AdamW's
// moments for those elements only and updates them from the gradient shard this plugin writes.
//  - stage 1: optimizer state sharded. Gradients are reduce-scattered per model stage (one
//    collective per stage's trainable parameters, started from the grad-ready hooks of the last
//    micro-batch in a fixed order, at most two in flight) into each rank's gradient shard; the
//    whole gradients stay allocated. after_optimizer_step all-gathers the updated shards into the
//    whole parameters.
//  - stage 2: as 1, and each whole gradient is freed (parameter_grad_release) as soon as it is
//    copied into its stage's reduce-scatter, so between steps a rank holds only gradient shards.
//  - stage 3: parameters sharded too (RELEASABLE shards, frozen LoRA bases included). train_step
//    runs the model stage by stage: before a stage's forward its parameters are all-gathered from
//    the shards (the next stage's gather is started while the current one computes), after it they
//    are released (plugin.reshard_after_forward, default true; false keeps them until their
//    backward); the backward runs stage by stage from the last, gathering again where released
//    (prefetching the stage before), then reduce-scatters the stage's gradients and frees its
//    parameters and whole gradients. Stage boundaries are copied into leaves that require grad, as
//    a pipeline's are. Tied embeddings: the embedding is used by the first and the last stage, so
//    it stays whole for the whole step.
// Gradient accumulation: micro-batches before the last accumulate whole gradients locally with no
// communication (stages 2 and 3 then hold whole gradients until the last micro-batch, as FSDP's
// no_sync does). eval_step: this rank's rows (stage 3 gathers stage by stage without gradients),
// {loss sum, tokens} summed over the world. global_grad_norm_sq: the sum of every rank's shard
// norms. materialize_parameters (stage 3): gathers every stage for the host to save the model.
//
// Collectives are bounded: a stage's parameters travel in groups of at most plugin.bucket_mb MiB
// (as whole fp32 tensors; a larger parameter is cut into pieces over consecutive groups), so no
// buffer holds more than that while the parameter itself is gathered or reduced piece by piece.
//
// Mixed precision (stage 3, plugin.param_dtype = "compute", the default; a host with ABI >= 1.6):
// the gathered matrices (linear weights, embedding, LoRA factors) are materialised in the run's
// compute dtype (bf16 / fp16) and their whole gradients come in it, as FSDP's
// MixedPrecisionPolicy(param_dtype=bf16) does: a rank's gathered parameters and whole gradients
// take half the memory and the forward makes no weight copies. The collectives still move fp32
// (the masters' values, the gradients widened) and masters, shards and gradient shards stay fp32.
// The products are the same as one process's (it casts the same fp32 values before each
// product); what differs is rounding where whole gradients add up in the compute dtype (the tied
// embedding's two uses, micro-batches) and the embedding lookup, which reads compute-dtype values.
//
// Composed over a device mesh (ABI 1.12: "gpipe,zero", "tensor_parallel,zero"): zero owns dp and
// stages 1 and 2 reduce-scatter the gradients after the driver's backward (finish_step); stage 3 is
// refused there (the driver runs the forward and backward that it would gather around).
//
// Configuration ([plugin]): stage (1, 2 or 3; default 3), reshard_after_forward (bool, default
// true; stage 3 only), bucket_mb (float > 0, default 64), param_dtype ("compute" or "fp32",
// default "compute"; stage 3 only). Needs a host with ABI >= 1.3 (1.6 for param_dtype). Master
// parameters are fp32.
#ifndef WEFT_PLUGINS_ZERO_ZERO_HPP
#define WEFT_PLUGINS_ZERO_ZERO_HPP

#include <cstdint>
#include <deque>
#include <exception>
#include <vector>

#include <weft/strategy.hpp>

#include "flat_layout.hpp"

namespace weft {
namespace zero {

class Zero : public weft::sdk::Strategy {
 public:
  static constexpr uint16_t min_host_minor = 3;
  // ABI 1.12: the data-parallel dimension of a composed run (stages 1 and 2; stage 3 runs alone).
  static constexpr uint32_t mesh_dimensions = 1u << WEFT_MESH_DP;

  explicit Zero(weft::sdk::Host host);
  ~Zero() override;

  void plan(weft_model_plan& plan) override;
  void setup() override;
  weft_flat_shard flat_shard(int64_t index) override;
  double train_step(const weft_step_info& step) override;
  weft::sdk::EvalResult eval_step(const weft_step_info& step) override;
  double global_grad_norm_sq(double local_sq) override;
  void after_optimizer_step() override;
  void materialize_parameters(bool whole) override;
  void memory_plan(weft_memory_plan& plan) override;
  // Composed (ABI 1.12): the gradients reduce-scattered after the driver's backward (stage 2 frees
  // each whole gradient once copied), the loss averaged; held-out sums added over the world.
  // gradient_copies stays 1: the ranks' shards are disjoint.
  double finish_step(const weft_step_info& step, double loss) override;
  weft::sdk::EvalResult finish_eval(const weft_step_info& step, const weft::sdk::EvalResult& sums) override;

 private:
  // A collective of one group in flight, with the buffers it uses.
  struct InFlight {
    size_t group = 0;
    weft::sdk::Buffer send, receive;
    weft::sdk::Work work;
  };
  // One model stage: its parameters and the groups (collectives) they travel in.
  struct StageLayout {
    std::vector<int64_t> gathered;       // host indices (stage 3: every parameter; else the trainable)
    std::vector<size_t> gather_groups;   // indices into gather_groups_
    std::vector<size_t> reduce_groups;   // indices into reduce_groups_ (its trainable parameters)
    int64_t trainable = 0;               // trainable parameters (grad-ready bookkeeping)
  };

  // --- gradients: reduce-scatter into the gradient shards ---
  InFlight start_reduce(size_t group);
  void finish_reduce(InFlight& flight);
  void reduce_stage(size_t stage);  // starts its groups, keeping at most kInFlight started and unfinished
  void finish_reduces();
  static void grad_ready_trampoline(void* user_data, int64_t parameter_index) noexcept;
  void on_grad_ready(int64_t parameter_index);

  // --- parameters: all-gather from the shards into whole parameters ---
  InFlight start_gather(size_t group);
  void finish_gather(InFlight& flight);
  void gather_every_group();               // stages 1-2: the updated shards into the whole parameters
  void ensure_whole(size_t stage);         // stage 3: gathered, waiting for its prefetch if one is in flight
  void prefetch(size_t stage);             // stage 3: starts the stage's gathers if it is released
  void release_stage(size_t stage, bool even_pinned = false);  // stage 3: frees its parameters
  void release_all();

  double staged_train_step(const weft_step_info& step);  // stage 3
  double hooked_train_step(const weft_step_info& step);  // stages 1 and 2
  double all_reduce_sum(std::vector<double>& values);
  void abandon() noexcept;

  weft::sdk::Group world_;
  int32_t ranks_ = 1, rank_ = 0;
  int64_t stage_ = 3;
  bool reshard_after_forward_ = true;
  double bucket_mb_ = 64.0;                // the most a collective moves (whole group, fp32)
  int64_t model_stages_ = 0;
  std::vector<StageLayout> stages_;
  std::vector<FlatGroup> gather_groups_, reduce_groups_;
  std::vector<size_t> gather_stage_;      // per gather group: its model stage
  size_t first_trainable_ = 0;            // the first model stage with a trainable parameter
  std::vector<size_t> reduce_order_;      // model stages from the last to the first (gradients' order)
  std::vector<char> whole_;               // per model stage: its parameters are whole now
  std::vector<int64_t> gathered_;         // per model stage: groups finished since its release
  std::vector<char> gather_started_;      // per gather group: started since its stage's release
  std::vector<int64_t> stage_of_;         // per host parameter: its model stage if trainable, else -1
  std::vector<int64_t> pieces_;           // per host parameter: its pieces in the reduce groups
  std::vector<int64_t> pieces_left_;      // per host parameter: pieces not yet copied in this sync
  std::vector<int64_t> pending_;          // per model stage: trainable parameters not ready yet
  std::vector<char> ready_;               // per host parameter: gradient ready in this backward
  size_t next_reduce_ = 0;                // index into reduce_order_ of the next stage to reduce
  std::deque<InFlight> reducing_;
  std::deque<InFlight> gathering_;
  bool syncing_ = false;
  bool resting_ = false;  // stage 3: every unpinned stage released
  bool tied_ = false;     // tied embeddings: stage 0 pinned whole during steps
  bool compute_dtype_ = false;  // stage 3: whole matrices in the compute dtype (plugin.param_dtype, ABI 1.6)
  std::exception_ptr callback_error_;
};

}  // namespace zero
}  // namespace weft

#endif  // WEFT_PLUGINS_ZERO_ZERO_HPP
