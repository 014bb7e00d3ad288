// pipeline_strategy.hpp - the host's pipeline runtime, which core/plugin/abi2_pipeline.cpp runs for
// a plugin's schedule as data (gpipe.so, pipedream.so, ZB-V): placement, partition, verified
// schedules, tied embeddings, replicas, loss and evaluation. The plugin's weft_layout and
// weft_schedule give what Options holds (stages, micro-batches, chunks, balance, partition).
//
// Layout: world = stages x replicas; world rank = replica * stages + stage. Each rank builds
// only its pipeline stage's model stages (plan). Each replica sees its own rows of every global
// batch (data_parallel_size = replicas); a step's host micro-batches (train.grad_accum_steps)
// are each split into `microbatches` pipeline micro-batches, and one schedule runs them all.
//
// Per step it reports (metrics.jsonl): plugin.bubble (the ranks' idle share of the step window:
// 1 - forward/backward time summed over ranks / (ranks x the longest rank's schedule time)),
// plugin.bubble_formula ((S - 1) / (v M + S - 1), v = chunks: GPipe's for v = 1; ZB-H1's
// (S - 1) / (3 M + S - 1)), plugin.peak_in_flight
// (this rank's most micro-batches between forward and backward, counted per chunk; rank 0 is
// stage 0, the fullest).
#ifndef WEFT_CORE_PIPELINE_PIPELINE_STRATEGY_HPP
#define WEFT_CORE_PIPELINE_PIPELINE_STRATEGY_HPP

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/plugin/step/step.hpp"

#include "grad_average.hpp"
#include "executor.hpp"
#include "partition.hpp"
#include "schedule.hpp"

namespace weft {
namespace pipeline {

class PipelineStrategy : public weft::sdk::Strategy {
 public:
  void plan(weft_model_plan& plan) override;
  void setup() override;
  double train_step(const weft_step_info& step) override;
  weft::sdk::EvalResult eval_step(const weft_step_info& step) override;
  double global_grad_norm_sq(double local_sq) override;
  // The tied embedding's two copies (first and last stage) hold the same gradient.
  void memory_plan(weft_memory_plan& plan) override;

  // --- introspection (tests) ---
  const Placement& placement() const { return placement_; }
  const std::string& schedule_name() const { return schedule_name_; }
  const Partition& partition() const { return partition_; }
  const RunStats& last_stats() const { return last_stats_; }

 protected:
  // A pipeline whose schedule a subclass gives (step_schedule): the host's runtime for a plugin's
  // schedule as data (core/plugin/abi2_pipeline.cpp).
  struct Options {
    std::string schedule_name;         // in messages and logs
    int32_t stages = 1;                // must divide the world
    int32_t microbatches = 1;          // pipeline micro-batches per host micro-batch
    int32_t chunks = 1;                // virtual stages per stage
    std::vector<int32_t> chunk_stage;  // Schedule::chunk_stage (empty: the loop order)
    bool split_backward = false;       // the schedule has B/W halves
    std::vector<int64_t> balance;      // decoder layers per virtual stage (empty: balanced by parameters,
    bool partition_by_time = false;    // or, with this, by each model stage's profiled time)
    double bucket_mb = 25.0;
    bool stage_major = false;          // Placement::stage_major (a device mesh's layout, pp outside dp)
    // This rank's replicas of its stage (made by the caller, collectively), or none: setup makes them.
    weft::sdk::Group replica_group;
    // The pipeline's ranks, when not the world's: a mesh with `inner` tensor-parallel ranks beneath
    // the pipeline's dimensions (world rank = x * inner + t), each t its own copy of the pipeline over
    // its ranks x; `group` is this rank's copy (made by the caller, collectively).
    weft::sdk::Group group;
    int32_t inner = 1;
    // The ranks beside this one that hold other tokens of the same rows (context parallelism inside
    // `inner`), or none: the step's loss is their mean and an evaluation's sums their sum.
    weft::sdk::Group sequence_group;
  };
  PipelineStrategy(weft::sdk::Host host, std::string plugin, Options options);

  // The training schedule of one step of `micro_batches` pipeline micro-batches, with its
  // transfers (verified by the caller before it runs): the plugin's.
  virtual Schedule step_schedule(int32_t micro_batches) = 0;
  // The bubble the schedule's model predicts (metrics.jsonl plugin.bubble_formula).
  virtual double bubble_formula(int32_t micro_batches) = 0;

  bool recompute_ = false;  // set by a plugin's constructor (gpipe.so: recompute = true)

  // The host's collectives as actions of the schedule (ABI 2's host step). reduces_in_schedule: each
  // training schedule gets a kReduce per chunk after its last backward (lower_reductions), and the
  // tied embedding's copies are left for end_reductions to combine; gathers_in_schedule: a kGather
  // before each chunk's first compute and a kRelease after its last (lower_gathers). The executor
  // calls chunk_hooks() at those actions; begin_reductions runs before a training run, end_reductions
  // after it. The defaults: none (the replicas average their gradients after the flush, with
  // GradientAverager, and the tied copies are combined before).
  virtual bool reduces_in_schedule() const { return false; }
  virtual bool gathers_in_schedule() const { return false; }
  virtual Executor::ChunkHooks chunk_hooks() { return {}; }
  virtual void begin_reductions() {}
  virtual void end_reductions() {}
  // Sums the tied embedding's two copies' gradients (first and last stage), where this rank holds one.
  void combine_tied_embedding_gradients();
  // This rank's index of a trainable tied embedding whose other copy is on another rank, or -1.
  int64_t tied_parameter() const { return tied_parameter_; }
  // This rank's replicas of its stage (valid after setup, or from Options).
  const weft::sdk::Group& replica_group() const { return replica_group_; }

  // For plugins that run their own step (pipedream.so's async mode):
  // the tied embedding's two copies get the sum of their gradients, replicas the mean.
  void finish_gradients();
  // Sums `values` element-wise over `group` (in place of a collective per value).
  std::vector<double> sum_over(weft::sdk::Group group, std::vector<double> values) const;
  const weft::sdk::Group& world() const { return world_; }

 private:
  const Schedule& verified_schedule(const std::string& name, int32_t micro_batches);
  std::vector<double> parameter_costs(const weft_model_info& info) const;
  int64_t deferred_weight_bytes_per_row(int64_t seq_len) const;
  std::vector<double> profiled_costs(int64_t model_stages) const;
  double tied_copy_norm_sq() const;

  void place_ranks(int32_t stages);
  std::string held_parts() const;  // "stage 0 holds parts 0, 3; stage 1 holds parts 1, 2"

  std::string plugin_;
  std::string schedule_name_;
  int32_t chunks_ = 1;  // virtual stages per rank (interleaved1f1b)
  std::vector<int32_t> chunk_stage_;  // which virtual stage each chunk is (empty: the loop order)
  bool split_backward_ = false;
  weft::sdk::Group world_;
  int32_t microbatches_ = 4;
  std::vector<int64_t> balance_;
  std::string partition_by_ = "parameters";
  int32_t inner_ = 1;  // Options::inner
  // A group of the pipeline's ranks (its world's), made for every copy of the pipeline (Options::inner)
  // in turn, this rank's returned. Collective over the world.
  weft::sdk::Group make_group(const std::vector<int32_t>& ranks) const;
  double bucket_mb_ = 25.0;
  Placement placement_;
  Partition partition_;
  weft::sdk::Group pipeline_group_;  // this replica's stages
  weft::sdk::Group replica_group_;   // this stage's replicas (when replicas > 1)
  weft::sdk::Group sequence_group_;  // Options::sequence_group
  bool stage_major_ = false;
  weft::sdk::Group tied_group_;      // {stage 0, last stage} of this replica, when tied
  int64_t tied_parameter_ = -1;      // this rank's index of model.embed_tokens.weight, when tied
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<weft::plugins::GradientAverager> replica_average_;
  std::map<std::pair<std::string, int32_t>, Schedule> schedules_;  // verified, by (name, M)
  RunStats last_stats_;
};

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_PIPELINE_STRATEGY_HPP
