#include "core/train/conformance.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/train/trainer.h"
#include "core/util/error.h"

namespace weft {
namespace {

// A deterministic pseudo-English JSONL corpus, so the check needs no data files.
std::string write_corpus(const std::string& dir) {
  static const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and",
                                "runs", "away", "from", "her", "sister", "at", "noon", "with", "grace"};
  std::mt19937 rng(7);
  const std::string path = dir + "/corpus.jsonl";
  std::ofstream out(path);
  for (int d = 0; d < 48; ++d) {
    std::string text;
    for (int w = 0; w < 80; ++w) text += std::string(w ? " " : "") + words[rng() % 19];
    out << "{\"text\": \"" << text << ".\"}\n";
  }
  return path;
}

TrainOptions run_options(const ConformanceOptions& c, const std::string& corpus, const std::string& plugin,
                         const std::string& out_dir) {
  TrainOptions o;
  o.model.preset = "tiny";
  o.data.paths = {corpus};
  o.data.seq_len = 32;
  o.data.heldout_fraction = 0.1;
  o.data.split_seed = 1;
  o.data.tokenize_threads = 1;
  o.tokenizer = "byte";
  o.optim.lr = 3e-3;
  o.optim.warmup_steps = 2;
  o.seed = 11;
  o.max_steps = c.steps;
  o.batch_size = c.batch_size;
  o.grad_accum_steps = c.grad_accum_steps;
  o.precision = "fp32";
  o.threads = 1;
  o.out_dir = out_dir;
  o.metrics_file = "";
  o.progress = "off";
  o.save_final = false;
  o.keep_best = false;
  o.overwrite = true;
  o.plugin = plugin;
  return o;
}

}  // namespace

std::string ConformanceReport::describe() const {
  return fmt::format(
      "{}: {} fp32 steps; largest loss difference {:.3g} (relative), largest parameter difference {:.3g} "
      "(absolute, {})",
      passed ? "PASS" : "FAIL", steps, max_loss_rel_diff, max_param_abs_diff,
      worst_parameter.empty() ? "-" : worst_parameter);
}

ConformanceReport check_conformance(const ConformanceOptions& c) {
  WEFT_CHECK(!c.plugin.empty(), "conformance check: no plugin given");
  const std::string dir = c.work_dir.empty()
                              ? (std::filesystem::temp_directory_path() / ("weft-check-" + std::to_string(::getpid()))).string()
                              : c.work_dir;
  std::filesystem::create_directories(dir);
  const std::string corpus = write_corpus(dir);
  Trainer reference(run_options(c, corpus, c.reference, dir + "/reference"));
  Trainer candidate(run_options(c, corpus, c.plugin, dir + "/candidate"));
  const auto r = reference.run();
  const auto p = candidate.run();

  ConformanceReport report;
  report.reference_losses = r.step_losses;
  report.plugin_losses = p.step_losses;
  report.steps = static_cast<int64_t>(std::min(r.step_losses.size(), p.step_losses.size()));
  bool same_steps = r.step_losses.size() == p.step_losses.size();
  for (int64_t i = 0; i < report.steps; ++i) {
    const double a = r.step_losses[i], b = p.step_losses[i];
    report.max_loss_rel_diff = std::max(report.max_loss_rel_diff, std::abs(a - b) / std::max(std::abs(a), 1e-12));
  }
  auto reference_params = reference.model().named_parameters();
  for (auto& item : candidate.model().named_parameters()) {
    const auto* ref = reference_params.find(item.key());
    if (!ref) continue;  // a sharding plugin holds only part; the multi-rank check gathers
    const double diff = (item.value() - *ref).abs().max().item<double>();
    if (diff > report.max_param_abs_diff) {
      report.max_param_abs_diff = diff;
      report.worst_parameter = item.key();
    }
  }
  report.passed = same_steps && report.steps == c.steps && report.max_loss_rel_diff <= c.loss_rtol &&
                  report.max_param_abs_diff <= c.param_atol;
  if (c.work_dir.empty()) std::filesystem::remove_all(dir);
  return report;
}

}  // namespace weft
