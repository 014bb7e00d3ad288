#include "core/bench/bench_stats.h"

#include <algorithm>
#include <fstream>

#include <fmt/format.h>

#include "core/train/metrics.h"
#include "core/util/error.h"

namespace weft {
namespace {

Spread spread_of(const std::vector<double>& values) {
  if (values.empty()) return {};
  return {median_of(values), *std::min_element(values.begin(), values.end()),
          *std::max_element(values.begin(), values.end())};
}

std::string optional_percent(const std::optional<double>& v) {
  return v ? fmt::format("{:.1f}%", 100.0 * *v) : "-";
}

std::string ranks_text(const std::vector<double>& values) {
  std::string out;
  for (double v : values) out += fmt::format("{}{:.0f}", out.empty() ? "" : "/", v);
  return out.empty() ? "-" : out;
}

}  // namespace

RunMeasurement read_run(const std::string& metrics_path, int64_t warmup_steps) {
  std::ifstream in(metrics_path);
  WEFT_CHECK(in.good(), "{}: cannot read the run's metrics", metrics_path);
  RunMeasurement run;
  bool summary = false;
  double train_seconds = 0;  // every step's time so far, warm-up included
  double eval_seconds = 0;   // every evaluation's time so far
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    WEFT_CHECK(!j.is_discarded() && j.is_object(), "{}: a line is not a JSON object: {}", metrics_path, line);
    const std::string type = j.value("type", "");
    if (type == "step") train_seconds += j.value("step_time_s", 0.0);
    if (type == "eval") {  // the final evaluation repeats a periodic one at the last step: one point
      eval_seconds += j.value("seconds", 0.0);
      const HeldOut e{j.value("step", int64_t{0}), train_seconds, j.value("loss", 0.0), train_seconds + eval_seconds};
      if (!run.held_out.empty() && run.held_out.back().step == e.step) run.held_out.pop_back();
      run.held_out.push_back(e);
    } else if (type == "step" && j.value("step", int64_t{0}) > warmup_steps) {
      if (j.contains("link_bytes")) run.link_bytes.push_back(j["link_bytes"].get<double>());
      run.step_seconds.push_back(j.at("step_time_s").get<double>());
      run.tokens_per_second.push_back(j.value("tokens_per_s", 0.0));
      if (j.contains("comm_wait_s")) {
        run.has_comm = true;
        run.comm_wait_seconds += j["comm_wait_s"].get<double>();
        run.comm_bytes.push_back(j.value("comm_bytes", 0.0));
      }
      if (j.contains("plugin.bubble")) run.bubble.push_back(j["plugin.bubble"].get<double>());
      if (j.contains("forward_s") && j.contains("backward_s")) {
        run.forward_seconds.push_back(j["forward_s"].get<double>());
        run.backward_seconds.push_back(j["backward_s"].get<double>());
      }
      if (j.contains("plugin.bubble_formula")) run.bubble_formula = j["plugin.bubble_formula"].get<double>();
    } else if (type == "summary") {
      summary = true;
      run.steps_per_epoch = j.value("steps_per_epoch", int64_t{0});
      if (j.contains("model_flops_per_token")) run.flops_per_token = j["model_flops_per_token"].get<double>();
      if (j.contains("peak_rss_mib_per_rank")) {
        run.peak_rss_mib_per_rank = j["peak_rss_mib_per_rank"].get<std::vector<double>>();
      } else {
        run.peak_rss_mib_per_rank = {j.value("peak_rss_mib", 0.0)};
      }
      if (j.contains("activation_peak_mib_per_rank")) {
        run.activation_peak_mib_per_rank = j["activation_peak_mib_per_rank"].get<std::vector<double>>();
      }
    }
  }
  WEFT_CHECK(!run.step_seconds.empty(), "{}: no step after the {} warm-up steps", metrics_path, warmup_steps);
  WEFT_CHECK(summary, "{}: no summary line (did the run finish?)", metrics_path);
  return run;
}

VariantSummary summarise(const std::string& name, const std::string& plugin, int nproc, bool pytorch,
                         const std::vector<RunMeasurement>& runs, int64_t tokens_per_step) {
  WEFT_CHECK(!runs.empty(), "bench: variant '{}' has no runs", name);
  VariantSummary v;
  v.name = name;
  v.plugin = plugin;
  v.nproc = nproc;
  v.pytorch = pytorch;
  v.tokens_per_step = tokens_per_step;
  std::vector<double> steps, bytes, bubble, forward, backward, link;
  double wait = 0, busy = 0;
  bool comm = false;
  for (const auto& run : runs) {
    steps.insert(steps.end(), run.step_seconds.begin(), run.step_seconds.end());
    v.run_step_seconds.push_back(median_of(run.step_seconds));
    bytes.insert(bytes.end(), run.comm_bytes.begin(), run.comm_bytes.end());
    bubble.insert(bubble.end(), run.bubble.begin(), run.bubble.end());
    link.insert(link.end(), run.link_bytes.begin(), run.link_bytes.end());
    forward.insert(forward.end(), run.forward_seconds.begin(), run.forward_seconds.end());
    backward.insert(backward.end(), run.backward_seconds.begin(), run.backward_seconds.end());
    if (run.bubble_formula) v.bubble_formula = run.bubble_formula;
    comm = comm || run.has_comm;
    wait += run.comm_wait_seconds;
    for (double s : run.step_seconds) busy += s;
    if (v.peak_rss_mib_per_rank.size() < run.peak_rss_mib_per_rank.size()) {
      v.peak_rss_mib_per_rank.resize(run.peak_rss_mib_per_rank.size(), 0.0);
    }
    for (size_t r = 0; r < run.peak_rss_mib_per_rank.size(); ++r) {
      v.peak_rss_mib_per_rank[r] = std::max(v.peak_rss_mib_per_rank[r], run.peak_rss_mib_per_rank[r]);
    }
    auto& activations = v.activation_peak_mib_per_rank;
    if (activations.size() < run.activation_peak_mib_per_rank.size()) {
      activations.resize(run.activation_peak_mib_per_rank.size(), 0.0);
    }
    for (size_t r = 0; r < run.activation_peak_mib_per_rank.size(); ++r) {
      activations[r] = std::max(activations[r], run.activation_peak_mib_per_rank[r]);
    }
  }
  v.step_seconds = spread_of(steps);
  v.step_seconds_mean = mean_of(steps);
  v.step_percentiles = {percentile_of(steps, 50), percentile_of(steps, 95), percentile_of(steps, 99)};
  const double tokens = static_cast<double>(tokens_per_step);
  v.tokens_per_second = {tokens / v.step_seconds.median, tokens / v.step_seconds.max, tokens / v.step_seconds.min};
  const double per_epoch = static_cast<double>(runs.front().steps_per_epoch);
  v.epoch_seconds = {per_epoch * v.step_seconds.median, per_epoch * v.step_seconds.min,
                     per_epoch * v.step_seconds.max};
  if (comm) {
    v.comm_wait_fraction = busy > 0 ? wait / busy : 0.0;
    v.comm_bytes_per_step = mean_of(bytes);  // bytes add up: a strategy that syncs every H steps counts 1/H
  }
  if (!bubble.empty()) v.bubble = median_of(bubble);
  if (!link.empty()) v.link_bytes_per_step = mean_of(link);
  for (size_t e = 0; e < runs.front().held_out.size(); ++e) {
    std::vector<double> seconds, losses, wall;
    for (const auto& run : runs) {
      if (e >= run.held_out.size()) continue;
      seconds.push_back(run.held_out[e].train_seconds);
      losses.push_back(run.held_out[e].loss);
      wall.push_back(run.held_out[e].wall_seconds);
    }
    v.held_out.push_back({runs.front().held_out[e].step, median_of(seconds), median_of(losses), median_of(wall)});
  }
  if (!forward.empty()) {
    v.forward_seconds = median_of(forward);
    v.backward_seconds = median_of(backward);
  }
  return v;
}

std::vector<PairRatio> pair_ratios(const std::vector<VariantSummary>& variants) {
  std::vector<PairRatio> out;
  for (size_t i = 0; i < variants.size(); ++i) {
    for (size_t j = i + 1; j < variants.size(); ++j) {
      const auto &a = variants[i], &b = variants[j];
      PairRatio r{a.name, b.name, a.step_seconds.median / b.step_seconds.median, {}};
      for (size_t k = 0; k < std::min(a.run_step_seconds.size(), b.run_step_seconds.size()); ++k) {
        r.per_repetition.push_back(a.run_step_seconds[k] / b.run_step_seconds[k]);
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::string format_bench_table(const std::vector<VariantSummary>& variants, const std::vector<PairRatio>& ratios) {
  std::string out =
      "| variant | processes | step time median [min-max] | step p50 / p95 / p99 | tokens/s median [min-max] | time "
      "per epoch median [min-max] | forward / backward per step (rank 0) | peak RSS MiB per rank | activation peak MiB "
      "per rank | waiting on comm (rank 0) | MB sent per step | bubble (formula) | MFU (of the measured GEMM peak) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& v : variants) {
    const std::string bubble =
        v.bubble ? fmt::format("{:.3f} ({})", *v.bubble, v.bubble_formula ? fmt::format("{:.3f}", *v.bubble_formula) : "-")
                 : "-";
    const std::string compute =
        v.forward_seconds ? fmt::format("{:.3f} / {:.3f} s", *v.forward_seconds, *v.backward_seconds) : "-";
    out += fmt::format("| {} | {} | {:.3f} s [{:.3f}-{:.3f}] | {:.3f} / {:.3f} / {:.3f} s | {:.0f} [{:.0f}-{:.0f}] | {} "
                       "[{}-{}] | {} | {} | {} | {} | {} | {} | {} |\n",
                       v.name, v.nproc, v.step_seconds.median, v.step_seconds.min, v.step_seconds.max,
                       v.step_percentiles.p50, v.step_percentiles.p95, v.step_percentiles.p99,
                       v.tokens_per_second.median, v.tokens_per_second.min, v.tokens_per_second.max,
                       format_duration(v.epoch_seconds.median), format_duration(v.epoch_seconds.min),
                       format_duration(v.epoch_seconds.max), compute, ranks_text(v.peak_rss_mib_per_rank),
                       ranks_text(v.activation_peak_mib_per_rank),
                       v.pytorch ? "n/a" : optional_percent(v.comm_wait_fraction),
                       v.comm_bytes_per_step ? fmt::format("{:.2f}", *v.comm_bytes_per_step / 1e6) : "-", bubble,
                       optional_percent(v.mfu));
  }
  if (!ratios.empty()) {
    // Every pair of up to 3 variants; beyond that (28 pairs for 8) each against the first.
    const bool all_pairs = variants.size() <= 3;
    out += fmt::format("\n| B vs A | tokens/s of B / tokens/s of A | per repetition{} |\n|---|---|---|\n",
                       all_pairs ? "" : " (each against the first variant; every pair is in bench.json)");
    for (const auto& r : ratios) {
      if (!all_pairs && r.a != variants.front().name) continue;
      std::string reps;
      for (double x : r.per_repetition) reps += fmt::format("{}{:.2f}", reps.empty() ? "" : ", ", x);
      out += fmt::format("| {} vs {} | {:.2f}x | {} |\n", r.b, r.a, r.tokens_per_second, reps);
    }
  }
  const bool link = std::any_of(variants.begin(), variants.end(), [](const auto& v) { return v.link_bytes_per_step; });
  const bool held_out = std::any_of(variants.begin(), variants.end(), [](const auto& v) { return !v.held_out.empty(); });
  if (link || held_out) {
    out += "\n| variant | step time mean | link MB per step (rank 0's node, received + sent) | last held-out loss (step, "
           "training time) |\n|---|---|---|---|\n";
    for (const auto& v : variants) {
      const std::string loss = v.held_out.empty() ? "-"
                                                  : fmt::format("{:.4f} (step {}, {:.1f} s)", v.held_out.back().loss,
                                                                v.held_out.back().step, v.held_out.back().train_seconds);
      out += fmt::format("| {} | {:.3f} s | {} | {} |\n", v.name, v.step_seconds_mean,
                         v.link_bytes_per_step ? fmt::format("{:.2f}", *v.link_bytes_per_step / 1e6) : "-", loss);
    }
  }
  return out;
}

nlohmann::json to_json(const VariantSummary& v) {
  auto spread = [](const Spread& s) { return nlohmann::json{{"median", s.median}, {"min", s.min}, {"max", s.max}}; };
  auto optional = [](const std::optional<double>& x) { return x ? nlohmann::json(*x) : nlohmann::json(nullptr); };
  nlohmann::json runs = nlohmann::json::array();
  for (size_t k = 0; k < v.run_step_seconds.size(); ++k) {
    runs.push_back({{"repetition", k + 1}, {"step_time_s", v.run_step_seconds[k]},
                    {"tokens_per_s", static_cast<double>(v.tokens_per_step) / v.run_step_seconds[k]}});
  }
  nlohmann::json held_out = nlohmann::json::array();
  for (const auto& e : v.held_out) {
    held_out.push_back(
        {{"step", e.step}, {"train_seconds", e.train_seconds}, {"wall_seconds", e.wall_seconds}, {"loss", e.loss}});
  }
  return {{"name", v.name},
          {"plugin", v.plugin},
          {"nproc", v.nproc},
          {"kind", v.pytorch ? "pytorch" : "weft"},
          {"tokens_per_step", v.tokens_per_step},
          {"step_time_s", spread(v.step_seconds)},
          {"step_time_mean_s", v.step_seconds_mean},
          {"step_time_percentiles_s",
           {{"p50", v.step_percentiles.p50}, {"p95", v.step_percentiles.p95}, {"p99", v.step_percentiles.p99}}},
          {"tokens_per_s", spread(v.tokens_per_second)},
          {"epoch_s", spread(v.epoch_seconds)},
          {"peak_rss_mib_per_rank", v.peak_rss_mib_per_rank},
          {"activation_peak_mib_per_rank", v.activation_peak_mib_per_rank},
          {"comm_wait_fraction", optional(v.comm_wait_fraction)},
          {"comm_bytes_per_step", optional(v.comm_bytes_per_step)},
          {"bubble", optional(v.bubble)},
          {"bubble_formula", optional(v.bubble_formula)},
          {"forward_s", optional(v.forward_seconds)},
          {"backward_s", optional(v.backward_seconds)},
          {"link_bytes_per_step", optional(v.link_bytes_per_step)},
          {"mfu", optional(v.mfu)},
          {"held_out", held_out},
          {"runs", runs}};
}

nlohmann::json to_json(const PairRatio& r) {
  return {{"a", r.a}, {"b", r.b}, {"tokens_per_s", r.tokens_per_second}, {"per_repetition", r.per_repetition}};
}

}  // namespace weft
