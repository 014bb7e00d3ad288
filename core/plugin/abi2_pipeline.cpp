// The host's step for an ABI 2 plugin that owns the pipeline dimension: the plugin gives where the
// virtual stages live (weft_layout's pipeline fields) and each rank's compute actions
// ("weft_schedule"); the host partitions the model, adds the transfers, verifies the whole
// schedule and runs it with the pipeline runtime that the 1.x pipeline plugins use too
// (core/pipeline: its verifier, executor and step, which take the schedule as data). Composed on
// a mesh, a data-parallel plugin's layout runs over the pipeline's replicas and a tensor-parallel
// plugin's slices and hooks inside each stage (abi2_slices.h).
#include <algorithm>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/plugin/abi2_context.h"
#include "core/plugin/abi2_slices.h"
#include "core/plugin/host_services.h"
#include "core/plugin/placement_collectives.h"
#include "core/plugin/replicas.h"
#include "async_pipeline.hpp"
#include "pipeline_strategy.hpp"
#include "schedule.hpp"
#include "verify.hpp"

namespace weft {
namespace {

// The pipeline plugin's instance, and what its layout says, for the step's life.
struct PipelinePlugin : Abi2Instance {
  PipelinePlugin(sdk::Host host, const Abi2Plugin& p) : Abi2Instance(host, p) {}
  weft_schedule_fn schedule = nullptr;
  std::vector<int32_t> chunk_stage;  // copied from the layout (empty: the loop order)
};

std::string plugin_name(const PipelinePlugin& o) { return o.plugin.table.name; }

// The data-parallel plugin composed with the pipeline one on a mesh pp x dp (train.plugin names
// both, in either order): its instance and layout, its dimension the mesh's dp slice of this rank.
using Companion = Abi2Instance;

void check_status(const sdk::Host& host, const std::string& name, weft_status* status, const char* what) {
  if (status == nullptr) return;
  const weft_status_code code = status_code(status);
  const std::string message = status_message(status);
  status_release(status);
  throw sdk::Error(code, fmt::format("{} ({}): {}", name, what, message));
}

// A status from the plugin becomes an Error naming it and the function (`what`, unless null).
void check_status(const PipelinePlugin& o, weft_status* status, const char* what) {
  if (status == nullptr) return;
  const weft_status_code code = status_code(status);
  const std::string message = status_message(status);
  status_release(status);
  throw sdk::Error(code, what ? fmt::format("{} ({}): {}", plugin_name(o), what, message) : message);
}

[[noreturn]] void refuse_layout(const PipelinePlugin& o, const std::string& problem) {
  throw sdk::Error(WEFT_STATUS_BAD_CONFIG, fmt::format("{}: {}", plugin_name(o), problem));
}

// Every rank's compute actions for a step of `micro_batches` micro-batches, from the plugin, as the
// runtime's schedule with the transfers added (not yet verified).
pipeline::Schedule plugin_schedule(PipelinePlugin& o, int32_t stages, int32_t micro_batches) {
  const int32_t chunks = o.layout.pipeline_chunks;
  std::vector<std::vector<weft_action>> lists(static_cast<size_t>(stages));
  const int64_t most = 3LL * micro_batches * chunks + 1;
  for (int32_t p = 0; p < stages; ++p) {
    weft_schedule_request request{};
    request.struct_size = sizeof request;
    request.rank = p;
    request.stages = stages;
    request.chunks = chunks;
    request.micro_batches = micro_batches;
    const weft_action* actions = nullptr;
    int64_t count = 0;
    check_status(o, o.schedule(o.instance, &request, &actions, &count), "weft_schedule");
    if (count < 0 || count > most || (count > 0 && actions == nullptr)) {
      refuse_layout(o, fmt::format("weft_schedule gave {} actions for rank {} (a step of {} micro-batches x {} chunks has at most {})",
                            count, p, micro_batches, chunks, most));
    }
    lists[static_cast<size_t>(p)].assign(actions, actions + count);
  }
  try {
    return pipeline::schedule_from_actions(plugin_name(o), stages, micro_batches, chunks, o.chunk_stage, lists);
  } catch (const std::invalid_argument& e) {
    refuse_layout(o, fmt::format("weft_schedule: {}", e.what()));
  }
}

class PipelineStep : public pipeline::PipelineStrategy {
 public:
  static PipelineStep* create(sdk::Host host, const Abi2Plugin& plugin) {
    auto opened = std::make_unique<PipelinePlugin>(host, plugin);
    std::unique_ptr<Companion> companion;
    std::unique_ptr<Abi2Instance> tensor, context;
    sdk::Group tp_slice, cp_slice;
    Options options = open(host, *opened, companion, tensor, tp_slice, context, cp_slice);
    return new PipelineStep(host, std::move(opened), std::move(companion), std::move(tensor), tp_slice, std::move(context),
                            cp_slice, std::move(options));
  }

  // A tensor-parallel plugin composed with the pipeline: what the model holds of each weight.
  weft_shard shard_parameter(const weft_parameter_info& info) override {
    if (!slices_) return weft_shard{0, 1, 0};
    const ParameterShard slice = slices_->shard(info);
    return weft_shard{slice.dim, slice.parts, slice.index};
  }
  // Its hooks at the model's points (the session calls none without it: skips_model_points).
  bool runs_model_points() const override { return true; }
  void comm_point(weft_comm_point point, weft_direction direction, int64_t layer, DLTensor& tensor) override {
    abi2_run_model_hooks(hooks_, comm_point_name(static_cast<CommPoint>(point)), direction == WEFT_BACKWARD, layer, tensor,
                         nullptr, 0);
  }
  void sequence_region(weft_comm_point point, weft_direction direction, int64_t layer, const DLTensor& input,
                       DLTensor& output) override {
    abi2_run_model_hooks(hooks_, comm_point_name(static_cast<CommPoint>(point)), direction == WEFT_BACKWARD, layer, output,
                         &input, 0);
  }
  // A context-parallel plugin composed with the pipeline: its attention hook in every stage.
  void context_exchange(int64_t layer, weft_direction direction, const DLTensor& send, DLTensor& recv) override {
    sequences_->exchange(step_, layer, direction, send, recv);
  }
  void context_attention(const weft_attention_call& call) override { sequences_->attention(step_, call); }

  void plan(weft_model_plan& plan) override {
    PipelineStrategy::plan(plan);
    if (tensor_ && tensor_->layout.sequence_parallel != 0 && tp_slice_.size() > 1) {  // Megatron's, in the tp slice
      plan.sequence_parallel_size = tp_slice_.size();
      plan.sequence_parallel_rank = tp_slice_.rank();
    }
    if (sequences_) sequences_->plan(plan);  // each rank its share of every sequence, in every stage
  }

  // The ranks whose gradients are averaged: the pipeline's replicas over dp, and with a context-parallel
  // plugin dp x cp flattened (Options::replica_group); this rank's place among them.
  int32_t replicas() const { return replica_group().get() != nullptr ? replica_group().size() : placement().replicas; }
  int32_t replica() const { return replica_group().get() != nullptr ? replica_group().rank() : placement().replica; }

  ~PipelineStep() override {
    reducer_.reset();
    slices_.reset();
    gatherer_.reset();
    state_gatherer_.reset();
  }

  // Replicas of the pipeline (the plugin's pipeline_stages below the world, or a data-parallel plugin
  // composed on the mesh): the data-parallel plugin's placements over them. REPLICATE gradients are
  // averaged in buckets that start during each chunk's last backward (or at its REDUCE after a split
  // one's last weight pass) and are waited for before the optimizer step; FLAT_SHARD ones are
  // reduce-scattered into this rank's ranges, whose optimizer state it keeps (ZeRO's stages 1 and 2
  // per pipeline stage); FLAT_SHARD parameters are whole only between their chunk's GATHER and
  // RELEASE (FSDP x PP: gathered before the chunk's first forward of the step, released after its
  // reduction, as torchtitan's pipelines keep FSDP's parameters through the micro-batches).
  void setup() override {
    PipelineStrategy::setup();
    if (opened_->layout.pipeline_asynchronous == 1) async_ = std::make_unique<pipeline::AsyncPipeline>(host(), world(), placement());
    if (slices_) {  // the tensor-parallel plugin's slices, PARTIAL sums and hooks
      for (int64_t i = 0; i < host().parameter_count(); ++i) slices_->place(i, host().parameter_info(i));
      abi2_register_hooks(*tensor_, comm_point_names(), hooks_);
      abi2_check_sequence_hooks(*tensor_, hooks_, tp_slice_.size());
      slices_->make_reducers(tensor_->layout.reduce_bucket_bytes);
    }
    if (replicas() <= 1) return;
    const sdk::Host h = host();
    const std::string dp_name = companion_ ? companion_->name() : plugin_name(*opened_);
    const auto place =
        companion_ ? reinterpret_cast<weft_place_fn>(companion_->proc("weft_place")) : static_cast<weft_place_fn>(nullptr);
    std::vector<GradientReducer::Reduced> reduced;
    std::vector<int64_t> replicated;  // every parameter: replicas start equal
    std::vector<std::pair<int64_t, int64_t>> parameter_stages, state_stages;  // (index, model stage)
    const auto& chunks = placement().chunk_stages;
    chunk_parameters_.assign(chunks.size(), {});
    int64_t trainable = 0;
    for (int64_t i = 0; i < h.parameter_count(); ++i) {
      const weft_parameter_info info = h.parameter_info(i);
      DLTensor data = h.parameter_data(i);
      weft_parameter_layout where{};
      if (place != nullptr) {
        const weft_parameter_desc desc = abi2_parameter_desc(info);
        check_status(h, dp_name, place(companion_->instance, &desc, &where), "weft_place");
        check_abi2_placement(dp_name, info, where);
        if (where.parameter.kind == WEFT_PLACE_LOCAL) {
          throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                           fmt::format("{} places {} LOCAL beside pipeline {}, which this host (ABI 2.{}) does not "
                                       "execute yet (REPLICATE, FLAT_SHARD)",
                                       dp_name, info.name, plugin_name(*opened_), WEFT_PLUGIN_ABI_MINOR));
        }
      }
      const bool shard_parameter = where.parameter.kind == WEFT_PLACE_FLAT_SHARD;
      const bool fp32 = data.dtype.code == kDLFloat && data.dtype.bits == 32;
      if (shard_parameter) {
        if (!fp32) {
          throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                           fmt::format("{} places parameter {} FLAT_SHARD, but it is not fp32 (this host shards fp32 "
                                       "parameters; model.frozen_dtype = \"fp32\" keeps a frozen base so)",
                                       dp_name, info.name));
        }
        parameter_shards_.push_back(i);
        parameter_stages.emplace_back(i, info.stage);
      }
      replicated.push_back(i);
      if (!info.trainable) continue;
      ++trainable;
      if (!fp32) {
        throw sdk::Error(WEFT_STATUS_UNSUPPORTED, fmt::format("{}: trainable parameter {} is not fp32", plugin_name(*opened_),
                                                              info.name));
      }
      if (where.optimizer_state.kind == WEFT_PLACE_FLAT_SHARD) {
        state_shards_.push_back(i);
        if (!shard_parameter) state_stages.emplace_back(i, info.stage);
      }
      const bool scatter = where.gradient.kind == WEFT_PLACE_FLAT_SHARD;
      if (scatter) grad_shards_.push_back(i);
      reduced.push_back({i, scatter});
      if (i == tied_parameter()) continue;  // reduced once its two copies are summed (end_reductions)
      for (size_t c = 0; c < chunks.size(); ++c) {
        if (chunks[c].first <= info.stage && info.stage < chunks[c].second) {
          chunk_parameters_[c].push_back(i);
          break;
        }
      }
    }
    make_replicas_equal(h, replica_group(), replicated);
    // Reduce-scattered gradients take each chunk's whole gradients at its REDUCE: its PARTIAL sums come
    // first, there, instead of after the flush (and none of its buckets starts during the backward).
    tp_first_ = slices_ && slices_->sums() && !grad_shards_.empty();
    if (!state_shards_.empty() && static_cast<int64_t>(state_shards_.size()) != trainable) {
      throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                       fmt::format("{} shards the optimizer state of {} of the {} trainable parameters beside pipeline {}: "
                                   "this host shards all of them or none under a pipeline",
                                   dp_name, state_shards_.size(), trainable, plugin_name(*opened_)));
    }
    const int64_t bucket_bytes =
        std::max<int64_t>(1, companion_ ? companion_->layout.reduce_bucket_bytes : bucket_bytes_);
    if (!state_shards_.empty()) {  // the checkpoint gathers the optimizer state over the ranges' group
      h.handle()->state->flat_shard_group = replica_group().get()->group;
    }
    if (!state_stages.empty()) {
      state_gatherer_ = std::make_unique<ParameterGatherer>(h, replica_group(), h.model_num_stages(), state_stages, bucket_bytes);
    }
    if (!parameter_shards_.empty()) {
      gatherer_ = std::make_unique<ParameterGatherer>(h, replica_group(), h.model_num_stages(), parameter_stages, bucket_bytes);
      // Each chunk gathers the model stages of its parameters; a copy of a tied embedding (model stage
      // 0) is gathered by the chunk that holds the head too.
      chunk_gather_.assign(chunks.size(), {});
      const int64_t last_stage = h.model_num_stages() - 1;
      const bool tied = h.model_info().tie_word_embeddings != 0;
      for (const auto& [index, stage] : parameter_stages) {
        for (size_t c = 0; c < chunks.size(); ++c) {
          const bool holds = chunks[c].first <= stage && stage < chunks[c].second;
          const bool head = tied && stage == 0 && chunks[c].first <= last_stage && last_stage < chunks[c].second;
          auto& list = chunk_gather_[c];
          if ((holds || head) && std::find(list.begin(), list.end(), stage) == list.end()) list.push_back(stage);
        }
      }
      gathered_.assign(static_cast<size_t>(h.model_num_stages()), 0);  // released at the first step
    }
    if (reduced.empty()) return;
    reducer_ = std::make_unique<GradientReducer>(h, replica_group(), replica_group(), sdk::Group(), reduced, bucket_bytes);
    reducer_->set_explicit(true);  // a chunk's gradients are final at its REDUCE, not at each backward
    reducer_->keep_gradients_in_buckets();  // each replicated gradient a view of its bucket, as ddp's
    if (async_ && !state_shards_.empty()) {
      throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                       fmt::format("{} places state FLAT_SHARD, which the asynchronous pipeline of {} does not run (its "
                                   "replicas hold whole parameters, gradients and optimizer state)",
                                   dp_name, plugin_name(*opened_)));
    }
  }

  // The optimizer state FLAT_SHARD: this rank's range of each parameter over its stage's replicas
  // (ceil(n / N) elements in replica order); a FLAT_SHARD parameter's range is its master copy.
  weft_flat_shard flat_shard(int64_t index) override {
    const int64_t elements = element_count(host().parameter_data(index));
    const bool parameter = std::binary_search(parameter_shards_.begin(), parameter_shards_.end(), index);
    if (!parameter && !std::binary_search(state_shards_.begin(), state_shards_.end(), index)) {
      return weft_flat_shard{0, elements, 0u, 0u};
    }
    weft_flat_shard range = flat_range(elements, replicas(), replica(), parameter);
    if (parameter && companion_->layout.shard_compute_dtype != 0) range.flags |= WEFT_FLAT_SHARD_COMPUTE_DTYPE;
    return range;
  }

  // The pipeline's plan (PipelineStrategy::memory_plan), with the data-parallel plugin's FLAT_SHARD
  // placements over the replicas: 1 / N of the optimizer state's share; the gradients' range beside
  // the whole ones; the parameters' range beside the whole ones, which a chunk keeps from its GATHER to
  // its RELEASE (all of this rank's at the step's peak).
  void memory_plan(weft_memory_plan& plan) override {
    PipelineStrategy::memory_plan(plan);
    const int32_t compute_bytes = host().model_info().compute_dtype.bits / 8;
    const int64_t tokens = plan.seq_len / (sequences_ ? sequences_->ranks() : 1);
    for (const Abi2Instance* o : {static_cast<const Abi2Instance*>(opened_.get()), static_cast<const Abi2Instance*>(companion_.get()),
                                  static_cast<const Abi2Instance*>(tensor_.get()), static_cast<const Abi2Instance*>(context_.get())}) {
      if (o != nullptr) plan.buffer_bytes += abi2_plugin_memory(*o, plan, tokens, compute_bytes);  // the plugins' own
    }
    // Each rank's share of every sequence. (The buckets that average the gradients over cp, or dp x
    // cp, are the gradients' own memory: keep_gradients_in_buckets.)
    if (sequences_) plan.activation_bytes /= sequences_->ranks();
    if (!companion_ || replicas() <= 1) return;
    std::vector<std::pair<int64_t, int64_t>> ranges(placement().chunk_stages.begin(), placement().chunk_stages.end());
    const Abi2ShardShares shares =
        abi2_shard_shares(host(), companion_->name(), reinterpret_cast<weft_place_fn>(companion_->proc("weft_place")),
                          companion_->instance, ranges);
    const double n = replicas();
    const auto range = [n](int64_t bytes, double share) {
      return static_cast<int64_t>(static_cast<double>(bytes) * share / n);
    };
    plan.optimizer_bytes -= static_cast<int64_t>(static_cast<double>(plan.optimizer_bytes) * shares.optimizer_state) -
                            range(plan.optimizer_bytes, shares.optimizer_state);
    const int64_t gradients = plan.gradient_bytes;
    plan.gradient_bytes += range(gradients, std::max(shares.gradient, shares.optimizer_state));
    plan.parameter_bytes += range(plan.parameter_bytes, shares.parameter);
    if (companion_->layout.shard_compute_dtype != 0 && shares.parameter > 0.0) {  // whole in the compute dtype
      int64_t saved = 0, saved_gradients = 0;
      for (const auto& [first, last] : ranges) {
        for (int64_t s = first; s < last; ++s) {
          const weft_stage_memory m = host().stage_memory(s);
          saved += m.parameter_bytes - m.compute_parameter_bytes;
          saved_gradients += m.trainable_bytes - m.compute_trainable_bytes;
        }
      }
      plan.parameter_bytes -= static_cast<int64_t>(static_cast<double>(saved) * shares.parameter);
      plan.gradient_bytes -= static_cast<int64_t>(static_cast<double>(saved_gradients) * shares.parameter);
    }
    // An all-reduce bucket holds its gradients themselves (keep_gradients_in_buckets): nothing beside
    // them. A reduce-scatter bucket takes the place of the whole gradients it frees, beside its row.
    plan.buffer_bytes += range(gradients, shares.gradient);
  }

  double train_step(const weft_step_info& step) override {
    if (async_) return asynchronous_step(step);
    if (!began_) {  // the context-parallel plugin's step hooks (the others register none beside a pipeline)
      began_ = true;
      abi2_run_step_hooks(hooks_, "train.begin", step.step);
    }
    step_ = step.step;
    try {
      if (gatherer_ && !resting_) {  // whole since the last materialisation (a save)
        gatherer_->release_all();
        std::fill(gathered_.begin(), gathered_.end(), 0);
        resting_ = true;
      }
      const double loss = PipelineStrategy::train_step(step);
      if (slices_ && slices_->sums() && !tp_first_) {  // the PARTIAL sums over the averaged gradients, then their ranges
        slices_->start(nullptr);
        slices_->finish();
        shard_gradients();
      }
      return loss;
    } catch (...) {
      if (reducer_) reducer_->abandon();
      if (slices_) slices_->abandon();
      throw;
    }
  }

  sdk::EvalResult eval_step(const weft_step_info& step) override {
    if (!gatherer_ || !resting_) return PipelineStrategy::eval_step(step);
    gatherer_->gather_all();  // a forward-only schedule over whole parameters
    sdk::EvalResult result = PipelineStrategy::eval_step(step);
    gatherer_->release_all();
    return result;
  }

  // Every parameter whole (a checkpoint, generation) or back to its ranges.
  void materialize_parameters(bool whole) override {
    if (!gatherer_) return;
    if (whole) {
      gatherer_->gather_all();
    } else {
      gatherer_->release_all();
    }
    std::fill(gathered_.begin(), gathered_.end(), 0);
    resting_ = !whole;
  }

  // The asynchronous 1F1B with weight stashing (weft_layout.pipeline_asynchronous): the host's runtime runs this
  // step's forward and the stashed backward (AsyncPipeline); then the tied embedding's copies are summed
  // and the replicas' gradients averaged.
  double asynchronous_step(const weft_step_info& step) {
    if (step.micro_batches != 1) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                       fmt::format("{}: the asynchronous pipeline runs one minibatch per step; set train.grad_accum_steps "
                                   "= 1 (it is {})",
                                   plugin_name(*opened_), step.micro_batches));
    }
    if (!began_) {
      began_ = true;
      abi2_run_step_hooks(hooks_, "train.begin", step.step);
    }
    step_ = step.step;
    const double local = async_->step(step.step, step.rows_per_micro_batch, step.stage_tokens);
    combine_tied_embedding_gradients();
    if (reducer_) {
      try {
        reducer_->start_all();
        reducer_->finish();
      } catch (...) {
        reducer_->abandon();
        throw;
      }
    }
    const double loss = sum_over(world(), {placement().is_last() ? local : 0.0})[0] / placement().replicas;
    host().report_metric("stashed_versions", static_cast<double>(async_->peak_stashed()));
    host().report_metric("stash_weight_staleness", async_->last_weight_staleness());
    host().report_metric("stash_recompute_difference", async_->last_recompute_difference());
    return loss;
  }

  // The optimizer state FLAT_SHARD, the parameter whole: each rank's updated range into every replica.
  void after_optimizer_step() override {
    if (state_gatherer_) state_gatherer_->refresh_all();
    abi2_run_step_hooks(hooks_, "step.end", step_ + 1);
  }

  // Sharded, the host's norm covers this rank's ranges: the stage's replicas together cover each
  // element once, so the sum runs over every rank, less the last stage's tied copy (its range).
  double global_grad_norm_sq(double local_sq) override {
    if (slices_) {  // each slice and range once over the world; the replicas' whole gradients over dp
      const auto [ranges, whole] = slices_->norm_shares(state_shards_, placement().is_first() ? -1 : tied_parameter());
      const std::vector<double> sums = sum_over(host().world(), {ranges, whole});
      return sums[0] + sums[1] / replicas();
    }
    if (state_shards_.empty()) return PipelineStrategy::global_grad_norm_sq(local_sq);
    double copy = 0.0;
    if (tied_parameter() >= 0 && !placement().is_first()) copy = host().squared_norm(host().parameter_grad_shard(tied_parameter()));
    // The ranges cover each element once over the pipeline's ranks, and with cp over theirs too (the world).
    return sum_over(sequences_ ? host().world() : world(), {local_sq - copy})[0];
  }

 protected:
  pipeline::Schedule step_schedule(int32_t micro_batches) override {
    return plugin_schedule(*opened_, placement().stages, micro_batches);
  }

  // The verifier's simulated bubble of the plugin's schedule (forward 1, backward 2, a split
  // backward's weight half 1, free transfers).
  double bubble_formula(int32_t micro_batches) override {
    const auto it = bubbles_.find(micro_batches);
    if (it != bubbles_.end()) return it->second;
    return bubbles_[micro_batches] = pipeline::verify(step_schedule(micro_batches)).bubble;
  }

  bool reduces_in_schedule() const override { return replicas() > 1; }
  bool gathers_in_schedule() const override { return gatherer_ != nullptr; }

  pipeline::Executor::ChunkHooks chunk_hooks() override {
    pipeline::Executor::ChunkHooks hooks;
    hooks.reduce = [this](int32_t chunk) { reduce_chunk(chunk); };
    hooks.final_backward = [this](int32_t chunk, bool before) { final_backward(chunk, before); };
    hooks.gather = [this](int32_t chunk) {
      const auto& stages = chunk_gather_.at(static_cast<size_t>(chunk));
      for (int64_t stage : stages) {  // every stage's all-gathers under way before the first is waited for
        if (gathered_[static_cast<size_t>(stage)] == 0) gatherer_->prefetch(stage);
      }
      for (int64_t stage : stages) {
        if (gathered_[static_cast<size_t>(stage)]++ == 0) gatherer_->gather(stage);
      }
    };
    hooks.release = [this](int32_t chunk) {
      for (int64_t stage : chunk_gather_.at(static_cast<size_t>(chunk))) {
        if (--gathered_[static_cast<size_t>(stage)] == 0) gatherer_->release(stage);
      }
    };
    return hooks;
  }

  void begin_reductions() override {
    if (reducer_) reducer_->arm();
    started_at_reduce_ = 0;
  }

  // REDUCE(chunk): what of the chunk's gradients did not start during its last backward starts now.
  void reduce_chunk(int32_t chunk) {
    if (!reducer_) return;
    if (tp_first_) slices_->sum_now(chunk_parameters_.at(static_cast<size_t>(chunk)));
    const int64_t before = reducer_->started_in_backward();
    for (int64_t index : chunk_parameters_.at(static_cast<size_t>(chunk))) reducer_->ready(index);
    started_at_reduce_ += reducer_->started_in_backward() - before;
  }
  // During a chunk's last backward its buckets start as the host reports each gradient final, as
  // PyTorch DDP's do during the backward (whole backwards only: a split one finishes the weights at W).
  void final_backward(int32_t chunk, bool before) {
    if (!reducer_) return;
    if (before) {
      std::vector<char> mask(static_cast<size_t>(host().parameter_count()), 0);
      if (!tp_first_) {  // (else nothing starts before the chunk's PARTIAL sums, at its REDUCE)
        for (int64_t index : chunk_parameters_.at(static_cast<size_t>(chunk))) mask[static_cast<size_t>(index)] = 1;
      }
      reducer_->accept_only(std::move(mask));
    }
    reducer_->set_explicit(!before);
  }

  // After the run: the tied embedding's copies summed, then its reduction and the rest; all waited for.
  void end_reductions() override {
    combine_tied_embedding_gradients();
    if (!reducer_) return;
    reducer_->start_rest();
    reducer_->finish();
    reducer_->disarm();
    shard_gradients();
    // metrics.jsonl: plugin.reduce_buckets, plugin.reduce_buckets_in_backward (started during a chunk's
    // last backward, before its REDUCE)
    host().report_metric("reduce_buckets", static_cast<double>(reducer_->buckets()));
    host().report_metric("reduce_buckets_in_backward",
                         static_cast<double>(reducer_->started_in_backward() - started_at_reduce_));
  }

  // The optimizer state FLAT_SHARD, the gradient whole: this rank's range of each averaged gradient
  // into the parameter's gradient shard, which the host's optimizer reads.
  void shard_gradients() const {
    copy_gradient_ranges(host(), state_shards_, grad_shards_, replicas(), replica());
  }


 private:
  PipelineStep(sdk::Host host, std::unique_ptr<PipelinePlugin> opened, std::unique_ptr<Companion> companion,
               std::unique_ptr<Abi2Instance> tensor, sdk::Group tp_slice, std::unique_ptr<Abi2Instance> context,
               sdk::Group cp_slice, Options options)
      : PipelineStrategy(host, opened->plugin.table.name, std::move(options)), opened_(std::move(opened)),
        companion_(std::move(companion)), tensor_(std::move(tensor)), tp_slice_(tp_slice),
        context_(std::move(context)), cp_slice_(cp_slice), bucket_bytes_(kAbi2DefaultBucketBytes) {
    if (tensor_) slices_ = std::make_unique<TensorSlices>(host, *tensor_, tp_slice_);
    if (context_) sequences_ = std::make_unique<SequenceSplit>(*context_, cp_slice_, hooks_);
    host.handle()->state->skips_model_points = tensor_ == nullptr;
  }

  // A plugin composed with this one over `group` (this rank's slice of `dimension`): its instance, and its
  // layout over the host's defaults.
  static std::unique_ptr<Abi2Instance> open_beside(sdk::Host host, const Abi2Plugin& plugin, weft_host* settings,
                                                   sdk::Group group, int32_t dimension) {
    auto c = std::make_unique<Abi2Instance>(host, plugin, group.get(), settings);
    check_status(host, c->name(), c->plugin.table.create(&c->services, &c->instance), "create");
    c->layout.struct_size = sizeof c->layout;
    c->layout.dimension = dimension;
    c->layout.batch_split = WEFT_SPLIT_NONE;
    c->layout.reduce_bucket_bytes = kAbi2DefaultBucketBytes;
    if (auto fn = reinterpret_cast<weft_layout_fn>(c->proc("weft_layout"))) {
      check_status(host, c->name(), fn(c->instance, &c->layout), "weft_layout");
    }
    return c;
  }
  [[noreturn]] static void refuse_beside(const Abi2Instance& c, const PipelinePlugin& o, const std::string& problem) {
    throw sdk::Error(WEFT_STATUS_UNSUPPORTED, fmt::format("{} composed with pipeline {}: {}", c.name(), plugin_name(o), problem));
  }

  // The context-parallel plugin composed with this one: its instance over this rank's cp slice and its
  // layout (a split of the sequences), its hooks asked at once (SequenceSplit).
  static std::unique_ptr<Abi2Instance> open_context(sdk::Host host, const PipelinePlugin& o, sdk::Group cp) {
    const PluginHost::State& state = *host.handle()->state;
    auto c = open_beside(host, *state.abi2_context_parallel, state.abi2_context_parallel_settings, cp, WEFT_MESH_CP);
    if (c->layout.batch_split != WEFT_SPLIT_SEQUENCE && c->layout.batch_split != WEFT_SPLIT_SEQUENCE_BALANCED) {
      refuse_beside(*c, o, "it owns the context-parallel dimension, but its weft_layout does not split sequences");
    }
    for (const char* later : {"weft_schedule", "weft_place"}) {
      if (c->proc(later) != nullptr) {
        refuse_beside(*c, o, fmt::format("it provides {}, which this host (ABI 2.{}) does not execute for a context-parallel "
                                         "plugin beside a pipeline",
                                         later, WEFT_PLUGIN_ABI_MINOR));
      }
    }
    return c;
  }

  // The tensor-parallel plugin composed with this one: its instance over this rank's tp slice and its
  // layout (the same rows on every rank of the slice).
  static std::unique_ptr<Abi2Instance> open_tensor(sdk::Host host, const PipelinePlugin& o, sdk::Group tp) {
    const PluginHost::State& state = *host.handle()->state;
    auto c = open_beside(host, *state.abi2_tensor_parallel, state.abi2_tensor_parallel_settings, tp, WEFT_MESH_TP);
    if (c->layout.batch_split != WEFT_SPLIT_NONE) refuse_beside(*c, o, "its weft_layout splits the batch, which tensor-parallel ranks share");
    if (c->proc("weft_schedule") != nullptr) refuse_beside(*c, o, "it provides weft_schedule but does not own the pipeline dimension");
    return c;
  }

  // The data-parallel plugin composed with this one: its instance over this rank's dp slice, and its
  // layout, which must split rows.
  static std::unique_ptr<Companion> open_companion(sdk::Host host, const PipelinePlugin& o, sdk::Group dp) {
    const PluginHost::State& state = *host.handle()->state;
    auto c = std::make_unique<Companion>(host, *state.abi2_data_parallel, dp.get(), state.abi2_data_parallel_settings);
    check_status(host, c->name(), c->plugin.table.create(&c->services, &c->instance), "create");
    c->layout.struct_size = sizeof c->layout;
    c->layout.dimension = WEFT_MESH_DP;
    c->layout.batch_split = WEFT_SPLIT_NONE;
    c->layout.reduce_bucket_bytes = kAbi2DefaultBucketBytes;
    c->layout.shard_group_size = 0;
    c->layout.pipeline_chunks = 1;
    c->layout.pipeline_micro_batches = 1;
    if (auto fn = reinterpret_cast<weft_layout_fn>(c->proc("weft_layout"))) {
      check_status(host, c->name(), fn(c->instance, &c->layout), "weft_layout");
    }
    const auto refuse = [&](const std::string& problem) {
      throw sdk::Error(WEFT_STATUS_UNSUPPORTED, fmt::format("{} composed with pipeline {}: {}", c->name(), plugin_name(o), problem));
    };
    if (c->layout.batch_split != WEFT_SPLIT_ROWS) {
      refuse(fmt::format("its weft_layout's batch split is {}; over dp the pipeline's replicas take the batch's rows "
                         "(WEFT_SPLIT_ROWS)",
                         c->layout.batch_split));
    }
    check_shard_options(c->name(), c->layout);
    if (c->layout.shard_group_size != 0 && c->layout.shard_group_size != dp.size()) {
      refuse(fmt::format("its weft_layout's shard group of {} ranks (this host shards over the whole dp dimension "
                         "under a pipeline)",
                         c->layout.shard_group_size));
    }
    for (const char* later : {"weft_schedule", "weft_hooks"}) {
      if (c->proc(later) != nullptr) {
        refuse(fmt::format("it provides {}, which this host (ABI 2.{}) does not execute for a data-parallel plugin "
                           "beside a pipeline yet",
                           later, WEFT_PLUGIN_ABI_MINOR));
      }
    }
    return c;
  }

  // Creates the plugin's instance and reads its layout; composed, makes the dp slices' groups
  // (collective) and opens the data-parallel plugin over them.
  static Options open(sdk::Host host, PipelinePlugin& o, std::unique_ptr<Companion>& companion,
                      std::unique_ptr<Abi2Instance>& tensor, sdk::Group& tp_slice, std::unique_ptr<Abi2Instance>& context,
                      sdk::Group& cp_slice) {
    const sdk::Group world = host.world();
    // Composed on a mesh pp x dp x cp x tp (rank = ((p x dp + d) x cp + c) x tp + t), the plugin's
    // dimension is this rank's pp slice; the pipeline runs over the ranks x = p x dp + d of this rank's
    // inner coordinate i = c x tp + t (a copy of the pipeline per i); each tp slice holds one pipeline
    // rank's slices and each cp slice its share of the sequences; the replicas that average gradients
    // (and hold FLAT_SHARD ranges) are dp x cp flattened. Every rank makes every group, in the same
    // order (collective).
    const PluginHost::State& state = *host.handle()->state;
    const bool composed = state.abi2_data_parallel != nullptr || state.abi2_tensor_parallel != nullptr ||
                          state.abi2_context_parallel != nullptr;
    const int32_t mesh_pp = composed ? state.abi2_mesh[0] : 0;
    const int32_t cp = composed ? std::max(1, state.abi2_mesh[2]) : 1;
    const int32_t tp = composed ? std::max(1, state.abi2_mesh[3]) : 1;
    const int32_t inner = cp * tp;
    sdk::Group pp_slice = world, dp_slice, pipeline;
    if (mesh_pp != 0) {
      const int32_t dp = world.size() / (mesh_pp * inner), x = world.rank() / inner, i = world.rank() % inner;
      const int32_t p_me = x / dp, d_me = x % dp, c_me = i / tp, t_me = i % tp;
      const auto rank_of = [&](int32_t p, int32_t d, int32_t c, int32_t t) { return ((p * dp + d) * cp + c) * tp + t; };
      const auto make = [&](const std::vector<int32_t>& ranks, bool mine, sdk::Group& out) {
        sdk::Group g = host.create_group(ranks);
        if (mine) out = g;
      };
      for (int32_t t = 0; t < tp; ++t) {
        for (int32_t p = 0; p < mesh_pp; ++p) {  // the replicas: dp x cp
          std::vector<int32_t> ranks;
          for (int32_t d = 0; d < dp; ++d) {
            for (int32_t c = 0; c < cp; ++c) ranks.push_back(rank_of(p, d, c, t));
          }
          make(ranks, p == p_me && t == t_me, dp_slice);
        }
        for (int32_t c = 0; c < cp; ++c) {
          for (int32_t d = 0; d < dp; ++d) {  // the pipeline plugin's dimension: pp
            std::vector<int32_t> ranks;
            for (int32_t p = 0; p < mesh_pp; ++p) ranks.push_back(rank_of(p, d, c, t));
            make(ranks, d == d_me && c == c_me && t == t_me, pp_slice);
          }
        }
      }
      if (inner > 1) {
        for (int32_t j = 0; j < inner; ++j) {  // each copy of the pipeline: world rank = x x inner + j
          std::vector<int32_t> ranks;
          for (int32_t y = 0; y < mesh_pp * dp; ++y) ranks.push_back(y * inner + j);
          make(ranks, j == i, pipeline);
        }
      }
      for (int32_t y = 0; y < mesh_pp * dp && tp > 1; ++y) {
        for (int32_t c = 0; c < cp; ++c) {
          std::vector<int32_t> ranks;
          for (int32_t t = 0; t < tp; ++t) ranks.push_back((y * cp + c) * tp + t);
          make(ranks, y == x && c == c_me, tp_slice);
        }
      }
      for (int32_t y = 0; y < mesh_pp * dp && cp > 1; ++y) {
        for (int32_t t = 0; t < tp; ++t) {
          std::vector<int32_t> ranks;
          for (int32_t c = 0; c < cp; ++c) ranks.push_back((y * cp + c) * tp + t);
          make(ranks, y == x && t == t_me, cp_slice);
        }
      }
    }
    o.context.group = pp_slice.get();
    check_status(o, o.plugin.table.create(&o.services, &o.instance), nullptr);  // the session names the plugin and "create"
    const auto proc = [&](const char* name) { return o.plugin.table.get_proc_address(name); };
    o.layout.struct_size = sizeof o.layout;
    o.layout.dimension = WEFT_MESH_PP;
    o.layout.batch_split = WEFT_SPLIT_NONE;
    o.layout.reduce_bucket_bytes = kAbi2DefaultBucketBytes;
    o.layout.shard_group_size = 0;
    o.layout.pipeline_chunks = 1;
    o.layout.chunk_stages = nullptr;
    o.layout.pipeline_micro_batches = 1;
    o.layout.pipeline_balance = nullptr;
    o.layout.pipeline_partition = WEFT_PARTITION_PARAMETERS;
    o.layout.pipeline_balance_count = 0;
    o.layout.pipeline_stages = 0;
    o.layout.pipeline_asynchronous = 0;
    if (auto fn = reinterpret_cast<weft_layout_fn>(proc("weft_layout"))) check_status(o, fn(o.instance, &o.layout), "weft_layout");
    if (o.layout.batch_split != WEFT_SPLIT_NONE) {
      refuse_layout(o, fmt::format("weft_layout's batch split {}: a pipeline's ranks all take the whole batch (WEFT_SPLIT_NONE) "
                            "and split it into weft_layout.pipeline_micro_batches",
                            o.layout.batch_split));
    }
    for (const char* later : {"weft_place", "weft_hooks"}) {
      if (proc(later) != nullptr) {
        throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                         fmt::format("{} provides {}, which this host (ABI 2.{}) does not execute for a plugin that owns "
                                     "the pipeline dimension yet",
                                     plugin_name(o), later, WEFT_PLUGIN_ABI_MINOR));
      }
    }
    o.schedule = reinterpret_cast<weft_schedule_fn>(proc("weft_schedule"));
    if (o.schedule == nullptr) refuse_layout(o, "it owns the pipeline dimension but provides no weft_schedule");
    const int32_t chunks = o.layout.pipeline_chunks;
    if (mesh_pp != 0 && o.layout.pipeline_stages != 0 && o.layout.pipeline_stages != mesh_pp) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_stages = {}, but the device mesh has pp = {}: composed with a "
                                   "data-parallel plugin, the mesh's pp is the pipeline's stages",
                                   o.layout.pipeline_stages, mesh_pp));
    }
    const int32_t stages = mesh_pp != 0 ? mesh_pp : o.layout.pipeline_stages == 0 ? world.size() : o.layout.pipeline_stages;
    if (stages < 1 || world.size() % stages != 0) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_stages = {} must be >= 1 and divide the {} ranks", stages,
                                   world.size()));
    }
    if (chunks < 1 || chunks > WEFT_MAX_STAGE_CHUNKS) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_chunks = {} (1 to {})", chunks, WEFT_MAX_STAGE_CHUNKS));
    }
    if (o.layout.pipeline_micro_batches < 1 || o.layout.pipeline_micro_batches > 4096) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_micro_batches = {} (1 to 4096)", o.layout.pipeline_micro_batches));
    }
    if (o.layout.chunk_stages != nullptr) {
      o.chunk_stage.assign(o.layout.chunk_stages, o.layout.chunk_stages + static_cast<size_t>(stages) * chunks);
    }
    if (const std::string bad = pipeline::check_chunk_map(stages, chunks, o.chunk_stage); !bad.empty()) {
      refuse_layout(o, "weft_layout's chunk_stages: " + bad);
    }
    Options options;
    options.schedule_name = plugin_name(o);
    options.stages = stages;
    options.microbatches = o.layout.pipeline_micro_batches;
    options.chunks = chunks;
    options.chunk_stage = o.chunk_stage;
    if (o.layout.pipeline_balance_count != 0) {
      if (o.layout.pipeline_balance == nullptr || o.layout.pipeline_balance_count != stages * chunks) {
        refuse_layout(o, fmt::format("weft_layout's pipeline_balance has {} entries for {} virtual stages ({} stages x {} chunks)",
                                     o.layout.pipeline_balance_count, stages * chunks, stages, chunks));
      }
      options.balance.assign(o.layout.pipeline_balance, o.layout.pipeline_balance + o.layout.pipeline_balance_count);
    }
    if (o.layout.sequence_parallel != 0) {
      refuse_layout(o, "weft_layout.sequence_parallel is for a plugin that owns the tensor-parallel dimension");
    }
    if (o.layout.pipeline_partition != WEFT_PARTITION_PARAMETERS && o.layout.pipeline_partition != WEFT_PARTITION_TIME) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_partition = {} (WEFT_PARTITION_PARAMETERS or WEFT_PARTITION_TIME)",
                                   o.layout.pipeline_partition));
    }
    options.partition_by_time = o.layout.pipeline_partition == WEFT_PARTITION_TIME;
    if (o.layout.pipeline_asynchronous != 0) {
      if (o.layout.pipeline_asynchronous != 1) {
        refuse_layout(o, fmt::format("weft_layout's pipeline_asynchronous = {} (0 or 1)", o.layout.pipeline_asynchronous));
      }
      if (chunks != 1) refuse_layout(o, fmt::format("the asynchronous pipeline holds one chunk per rank, not {}", chunks));
      if (state.abi2_tensor_parallel != nullptr || state.abi2_context_parallel != nullptr) {
        refuse_layout(o, "the asynchronous pipeline runs without a tensor- or context-parallel plugin beside it on this host");
      }
    }
    // Whether the backward is split decides what the model keeps (the plan): ask one list now.
    options.split_backward = plugin_schedule(o, stages, options.microbatches).split_backward;
    if (mesh_pp != 0) {
      options.stage_major = true;
      options.replica_group = dp_slice;
      if (inner > 1) {
        options.group = pipeline;
        options.inner = inner;
      }
      options.sequence_group = cp_slice;
      if (state.abi2_data_parallel != nullptr) companion = open_companion(host, o, dp_slice);
      if (state.abi2_tensor_parallel != nullptr) tensor = open_tensor(host, o, tp_slice);
      if (state.abi2_context_parallel != nullptr) context = open_context(host, o, cp_slice);
    }
    return options;
  }

  std::unique_ptr<PipelinePlugin> opened_;
  std::unique_ptr<Companion> companion_;
  std::unique_ptr<Abi2Instance> tensor_;  // the tensor-parallel plugin composed on the mesh, over tp_slice_
  sdk::Group tp_slice_;
  std::unique_ptr<Abi2Instance> context_;  // the context-parallel plugin composed on the mesh, over cp_slice_
  sdk::Group cp_slice_;
  std::unique_ptr<SequenceSplit> sequences_;  // its split and attention hook
  std::unique_ptr<pipeline::AsyncPipeline> async_;  // weft_layout.pipeline_asynchronous's runtime
  bool began_ = false;
  int64_t step_ = 0;  // the current step (weft_step_info.step)
  std::unique_ptr<TensorSlices> slices_;
  std::vector<Abi2Hook> hooks_;  // its hooks at the model's points
  bool tp_first_ = false;  // its PARTIAL sums at each chunk's REDUCE, before the dp reduce-scatter
  int64_t bucket_bytes_;  // the replicas' buckets without a data-parallel plugin
  std::unique_ptr<GradientReducer> reducer_;
  std::vector<std::vector<int64_t>> chunk_parameters_;  // each chunk's trainable parameters (host indices)
  int64_t started_at_reduce_ = 0;  // this step's buckets started by a REDUCE, not during a backward
  // FLAT_SHARD placements over the replicas (ascending host indices).
  std::vector<int64_t> state_shards_, grad_shards_, parameter_shards_;
  std::unique_ptr<ParameterGatherer> gatherer_;        // the FLAT_SHARD parameters, by model stage
  std::unique_ptr<ParameterGatherer> state_gatherer_;  // the whole parameters of FLAT_SHARD optimizer states
  std::vector<std::vector<int64_t>> chunk_gather_;     // the model stages each chunk's GATHER makes whole
  std::vector<int32_t> gathered_;                      // per model stage: how many chunks hold it gathered
  bool resting_ = false;                               // every FLAT_SHARD parameter released
  std::map<int32_t, double> bubbles_;
};

}  // namespace

std::unique_ptr<sdk::Strategy> create_abi2_pipeline_step(sdk::Host host, const Abi2Plugin& plugin) {
  return std::unique_ptr<sdk::Strategy>(PipelineStep::create(host, plugin));
}

}  // namespace weft
