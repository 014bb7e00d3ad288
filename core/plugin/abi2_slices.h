// A plugin that owns the tensor-parallel dimension, as the host's steps execute it (abi2.cpp without
// a pipeline, abi2_pipeline.cpp with one): its SLICE placements (asked before the model is built,
// checked against what the model holds after), its PARTIAL gradients summed over the ranks that hold
// the same parameter, each gradient counted once in the norm, and its hooks at the model's points.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/model/parallel.h"
#include "core/plugin/abi2_context.h"
#include "core/plugin/placement_collectives.h"

namespace weft {

// A status from `o` becomes an sdk::Error naming it and the function (`what`, unless null).
void abi2_check(const Abi2Instance& o, weft_status* status, const char* what);
// `o`'s placement of a parameter (weft_place, told its full shape; without it, REPLICATE everywhere).
weft_parameter_layout abi2_placement(const Abi2Instance& o, const weft_parameter_info& info);

// A plugin's hook at a point, and the plugin it calls.
struct Abi2Hook {
  std::string point;
  weft_hook_fn fn;
  Abi2Instance* owner;
};
// `o`'s hooks ("weft_hooks") into `out`, each at one of `published` (else one error naming the point).
void abi2_register_hooks(Abi2Instance& o, const std::vector<std::string>& published, std::vector<Abi2Hook>& out);
// The hooks at `point`: `tensor` combined in place, or filled from `source` where the point moves tokens
// (event.tensor, source, backward, layer; step: `step`).
// Sequence parallelism (weft_layout.sequence_parallel over `ranks` > 1) moves tokens at every region's
// ends: `tp` must hook each of them (else one error naming the missing points).
void abi2_check_sequence_hooks(const Abi2Instance& tp, const std::vector<Abi2Hook>& hooks, int32_t ranks);
// The bytes `o` holds itself at the step's peak ("weft_memory", 0 without it), for a memory plan of
// `plan`'s shapes with `tokens` of each sequence on this rank.
int64_t abi2_plugin_memory(const Abi2Instance& o, const weft_memory_plan& plan, int64_t tokens, int32_t compute_bytes);
// The hooks at a step's point ("train.begin", "step.end"; event.step: `step`).
void abi2_run_step_hooks(const std::vector<Abi2Hook>& hooks, const char* point, int64_t step);
void abi2_run_model_hooks(const std::vector<Abi2Hook>& hooks, const std::string& point, bool backward, int64_t layer,
                          DLTensor& tensor, const DLTensor* source, int64_t step);

// A plugin that owns the context-parallel dimension, as both host steps execute it: its sequence split
// (the plan's), and its hook at the attention, "attention.exchange" (the model's all-to-alls around its
// core) or "attention.core" (the plugin computes the core itself).
class SequenceSplit {
 public:
  // Registers `cp`'s hooks into `hooks` (which this keeps a reference to) at once, since the plan, asked
  // before the model is built, depends on them; one error if it hooks no attention point, both, or the
  // balanced split with "attention.exchange". `group`: its dimension.
  SequenceSplit(Abi2Instance& cp, sdk::Group group, std::vector<Abi2Hook>& hooks);
  const Abi2Instance& owner() const { return cp_; }
  int32_t ranks() const { return group_.size(); }
  // The plan's sequence fields (with more than one rank).
  void plan(weft_model_plan& plan) const;
  // The attention's points of decoder block `layer` (weft_hook_event.step: `step`).
  void exchange(int64_t step, int64_t layer, weft_direction direction, const DLTensor& send, DLTensor& recv) const;
  void attention(int64_t step, const weft_attention_call& call) const;

 private:
  Abi2Instance& cp_;
  sdk::Group group_;
  const std::vector<Abi2Hook>& hooks_;
  bool plugin_attention_ = false;
};

class TensorSlices {
 public:
  // `tp`: the plugin, whose dimension is `group` (the world alone, its mesh slice composed; the mesh
  // puts tp innermost: a group is consecutive ranks).
  TensorSlices(sdk::Host host, Abi2Instance& tp, sdk::Group group) : host_(host), tp_(tp), group_(group) {}

  const sdk::Group& group() const { return group_; }
  // The slice a placement asks for (whole for REPLICATE), after checking what this host executes on
  // the tensor-parallel dimension: parameters SLICE or REPLICATE, their gradients as the parameter
  // or PARTIAL, optimizer states as the parameter.
  ParameterShard slice_of(const std::string& parameter, int32_t ndim, const weft_parameter_layout& where) const;
  // What the model should hold of a parameter (before it is built: weft_place with its full shape).
  ParameterShard shard(const weft_parameter_info& info) const { return slice_of(info.name, info.ndim, abi2_placement(tp_, info)); }
  // A built parameter: the slice the model holds must be the one asked for (LoRA's factors follow their
  // base layer's); a trainable one is counted, its PARTIAL gradient summed.
  void place(int64_t index, const weft_parameter_info& info);
  // One summing reducer per slice count (the whole group for REPLICATE parameters' PARTIAL gradients,
  // each group of ranks sharing a slice). Returns the whole group's, or null. Collective.
  GradientReducer* make_reducers(int64_t bucket_bytes);
  bool sums() const { return !reducers_.empty(); }
  // Sums now, over their groups, the PARTIAL gradients among `indices` (a pipeline chunk's, before its
  // data-parallel reduce-scatter takes them); start() and finish() then leave them to the caller.
  void sum_now(const std::vector<int64_t>& indices);
  // The sums: started (`armed`: the one armed for the last backward starts what is left), waited for.
  void start(const GradientReducer* armed);
  void finish();
  void abandon() noexcept;
  // Of each trainable parameter's squared gradient norm divided by how many tp ranks hold it: the share
  // of those whose optimizer state `flat_sharded` (ascending) holds in ranges (their gradient shards),
  // and of the others (whole gradients).
  // `skip`: a parameter not counted here (a tied embedding's second copy), or -1.
  std::pair<double, double> norm_shares(const std::vector<int64_t>& flat_sharded, int64_t skip = -1) const;

 private:
  sdk::Host host_;
  Abi2Instance& tp_;
  sdk::Group group_;
  std::vector<int64_t> trainable_;
  std::vector<double> copies_;
  std::map<int32_t, std::vector<int64_t>> partial_;  // PARTIAL gradients by their parameter's slice count
  std::vector<std::unique_ptr<GradientReducer>> reducers_;
  std::vector<std::pair<sdk::Group, std::vector<int64_t>>> sums_;  // each reducer's group and gradients
};

}  // namespace weft
