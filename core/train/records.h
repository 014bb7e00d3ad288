// What a training run records: one metrics.jsonl line per step, evaluation and epoch, the
// progress display, and the summary (line and log) at the end, with the totals behind it (time,
// tokens, this rank's communication, the plugin's metrics, memory).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/job/evaluate.h"
#include "core/plugin/strategy_session.h"
#include "core/train/metrics.h"

namespace weft {

class Communicator;

struct TrainResult {
  int64_t steps = 0;                   // optimizer steps completed (including before a resume)
  int64_t epochs_completed = 0;
  std::vector<double> step_losses;     // losses of the steps run by this process
  std::vector<double> epoch_seconds;   // wall time of each completed epoch
  double tokens_per_second = 0;        // over the steps run by this process
  std::optional<EvalResult> final_eval;
  double best_eval_loss = 0;
  bool early_stopped = false;
  bool interrupted = false;            // stopped by SIGINT/SIGTERM (after saving a checkpoint if it could)
  int interrupt_signal = 0;            // that signal (the same on every rank)
  int64_t backup_failures = 0;         // backup.url: checkpoints whose upload failed (rank 0)
  double peak_rss_mib = 0;
  double tensor_peak_mib = 0;  // the most CPU tensor memory this rank held at once (memory.h), 0 untracked
  // What this rank's training state held between steps after the last one (MiB): parameters,
  // gradients and optimizer state as they were stored (whole or sharded).
  double state_parameters_mib = 0, state_gradients_mib = 0, state_optimizer_mib = 0;
  // Model FLOP utilisation (0 where the device's peak is unknown) at the median step's time: the
  // steady state, which the first steps' one-time costs (CUDA's kernel selection, the caching
  // allocator's growth) do not move; and over the whole run (tokens_per_second).
  double mfu = 0;
  double mfu_whole_run = 0;
  double step_seconds_median = 0;      // of the steps run by this process
  double device_peak_allocated_mib = 0;  // CUDA: this rank's peak tensor memory (0 on a CPU)
  double device_peak_reserved_mib = 0;   // CUDA: this rank's peak memory held by the caching allocator
  int64_t skipped_steps = 0;           // fp16: steps skipped for non-finite gradients
  int chunked_loss = -1;               // PluginHost::chunked_loss: 1 chunked, 0 logits, -1 no loss here
  std::map<std::string, int64_t> adalora_ranks;  // AdaLoRA: each adapted layer's kept rank at the end
};

// Where and how the run computes, for the records: the summary's device, precision and MFU.
struct RunSetting {
  std::string device;          // "cpu", "cuda:0"
  std::string device_name;     // "cpu", "NVIDIA H100 80GB HBM3"
  std::string precision;       // train.precision
  int world = 1;               // processes (devices) of the run
  double flops_per_token = 0;  // training FLOPs per token (core/train/flops.h)
  double peak_tflops = 0;      // the device's peak at this precision, 0 if unknown
  double memory_plan_mib = 0;  // this rank's memory plan (core/job: parameters .. buffers, no runtime)
  // The model trained, for the records: where its weights came from (a file or folder, or the
  // random init), its shape, its parameters and those trained (-1: all of them).
  std::string model_weights;
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, vocab = 0, parameters = 0, trainable = -1;
};

// One optimizer step as it is recorded.
struct StepRecord {
  int64_t step = 0, epoch = 0;  // the step's number (1-based) and its epoch (0-based)
  double lr = 0, grad_norm = 0, seconds = 0;
  double loss_scale = 0;        // fp16: the loss scale of the step (0: no scaling)
  bool skipped = false;         // fp16: gradients were not finite, the optimizer did not step
  double activation_mib = 0;    // tensor memory the step added on this rank at its peak
  // A job across nodes, rank 0: bytes its node's link carried during the step (received + sent on
  // the interfaces its Gloo uses; core/dist/link_counter.h).
  std::optional<int64_t> link_bytes;
  StepReport report;            // loss, communication, plugin metrics
};

class RunRecords {
 public:
  // metrics_file "" records no lines (ranks other than 0); resumed: append to it.
  RunRecords(const std::string& metrics_file, bool resumed, const std::string& progress_mode, int64_t log_every,
             int64_t tokens_per_step, RunSetting setting);

  Progress& progress() { return progress_; }
  TrainResult& result() { return result_; }
  int64_t tokens_per_step() const { return tokens_per_step_; }

  void step(const StepRecord& step);
  void eval(const EvalResult& eval, int64_t step, int64_t epoch, bool improved);
  void epoch(int64_t epoch, int64_t step, double seconds, int64_t tokens, const std::optional<EvalResult>& eval);
  // Completes the result (throughput, memory) and writes the summary line and the log lines.
  // Collective over `communicator`'s world (per-rank memory).
  // tensor_peak_mib: this rank's peak tensor memory over the run (compared with its memory plan).
  const TrainResult& finish(Communicator& communicator, int rank, int64_t steps_per_epoch, int64_t skipped_steps,
                            double tensor_peak_mib);
  // MFU of `tokens_per_second` (the whole run's) on this setting, 0 when the peak is unknown.
  double mfu(double tokens_per_second) const;

 private:
  MetricsWriter metrics_;
  Progress progress_;
  TrainResult result_;
  int64_t tokens_per_step_ = 0;
  RunSetting setting_;
  double seconds_ = 0.0;             // of the steps run by this process
  std::vector<double> step_seconds_;  // each of them
  int64_t tokens_ = 0;
  double activation_peak_mib_ = 0.0;
  double comm_wait_seconds_ = 0.0;   // this rank's time blocked on the plugin's communication
  int64_t comm_bytes_ = 0;
  int64_t link_bytes_ = 0, link_steps_ = 0;  // steps that counted their node's link bytes
  std::map<std::string, std::pair<double, int64_t>> plugin_metric_sums_;  // name -> (sum, steps)
};

}  // namespace weft
