// trainer bench's figures: what one run measured (from its metrics.jsonl) and the summary of a
// variant over its repetitions, with the table and JSON they are reported in.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/util/stats.h"  // median_of, percentile_of

namespace weft {

// A held-out evaluation: after `step` steps, `train_seconds` of training (the step times of every
// step up to it, warm-up included; the evaluations' own time left out) and `wall_seconds` (the
// same with the evaluations' time, this one's included).
struct HeldOut {
  int64_t step = 0;
  double train_seconds = 0, loss = 0, wall_seconds = 0;
};

// One run's measured steps (those after the warm-up) and its summary line.
struct RunMeasurement {
  std::vector<double> step_seconds;
  std::vector<double> tokens_per_second;  // as the run logged them (global tokens / step time)
  double comm_wait_seconds = 0;           // rank 0, over the measured steps
  std::vector<double> comm_bytes;         // rank 0, per measured step
  std::vector<double> bubble;             // plugin.bubble per measured step (pipelines)
  std::vector<double> forward_seconds;    // rank 0, per measured step, where the run timed them
  std::vector<double> backward_seconds;   // (forward_s, backward_s: weft on the CPU, the baselines)
  std::optional<double> bubble_formula;
  bool has_comm = false;
  int64_t steps_per_epoch = 0;
  std::vector<double> peak_rss_mib_per_rank;
  std::vector<double> activation_peak_mib_per_rank;  // tensor bytes a step added at its peak (weft)
  std::vector<double> link_bytes;         // per measured step: rank 0's node's link (a job across nodes)
  std::vector<HeldOut> held_out;          // every evaluation of the run, in order
  std::optional<double> flops_per_token;  // the summary's model_flops_per_token (weft's runs)
};

// Reads `metrics_path` (weft's metrics.jsonl, or the PyTorch baseline's in the same format),
// keeping steps numbered above `warmup_steps`. Throws weft::Error naming the file when it is
// missing, has no measured step or no summary line.
RunMeasurement read_run(const std::string& metrics_path, int64_t warmup_steps);

struct Spread {
  double median = 0, min = 0, max = 0;
};

// Step latency percentiles (linear interpolation between the closest ranks, numpy's default).
struct Percentiles {
  double p50 = 0, p95 = 0, p99 = 0;
};

struct VariantSummary {
  std::string name, plugin;
  int nproc = 1;
  bool pytorch = false;
  int64_t tokens_per_step = 0;   // the variant's global batch in tokens (its own settings may change it)
  Spread step_seconds;           // over every measured step of every repetition
  double step_seconds_mean = 0;  // the same steps' mean: with a strategy whose steps differ in kind
                                 // (a sync every H steps), the time a step costs on average
  Percentiles step_percentiles;  // the same steps' p50 / p95 / p99
  Spread tokens_per_second;      // global tokens per step / step time (min from the slowest step)
  Spread epoch_seconds;          // steps per epoch x step time
  std::vector<double> run_step_seconds;  // each repetition's median step time, in order
  std::vector<double> peak_rss_mib_per_rank;  // the largest over repetitions, per rank
  std::vector<double> activation_peak_mib_per_rank;  // the largest over repetitions, per rank (weft)
  std::optional<double> comm_wait_fraction;   // rank 0's time blocked on communication / step time
  std::optional<double> comm_bytes_per_step;  // mean over the measured steps
  std::optional<double> bubble, bubble_formula;
  std::optional<double> forward_seconds, backward_seconds;  // medians per step (rank 0), where timed
  std::optional<double> link_bytes_per_step;  // mean: rank 0's node's link, received + sent (across nodes)
  // The held-out loss against training time: per evaluation, the median over repetitions of its
  // train_seconds and loss (each repetition evaluates at the same steps).
  std::vector<HeldOut> held_out;
  // Model FLOP utilisation at the median tokens/s: per process, against the GEMM peak trainer bench
  // measured (gemm_peak.h); set by the bench where the peak and the job's FLOPs per token apply.
  std::optional<double> mfu;
};


// Summarises a variant's repetitions. `tokens_per_step` is the variant's global batch in tokens.
VariantSummary summarise(const std::string& name, const std::string& plugin, int nproc, bool pytorch,
                         const std::vector<RunMeasurement>& runs, int64_t tokens_per_step);

// B's tokens/s over A's, for every pair of variants (A listed first), with the ratio of each
// repetition's medians (runs of one repetition ran back to back).
struct PairRatio {
  std::string a, b;
  double tokens_per_second = 0;
  std::vector<double> per_repetition;
};
std::vector<PairRatio> pair_ratios(const std::vector<VariantSummary>& variants);

// The terminal / Markdown table: one row per variant, then the ratios (every pair for up to 3
// variants, otherwise each variant against the first), and where runs crossed nodes or evaluated,
// a table of each variant's mean step time, link bytes per step and last held-out loss.
std::string format_bench_table(const std::vector<VariantSummary>& variants, const std::vector<PairRatio>& ratios);

// bench.json's "variants" entry and "ratios" entry.
nlohmann::json to_json(const VariantSummary& v);
nlohmann::json to_json(const PairRatio& r);

}  // namespace weft
