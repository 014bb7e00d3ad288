#include "pipeline_strategy.hpp"

#include <algorithm>
#include <cinttypes>
#include <cstddef>
#include <stdexcept>
#include <utility>

#include "dl_views.hpp"
#include "reductions.hpp"
#include "verify.hpp"

namespace weft {
namespace pipeline {

using weft::sdk::Error;

namespace {

constexpr const char* kTiedName = "model.embed_tokens.weight";

}  // namespace

PipelineStrategy::PipelineStrategy(weft::sdk::Host host, std::string plugin, Options options)
    : Strategy(host), plugin_(std::move(plugin)), schedule_name_(std::move(options.schedule_name)),
      world_(options.group.get() != nullptr ? options.group : host.world()), inner_(std::max(1, options.inner)) {
  const int32_t world = world_.size();
  if (options.stages < 1 || world % options.stages != 0) {
    throw Error(WEFT_STATUS_BAD_CONFIG, plugin_ + ": " + std::to_string(options.stages) +
                                            " pipeline stages must be >= 1 and divide the world size " + std::to_string(world));
  }
  if (options.microbatches < 1 || options.chunks < 1 || options.chunks > WEFT_MAX_STAGE_CHUNKS) {
    throw Error(WEFT_STATUS_BAD_CONFIG, plugin_ + ": " + std::to_string(options.microbatches) + " micro-batches and " +
                                            std::to_string(options.chunks) + " chunks per stage (at least 1 of each, at most " +
                                            std::to_string(WEFT_MAX_STAGE_CHUNKS) + " chunks)");
  }
  if (std::string bad = check_chunk_map(options.stages, options.chunks, options.chunk_stage); !bad.empty()) {
    throw Error(WEFT_STATUS_BAD_CONFIG, plugin_ + ": " + bad);
  }
  microbatches_ = options.microbatches;
  chunks_ = options.chunks;
  chunk_stage_ = std::move(options.chunk_stage);
  split_backward_ = options.split_backward;
  bucket_mb_ = options.bucket_mb;
  balance_ = std::move(options.balance);  // its size is the caller's to check (stages x chunks)
  if (options.partition_by_time) partition_by_ = "time";
  stage_major_ = options.stage_major;
  replica_group_ = options.replica_group;
  sequence_group_ = options.sequence_group;
  place_ranks(options.stages);
}

void PipelineStrategy::place_ranks(int32_t stages) {
  placement_.stages = stages;
  placement_.replicas = world_.size() / placement_.stages;
  placement_.stage_major = stage_major_;
  placement_.stage = stage_major_ ? world_.rank() / placement_.replicas : world_.rank() % placement_.stages;
  placement_.replica = stage_major_ ? world_.rank() % placement_.replicas : world_.rank() / placement_.stages;
  placement_.chunk_stage = chunk_stage_;
}

std::vector<double> PipelineStrategy::parameter_costs(const weft_model_info& info) const {
  const double h = static_cast<double>(info.hidden_size);
  const double q = static_cast<double>(info.num_attention_heads) * static_cast<double>(info.head_dim);
  const double kv = static_cast<double>(info.num_key_value_heads) * static_cast<double>(info.head_dim);
  const double block = 2 * h + h * q + 2 * h * kv + q * h + 3 * h * static_cast<double>(info.intermediate_size);
  const double embedding = static_cast<double>(info.vocab_size) * h;
  std::vector<double> costs(static_cast<size_t>(info.num_layers) + 2, block);
  costs.front() = embedding;
  costs.back() = h + embedding;  // final norm + head (the head multiplies by a vocab x hidden
                                 // matrix even when it is the tied embedding)
  return costs;
}

// Seconds per model stage, measured by the host on every rank and averaged over the world so
// that every rank computes the same partition.
std::vector<double> PipelineStrategy::profiled_costs(int64_t model_stages) const {
  std::vector<double> seconds = sum_over(world_, host().profile_stages(model_stages));
  for (double& s : seconds) s /= world_.size();
  if (world_.rank() == 0) {
    WEFT_LOG_INFO(host(), "%s: profiled forward+backward per micro-batch: embedding %.2f ms, block %.2f ms, head+loss %.2f ms",
                  plugin_.c_str(), 1e3 * seconds.front(), 1e3 * seconds[1], 1e3 * seconds.back());
  }
  return seconds;
}

void PipelineStrategy::plan(weft_model_plan& plan) {
  const weft_model_info info = host().model_info();
  const int64_t layers = info.num_layers;
  const int32_t parts = placement_.stages * chunks_;  // virtual stages
  try {
    if (!balance_.empty()) {
      partition_ = partition_from_balance(balance_, layers);
    } else {
      const std::vector<double> costs = partition_by_ == "time" ? profiled_costs(layers + 2) : parameter_costs(info);
      partition_ = balanced_partition(costs, parts);
      if (!chunk_stage_.empty()) {  // a placement other than the loop: balance the ranks, not the parts
        std::vector<int32_t> owner(static_cast<size_t>(parts));
        for (size_t i = 0; i < chunk_stage_.size(); ++i) owner[static_cast<size_t>(chunk_stage_[i])] = static_cast<int32_t>(i) / chunks_;
        partition_ = rebalance_for_owners(partition_, costs, owner);
      }
    }
  } catch (const std::invalid_argument& e) {
    throw Error(WEFT_STATUS_BAD_CONFIG, plugin_ + ": " + e.what() +
                                            (chunks_ > 1 ? " (" + std::to_string(placement_.stages) + " stages x " +
                                                               std::to_string(chunks_) + " chunks)"
                                                         : ""));
  }
  placement_.chunk_stages.clear();
  for (int32_t c = 0; c < chunks_; ++c) {  // chunk c is virtual stage c x S + p, or as chunk_stage_ says
    const auto u = static_cast<size_t>(chunk_stage_.empty() ? c * placement_.stages + placement_.stage
                                                            : chunk_stage_[static_cast<size_t>(placement_.stage * chunks_ + c)]);
    placement_.chunk_stages.emplace_back(partition_[u], partition_[u + 1]);
  }
  placement_.first_model_stage = placement_.chunk_stages.front().first;
  placement_.last_model_stage = placement_.chunk_stages.front().second;
  placement_.hidden_size = info.hidden_size;
  // The model stages this rank builds: its chunks' ranges in the model's order, neighbours joined.
  std::vector<std::pair<int64_t, int64_t>> held = placement_.chunk_stages;
  std::sort(held.begin(), held.end());
  std::vector<std::pair<int64_t, int64_t>> joined;
  for (const auto& range : held) {
    if (!joined.empty() && joined.back().second == range.first) {
      joined.back().second = range.second;
    } else {
      joined.push_back(range);
    }
  }
  plan.first_stage = joined.front().first;
  plan.last_stage = joined.back().second;
  plan.data_parallel_size = placement_.replicas;
  plan.data_parallel_rank = placement_.replica;
  if (split_backward_) {
    if (plan.struct_size < offsetof(weft_model_plan, split_backward) + sizeof(plan.split_backward)) {
      throw Error(WEFT_STATUS_UNSUPPORTED, plugin_ + ": plugin.schedule = \"zbh1\" needs a host with ABI >= 1.11");
    }
    plan.split_backward = 1;
  }
  if (joined.size() > 1) {
    plan.stage_chunks = static_cast<int32_t>(joined.size());
    for (size_t c = 0; c < joined.size(); ++c) {
      plan.chunk_stages[2 * c] = joined[c].first;
      plan.chunk_stages[2 * c + 1] = joined[c].second;
    }
  }
  if (world_.rank() == 0) {
    WEFT_LOG_INFO(host(), "%s: %d stages x %d replicas, %d micro-batches, schedule from %s%s, partition %s (layers per %s:%s)",
                  plugin_.c_str(), placement_.stages, placement_.replicas, microbatches_, schedule_name_.c_str(),
                  chunks_ > 1 ? (" with " + std::to_string(chunks_) + " chunks per stage (" + held_parts() + ")").c_str() : "",
                  describe(partition_).c_str(), chunks_ > 1 ? "part" : "stage",
                  [&] {
                    std::string s;
                    for (int64_t b : balance_of(partition_)) s += " " + std::to_string(b);
                    return s;
                  }()
                      .c_str());
  }
}

std::string PipelineStrategy::held_parts() const {
  if (chunk_stage_.empty()) return "stage p holds parts p, p + S, ...";
  std::string out;
  for (int32_t p = 0; p < placement_.stages; ++p) {
    out += (p == 0 ? "stage " : "; stage ") + std::to_string(p) + " holds parts";
    for (int32_t c = 0; c < chunks_; ++c) out += (c == 0 ? " " : ", ") + std::to_string(placement_.virtual_stage(p, c));
  }
  return out;
}

weft::sdk::Group PipelineStrategy::make_group(const std::vector<int32_t>& ranks) const {
  const int32_t own = host().world().rank() % inner_;
  weft::sdk::Group mine;
  for (int32_t t = 0; t < inner_; ++t) {
    std::vector<int32_t> world_ranks;
    for (int32_t x : ranks) world_ranks.push_back(x * inner_ + t);
    weft::sdk::Group g = host().create_group(world_ranks);
    if (t == own) mine = g;
  }
  return mine;
}

void PipelineStrategy::setup() {
  const weft_model_info info = host().model_info();
  const int32_t S = placement_.stages, R = placement_.replicas;
  // Groups are collective over the world: every rank creates every group, in the same order.
  for (int32_t r = 0; r < R; ++r) {
    std::vector<int32_t> ranks;
    for (int32_t p = 0; p < S; ++p) ranks.push_back(placement_.rank_of(p, r));
    weft::sdk::Group g = make_group(ranks);
    if (r == placement_.replica) pipeline_group_ = g;
  }
  const int32_t first = placement_.stage_of(0), last = placement_.stage_of(placement_.virtual_stages() - 1);
  if (info.tie_word_embeddings && first != last) {
    for (int32_t r = 0; r < R; ++r) {
      weft::sdk::Group g = make_group({placement_.rank_of(std::min(first, last), r),
                                       placement_.rank_of(std::max(first, last), r)});
      if (r == placement_.replica) tied_group_ = g;
    }
    if (placement_.is_first() || placement_.is_last()) {
      bool held = false;
      for (int64_t i = 0; i < host().parameter_count(); ++i) {
        const auto parameter = host().parameter_info(i);
        if (std::string(parameter.name) != kTiedName) continue;
        held = true;
        // A frozen embedding (LoRA) has no gradient for its two copies to combine.
        if (parameter.trainable) tied_parameter_ = i;
      }
      if (!held) throw Error(WEFT_STATUS_INTERNAL, plugin_ + ": tied embeddings but this rank holds no " + kTiedName);
    }
  }
  if (replica_group_.get() == nullptr) {
    for (int32_t p = 0; p < S; ++p) {
      std::vector<int32_t> ranks;
      for (int32_t r = 0; r < R; ++r) ranks.push_back(placement_.rank_of(p, r));
      weft::sdk::Group g = make_group(ranks);
      if (p == placement_.stage) replica_group_ = g;
    }
  }
  if (R > 1 && !reduces_in_schedule()) {
    replica_average_ = std::make_unique<weft::plugins::GradientAverager>(host(), replica_group_, bucket_mb_);
  }
  executor_ = std::make_unique<Executor>(host(), world_, placement_, recompute_);
}

const Schedule& PipelineStrategy::verified_schedule(const std::string& name, int32_t micro_batches) {
  const auto key = std::make_pair(name, micro_batches);
  auto it = schedules_.find(key);
  if (it != schedules_.end()) return it->second;
  Schedule schedule = name == "forward" ? forward_only_schedule(placement_.stages, micro_batches, chunks_, chunk_stage_)
                                        : step_schedule(micro_batches);
  if (schedule.trains && reduces_in_schedule()) lower_reductions(schedule);
  if (schedule.trains && gathers_in_schedule()) lower_gathers(schedule);
  const Verification v = verify(schedule);
  if (!v.ok) {
    throw Error(WEFT_STATUS_INTERNAL, plugin_ + ": schedule " + name + " (" + std::to_string(placement_.stages) +
                                          " stages, " + std::to_string(micro_batches) +
                                          " micro-batches) failed verification: " + v.error);
  }
  return schedules_.emplace(key, std::move(schedule)).first->second;
}

// The host's plan counts one micro-batch of this rank's rows through its stages; a pipeline splits
// the rows into micro-batches and keeps as many in flight as its (verified) schedule says at this
// stage (GPipe: all of them; 1F1B: at most the stages after it), with their stage inputs received;
// recompute keeps only each micro-batch's block inputs plus one micro-batch's activations. A last
// stage that does not hold the embedding keeps its own copy of a tied one.
void PipelineStrategy::memory_plan(weft_memory_plan& plan) {
  const int32_t M = plan.rows_per_micro_batch % microbatches_ == 0 ? microbatches_ : 1;
  const int64_t rows = plan.rows_per_micro_batch / M;  // per pipeline micro-batch
  Verification v;
  try {
    v = verify(step_schedule(M));
  } catch (const std::exception&) {  // M not a multiple of the stages: the step refuses it
  }
  // Micro-batch activations in flight (chunk activations with virtual stages).
  const int64_t in_flight = v.ok && placement_.stage < static_cast<int32_t>(v.peak_in_flight.size())
                                ? v.peak_in_flight[static_cast<size_t>(placement_.stage)]
                                : static_cast<int64_t>(M) * chunks_;
  // Per chunk: activations per row and the boundary's input and output per row.
  int64_t per_row = 0, largest_per_row = 0, copies = 0, inputs = 0, outputs = 0;
  for (const auto& [first, last] : placement_.chunk_stages) {
    int64_t chunk_per_row = 0;
    for (int64_t s = first; s < last; ++s) {
      const weft_stage_memory m = host().stage_memory(s);
      chunk_per_row += m.activation_bytes_per_row;
      copies += m.weight_copy_bytes;
      if (s == first && s > 0) inputs += host().stage_memory(s - 1).output_bytes_per_row;
      if (s + 1 == last) outputs += m.output_bytes_per_row;
    }
    per_row += chunk_per_row;
    largest_per_row = std::max(largest_per_row, chunk_per_row);
  }
  const int64_t chunks = chunks_;  // an activation in flight is one chunk's: the mean chunk's size
  if (recompute_) {  // every micro-batch keeps its chunk input; one chunk is re-materialised at a time
    plan.activation_bytes = copies + rows * (in_flight * inputs / chunks + largest_per_row);
  } else {
    plan.activation_bytes = copies + rows * in_flight * (per_row + inputs) / chunks;
  }
  if (v.ok && !v.peak_pending_weights.empty()) {  // a split backward keeps each linear's input and output gradient until W
    const int64_t pending = v.peak_pending_weights[static_cast<size_t>(placement_.stage)];
    // Each waiting W is one chunk's: the mean chunk's share of the rank's blocks.
    plan.activation_bytes += rows * pending * deferred_weight_bytes_per_row(plan.seq_len) / chunks;
  }
  // Receive buffers and gradients of the boundaries: this rank's tokens of a split sequence.
  plan.buffer_bytes += rows * (inputs + outputs) * 2 * plan.stage_tokens / std::max<int64_t>(1, plan.seq_len);
  if (placement_.is_last() && !placement_.is_first() && host().model_info().tie_word_embeddings) {
    const weft_stage_memory embedding = host().stage_memory(0);
    plan.parameter_bytes += embedding.parameter_bytes;
    plan.gradient_bytes += embedding.trainable_bytes;
    plan.optimizer_bytes += 2 * embedding.trainable_bytes;
  }
  // The replicas' averaging buckets hold the gradients themselves (each a view of its bucket): nothing beside them.
}

// Per sequence of seq_len tokens, what a split backward keeps for one micro-batch's W on this rank: for each held
// decoder block with trainable projections, the inputs and output gradients of q/k/v, o, gate/up
// and down, in the compute dtype (fp32 for fp32 runs, 2 bytes otherwise).
int64_t PipelineStrategy::deferred_weight_bytes_per_row(int64_t seq_len) const {
  const weft_model_info info = host().model_info();
  const int64_t h = info.hidden_size, q = info.num_attention_heads * info.head_dim,
                kv = info.num_key_value_heads * info.head_dim, i = info.intermediate_size;
  const int64_t per_token = (h + q + 2 * kv) + (q + h) + (h + 2 * i) + (i + h);
  const int64_t bytes = info.compute_dtype.bits == 32 ? 4 : 2;
  int64_t blocks = 0;
  for (const auto& [first, last] : placement_.chunk_stages) {
    for (int64_t s = std::max<int64_t>(first, 1); s < std::min<int64_t>(last, info.num_layers + 1); ++s) {
      const weft_stage_memory m = host().stage_memory(s);
      if (2 * m.trainable_bytes >= m.parameter_bytes) ++blocks;  // full fine-tuning (LoRA's base is frozen)
    }
  }
  return blocks * per_token * bytes * seq_len;
}

std::vector<double> PipelineStrategy::sum_over(weft::sdk::Group group, std::vector<double> values) const {
  return weft::plugins::sum_over(host(), group, std::move(values));
}

void PipelineStrategy::combine_tied_embedding_gradients() {
  if (tied_parameter_ < 0) return;
  DLTensor grad = host().parameter_grad(tied_parameter_);
  host().all_reduce(tied_group_, grad).wait();  // both copies now hold the full gradient
}

void PipelineStrategy::finish_gradients() {
  if (!reduces_in_schedule()) combine_tied_embedding_gradients();  // else end_reductions' to do
  if (replica_average_) replica_average_->average();
}

double PipelineStrategy::tied_copy_norm_sq() const {
  if (tied_parameter_ < 0 || placement_.is_first()) return 0.0;
  const DLTensor grad = host().parameter_grad(tied_parameter_);
  if (!weft::plugins::is_fp32(grad)) {
    throw Error(WEFT_STATUS_UNSUPPORTED, plugin_ + ": the tied embedding's gradient is not fp32");
  }
  return host().squared_norm(grad);
}

double PipelineStrategy::train_step(const weft_step_info& step) {
  if (step.rows_per_micro_batch % microbatches_ != 0) {
    throw Error(WEFT_STATUS_BAD_CONFIG, plugin_ + ": each replica's " + std::to_string(step.rows_per_micro_batch) +
                                            " sequences per micro-batch (train.batch_size / replicas) do not "
                                            "divide into plugin.microbatches = " +
                                            std::to_string(microbatches_));
  }
  const int32_t total = step.micro_batches * microbatches_;
  const Schedule& schedule = verified_schedule(schedule_name_, total);
  if (reduces_in_schedule() || gathers_in_schedule()) {
    begin_reductions();
    last_stats_ = executor_->run(schedule, microbatches_, step.rows_per_micro_batch, step.stage_tokens,
                                 chunk_hooks());
    end_reductions();
  } else {
    last_stats_ = executor_->run(schedule, microbatches_, step.rows_per_micro_batch, step.stage_tokens);
  }
  finish_gradients();
  // Loss (last stages), compute time (all ranks) and every rank's wall time, over the world.
  // The bubble is the idle share of the ranks over the step's window: the longest rank's run
  // (ranks start and end a step at different times, so their own walls are shorter).
  const int32_t world = world_.size();
  std::vector<double> values(2 + static_cast<size_t>(world), 0.0);
  values[0] = placement_.is_last() ? last_stats_.loss_sum : 0.0;
  values[1] = last_stats_.compute_seconds;
  values[2 + static_cast<size_t>(world_.rank())] = last_stats_.wall_seconds;
  const std::vector<double> sums = sum_over(world_, values);
  double loss = sums[0] / (static_cast<double>(total) * placement_.replicas);
  if (sequence_group_.get() != nullptr && sequence_group_.size() > 1) {  // the mean over every token's share
    loss = sum_over(sequence_group_, {loss})[0] / sequence_group_.size();
  }
  const double window = *std::max_element(sums.begin() + 2, sums.end());
  const double bubble = window > 0 ? 1.0 - sums[1] / (world * window) : 0.0;
  const double formula = bubble_formula(total);
  host().report_metric("bubble", bubble);
  host().report_metric("bubble_formula", formula);
  host().report_metric("peak_in_flight", last_stats_.peak_in_flight);
  return loss;
}

weft::sdk::EvalResult PipelineStrategy::eval_step(const weft_step_info& step) {
  // Every stage learns this replica's row count from the batch (the last one may be partial).
  int64_t rows = 0;
  {
    weft::sdk::Batch batch = host().batch(0);
    const DLTensor inputs = host().activation_view(batch.inputs);
    rows = inputs.ndim > 0 ? inputs.shape[0] : 0;
  }
  RunStats stats;
  if (rows > 0) {
    const int32_t splits = rows % microbatches_ == 0 ? microbatches_ : 1;
    stats = executor_->run(verified_schedule("forward", splits), splits, rows, step.stage_tokens);
  }
  std::vector<double> sums =
      sum_over(world_, {placement_.is_last() ? stats.token_loss_sum : 0.0,
                        placement_.is_last() ? static_cast<double>(stats.tokens) : 0.0});
  if (sequence_group_.get() != nullptr && sequence_group_.size() > 1) sums = sum_over(sequence_group_, sums);
  weft::sdk::EvalResult result;
  result.loss_sum = sums[0];
  result.tokens = static_cast<int64_t>(sums[1] + 0.5);
  return result;
}

double PipelineStrategy::global_grad_norm_sq(double local_sq) {
  // The tied copy on the last stage is the same tensor as stage 0's: count it once. Replicas
  // hold equal gradients, so the sum over this replica's stages is the global norm.
  return sum_over(pipeline_group_, {local_sq - tied_copy_norm_sq()})[0];
}

}  // namespace pipeline
}  // namespace weft
