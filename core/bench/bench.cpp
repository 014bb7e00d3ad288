#include "core/bench/bench.h"

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <tuple>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/bench/bench_stats.h"
#include "core/bench/gemm_peak.h"
#include "core/config/config.h"
#include "core/plugin/abi2.h"
#include "core/plugin/library.h"
#include "core/job/export.h"
#include "core/job/job.h"
#include "core/job/options.h"
#include "core/model/linear_cross_entropy.h"
#include "core/train/flops.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/shell.h"

namespace weft {
namespace fs = std::filesystem;
namespace {

std::vector<std::string> split_words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

std::vector<int> parse_counts(const std::string& text) {
  std::vector<int> counts;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    WEFT_CHECK(used == item.size() && n >= 1, "--nproc '{}': expected a process count >= 1 or a list like 1,2", text);
    counts.push_back(n);
  }
  WEFT_CHECK(!counts.empty(), "--nproc '{}': expected a process count >= 1 or a list like 1,2", text);
  return counts;
}

// "ddp" from "ddp", "build/plugins/ddp.so" or "libddp.so".
std::string short_plugin_name(const std::string& plugin) {
  std::string name = fs::path(plugin).filename().string();
  if (name.size() > 3 && name.compare(name.size() - 3, 3, ".so") == 0) name.resize(name.size() - 3);
  if (name.rfind("lib", 0) == 0 && name.size() > 3) name = name.substr(3);
  return name;
}

// The mesh dimensions (bits of weft_mesh_dim) that a variant's plugin, run alone, can own: which
// of PyTorch's baselines compare with it. None for a composition or a PyTorch baseline.
uint32_t owned_dimensions(const BenchVariant& v) {
  if (v.pytorch || v.plugin.find(',') != std::string::npos) return 0;
  const auto library = PluginLibrary::load(v.plugin);  // throws naming a plugin that is not found
  return library->plugin().table.mesh_dimensions;
}

// "gpipe --set plugin.microbatches=8" -> the plugin and its settings.
BenchVariant parse_plugin_spec(const std::string& spec) {
  const auto words = split_words(spec);
  WEFT_CHECK(!words.empty(), "--plugin '': expected a plugin name or path");
  BenchVariant v;
  v.plugin = words[0];
  for (size_t i = 1; i < words.size(); i += 2) {
    WEFT_CHECK(words[i] == "--set" && i + 1 < words.size() && words[i + 1].find('=') != std::string::npos,
               "--plugin '{}': after the plugin only '--set KEY=VALUE' pairs may follow", spec);
    v.settings.push_back(words[i + 1]);
  }
  return v;
}

std::string variant_name(const BenchVariant& v) {
  // The baseline keeps one name at every size (one process runs without the DDP wrapper), so
  // that it is one line in the scaling plots.
  std::string name = !v.pytorch                  ? short_plugin_name(v.plugin)
                     : !v.transformers.empty()    ? (v.transformers == "lora" ? "transformers-peft" : "transformers")
                     : v.pytorch_parallel == "pp" ? "pytorch-" + v.pytorch_schedule
                                                  : "pytorch-" + v.pytorch_parallel;
  for (const auto& s : v.settings) name += " " + (s.rfind("plugin.", 0) == 0 ? s.substr(7) : s);
  return name + " x" + std::to_string(v.nproc * v.nnodes);
}

std::string slug(const std::string& name) {
  std::string out;
  for (char c : name) out += std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_';
  return out;
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof(text), "%Y%m%d-%H%M%S", std::localtime(&now));
  return text;
}

// The first line of `log` that reports an error (the cause, usually), or "".
std::string first_error_line(const std::string& log) {
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    if (line.find("error") != std::string::npos || line.find("Error") != std::string::npos) return line;
  }
  return "";
}

// Runs `command` with its output in `log`; throws naming the cause and the log on failure.
void run_logged(const std::string& command, const std::string& log) {
  const int status = std::system((command + " > " + shell_quote(log) + " 2>&1").c_str());
  WEFT_CHECK(status == 0, "{} (all its output: {})", first_error_line(log), log);
}

// A variant that failed: it is left out of the figures and named with its error.
struct Failure {
  std::string error;
  int64_t repetition = 0;
};

// `run`: the run's number in the bench (0, 1, ...), the same on every node: its rendezvous port.
std::vector<std::string> weft_run_command(const BenchOptions& o, const BenchVariant& v, const std::string& run_dir,
                                          int64_t run) {
  std::vector<std::string> args{o.trainer_path, "train"};
  if (!o.config.empty()) args.insert(args.end(), {"--config", o.config});
  for (const auto& s : o.overrides) args.insert(args.end(), {"--set", s});
  args.insert(args.end(), {"--plugin", v.plugin, "--nproc", std::to_string(v.nproc)});
  if (o.nnodes > 1) {
    args.insert(args.end(), {"--nnodes", std::to_string(o.nnodes), "--node-rank", std::to_string(o.node_rank),
                             "--master-addr", o.master_addr, "--master-port", std::to_string(o.master_port + run)});
  }
  for (const auto& s : v.settings) args.insert(args.end(), {"--set", s});
  // Without --eval-every only the final evaluation runs, on one batch (the run's end, not timed).
  std::vector<std::string> fixed{
      "train.max_steps=" + std::to_string(o.warmup_steps + o.steps), "train.out_dir=" + run_dir,
      "train.overwrite=true", "log.progress=off", "eval.every_steps=" + std::to_string(o.eval_every),
      "checkpoint.save_final=false", "checkpoint.keep_best=false", "checkpoint.every_steps=0",
      "checkpoint.resume=", "log.trace="};
  if (o.eval_every == 0) fixed.push_back("eval.max_batches=1");
  for (const auto& s : fixed) args.insert(args.end(), {"--set", s});
  args.insert(args.end(), {"--log-level", "warn"});
  return args;
}

std::vector<std::string> pytorch_run_command(const BenchOptions& o, const BenchVariant& v,
                                             const std::string& job_dir, const std::string& run_dir) {
  std::vector<std::string> args{o.python,  o.python_dir + "/pytorch_baseline.py", "--data", job_dir, "--nproc",
                                std::to_string(v.nproc), "--out", run_dir, "--parallel", v.pytorch_parallel};
  if (!v.transformers.empty()) args.insert(args.end(), {"--model", "transformers"});
  if (v.pytorch_parallel == "pp") {
    args.insert(args.end(), {"--schedule", v.pytorch_schedule, "--microbatches", std::to_string(v.pytorch_microbatches)});
  }
  return args;
}

// The job as files for the baseline (same data, model, batch and optimiser).
void export_job_for_baseline(const BenchOptions& o, const std::string& dir) {
  export_job(train_options_from_config(load_run_config(o.config, o.overrides)), dir, o.warmup_steps + o.steps);
}

void check_python_has_torch(const std::string& python, const std::string& dir) {
  const std::string log = dir + "/python-check.log";
  const int status = std::system((shell_quote(python) + " -c 'import torch' > " + shell_quote(log) + " 2>&1").c_str());
  WEFT_CHECK(status == 0,
             "--baseline pytorch needs PyTorch, but '{}' cannot import torch (tools/setup.sh makes a virtual "
             "environment with it, or set WEFT_PYTHON to an interpreter that has it); see {}",
             python, log);
}

void draw_plots(const BenchOptions& o, const std::string& json_path) {
  const std::string command = shell_join({o.plot_python, o.python_dir + "/plot_bench.py", json_path, "-o", o.out_dir}) +
                              " > " + shell_quote(o.out_dir + "/plots.log") + " 2>&1";
  if (std::system(command.c_str()) != 0) {
    spdlog::warn("bench: the plots were not drawn ({} {}/plot_bench.py failed; see {}/plots.log)", o.plot_python,
                 o.python_dir,
                 o.out_dir);
  }
}

// On a CPU job, the GEMM peak of the job's products on this machine (gemm_peak.h), for the
// largest micro-batch one process of the bench multiplies (`micro_batch_tokens`: each variant's),
// logged where `log`; none on a GPU (its MFU is in each run's own
// summary, against the data sheet's peak).
std::optional<GemmPeak> cpu_gemm_peak(const TrainOptions& job, const std::vector<BenchVariant>& variants,
                                      const std::vector<int64_t>& micro_batch_tokens, bool log) {
  const bool cpu = job.device == "cpu" || (job.device == "auto" && !torch::cuda::is_available());
  if (!cpu || variants.empty()) return std::nullopt;
  const int64_t tokens = *std::max_element(micro_batch_tokens.begin(), micro_batch_tokens.end());
  const ModelConfig config = resolve_model_config(job, nullptr);
  const auto shapes = model_gemm_shapes(config, tokens, linear_cross_entropy_chunk_rows(config.vocab_size));
  const auto dtype = compute_dtype(job.precision);
  const int threads = static_cast<int>(job.threads);
  const auto aten = measure_gemm_peak(shapes, dtype, threads);
  auto peak = aten;
  // fp32 on a CPU where oneDNN multiplies it too (train.fp32_cpu_gemm): the machine's peak is the
  // faster library's, shape by shape.
  std::optional<GemmPeak> onednn;
  if (dtype == torch::kFloat32 && !onednn_fp32_gemm_unavailable()) {
    onednn = measure_gemm_peak(shapes, dtype, threads, 0.2, CpuFp32Gemm::onednn);
    peak = faster_of(aten, *onednn);
  }
  const auto best = std::max_element(peak.rates.begin(), peak.rates.end(),
                                     [](const GemmRate& a, const GemmRate& b) { return a.gflops < b.gflops; });
  if (!log) return peak;
  spdlog::info("bench: this CPU's GEMM peak in {} with {} thread{}: {:.0f} GFLOP/s ({}: [{} x {}] by [{} x {}], {}{}); "
               "measured again before each repetition, the table's MFU is against the median",
               peak.dtype, peak.threads, peak.threads == 1 ? "" : "s", peak.gflops, best->shape.what, best->shape.m,
               best->shape.k, best->shape.k, best->shape.n, best->library,
               onednn ? fmt::format("; ATen's best {:.0f}, oneDNN's {:.0f}", aten.gflops, onednn->gflops) : std::string());
  return peak;
}

// Each variant's MFU against `peak`: a weft variant's from its runs' FLOPs per token; transformers'
// (the same job) and, for full fine-tuning, PyTorch's baselines (the same model, every weight
// trained) from weft's. PyTorch's model on a LoRA job trains every weight: other FLOPs, none.
void set_mfu(std::vector<VariantSummary>& summaries, const std::vector<std::vector<RunMeasurement>>& runs,
             const std::vector<BenchVariant>& variants, const std::string& mode, const GemmPeak& peak) {
  std::optional<double> job_flops;
  for (size_t i = 0; i < variants.size() && !job_flops; ++i) {
    if (!variants[i].pytorch && !runs[i].empty()) job_flops = runs[i].front().flops_per_token;
  }
  for (auto& s : summaries) {
    const auto v = std::find_if(variants.begin(), variants.end(), [&](const BenchVariant& b) { return b.name == s.name; });
    std::optional<double> flops;
    if (!v->pytorch) {
      flops = runs[static_cast<size_t>(v - variants.begin())].front().flops_per_token;
    } else if (!v->transformers.empty() || mode == "full") {
      flops = job_flops;
    }
    if (flops && peak.gflops > 0) s.mfu = model_flop_utilisation(s.tokens_per_second.median / s.nproc, *flops, peak.gflops / 1e3);
  }
}

}  // namespace

std::vector<BenchVariant> plan_bench(const BenchOptions& o) {
  WEFT_CHECK(!o.plugins.empty() || o.pytorch_baseline, "trainer bench needs at least one --plugin (or --baseline pytorch)");
  std::vector<std::vector<int>> counts;
  for (const auto& text : o.nproc) counts.push_back(parse_counts(text));
  if (counts.empty()) counts.push_back({1});
  WEFT_CHECK(o.nnodes >= 1 && o.node_rank >= 0 && o.node_rank < o.nnodes,
             "trainer bench --nnodes {} --node-rank {}: the node rank must be 0 to {}", o.nnodes, o.node_rank,
             o.nnodes - 1);
  WEFT_CHECK(o.nnodes == 1 || !o.master_addr.empty(),
             "trainer bench --nnodes {}: each node needs its --node-rank and node 0's --master-addr", o.nnodes);
  WEFT_CHECK(o.nnodes == 1 || !o.pytorch_baseline,
             "trainer bench --nnodes {}: --baseline pytorch runs on one node only; leave it out across nodes", o.nnodes);
  WEFT_CHECK(o.eval_every >= 0, "trainer bench --eval-every {}: expected 0 (none) or a number of steps", o.eval_every);
  WEFT_CHECK(counts.size() == 1 || counts.size() == o.plugins.size(),
             "trainer bench: {} --nproc values for {} --plugin values (give one for all, or one per plugin in order)",
             counts.size(), o.plugins.size());
  std::vector<BenchVariant> variants;
  std::set<int> sizes;
  for (size_t i = 0; i < o.plugins.size(); ++i) {
    for (int n : counts.size() == 1 ? counts[0] : counts[i]) {
      BenchVariant v = parse_plugin_spec(o.plugins[i]);
      v.nproc = n;
      v.nnodes = o.nnodes;
      v.name = variant_name(v);
      variants.push_back(v);
      sizes.insert(n);
    }
  }
  if (o.plugins.empty()) sizes.insert(counts[0].begin(), counts[0].end());
  if (o.pytorch_baseline) {
    std::set<int> tensor_parallel_sizes;  // where a plugin alone splits the weights, DTensor's beside it
    for (const auto& v : variants) {
      if (v.nproc >= 2 && (owned_dimensions(v) & (1u << WEFT_MESH_TP))) tensor_parallel_sizes.insert(v.nproc);
    }
    // Pipelines: (process count, micro-batches, whether the plugin's settings named them).
    std::set<std::tuple<int, int, bool>> pipelines;
    for (const auto& v : variants) {
      if (v.nproc < 2 || !(owned_dimensions(v) & (1u << WEFT_MESH_PP))) continue;
      int microbatches = 4;  // the pipelines' default
      bool named = false;
      for (const auto& s : v.settings) {
        if (s.rfind("plugin.microbatches=", 0) != 0) continue;
        microbatches = parse_counts(s.substr(std::string("plugin.microbatches=").size())).front();
        named = true;
      }
      pipelines.insert({v.nproc, microbatches, named});
    }
    for (const auto& [parallel, counts] : {std::pair{std::string("ddp"), sizes}, {"tp", tensor_parallel_sizes}}) {
      for (int n : counts) {
        BenchVariant v;
        v.pytorch = true;
        v.pytorch_parallel = parallel;
        v.nproc = n;
        v.name = variant_name(v);
        variants.push_back(v);
      }
    }
    // transformers (+ PEFT) on the job's checkpoint: what a user fine-tuning it would otherwise run.
    // A LoRA job without a checkpoint (a preset's shape) gets transformers + PEFT on transformers'
    // own initialisation of that shape: the same model, batch and steps, other initial weights
    // (times compare, losses do not); PyTorch's plain model trains every weight.
    const TrainOptions job = train_options_from_config(load_run_config(o.config, o.overrides));
    if ((!job.model.weights.empty() || job.mode == "lora") && (job.mode == "full" || job.mode == "lora") &&
        job.task == "causal_lm" &&
        job.model.quantize == "none" && job.data.format != "chat") {
      for (int n : sizes) {
        BenchVariant v;
        v.pytorch = true;
        v.pytorch_parallel = "ddp";
        v.transformers = job.mode;
        v.nproc = n;
        v.name = variant_name(v);
        variants.push_back(v);
      }
    }
    for (const auto& [n, microbatches, named] : pipelines) {
      for (const char* schedule : {"gpipe", "1f1b", "interleaved1f1b"}) {
        BenchVariant v;
        v.pytorch = true;
        v.pytorch_parallel = "pp";
        v.pytorch_schedule = schedule;
        v.pytorch_microbatches = microbatches;
        if (named) v.settings.push_back("plugin.microbatches=" + std::to_string(microbatches));
        v.nproc = n;
        v.name = variant_name(v);
        variants.push_back(v);
      }
    }
  }
  for (size_t i = 0; i < variants.size(); ++i) {
    for (size_t j = i + 1; j < variants.size(); ++j) {
      WEFT_CHECK(variants[i].name != variants[j].name, "trainer bench: variant '{}' is listed twice", variants[i].name);
    }
  }
  return variants;
}

int run_bench(const BenchOptions& options) {
  BenchOptions o = options;
  WEFT_CHECK(o.warmup_steps >= 0 && o.steps >= 1 && o.repetitions >= 1,
             "trainer bench: --warmup must be >= 0, --steps and --repetitions >= 1");
  const auto variants = plan_bench(o);
  // The job itself is validated here, before any run: a bad config fails once, clearly.
  const TrainOptions job = train_options_from_config(load_run_config(o.config, o.overrides));
  const int64_t tokens_per_step = job.batch_size * job.grad_accum_steps * job.data.seq_len;
  // Each variant's global batch in tokens: its own settings may change train.batch_size,
  // train.grad_accum_steps or data.seq_len (and a bad one fails here, before any run).
  std::vector<int64_t> variant_tokens(variants.size(), tokens_per_step);
  std::vector<int64_t> micro_batch_tokens(variants.size(), 0);  // one process's micro-batch
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto& v = variants[i];
    if (!v.pytorch) resolve_plugin_paths(v.plugin);  // throws naming a plugin that is not found
    TrainOptions own = job;
    if (!v.settings.empty()) {
      auto overrides = o.overrides;
      overrides.insert(overrides.end(), v.settings.begin(), v.settings.end());
      try {
        own = train_options_from_config(load_run_config(o.config, overrides));
      } catch (const Error& e) {
        fail("trainer bench: variant '{}': {}", v.name, e.what());
      }
    }
    variant_tokens[i] = own.batch_size * own.grad_accum_steps * own.data.seq_len;
    micro_batch_tokens[i] = std::max<int64_t>(variant_tokens[i] / own.grad_accum_steps / (v.nproc * v.nnodes), 1);
  }
  // The runs' directories are part of their configuration, which every rank checks is the same.
  WEFT_CHECK(o.nnodes == 1 || !o.out_dir.empty(),
             "trainer bench --nnodes {}: give every node the same --out (the runs' directories must match)", o.nnodes);
  if (o.out_dir.empty()) o.out_dir = "runs/bench-" + timestamp();
  fs::create_directories(o.out_dir);
  o.out_dir = fs::absolute(o.out_dir).lexically_normal().string();
  const std::string job_dir = o.out_dir + "/job";
  if (std::any_of(variants.begin(), variants.end(), [](const BenchVariant& v) { return v.pytorch; })) {
    check_python_has_torch(o.python, o.out_dir);
    export_job_for_baseline(o, job_dir);
  }
  spdlog::info("bench: {} variants x {} repetitions, {} warm-up + {} measured steps each, {} tokens per step{}",
               variants.size(), o.repetitions, o.warmup_steps, o.steps, tokens_per_step,
               o.nnodes > 1 ? fmt::format(", node {} of {}", o.node_rank, o.nnodes) : "");
  // Across nodes, node 0's rank 0 writes each run's metrics; the other nodes' files are named by node
  // (a run directory may be shared between nodes, as on a shared file system).
  const bool reads_metrics = o.node_rank == 0;
  // The GEMM peak, measured on the quiet machine the runs will have, before each repetition: the
  // table's MFU is against each product's median rate over those measurements, the machine's speed
  // over the whole bench (a shared machine's moves by ~10% within minutes) rather than at one moment.
  std::vector<GemmPeak> peaks;
  const auto measure_peak = [&](int64_t rep) {
    if (!reads_metrics) return;
    if (auto peak = cpu_gemm_peak(job, variants, micro_batch_tokens, rep == 1)) peaks.push_back(*peak);
  };
  const std::string node_suffix = reads_metrics ? "" : fmt::format(".node{}", o.node_rank);
  std::vector<std::vector<RunMeasurement>> runs(variants.size());
  std::vector<std::optional<Failure>> failures(variants.size());
  nlohmann::json outcomes = nlohmann::json::array();  // the other nodes: each run's outcome
  for (int64_t rep = 1; rep <= o.repetitions; ++rep) {
    measure_peak(rep);
    for (size_t i = 0; i < variants.size(); ++i) {  // alternated: A B C, A B C, ...
      const auto& v = variants[i];
      if (failures[i]) continue;  // failed once: its other repetitions would fail alike
      const std::string run_dir = fmt::format("{}/runs/{}/rep{}", o.out_dir, slug(v.name), rep);
      fs::create_directories(run_dir);
      const int64_t run = (rep - 1) * static_cast<int64_t>(variants.size()) + static_cast<int64_t>(i);
      const auto args = v.pytorch ? pytorch_run_command(o, v, job_dir, run_dir) : weft_run_command(o, v, run_dir, run);
      write_file_atomically(run_dir + "/command" + node_suffix + ".txt", shell_join(args) + "\n");
      try {
        run_logged(shell_join(args), run_dir + "/output" + node_suffix + ".log");
        if (reads_metrics) runs[i].push_back(read_run(run_dir + "/metrics.jsonl", o.warmup_steps));
      } catch (const Error& e) {
        failures[i] = Failure{e.what(), rep};
        spdlog::error("bench: repetition {}/{} {} failed: {}; the bench goes on without it", rep, o.repetitions,
                      v.name, e.what());
        if (!reads_metrics) outcomes.push_back({{"name", v.name}, {"repetition", rep}, {"ok", false}, {"error", e.what()}});
        continue;
      }
      if (!reads_metrics) {
        outcomes.push_back({{"name", v.name}, {"repetition", rep}, {"ok", true}});
        spdlog::info("bench: repetition {}/{} {}: node {}'s ranks done", rep, o.repetitions, v.name, o.node_rank);
        continue;
      }
      if (o.eval_every == 0) runs[i].back().held_out.clear();  // only the final one-batch evaluation
      const double step = median_of(runs[i].back().step_seconds);
      spdlog::info("bench: repetition {}/{} {}: median step {:.3f} s, {:.0f} tokens/s", rep, o.repetitions, v.name,
                   step, static_cast<double>(variant_tokens[i]) / step);
    }
  }
  if (!reads_metrics) {
    const int64_t failed = std::count_if(failures.begin(), failures.end(), [](const auto& f) { return f.has_value(); });
    const nlohmann::json json = {{"node_rank", o.node_rank}, {"nnodes", o.nnodes}, {"runs", outcomes}};
    write_file_atomically(o.out_dir + "/bench" + node_suffix + ".json", json.dump(2) + "\n");
    spdlog::info("bench: node {} of {} took part in {} runs ({} variants failed); node 0 writes the table", o.node_rank,
                 o.nnodes, outcomes.size(), failed);
    return failed > 0 ? 1 : 0;
  }
  std::vector<VariantSummary> summaries;
  int64_t steps_per_epoch = 0;
  for (size_t i = 0; i < variants.size(); ++i) {
    const auto& v = variants[i];
    if (failures[i]) continue;
    summaries.push_back(summarise(v.name, v.plugin, v.nproc * v.nnodes, v.pytorch, runs[i], variant_tokens[i]));
    steps_per_epoch = runs[i].front().steps_per_epoch;
  }
  const auto peak = peaks.empty() ? std::nullopt : std::optional<GemmPeak>(median_peak(peaks));
  if (peak) set_mfu(summaries, runs, variants, job.mode, *peak);
  const auto ratios = pair_ratios(summaries);
  std::string table = summaries.empty() ? std::string() : format_bench_table(summaries, ratios);
  const char* command = std::getenv("WEFT_COMMAND_LINE");  // set by the trainer's main
  nlohmann::json json = {{"command", command != nullptr ? command : ""},
                         {"config", o.config},
                         {"overrides", o.overrides},
                         {"warmup_steps", o.warmup_steps},
                         {"steps", o.steps},
                         {"repetitions", o.repetitions},
                         {"nnodes", o.nnodes},
                         {"eval_every", o.eval_every},
                         {"tokens_per_step", tokens_per_step},
                         {"steps_per_epoch", steps_per_epoch},
                         {"variants", nlohmann::json::array()},
                         {"ratios", nlohmann::json::array()},
                         {"failed", nlohmann::json::array()},
                         {"gemm_peak", peak ? to_json(*peak) : nlohmann::json(nullptr)}};
  for (const auto& s : summaries) json["variants"].push_back(to_json(s));
  for (const auto& r : ratios) json["ratios"].push_back(to_json(r));
  int failed = 0;
  for (size_t i = 0; i < variants.size(); ++i) {
    if (!failures[i]) continue;
    ++failed;
    json["failed"].push_back({{"name", variants[i].name},
                              {"plugin", variants[i].plugin},
                              {"nproc", variants[i].nproc},
                              {"repetition", failures[i]->repetition},
                              {"error", failures[i]->error}});
    table += fmt::format("{}- **{} failed** in repetition {} (no figures): {}\n",
                         table.empty() || failed > 1 ? "" : "\nFailed variants:\n\n", variants[i].name,
                         failures[i]->repetition, failures[i]->error);
  }
  if (peak) {
    table += fmt::format("\nMFU: model FLOPs per second per process over this CPU's GEMM peak, {:.0f} GFLOP/s in {} with {} "
                         "thread{} ({} on the job's products, the median of {} measurement{}, one before each "
                         "repetition; bench.json's gemm_peak).\n",
                         peak->gflops, peak->dtype, peak->threads, peak->threads == 1 ? "" : "s",
                         peak->dtype == "fp32" && !onednn_fp32_gemm_unavailable()
                             ? "torch::mm and oneDNN, each product's faster,"
                             : "torch::mm",
                         peak->measurements.size(), peak->measurements.size() == 1 ? "" : "s");
  }
  std::cout << table;
  const std::string json_path = o.out_dir + "/bench.json";
  write_file_atomically(json_path, json.dump(2) + "\n");
  write_file_atomically(o.out_dir + "/bench.md", table);
  if (!summaries.empty()) draw_plots(o, json_path);
  spdlog::info("bench: wrote {}, {}/bench.md and the plots in {}", json_path, o.out_dir, o.out_dir);
  if (failed > 0) {
    spdlog::error("bench: {} of {} variants failed (named in the table and in bench.json's \"failed\")", failed,
                  variants.size());
    return 1;
  }
  return 0;
}

}  // namespace weft
