#include "zero.hpp"

#include <algorithm>
#include <cstddef>
#include <string>

#include "../common/dl_views.hpp"
#include "../common/reductions.hpp"

namespace weft {
namespace zero {

using weft::plugins::element_count;
using weft::plugins::is_fp32;
using weft::sdk::Activation;
using weft::sdk::Error;

namespace {

constexpr size_t kInFlight = 2;  // collectives of one kind started and not yet finished
constexpr DLDataType kFp32{kDLFloat, 32, 1};

}  // namespace

Zero::Zero(weft::sdk::Host host) : Strategy(host), world_(host.world()) {
  ranks_ = world_.size();
  rank_ = world_.rank();
  stage_ = host.config_int("stage", 3);
  if (stage_ < 1 || stage_ > 3) {
    throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.stage must be 1, 2 or 3 (ZeRO's stages), got " + std::to_string(stage_));
  }
  reshard_after_forward_ = host.config_bool("reshard_after_forward", true);
  bucket_mb_ = host.config_float("bucket_mb", 64.0);
  const std::string param_dtype = host.config_string("param_dtype", "compute");
  if (param_dtype != "compute" && param_dtype != "fp32") {
    throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.param_dtype must be \"compute\" or \"fp32\", got \"" + param_dtype + "\"");
  }
  // Gathered matrices in the compute dtype where the host can (ABI 1.6); a 1.3-1.5 host keeps fp32.
  compute_dtype_ = stage_ == 3 && param_dtype == "compute" && host.negotiated_minor() >= 6;
  if (!(bucket_mb_ > 0.0)) throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.bucket_mb must be > 0, got " + std::to_string(bucket_mb_));
  // Composed, stage 3 drives the step itself (ABI 1.14 drives_stages): the host refuses it beside a pipeline.
  if (stage_ == 3 && host.composed() && host.negotiated_minor() < 14) {
    throw Error(WEFT_STATUS_BAD_CONFIG,
                "zero: plugin.stage = 3 gathers each model stage's parameters around its own forward and backward, "
                "so in a run composed with other plugins it must drive the step, which needs a host of ABI 1.14 "
                "(this one speaks 1." + std::to_string(host.negotiated_minor()) + "): use plugin.stage = 1 or 2 there");
  }
}

Zero::~Zero() {
  abandon();
  if (stage_ < 3 && !stage_of_.empty()) host().api()->set_grad_ready_callback(host().handle(), nullptr, nullptr);
}

void Zero::plan(weft_model_plan& plan) {
  plan.data_parallel_size = ranks_;
  plan.data_parallel_rank = rank_;
  // Stage 3 runs the model stage by stage (staged_train_step): composed, it drives the step and
  // the other plugins (tp, cp) finish the gradient shards it reduce-scattered (ABI 1.14).
  if (stage_ == 3 && plan.struct_size >= offsetof(weft_model_plan, drives_stages) + sizeof(int32_t) &&
      host().composed()) {
    plan.drives_stages = 1;
  }
}

void Zero::setup() {
  const int64_t count = host().parameter_count();
  model_stages_ = host().model_num_stages();
  tied_ = stage_ == 3 && host().model_info().tie_word_embeddings != 0;
  std::vector<weft::sdk::Work> broadcasts;
  std::vector<std::vector<int64_t>> gather_params(static_cast<size_t>(model_stages_)), gather_sizes = gather_params;
  std::vector<std::vector<int64_t>> reduce_params = gather_params, reduce_sizes = gather_params;
  for (int64_t i = 0; i < count; ++i) {
    DLTensor data = host().parameter_data(i);
    if (ranks_ > 1) broadcasts.push_back(host().broadcast(world_, data, 0));  // replicas start identical
    const weft_parameter_info info = host().parameter_info(i);
    // Frozen parameters of another dtype (a bf16 frozen base) stay whole on every rank under stages
    // 1 and 2; stage 3 shards them too, in fp32.
    if (!is_fp32(data) && info.trainable) {
      throw Error(WEFT_STATUS_UNSUPPORTED, std::string("zero: parameter ") + info.name + " is not fp32");
    }
    if (!is_fp32(data) && stage_ == 3) {
      throw Error(WEFT_STATUS_UNSUPPORTED, std::string("zero: stage 3 shards every parameter in fp32, but the frozen "
                                                       "parameter ") +
                                               info.name +
                                               " is not fp32 (model.frozen_dtype = \"bf16\"): use plugin.stage = 1 or "
                                               "2, or model.frozen_dtype = \"fp32\"");
    }
    const auto stage = static_cast<size_t>(info.stage);
    if (stage >= gather_params.size()) throw Error(WEFT_STATUS_INTERNAL, "zero: parameter stage out of range");
    if (info.trainable) {
      reduce_params[stage].push_back(i);
      reduce_sizes[stage].push_back(element_count(data));
    }
    if (info.trainable || stage_ == 3) {
      gather_params[stage].push_back(i);
      gather_sizes[stage].push_back(element_count(data));
    }
  }
  for (const weft::sdk::Work& work : broadcasts) work.wait();
  // Collectives of at most bucket_mb MiB: [ranks, width] fp32.
  const auto max_width = std::max<int64_t>(1, static_cast<int64_t>(bucket_mb_ * 1024 * 1024 / 4) / ranks_);
  stages_.assign(gather_params.size(), StageLayout{});
  gather_groups_.clear();
  reduce_groups_.clear();
  gather_stage_.clear();
  stage_of_.assign(static_cast<size_t>(count), -1);
  pieces_.assign(static_cast<size_t>(count), 0);
  for (size_t s = 0; s < gather_params.size(); ++s) {
    StageLayout& layout = stages_[s];
    layout.gathered = gather_params[s];
    layout.trainable = static_cast<int64_t>(reduce_params[s].size());
    for (FlatGroup& g : make_groups(gather_params[s], gather_sizes[s], ranks_, max_width)) {
      layout.gather_groups.push_back(gather_groups_.size());
      gather_stage_.push_back(s);
      gather_groups_.push_back(std::move(g));
    }
    for (FlatGroup& g : make_groups(reduce_params[s], reduce_sizes[s], ranks_, max_width)) {
      for (int64_t index : g.parameters) ++pieces_[static_cast<size_t>(index)];
      layout.reduce_groups.push_back(reduce_groups_.size());
      reduce_groups_.push_back(std::move(g));
    }
    for (int64_t i : reduce_params[s]) stage_of_[static_cast<size_t>(i)] = static_cast<int64_t>(s);
  }
  first_trainable_ = gather_params.size();
  for (size_t s = reduce_params.size(); s-- > 0;) {
    if (!reduce_params[s].empty()) first_trainable_ = s;
  }
  reduce_order_.clear();
  for (size_t s = gather_params.size(); s-- > 0;) reduce_order_.push_back(s);
  whole_.assign(gather_params.size(), 1);
  gathered_.assign(gather_params.size(), 0);
  gather_started_.assign(gather_groups_.size(), 0);
  pending_.assign(gather_params.size(), 0);
  pieces_left_ = pieces_;
  ready_.assign(static_cast<size_t>(count), 0);
  if (ranks_ == 1 && stage_ < 3) return;  // nothing to shard: the one-process step
  if (stage_ < 3) host().set_grad_ready_callback(&Zero::grad_ready_trampoline, this);
  if (stage_ >= 2) {
    for (int64_t i = 0; i < count; ++i) {
      if (stage_of_[static_cast<size_t>(i)] >= 0) host().release_parameter_grad(i);
    }
  }
}

weft_flat_shard Zero::flat_shard(int64_t index) {
  const int64_t elements = element_count(host().parameter_data(index));
  if (stage_ == 3) {
    weft_flat_shard shard = shard_of(elements, ranks_, rank_);
    shard.flags = WEFT_FLAT_SHARD_RELEASABLE | (compute_dtype_ ? WEFT_FLAT_SHARD_COMPUTE_DTYPE : 0u);
    return shard;
  }
  if (!host().parameter_info(index).trainable || ranks_ == 1) return weft_flat_shard{0, elements, 0u, 0u};
  return shard_of(elements, ranks_, rank_);
}

// The host's plan is the replicated one; per rank ZeRO keeps 1/N of the optimizer state (all
// stages), of the gradients (stages 2-3; whole gradients still accumulate over micro-batches, and
// a stage's whole gradients live until its reduce-scatter starts) and of the parameters (stage 3;
// at most kInFlight stages whole at once, plus the tied embedding during a step, or every stage
// between forward and backward without reshard_after_forward). Collectives in flight hold their
// send and receive buffers: a whole group (at most bucket_mb) and a row of it each.
void Zero::memory_plan(weft_memory_plan& plan) {
  if (ranks_ == 1 && stage_ < 3) return;
  const int64_t N = ranks_;
  const auto shard = [N](int64_t bytes) { return (bytes + N - 1) / N; };
  const int64_t stages = host().model_num_stages() > 0 ? host().model_num_stages() : host().model_info().num_layers + 2;
  // Stage 3 with tied embeddings pins stage 0 whole for the step (and its whole gradient lives from
  // the head's backward to the embedding's): counted once, the other stages by the largest.
  const bool pin = stage_ == 3 && host().model_info().tie_word_embeddings != 0;
  int64_t params = 0, trainable = 0, largest_params = 0, largest_trainable = 0, inputs = 0;
  int64_t pinned = 0, pinned_trainable = 0, whole_params = 0, whole_trainable = 0, weight_copies = 0;
  for (int64_t s = 0; s < stages; ++s) {
    const weft_stage_memory m = host().stage_memory(s);
    params += m.parameter_bytes;  // fp32 masters: the shards
    trainable += m.trainable_bytes;
    // What a whole stage and its whole gradients take: matrices in the compute dtype when the host
    // materialises them so (then the forward makes no weight copies of its own).
    const bool compute = compute_dtype_ && m.struct_size >= offsetof(weft_stage_memory, compute_trainable_bytes) + 8;
    const int64_t whole_p = compute ? m.compute_parameter_bytes : m.parameter_bytes;
    const int64_t whole_t = compute ? m.compute_trainable_bytes : m.trainable_bytes;
    whole_params += whole_p;
    whole_trainable += whole_t;
    if (compute) weight_copies += m.weight_copy_bytes;
    if (pin && s == 0) {
      pinned = whole_p;
      pinned_trainable = whole_t;
    } else {
      largest_params = std::max(largest_params, whole_p);
      largest_trainable = std::max(largest_trainable, whole_t);
    }
    if (s + 1 < stages) inputs += m.output_bytes_per_row;
  }
  const int64_t in_flight = static_cast<int64_t>(kInFlight);
  const auto bucket = static_cast<int64_t>(bucket_mb_ * 1024 * 1024);  // a collective's whole group at most
  const int64_t reduce_group = std::min(std::max(largest_trainable, pinned_trainable), bucket);
  const int64_t gather_group = std::min(std::max(largest_params, pinned), bucket);
  const int64_t reduce_buffers = in_flight * (reduce_group + shard(reduce_group));
  plan.optimizer_bytes = 2 * shard(trainable);
  plan.gradient_bytes = shard(trainable) + (stage_ == 1 || plan.micro_batches > 1
                                                 ? whole_trainable
                                                 : std::min(whole_trainable, pinned_trainable + in_flight * largest_trainable));
  plan.buffer_bytes += reduce_buffers;
  if (stage_ < 3) return;  // parameters whole; the gathers after the step reuse the reduce buffers' room
  plan.activation_bytes = std::max<int64_t>(0, plan.activation_bytes - weight_copies);
  const int64_t whole =
      reshard_after_forward_ ? std::min(whole_params, in_flight * largest_params + pinned) : whole_params;
  plan.parameter_bytes = shard(params) + whole;
  plan.buffer_bytes += in_flight * (gather_group + shard(gather_group));
  plan.activation_bytes += plan.rows_per_micro_batch * inputs;  // the stage inputs copied as leaves
}

// --- the step ---

double Zero::train_step(const weft_step_info& step) {
  if (step.micro_batches < 1) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "zero: micro_batches must be >= 1");
  if (stage_of_.size() != static_cast<size_t>(host().parameter_count())) {
    throw Error(WEFT_STATUS_INTERNAL, "zero: train_step before setup");
  }
  if (ranks_ == 1 && stage_ < 3) return single_process_train_step(step);
  double local = 0.0;
  try {
    local = stage_ == 3 ? staged_train_step(step) : hooked_train_step(step);
  } catch (...) {
    abandon();
    throw;
  }
  std::vector<double> sum{local};
  return all_reduce_sum(sum) / (static_cast<double>(step.micro_batches) * ranks_);
}

// Stages 1 and 2: the one-process loop; the last micro-batch's backward starts the reduce-scatters.
double Zero::hooked_train_step(const weft_step_info& step) {
  const int64_t stages = host().model_num_stages();
  const double scale = 1.0 / step.micro_batches;
  double loss_sum = 0.0;
  for (int32_t m = 0; m < step.micro_batches; ++m) {
    weft::sdk::Batch batch = host().batch(m);
    Activation logits = host().forward(0, stages, batch.inputs);
    weft::sdk::Loss loss = host().loss(logits, batch.targets, scale);
    if (m == step.micro_batches - 1) {
      for (size_t st = 0; st < stages_.size(); ++st) pending_[st] = stages_[st].trainable;
      std::fill(ready_.begin(), ready_.end(), 0);
      pieces_left_ = pieces_;
      next_reduce_ = 0;
      callback_error_ = nullptr;
      syncing_ = true;
    }
    host().backward(loss.loss);
    syncing_ = false;
    loss_sum += loss.value;
  }
  if (callback_error_) std::rethrow_exception(callback_error_);
  finish_reduces();
  return loss_sum;
}

// Stage 3: stage by stage, gathering each stage's parameters before it runs and releasing them
// after, in both directions.
double Zero::staged_train_step(const weft_step_info& step) {
  if (!resting_) release_all();
  const auto S = static_cast<size_t>(model_stages_);
  const double scale = 1.0 / step.micro_batches;
  double loss_sum = 0.0;
  next_reduce_ = 0;
  pieces_left_ = pieces_;
  if (tied_) ensure_whole(0);
  for (int32_t m = 0; m < step.micro_batches; ++m) {
    const bool last = m == step.micro_batches - 1;
    weft::sdk::Batch batch = host().batch(m);
    std::vector<Activation> inputs(S), outputs(S);  // inputs[s]: stage s's leaf input (s > 0)
    prefetch(0);
    for (size_t s = 0; s < S; ++s) {
      ensure_whole(s);
      if (s + 1 < S) prefetch(s + 1);
      weft::sdk::TraceSpan span(host(), "forward", "stage " + std::to_string(s));
      if (s == 0) {
        outputs[0] = host().forward(0, 1, batch.inputs);
      } else {
        inputs[s] = host().activation_from_tensor(host().activation_view(outputs[s - 1]), true);
        outputs[s] = host().forward(static_cast<int64_t>(s), static_cast<int64_t>(s + 1), inputs[s]);
      }
      if (reshard_after_forward_ && s + 1 < S) release_stage(s);
    }
    weft::sdk::Loss loss = host().loss(outputs[S - 1], batch.targets, scale);
    loss_sum += loss.value;
    for (size_t s = S; s-- > 0;) {
      if (s < first_trainable_) {  // nothing before it trains (a frozen LoRA embedding): no backward
        release_stage(s);
        continue;
      }
      ensure_whole(s);
      if (s > first_trainable_) prefetch(s - 1);
      {
        weft::sdk::TraceSpan span(host(), "backward", "stage " + std::to_string(s));
        if (s + 1 == S) {
          host().backward(loss.loss);
          loss.loss.reset();
        } else {
          Activation grad = host().activation_grad(inputs[s + 1]);
          host().backward(outputs[s], grad);
          inputs[s + 1].reset();
        }
        outputs[s].reset();  // its graph is spent
      }
      if (last) reduce_stage(s);
      release_stage(s);
    }
  }
  finish_reduces();
  release_stage(0, /*even_pinned=*/true);
  return loss_sum;
}

// Composed (ABI 1.12), after the driver's step: every stage's gradients reduce-scattered into the
// shards, after backward, in the same order as hooked_train_step's.
double Zero::finish_step(const weft_step_info& step, double loss) {
  (void)step;
  if (ranks_ > 1) {
    try {
      pieces_left_ = pieces_;
      next_reduce_ = 0;
      syncing_ = false;
      finish_reduces();
    } catch (...) {
      abandon();
      throw;
    }
  }
  std::vector<double> sum{loss};
  return all_reduce_sum(sum) / ranks_;
}

weft::sdk::EvalResult Zero::finish_eval(const weft_step_info& step, const weft::sdk::EvalResult& sums) {
  (void)step;
  return weft::plugins::eval_sums_over(host(), world_, sums);
}

weft::sdk::EvalResult Zero::eval_step(const weft_step_info& step) {
  std::vector<double> sums{0.0, 0.0};  // {loss sum, tokens}
  const int32_t micro_batches = step.micro_batches > 0 ? step.micro_batches : 1;
  const auto S = static_cast<size_t>(model_stages_);
  try {
    if (stage_ == 3 && !resting_) release_all();
    for (int32_t m = 0; m < micro_batches; ++m) {
      weft::sdk::Batch batch = host().batch(m);
      const DLTensor inputs = host().activation_view(batch.inputs);
      const bool rows = !(inputs.ndim > 0 && inputs.shape[0] == 0);  // a rank may have none
      Activation logits;
      if (stage_ < 3) {
        if (rows) logits = host().forward(0, static_cast<int64_t>(S), batch.inputs, WEFT_FORWARD_NO_GRAD);
      } else {  // every rank gathers every stage, rows or not: the gathers are collectives
        if (tied_) ensure_whole(0);
        prefetch(0);
        Activation hidden;
        for (size_t s = 0; s < S; ++s) {
          ensure_whole(s);
          if (s + 1 < S) prefetch(s + 1);
          if (rows) {
            hidden = host().forward(static_cast<int64_t>(s), static_cast<int64_t>(s + 1), s == 0 ? batch.inputs : hidden,
                                    WEFT_FORWARD_NO_GRAD);
          }
          if (s + 1 < S) release_stage(s);
        }
        logits = std::move(hidden);
        release_all();
      }
      if (!rows) continue;
      weft::sdk::Loss loss = host().loss(logits, batch.targets, 1.0);
      sums[0] += loss.value * static_cast<double>(loss.tokens);
      sums[1] += static_cast<double>(loss.tokens);
    }
  } catch (...) {
    abandon();
    throw;
  }
  all_reduce_sum(sums);
  weft::sdk::EvalResult result;
  result.loss_sum = sums[0];
  result.tokens = static_cast<int64_t>(sums[1] + 0.5);
  return result;
}

double Zero::global_grad_norm_sq(double local_sq) {
  if (ranks_ == 1) return local_sq;
  std::vector<double> sum{local_sq};
  return all_reduce_sum(sum);  // the ranks' shards cover every element once
}

void Zero::after_optimizer_step() {
  if (stage_ < 3 && ranks_ > 1) gather_every_group();  // the updated shards into every rank's whole parameters
}

void Zero::materialize_parameters(bool whole) {
  if (stage_ < 3) return;  // whole between steps already
  try {
    if (whole) {
      for (size_t st = 0; st < stages_.size(); ++st) prefetch(st);
      for (size_t st = 0; st < stages_.size(); ++st) ensure_whole(st);
      resting_ = false;
    } else {
      release_all();
    }
  } catch (...) {
    abandon();
    throw;
  }
}

// --- gradients ---

Zero::InFlight Zero::start_reduce(size_t group) {
  const FlatGroup& g = reduce_groups_[group];
  InFlight flight;
  flight.group = group;
  flight.send = host().buffer({static_cast<int64_t>(ranks_) * g.width}, kFp32);  // [ranks, width]
  flight.receive = host().buffer({g.width}, kFp32);
  for (size_t k = 0; k < g.parameters.size(); ++k) {
    const int64_t index = g.parameters[k];
    DLTensor grad{};
    weft_status* status = host().api()->parameter_grad(host().handle(), index, &grad);
    if (status != nullptr && host().api()->status_code(status) == WEFT_STATUS_INVALID_ARGUMENT) {
      host().api()->status_release(status);  // no gradient in this step: zeros (the buffer's)
    } else {
      host().check(status);
      if (!is_fp32(grad) && !compute_dtype_) throw Error(WEFT_STATUS_UNSUPPORTED, "zero: a gradient is not fp32");
      copy_into_matrix(host(), g, k, flight.send.view(), grad);
    }
    // Its last piece copied: the whole gradient can go (stages 2 and 3).
    if (--pieces_left_[static_cast<size_t>(index)] == 0 && stage_ >= 2 && status == nullptr) {
      host().release_parameter_grad(index);
    }
  }
  DLTensor receive = flight.receive.view();
  flight.work = host().reduce_scatter(world_, receive, flight.send.view(), WEFT_REDUCE_SUM);
  return flight;
}

void Zero::finish_reduce(InFlight& flight) {
  flight.work.wait();
  flight.send.reset();
  const FlatGroup& g = reduce_groups_[flight.group];
  DLTensor row = flight.receive.view();
  host().scale(row, 1.0 / ranks_);
  for (size_t k = 0; k < g.parameters.size(); ++k) {
    copy_from_row(host(), g, k, row, host().parameter_grad_shard(g.parameters[k]));
  }
}

// Starts the reduce-scatters of `stage`'s groups (stages start in reduce_order_ on every rank),
// finishing the oldest first when kInFlight are already under way.
void Zero::reduce_stage(size_t stage) {
  for (size_t group : stages_[stage].reduce_groups) {
    if (reducing_.size() >= kInFlight) {
      finish_reduce(reducing_.front());
      reducing_.pop_front();
    }
    reducing_.push_back(start_reduce(group));
  }
}

void Zero::finish_reduces() {
  if (stage_ < 3) {  // whatever did not arrive counts as zeros, in order
    for (; next_reduce_ < reduce_order_.size(); ++next_reduce_) reduce_stage(reduce_order_[next_reduce_]);
  }
  while (!reducing_.empty()) {
    finish_reduce(reducing_.front());
    reducing_.pop_front();
  }
}

void Zero::grad_ready_trampoline(void* user_data, int64_t parameter_index) noexcept {
  auto* self = static_cast<Zero*>(user_data);
  if (!self->syncing_ || self->callback_error_) return;
  try {
    self->on_grad_ready(parameter_index);
  } catch (...) {
    self->callback_error_ = std::current_exception();
  }
}

void Zero::on_grad_ready(int64_t parameter_index) {
  if (parameter_index < 0 || static_cast<size_t>(parameter_index) >= stage_of_.size()) {
    throw Error(WEFT_STATUS_INTERNAL, "zero: grad-ready callback for unknown parameter " + std::to_string(parameter_index));
  }
  const int64_t stage = stage_of_[static_cast<size_t>(parameter_index)];
  char& ready = ready_[static_cast<size_t>(parameter_index)];
  if (stage < 0 || ready) return;
  ready = 1;
  --pending_[static_cast<size_t>(stage)];
  while (next_reduce_ < reduce_order_.size() && pending_[reduce_order_[next_reduce_]] == 0) {
    reduce_stage(reduce_order_[next_reduce_++]);
  }
}

// --- parameters ---

Zero::InFlight Zero::start_gather(size_t group) {
  const FlatGroup& g = gather_groups_[group];
  InFlight flight;
  flight.group = group;
  flight.send = host().buffer({g.width}, kFp32);
  flight.receive = host().buffer({static_cast<int64_t>(ranks_) * g.width}, kFp32);  // [ranks, width]
  for (size_t k = 0; k < g.parameters.size(); ++k) {
    copy_into_row(host(), g, k, flight.send.view(), host().parameter_shard(g.parameters[k]));
  }
  DLTensor receive = flight.receive.view();
  flight.work = host().all_gather(world_, receive, flight.send.view());
  return flight;
}

void Zero::finish_gather(InFlight& flight) {
  flight.work.wait();
  flight.send.reset();
  const FlatGroup& g = gather_groups_[flight.group];
  for (size_t k = 0; k < g.parameters.size(); ++k) {
    const int64_t index = g.parameters[k];
    // Stage 3: whole storage on the first piece (the later pieces find it whole).
    const DLTensor whole = stage_ == 3 ? host().materialize_parameter(index) : host().parameter_data(index);
    copy_from_matrix(host(), g, k, flight.receive.view(), whole);
  }
  const size_t stage = gather_stage_[flight.group];
  if (++gathered_[stage] == static_cast<int64_t>(stages_[stage].gather_groups.size())) whole_[stage] = 1;
}

void Zero::gather_every_group() {
  for (size_t group = 0; group < gather_groups_.size(); ++group) {
    if (gathering_.size() >= kInFlight) {
      finish_gather(gathering_.front());
      gathering_.pop_front();
    }
    gathering_.push_back(start_gather(group));
  }
  while (!gathering_.empty()) {
    finish_gather(gathering_.front());
    gathering_.pop_front();
  }
  std::fill(gathered_.begin(), gathered_.end(), 0);  // stages 1-2 count nothing between steps
}

void Zero::prefetch(size_t stage) {
  if (whole_[stage]) return;
  for (size_t group : stages_[stage].gather_groups) {
    if (gather_started_[group]) continue;
    if (gathering_.size() >= kInFlight) {
      finish_gather(gathering_.front());
      gathering_.pop_front();
    }
    gathering_.push_back(start_gather(group));
    gather_started_[group] = 1;
  }
}

void Zero::ensure_whole(size_t stage) {
  if (whole_[stage]) return;
  prefetch(stage);
  while (!whole_[stage]) {  // gathers finish in the order they started
    finish_gather(gathering_.front());
    gathering_.pop_front();
  }
}

void Zero::release_stage(size_t stage, bool even_pinned) {
  if (stage_ < 3 || !whole_[stage] || stages_[stage].gather_groups.empty() || (tied_ && stage == 0 && !even_pinned)) {
    return;
  }
  for (int64_t index : stages_[stage].gathered) host().release_parameter(index);
  whole_[stage] = 0;
  gathered_[stage] = 0;
  for (size_t group : stages_[stage].gather_groups) gather_started_[group] = 0;
}

void Zero::release_all() {
  for (size_t stage = 0; stage < stages_.size(); ++stage) release_stage(stage, /*even_pinned=*/true);
  resting_ = true;
}

double Zero::all_reduce_sum(std::vector<double>& values) {
  values = weft::plugins::sum_over(host(), world_, values);
  return values[0];
}

// After a failure: no callback may act any more, and every collective in flight is released (the
// host waits for it) before its buffers go.
void Zero::abandon() noexcept {
  syncing_ = false;
  callback_error_ = nullptr;
  reducing_.clear();
  gathering_.clear();
}

}  // namespace zero
}  // namespace weft

WEFT_STRATEGY(weft::zero::Zero, "zero", "1.0.0",
              "sharded data parallelism (ZeRO stages 1-3, FSDP-style): optimizer state, gradients and parameters")
