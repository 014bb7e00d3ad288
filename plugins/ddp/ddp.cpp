#include "ddp.hpp"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <string>

#include "../common/dl_views.hpp"
#include "../common/reductions.hpp"

namespace weft {
namespace ddp {

using weft::sdk::Error;
using weft::plugins::element_count;
using weft::plugins::flat_view;
using weft::plugins::is_fp32;

namespace {

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

std::string describe(const char* key, double value) {
  return std::string("plugin.") + key + " must be > 0, got " + std::to_string(value);
}

}  // namespace

Ddp::Ddp(weft::sdk::Host host) : Strategy(host), world_(host.world()) {
  bucket_mb_ = host.config_float("bucket_mb", 25.0);
  if (!(bucket_mb_ > 0.0)) throw Error(WEFT_STATUS_BAD_CONFIG, describe("bucket_mb", bucket_mb_));
  log_every_ = host.config_int("log_every", 0);
  if (log_every_ < 0) {
    throw Error(WEFT_STATUS_BAD_CONFIG,
                "plugin.log_every must be >= 0, got " + std::to_string(log_every_));
  }
}

Ddp::~Ddp() {
  if (!buckets_.empty()) host().api()->set_grad_ready_callback(host().handle(), nullptr, nullptr);
}

void Ddp::plan(weft_model_plan& plan) {
  plan.data_parallel_size = world_.size();
  plan.data_parallel_rank = world_.rank();
}

void Ddp::setup() {
  const int64_t count = host().parameter_count();
  std::vector<weft::sdk::Work> broadcasts;
  std::vector<BucketInput> trainable;
  for (int64_t i = 0; i < count; ++i) {
    DLTensor data = host().parameter_data(i);
    broadcasts.push_back(host().broadcast(world_, data, 0));
    const weft_parameter_info info = host().parameter_info(i);
    if (!info.trainable) continue;
    if (info.dtype.code != kDLFloat || info.dtype.bits != 32 || info.dtype.lanes != 1) {
      throw Error(WEFT_STATUS_UNSUPPORTED, std::string("ddp: parameter ") + info.name + " is not fp32");
    }
    trainable.push_back({i, element_count(data)});  // this rank's tensor (a slice under TP)
  }
  for (const weft::sdk::Work& work : broadcasts) work.wait();
  lay_out_buckets(trainable);
  host().set_grad_ready_callback(&Ddp::grad_ready_trampoline, this);
  WEFT_LOG_DEBUG(host(), "ddp: %zu trainable parameters in %zu buckets of <= %.3f MiB",
                 trainable.size(), buckets_.size(), bucket_mb_);
}

void Ddp::lay_out_buckets(const std::vector<BucketInput>& trainable) {
  const auto limit = static_cast<int64_t>(bucket_mb_ * kBytesPerMiB);
  buckets_.clear();
  bucket_of_.assign(static_cast<size_t>(host().parameter_count()), -1);
  ready_.assign(static_cast<size_t>(host().parameter_count()), 0);
  for (BucketLayout& layout : build_buckets(trainable, limit > 0 ? limit : 1)) {
    buckets_.emplace_back();
    Bucket& bucket = buckets_.back();
    bucket.layout = std::move(layout);
    bucket.buffer = host().buffer({bucket.layout.elements}, DLDataType{kDLFloat, 32, 1});
    for (int64_t parameter : bucket.layout.parameters) {
      bucket_of_[static_cast<size_t>(parameter)] = static_cast<int64_t>(buckets_.size() - 1);
    }
  }
}

// ABI 1.14: after a driver that reduce-scattered the gradients into its flat shards during its step
// (a stage-driving ZeRO-3: cp x zero-3), the gradients to average are those shards; the buckets
// are laid out again for their sizes (once: a shard keeps its size).
void Ddp::match_step_gradients() {
  std::vector<BucketInput> inputs;
  bool same = true;
  for (int64_t i = 0; i < static_cast<int64_t>(bucket_of_.size()); ++i) {
    const int64_t b = bucket_of_[static_cast<size_t>(i)];
    if (b < 0) continue;
    const BucketLayout& layout = buckets_[static_cast<size_t>(b)].layout;
    const auto k = static_cast<size_t>(
        std::find(layout.parameters.begin(), layout.parameters.end(), i) - layout.parameters.begin());
    DLTensor grad{};
    const int64_t elements = host().step_gradient(i, grad) ? element_count(grad) : layout.sizes[k];
    same = same && elements == layout.sizes[k];
    inputs.push_back({i, elements});
  }
  if (!same) lay_out_buckets(inputs);
}

void Ddp::memory_plan(weft_memory_plan& plan) {
  if (host().negotiated_minor() >= 3 && world_.size() > 1) plan.buffer_bytes += plan.gradient_bytes;
}

std::vector<BucketLayout> Ddp::bucket_layouts() const {
  std::vector<BucketLayout> layouts;
  for (const Bucket& bucket : buckets_) layouts.push_back(bucket.layout);
  return layouts;
}

double Ddp::train_step(const weft_step_info& step) {
  const int32_t micro_batches = step.micro_batches;
  if (micro_batches < 1) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "ddp: micro_batches must be >= 1");
  if (bucket_of_.size() != static_cast<size_t>(host().parameter_count())) {
    throw Error(WEFT_STATUS_INTERNAL, "ddp: train_step before setup");
  }
  stats_ = StepStats{};
  stats_.step = step.step;
  const int64_t stages = host().model_num_stages();
  const double scale = 1.0 / micro_batches;
  std::vector<double> loss_sum{0.0};
  try {
    for (int32_t m = 0; m < micro_batches; ++m) {
      weft::sdk::Batch batch = host().batch(m);
      weft::sdk::Activation logits = host().forward(0, stages, batch.inputs);
      weft::sdk::Loss loss = host().loss(logits, batch.targets, scale);
      if (m == micro_batches - 1) begin_sync();
      host().backward(loss.loss);
      syncing_ = false;
      loss_sum[0] += loss.value;
    }
    if (callback_error_) std::rethrow_exception(callback_error_);
    finish_sync();
  } catch (...) {
    abandon_sync();
    throw;
  }
  const double global_sum = all_reduce_doubles(loss_sum);
  maybe_log(step);
  return global_sum / (static_cast<double>(micro_batches) * world_.size());
}

weft::sdk::EvalResult Ddp::eval_step(const weft_step_info& step) {
  const int64_t stages = host().model_num_stages();
  std::vector<double> sums{0.0, 0.0};  // {loss sum, tokens}
  const int32_t micro_batches = step.micro_batches > 0 ? step.micro_batches : 1;
  for (int32_t m = 0; m < micro_batches; ++m) {
    weft::sdk::Batch batch = host().batch(m);
    const DLTensor inputs = host().activation_view(batch.inputs);
    if (inputs.ndim > 0 && inputs.shape[0] == 0) continue;  // no rows for this rank
    weft::sdk::Activation logits = host().forward(0, stages, batch.inputs, WEFT_FORWARD_NO_GRAD);
    weft::sdk::Loss loss = host().loss(logits, batch.targets, 1.0);
    sums[0] += loss.value * static_cast<double>(loss.tokens);
    sums[1] += static_cast<double>(loss.tokens);
  }
  all_reduce_doubles(sums);
  weft::sdk::EvalResult result;
  result.loss_sum = sums[0];
  result.tokens = static_cast<int64_t>(sums[1] + 0.5);
  return result;
}

double Ddp::finish_step(const weft_step_info& step, double loss) {
  stats_ = StepStats{};
  stats_.step = step.step;
  try {
    match_step_gradients();
    begin_sync();
    syncing_ = false;  // every bucket starts now, in order
    finish_sync();
  } catch (...) {
    abandon_sync();
    throw;
  }
  std::vector<double> sum{loss};
  all_reduce_doubles(sum);
  maybe_log(step);
  return sum[0] / world_.size();
}

weft::sdk::EvalResult Ddp::finish_eval(const weft_step_info& step, const weft::sdk::EvalResult& sums) {
  (void)step;
  return weft::plugins::eval_sums_over(host(), world_, sums);
}

int32_t Ddp::gradient_copies(int64_t index) {
  (void)index;
  return world_.size();
}

// --- gradient synchronisation ---

void Ddp::grad_ready_trampoline(void* user_data, int64_t parameter_index) noexcept {
  auto* self = static_cast<Ddp*>(user_data);
  if (!self->syncing_ || self->callback_error_) return;
  try {
    self->on_grad_ready(parameter_index);
  } catch (...) {
    self->callback_error_ = std::current_exception();
  }
}

void Ddp::on_grad_ready(int64_t parameter_index) {
  if (parameter_index < 0 || static_cast<size_t>(parameter_index) >= bucket_of_.size()) {
    throw Error(WEFT_STATUS_INTERNAL, "ddp: grad-ready callback for unknown parameter " +
                                          std::to_string(parameter_index));
  }
  const int64_t bucket = bucket_of_[static_cast<size_t>(parameter_index)];
  char& ready = ready_[static_cast<size_t>(parameter_index)];
  if (bucket < 0 || ready) return;
  ready = 1;
  if (--buckets_[static_cast<size_t>(bucket)].pending == 0) {
    const int64_t before = stats_.all_reduces;
    start_ready_buckets();
    stats_.buckets_in_backward += stats_.all_reduces - before;
  }
}

void Ddp::begin_sync() {
  for (Bucket& bucket : buckets_) {
    bucket.work.reset();
    bucket.started = false;
    bucket.pending = static_cast<int64_t>(bucket.layout.parameters.size());
  }
  std::fill(ready_.begin(), ready_.end(), 0);
  next_bucket_ = 0;
  callback_error_ = nullptr;
  syncing_ = true;
}

// Starts buckets in index order for as long as the next one is complete.
void Ddp::start_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    start_bucket(buckets_[next_bucket_++]);
  }
}

void Ddp::start_bucket(Bucket& bucket) {
  fill_bucket(bucket);
  DLTensor view = bucket.buffer.view();
  bucket.work = host().all_reduce(world_, view, WEFT_REDUCE_SUM);
  bucket.started = true;
  ++stats_.all_reduces;
  stats_.bytes_all_reduced += bucket.buffer.elements() * static_cast<int64_t>(sizeof(float));
}

// Copies the bucket's gradients into its buffer (on the device, through the host); a parameter
// without a gradient is zeros.
void Ddp::fill_bucket(Bucket& bucket) {
  const BucketLayout& layout = bucket.layout;
  for (size_t k = 0; k < layout.parameters.size(); ++k) {
    int64_t part_shape[2];
    DLTensor target = bucket.buffer.part(layout.offsets[k], layout.sizes[k], part_shape);
    DLTensor grad{};
    if (!host().step_gradient(layout.parameters[k], grad)) {  // no gradient yet: contributes zeros
      ++stats_.missing_grads;
      host().scale(target, 0.0);
      continue;
    }
    if (!is_fp32(grad) || element_count(grad) != layout.sizes[k]) {
      throw Error(WEFT_STATUS_UNSUPPORTED, "ddp: the gradient of parameter " + std::to_string(layout.parameters[k]) +
                                               " is not an fp32 tensor of its parameter's size");
    }
    host().copy(target, grad);
  }
}

void Ddp::finish_sync() {
  for (Bucket& bucket : buckets_) bucket.pending = 0;  // whatever did not arrive counts as zeros
  start_ready_buckets();
  for (Bucket& bucket : buckets_) {
    timed_wait(bucket.work);
    bucket.work.reset();
    scatter_bucket(bucket);
  }
}

// Divides the summed buffer by the world size and copies it back into the gradients.
void Ddp::scatter_bucket(Bucket& bucket) {
  DLTensor whole = bucket.buffer.view();
  host().scale(whole, 1.0 / static_cast<double>(world_.size()));
  const BucketLayout& layout = bucket.layout;
  for (size_t k = 0; k < layout.parameters.size(); ++k) {
    DLTensor grad{};
    if (!host().step_gradient(layout.parameters[k], grad)) {
      // Still no gradient after backward: nowhere to write the average (see the report).
      WEFT_LOG_WARN(host(), "ddp: parameter %" PRId64 " has no gradient to receive the average",
                    layout.parameters[k]);
      continue;
    }
    int64_t part_shape[2];
    const DLTensor part = bucket.buffer.part(layout.offsets[k], layout.sizes[k], part_shape);
    host().copy(grad, part);
  }
}

// After a failure: no callback may act any more, and every collective in flight is released
// (the host waits for it) before the buffers could be touched again.
void Ddp::abandon_sync() noexcept {
  syncing_ = false;
  callback_error_ = nullptr;
  for (Bucket& bucket : buckets_) bucket.work.reset();
}

double Ddp::all_reduce_doubles(std::vector<double>& values) {
  int64_t shape[2];
  DLTensor view = flat_view(values, shape);
  weft::sdk::Work work = host().all_reduce(world_, view, WEFT_REDUCE_SUM);
  ++stats_.all_reduces;
  stats_.bytes_all_reduced += static_cast<int64_t>(values.size() * sizeof(double));
  timed_wait(work);
  return values[0];
}

void Ddp::timed_wait(const weft::sdk::Work& work) {
  const auto start = std::chrono::steady_clock::now();
  work.wait();
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Ddp::maybe_log(const weft_step_info& step) const {
  if (log_every_ <= 0 || (step.step + 1) % log_every_ != 0) return;
  WEFT_LOG_DEBUG(host(),
                 "ddp step %" PRId64 ": waited %.6f s, all-reduced %" PRId64 " bytes in %" PRId64
                 " calls (%" PRId64 " buckets during backward, %" PRId64 " missing gradients)",
                 stats_.step, stats_.wait_seconds, stats_.bytes_all_reduced, stats_.all_reduces,
                 stats_.buckets_in_backward, stats_.missing_grads);
}

}  // namespace ddp
}  // namespace weft

#ifndef WEFT_DDP_NO_ENTRY  // context_parallel.so builds on Ddp with an entry point of its own
WEFT_STRATEGY(weft::ddp::Ddp, "ddp", "1.0.0",
              "data parallelism: bucketed, overlapped gradient all-reduce over the world")
#endif
