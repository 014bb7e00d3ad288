#include "core/train/records.h"

#include <algorithm>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/dist/process_groups.h"
#include "core/model/gemm.h"
#include "core/train/flops.h"
#include "core/util/device.h"
#include "core/util/stats.h"
#include "core/util/libtorch.h"
#include "core/util/trace.h"

namespace weft {

RunRecords::RunRecords(const std::string& metrics_file, bool resumed, const std::string& progress_mode,
                       int64_t log_every, int64_t tokens_per_step, RunSetting setting)
    : metrics_(metrics_file, /*append=*/resumed),
      progress_(progress_mode, log_every),
      tokens_per_step_(tokens_per_step),
      setting_(std::move(setting)) {}

double RunRecords::mfu(double tokens_per_second) const {
  return model_flop_utilisation(tokens_per_second / std::max(setting_.world, 1), setting_.flops_per_token,
                                setting_.peak_tflops);
}

void RunRecords::step(const StepRecord& s) {
  seconds_ += s.seconds;
  step_seconds_.push_back(s.seconds);
  tokens_ += tokens_per_step_;
  activation_peak_mib_ = std::max(activation_peak_mib_, s.activation_mib);
  comm_wait_seconds_ += s.report.comm.wait_seconds;
  comm_bytes_ += s.report.comm.bytes;
  result_.step_losses.push_back(s.report.loss);
  nlohmann::json record = {{"step", s.step},
                           {"epoch", s.epoch + 1},
                           {"loss", s.report.loss},
                           {"lr", s.lr},
                           {"grad_norm", s.grad_norm},
                           {"tokens_per_s", tokens_per_step_ / s.seconds},
                           {"step_time_s", s.seconds},
                           {"activation_peak_mib", s.activation_mib},
                           {"comm_wait_s", s.report.comm.wait_seconds},
                           {"comm_bytes", s.report.comm.bytes}};
  if (s.link_bytes) {
    record["link_bytes"] = *s.link_bytes;
    link_bytes_ += *s.link_bytes;
    ++link_steps_;
  }
  if (s.report.compute.timed) {  // this rank's time in the host's forward (loss included) and backward
    record["forward_s"] = s.report.compute.forward_seconds;
    record["backward_s"] = s.report.compute.backward_seconds;
  }
  if (setting_.peak_tflops > 0) record["mfu"] = mfu(tokens_per_step_ / s.seconds);
  if (s.loss_scale > 0) {
    record["loss_scale"] = s.loss_scale;
    record["skipped"] = s.skipped;
  }
  for (const auto& [name, value] : s.report.metrics) {
    record["plugin." + name] = value;
    auto& sum = plugin_metric_sums_[name];
    sum.first += value;
    sum.second += 1;
  }
  metrics_.write("step", record);
}

void RunRecords::eval(const EvalResult& e, int64_t step, int64_t epoch, bool improved) {
  nlohmann::json record = {{"step", step}, {"epoch", epoch + 1}, {"loss", e.loss}, {"perplexity", e.perplexity},
                           {"tokens", e.tokens}, {"seconds", e.seconds}, {"best", improved}};
  // A classifier's task metrics, and its confusion matrix (rows: true class, columns: predicted).
  for (const auto& [name, value] : e.metrics) record[name] = value;
  if (!e.confusion.empty()) {
    const size_t k = e.classes.size();
    nlohmann::json rows = nlohmann::json::array();
    for (size_t r = 0; r < k; ++r) rows.push_back(std::vector<int64_t>(e.confusion.begin() + r * k, e.confusion.begin() + (r + 1) * k));
    record["confusion"] = rows;
    record["classes"] = e.classes;
  }
  metrics_.write("eval", record);
}

void RunRecords::epoch(int64_t epoch, int64_t step, double seconds, int64_t tokens,
                       const std::optional<EvalResult>& eval) {
  nlohmann::json record = {{"epoch", epoch + 1}, {"step", step}, {"time_s", seconds},
                           {"tokens_per_s", tokens / std::max(seconds, 1e-9)}};
  if (eval) {
    record["eval_loss"] = eval->loss;
    record["perplexity"] = eval->perplexity;
    for (const auto& [name, value] : eval->metrics) record["eval_" + name] = value;
  }
  metrics_.write("epoch", record);
  result_.epoch_seconds.push_back(seconds);
}

const TrainResult& RunRecords::finish(Communicator& communicator, int rank, int64_t steps_per_epoch,
                                      int64_t skipped_steps, double tensor_peak_mib) {
  TrainResult& result = result_;
  result.tensor_peak_mib = tensor_peak_mib;
  result.tokens_per_second = seconds_ > 0 ? tokens_ / seconds_ : 0.0;
  result.peak_rss_mib = peak_rss_mib();
  result.step_seconds_median = median_of(step_seconds_);
  result.mfu = result.step_seconds_median > 0 ? mfu(tokens_per_step_ / result.step_seconds_median) : 0.0;
  result.mfu_whole_run = mfu(result.tokens_per_second);
  result.skipped_steps = skipped_steps;
  const double steps = static_cast<double>(std::max<size_t>(result.step_losses.size(), 1));
  nlohmann::json summary = {{"steps", result.steps},
                            {"epochs", result.epochs_completed},
                            {"steps_per_epoch", steps_per_epoch},
                            {"epoch_seconds", result.epoch_seconds},
                            {"tokens_per_s", result.tokens_per_second},
                            {"step_time_median_s", result.step_seconds_median},
                            {"peak_rss_mib", result.peak_rss_mib},
                            {"early_stopped", result.early_stopped},
                            {"interrupted", result.interrupted},
                            {"libtorch", libtorch_version()},
                            {"device", setting_.device},
                            {"device_name", setting_.device_name},
                            {"precision", setting_.precision},
                            {"fp32_cpu_gemm", to_string(cpu_fp32_gemm())},
                            {"onednn_fp32_products", onednn_fp32_products()},
                            {"model_flops_per_token", setting_.flops_per_token},
                            {"activation_peak_mib", activation_peak_mib_}};
  if (seconds_ > 0) {
    summary["comm_wait_fraction"] = comm_wait_seconds_ / seconds_;
    summary["comm_bytes_per_step"] = static_cast<double>(comm_bytes_) / steps;
    if (comm_bytes_ > 0) {
      spdlog::info("communication: waiting {:.1f}% of step time ({:.3f} s per step), {:.2f} MB per step (rank {})",
                   100.0 * comm_wait_seconds_ / seconds_, comm_wait_seconds_ / steps, comm_bytes_ / steps / 1e6, rank);
    }
  }
  if (link_steps_ > 0) {
    summary["link_bytes_per_step"] = static_cast<double>(link_bytes_) / link_steps_;
    spdlog::info("this node's link: {:.2f} MB per step (received + sent)", link_bytes_ / 1e6 / link_steps_);
  }
  if (setting_.peak_tflops > 0) {
    summary["peak_tflops"] = setting_.peak_tflops;
    summary["mfu"] = result.mfu;
    summary["mfu_whole_run"] = result.mfu_whole_run;
    spdlog::info("model FLOP utilisation {:.1f}% at the median step ({:.3f} s, {:.0f} tokens/s; {:.1f}% over the whole "
                 "run, its first steps' one-time costs included: {:.0f} tokens/s) ({:.3g} FLOPs per token over {} "
                 "device(s) of {:.1f} TFLOP/s peak at {})",
                 100.0 * result.mfu, result.step_seconds_median,
                 result.step_seconds_median > 0 ? tokens_per_step_ / result.step_seconds_median : 0.0,
                 100.0 * result.mfu_whole_run, result.tokens_per_second, setting_.flops_per_token, setting_.world,
                 setting_.peak_tflops, setting_.precision);
  }
  summary["model"] = {{"weights", setting_.model_weights}, {"layers", setting_.layers},
                      {"hidden_size", setting_.hidden},     {"heads", setting_.heads},
                      {"kv_heads", setting_.kv_heads},      {"vocab_size", setting_.vocab},
                      {"parameters", setting_.parameters},
                      {"trainable_parameters", setting_.trainable >= 0 ? setting_.trainable : setting_.parameters}};
  if (setting_.precision == "fp16") summary["skipped_steps"] = skipped_steps;
  if (!result.adalora_ranks.empty()) summary["adalora_ranks"] = result.adalora_ranks;
  if (result.backup_failures > 0) summary["backup_failures"] = result.backup_failures;
  summary["peak_rss_mib_per_rank"] = communicator.all_gather(result.peak_rss_mib);  // collective
  // The memory plan made before the model was built, next to what the ranks' tensors peaked at.
  summary["memory_plan_mib_per_rank"] = communicator.all_gather(setting_.memory_plan_mib);  // collective
  summary["tensor_peak_mib_per_rank"] = communicator.all_gather(tensor_peak_mib);           // collective
  // How each rank computed the LM head's loss: 1 in row chunks (model.chunked_loss), 0 from whole
  // logits, -1 none (a pipeline stage without the head).
  summary["chunked_loss_per_rank"] = communicator.all_gather(static_cast<double>(result.chunked_loss));  // collective
  summary["state_mib_per_rank"] = {
      {"parameters", communicator.all_gather(result.state_parameters_mib)},  // collective
      {"gradients", communicator.all_gather(result.state_gradients_mib)},    // collective
      {"optimizer", communicator.all_gather(result.state_optimizer_mib)}};   // collective
  {  // the device's memory (CUDA's caching allocator; zeros on CPUs), every rank's
    const DeviceMemory memory = device_memory(c10::Device(setting_.device));
    result.device_peak_allocated_mib = static_cast<double>(memory.peak_allocated_bytes) / (1024.0 * 1024.0);
    result.device_peak_reserved_mib = static_cast<double>(memory.peak_reserved_bytes) / (1024.0 * 1024.0);
    const auto allocated = communicator.all_gather(result.device_peak_allocated_mib);  // collective
    const auto reserved = communicator.all_gather(result.device_peak_reserved_mib);    // collective
    if (c10::Device(setting_.device).is_cuda()) {
      summary["device_peak_allocated_mib_per_rank"] = allocated;
      summary["device_peak_reserved_mib_per_rank"] = reserved;
      summary["device_peak_allocated_mib"] = *std::max_element(allocated.begin(), allocated.end());
      summary["device_peak_reserved_mib"] = *std::max_element(reserved.begin(), reserved.end());
      std::string text;
      for (size_t r = 0; r < allocated.size(); ++r) {
        text += fmt::format("{}{:.0f}/{:.0f}", r ? ", " : "", allocated[r], reserved[r]);
      }
      spdlog::info("peak device memory (MiB allocated/reserved) per rank: {}", text);
    }
  }
  const auto per_rank = communicator.all_gather(activation_peak_mib_);               // collective
  summary["activation_peak_mib_per_rank"] = per_rank;
  std::string text;
  for (double mib : per_rank) text += fmt::format("{}{:.1f}", text.empty() ? "" : ", ", mib);
  spdlog::info("step activation memory (peak tensor MiB above the step's start) per rank: {}", text);
  std::string plugin_text;
  for (const auto& [name, sum] : plugin_metric_sums_) {
    const double mean = sum.first / static_cast<double>(std::max<int64_t>(sum.second, 1));
    summary["plugin." + name] = mean;
    plugin_text += fmt::format("{}{} {:.4g}", plugin_text.empty() ? "" : ", ", name, mean);
  }
  if (!plugin_text.empty()) spdlog::info("plugin metrics (mean over steps): {}", plugin_text);
  if (const std::string trace = Tracer::instance().write(); !trace.empty()) {
    spdlog::info("trace written to {}", trace);
  }
  if (result.final_eval) {
    summary["eval_loss"] = result.final_eval->loss;
    summary["perplexity"] = result.final_eval->perplexity;
    for (const auto& [name, value] : result.final_eval->metrics) summary["eval_" + name] = value;
  }
  metrics_.write("summary", summary);
  return result;
}

}  // namespace weft
