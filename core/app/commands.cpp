// The trainer's commands, one function each: train, eval, generate, check, bench, report, plugins.
#include "core/app/commands.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include "core/bench/bench.h"
#include "core/config/config.h"
#include "core/dist/process_groups.h"
#include "core/job/evaluate.h"
#include "core/job/generate.h"
#include "core/job/gguf_export.h"
#include "core/io/gguf.h"
#include "core/model/lora.h"
#include "core/job/job.h"
#include "core/plugin/library.h"
#include "core/train/classification_eval.h"
#include "core/train/conformance.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/log.h"
#include "core/util/shell.h"
#include "core/util/libtorch.h"

namespace weft::app {
namespace {

void print_summary(const TrainResult& r) {
  double total = 0;
  for (double s : r.epoch_seconds) total += s;
  spdlog::info("=== run summary ===");
  if (!r.epoch_seconds.empty()) {
    std::vector<std::string> each;
    for (double s : r.epoch_seconds) each.push_back(format_duration(s));
    spdlog::info("time per epoch: {} (mean over {} epochs: {})", fmt::join(each, ", "), r.epoch_seconds.size(),
                 format_duration(total / r.epoch_seconds.size()));
  }
  spdlog::info("steps: {}, throughput: {:.0f} tokens/s", r.steps, r.tokens_per_second);
  if (r.final_eval && !r.final_eval->metrics.empty()) {
    spdlog::info("held-out loss {:.4f}, {} (best loss {:.4f})", r.final_eval->loss,
                 describe_task_metrics(*r.final_eval), r.best_eval_loss);
  } else if (r.final_eval) {
    spdlog::info("held-out loss {:.4f}, perplexity {:.2f} (best loss {:.4f})", r.final_eval->loss,
                 r.final_eval->perplexity, r.best_eval_loss);
  }
  if (r.early_stopped) spdlog::info("stopped early (eval.patience)");
  spdlog::info("peak memory: {:.0f} MiB", r.peak_rss_mib);
}

// The configuration, options and rank context of a train or generate run, with logging set
// up for this rank.
struct RunSetup {
  Config config;
  TrainOptions options;
  RunContext context;
};

RunSetup prepare_run(const CommandLine& cli) {
  if (cli.config.empty() && cli.overrides.empty()) {
    throw Error("no configuration: pass --config FILE (see configs/) and/or --set key=value");
  }
  RunSetup run{load_run_config(cli.config, cli.overrides), {}, {}};
  run.options = train_options_from_config(run.config);
  set_log_level(cli.log_level.empty() ? run.options.log_level : cli.log_level);
  run.options.config_hash = run.config.hash();
  run.context.env = detect_distributed_env();
  run.context.rank = run.context.env.rank;
  run.context.world = run.context.env.world;
  if (run.context.world > 1) {
    spdlog::set_pattern(fmt::format("[%H:%M:%S] [rank {}] %^%l%$ %v", run.context.rank));
    // One voice: ranks other than 0 report warnings and errors unless a level is asked for.
    if (run.context.rank != 0 && cli.log_level.empty()) set_log_level("warn");
  }
  spdlog::info("config {} (hash {})", cli.config.empty() ? "<overrides>" : cli.config, run.config.hash());
  return run;
}

// python/: the Python the trainer runs (reports, bench plots, the PyTorch baseline), unless
// WEFT_PYTHON_DIR says otherwise.
std::string python_dir() {
  const char* dir = std::getenv("WEFT_PYTHON_DIR");
  return dir != nullptr ? dir : WEFT_PYTHON_DIR;
}

// The Python that draws (reports, bench plots): Debian's, with python3-matplotlib, unless
// WEFT_PLOT_PYTHON says otherwise.
std::string plot_python() {
  const char* python = std::getenv("WEFT_PLOT_PYTHON");
  return python != nullptr ? python : WEFT_DEFAULT_PLOT_PYTHON;
}

}  // namespace

// `trainer train`: the training run; its exit status is 128 + the signal when SIGINT/SIGTERM
// stopped it.
int run_train(const CommandLine& cli) {
  RunSetup run = prepare_run(cli);
  const Config& config = run.config;
  const auto& options = run.options;
  Trainer trainer(options, run.context);
  std::filesystem::create_directories(options.out_dir);
  if (run.context.rank == 0) {  // one writer: the effective config, and how to run this again (trainer report)
    write_run_config(options.out_dir, config);
    const char* command = std::getenv("WEFT_COMMAND_LINE");  // unset under torchrun / Slurm: not recorded
    if (command != nullptr) write_file_atomically(options.out_dir + "/command.txt", std::string(command) + "\n");
  }
  const auto result = trainer.run();
  print_summary(result);
  return result.interrupted ? 128 + result.interrupt_signal : 0;
}

// `trainer generate`: continue --prompt with the configured model (and plugin); rank 0 prints the
// tokens and the text on stdout.
int run_generate(const CommandLine& cli) {
  if (cli.prompt.empty()) throw Error("trainer generate needs --prompt TEXT");
  RunSetup run = prepare_run(cli);
  if (run.options.task == "classification") throw Error("trainer generate continues text: train.task = \"classification\" has no LM head");
  Job job(run.options, run.context, Job::Data::kNone);
  if (run.context.rank == 0) job.warn_if_random_weights("generate");
  const auto result = generate(job, cli.prompt, cli.chat);
  if (run.context.rank == 0) {
    std::string ids;
    for (int32_t id : result.tokens) ids += (ids.empty() ? "" : " ") + std::to_string(id);
    // The text: the prompt continued, or (--chat) the user's message and the reply on the next line.
    std::cout << "tokens: " << ids << "\n" << cli.prompt << (cli.chat ? "\n" : "") << result.text << "\n";
    spdlog::info("generated {} tokens after a {}-token prompt in {:.2f} s ({:.1f} tokens/s; first token after {:.3f} s)",
                 result.tokens.size(), result.prompt_tokens, result.seconds,
                 result.seconds > 0 ? static_cast<double>(result.tokens.size()) / result.seconds : 0.0,
                 result.first_token_seconds);
    if (result.comm_operations > 0) {
      spdlog::info("communication (rank 0): {} operations, {:.2f} MB, {:.3f} s waiting ({:.1f}% of the time; compute "
                   "and the rest {:.3f} s)",
                   result.comm_operations, result.comm_bytes / 1e6, result.comm_wait_seconds,
                   result.seconds > 0 ? 100.0 * result.comm_wait_seconds / result.seconds : 0.0,
                   result.seconds - result.comm_wait_seconds);
    }
  }
  return 0;
}

// `trainer export --out FILE.gguf [--type f16|bf16|q8_0|f32]`: the configured model (model.weights
// with model.adapter's LoRA merged in) as a GGUF file of the llama architecture, with the
// tokenizer's metadata (core/job/gguf_export.h). One process.
int run_export(const CommandLine& cli) {
  if (cli.out.empty()) throw Error("trainer export needs --out FILE.gguf");
  if (!is_gguf_path(cli.out)) throw Error(fmt::format("trainer export writes GGUF: --out '{}' must end in .gguf", cli.out));
  const uint32_t type = gguf_export_type(cli.type.empty() ? "f16" : cli.type);
  RunSetup run = prepare_run(cli);
  if (run.context.world > 1 || !run.options.plugin.empty()) {
    throw Error("trainer export runs in one process: leave out --plugin, --nproc and train.plugin");
  }
  if (run.options.task == "classification") {
    throw Error("trainer export writes causal LMs as GGUF: train.task = \"classification\" has a score head instead");
  }
  if (run.options.mode == "prompt_tuning" ||
      (!run.options.model.adapter.empty() && adapter_peft_type(run.options.model.adapter) == "PROMPT_TUNING")) {
    throw Error("trainer export writes a model's weights as GGUF, and a prompt-tuning adapter is not weights a GGUF "
                "model holds (its virtual tokens go before every input): export the base, and keep the adapter");
  }
  if (run.options.tokenizer == "byte") {  // refused before the model is loaded
    throw Error("trainer export writes the tokenizer into the GGUF file, and data.tokenizer = \"byte\" is not one GGUF "
                "holds: set data.tokenizer to the model's tokenizer.json or GGUF file");
  }
  Job job(run.options, run.context, Job::Data::kNone);
  job.warn_if_random_weights("export");
  if (job.lora()) merge_lora(job.model());  // the adapters folded into the base (quantized layers dequantized)
  const auto& m = run.options.model;
  std::string name = m.weights.empty() ? "weft" : std::filesystem::path(m.weights).filename().string();
  if (!m.adapter.empty()) name += " + " + std::filesystem::path(m.adapter).filename().string();
  export_gguf(job.model(), job.tokenizer(), run.options.tokenizer, cli.out, type, name);
  spdlog::info("wrote {} ({}, {:.1f} MB)", cli.out, ggml_type_name(type),
               static_cast<double>(std::filesystem::file_size(cli.out)) / 1e6);
  return 0;
}

// `trainer eval`: the configured model's token-weighted loss and perplexity on the held-out split
// of data.path (as training evaluates it), or on every sequence of the --data files (no split,
// packed as training packs them). Rank 0 prints them; --json also writes every sequence's loss.
int run_eval(const CommandLine& cli) {
  RunSetup run = prepare_run(cli);
  TrainOptions options = run.options;
  if (!cli.data.empty()) {
    options.data.paths = cli.data;
    options.data.heldout_fraction = 0;
    options.data.max_documents = 0;
    options.data.train_name = "evaluated";  // its only split: not a training split
    options.data.fit_short_split = true;    // a short file is one shorter sequence
  }
  Job job(options, run.context, Job::Data::kSplits);
  if (run.context.rank == 0) job.warn_if_random_weights("eval");
  const auto& sequences = cli.data.empty() ? job.data().heldout : job.data().train;
  WEFT_CHECK(sequences != nullptr,
             "trainer eval: data.heldout_fraction is 0, so data.path has no held-out split (pass --data FILE)");
  EvalOptions eval;
  eval.batch_size = options.eval_batch_size > 0 ? options.eval_batch_size : options.batch_size;
  eval.max_batches = cli.data.empty() ? options.eval_max_batches : 0;
  eval.per_sequence = !cli.json.empty();
  EvalResult result = evaluate(job, sequences, eval);
  const ClassificationData* classes = job.classification();
  if (classes) add_task_metrics(result, *classes, *sequences);
  if (run.context.rank != 0) return 0;
  if (classes) {  // a classifier: its task's metrics, beside always predicting the majority class
    std::cout << fmt::format("{}: {} examples, loss {:.6f}, {}\n", cli.data.empty() ? "held-out" : "data",
                             result.sequences, result.loss, describe_task_metrics(result));
    if (const std::string baseline = describe_majority_baseline(*classes, *sequences); !baseline.empty()) {
      std::cout << fmt::format("majority-class baseline: {}\n", baseline);
    }
  } else {
    std::cout << fmt::format("{}: {} sequences, {} tokens, loss {:.6f}, perplexity {:.4f}\n",
                             cli.data.empty() ? "held-out" : "data", result.sequences, result.tokens, result.loss,
                             result.perplexity);
  }
  if (!cli.json.empty()) {
    nlohmann::json json = {{"data", cli.data.empty() ? nlohmann::json("held-out") : nlohmann::json(cli.data)},
                                 {"sequences", result.sequences},
                                 {"seq_len", sequences->seq_len()},
                                 {"tokens", result.tokens},
                                 {"loss", result.loss},
                                 {"perplexity", result.perplexity},
                                 {"seconds", result.seconds},
                                 {"plugin", job.strategy().names()},
                                 {"weights", job.weights_source()},
                                 {"processes", run.context.world},
                                 {"sequence_losses", result.sequence_losses}};
    for (const auto& [name, value] : result.metrics) json[name] = value;
    write_file_atomically(cli.json, json.dump(2) + "\n");
    spdlog::info("wrote {}", cli.json);
  }
  return 0;
}

// `trainer plan`: every rank's memory plan as the run would make it before building the model, as
// a table on stdout (MiB), and whether it fits train.memory_limit_gib. Exit status 1 when a run
// would be refused.
int run_plan(const CommandLine& cli) {
  RunSetup run = prepare_run(cli);
  Job job(run.options, run.context, Job::Data::kPlanOnly);
  const MemoryVerdict& v = job.memory();
  // Exit status 1 is the answer "does not fit", on every rank after the last collective: the --nproc
  // launcher then reports no failed rank.
  if (!v.fits) job.communicator().declare_exit_status_an_answer();
  if (run.context.rank != 0) return v.fits ? 0 : 1;  // rank 0 reports
  const auto mib = [](int64_t bytes) { return fmt::format("{:.1f}", static_cast<double>(bytes) / (1024.0 * 1024.0)); };
  std::cout << fmt::format("memory plan: plugin {}, {} rank(s), precision {}, train.batch_size {} x {} micro-batch(es), "
                           "seq_len {}{}\n",
                           job.strategy().names(), v.ranks.size(), run.options.precision, run.options.batch_size,
                           run.options.grad_accum_steps, run.options.data.seq_len,
                           run.options.mode == "lora" ? ", LoRA" : run.options.mode == "adalora" ? ", AdaLoRA" : run.options.mode == "prompt_tuning" ? ", prompt tuning" : "");
  std::cout << fmt::format("{:>5} {:>8} {:>11} {:>10} {:>10} {:>12} {:>8} {:>8} {:>8}\n", "rank", "machine", "parameters",
                           "gradients", "optimizer", "activations", "buffers", "runtime", "total");
  for (size_t r = 0; r < v.ranks.size(); ++r) {
    const MemoryPlan& p = v.ranks[r];
    std::cout << fmt::format("{:>5} {:>8} {:>11} {:>10} {:>10} {:>12} {:>8} {:>8} {:>8}\n", r, v.machine[r], mib(p.parameters),
                             mib(p.gradients), mib(p.optimizer), mib(p.activations), mib(p.buffers), mib(v.runtime_bytes),
                             mib(p.total() + v.runtime_bytes));
  }
  std::cout << "(MiB; activations are an estimate of this host's kernels, the rest follows from the shapes)\n";
  if (!job.missing_inputs().empty()) {
    const auto& m = run.options.model;
    std::cout << fmt::format("note: the plan needs only the shapes ({}); the run also reads {}, which {} not exist here\n",
                             !m.config_path.empty()                                   ? "model.config = '" + m.config_path + "'"
                             : std::filesystem::exists(m.weights + "/config.json") ? "model.weights' config.json"
                                                                                    : "model.preset = '" + m.preset + "'",
                             fmt::join(job.missing_inputs(), ", "), job.missing_inputs().size() == 1 ? "does" : "do");
  }
  if (v.limit_bytes > 0) {
    std::cout << fmt::format("limit: {} MiB {} ({}): {}\n", mib(v.limit_bytes),
                             v.per_device ? "per device" : "per machine", v.limit_source,
                             v.fits ? "fits" : "does NOT fit: " + v.problem);
    if (!v.fits) {
      std::cout << (v.advice.empty() ? "no setting of the host's makes it fit (tried: activation checkpointing, a "
                                       "smaller batch per step, LoRA)\n"
                                     : "what would fit, or may:\n");
      for (const auto& a : v.advice) std::cout << "  " << a << "\n";
    }
  } else {
    std::cout << "limit: unknown (set train.memory_limit_gib)\n";
  }
  return v.fits ? 0 : 1;
}

namespace {

// The plugins a case of the matrix runs ("tensor_parallel,gpipe": both).
std::vector<std::string> plugins_of(const ConformanceCase& c) {
  std::vector<std::string> names;
  for (size_t start = 0, comma = 0; comma != std::string::npos; start = comma + 1) {
    comma = c.plugin.find(',', start);
    names.push_back(c.plugin.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
  }
  return names;
}

// `trainer check --all`: every case of the plugins' conformance matrix (conformance_matrix over the
// plugin search directories) this machine is asked for (at most
// --nproc ranks when given; with --plugin NAME only the cases that run NAME, alone or composed),
// each with the --set settings added, as one Markdown table. A case whose run fails is an error
// row; the others still run. Exit status 1 unless every case that ran passed.
int run_check_all(const CommandLine& cli) {
  std::vector<ConformanceCase> cases;
  std::set<std::string> shipped;
  const auto matrix = conformance_matrix(plugin_search_dirs());
  WEFT_CHECK(!matrix.empty(), "trainer check --all: no plugin lists conformance cases (<plugin>.conformance.toml in {})",
             fmt::join(plugin_search_dirs(), ", "));
  for (const auto& c : matrix) {
    const auto names = plugins_of(c);
    shipped.insert(names.begin(), names.end());
    if (cli.plugin.empty() || std::find(names.begin(), names.end(), cli.plugin) != names.end()) cases.push_back(c);
  }
  WEFT_CHECK(!cases.empty(), "trainer check --all --plugin {}: no case of the matrix runs it (its plugins: {})",
             cli.plugin, fmt::join(shipped, ", "));
  std::vector<std::string> common;
  for (const auto& setting : cli.overrides) {
    if (setting.rfind("train.plugin=", 0) == 0) continue;  // --plugin itself
    ConformanceOptions probe;
    apply_check_setting(probe, setting);  // refuses what check does not take, before any run
    common.push_back(setting);
  }
  const std::string trainer = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string root = (std::filesystem::temp_directory_path() / ("weft-check-all-" + std::to_string(::getpid()))).string();
  std::cout << "conformance matrix against single (" << cases.size() << " cases"
            << (cli.plugin.empty() ? "" : " that run " + cli.plugin)
            << (cli.nproc > 0 ? fmt::format(", at most {} ranks", cli.nproc) : "")
            << (common.empty() ? "" : fmt::format(", every case with {}", fmt::join(common, ", "))) << "):\n\n"
            << "| strategy | ranks | settings | largest loss difference (relative; tolerance) | largest parameter "
               "difference (tolerance) | result |\n|---|---|---|---|---|---|\n"
            << std::flush;
  int passed = 0, failed = 0, skipped = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    const std::string settings = c.settings.empty() ? "-" : fmt::format("{}", fmt::join(c.settings, ", "));
    std::string row = fmt::format("| {} | {} | {} | ", c.plugin, c.nproc, settings);
    if (cli.nproc > 0 && c.nproc > cli.nproc) {
      ++skipped;
      std::cout << row << "- | - | skipped: needs " << c.nproc << " ranks (--nproc " << cli.nproc << ") |\n" << std::flush;
      continue;
    }
    ConformanceOptions options;
    options.plugin = c.plugin;
    options.nproc = c.nproc;
    options.trainer_path = trainer;
    options.work_dir = fmt::format("{}/{}", root, i);
    if (cli.steps > 0) options.steps = cli.steps;
    for (const auto& setting : c.settings) apply_check_setting(options, setting);
    for (const auto& setting : common) apply_check_setting(options, setting);
    try {
      const auto report = check_conformance(options);
      (report.passed ? passed : failed) += 1;
      row += fmt::format("{:.2g} ({:.2g}) | {:.2g} ({:.2g}) | {} |", report.max_loss_rel_diff, report.loss_rtol,
                         report.max_param_abs_diff, report.param_atol, report.passed ? "pass" : "FAIL");
    } catch (const std::exception& e) {
      ++failed;
      std::string message = e.what();
      message = message.substr(0, message.find('\n'));
      for (auto& ch : message) ch = ch == '|' ? '/' : ch;
      row += "- | - | error: " + message + " |";
    }
    std::cout << row << "\n" << std::flush;
  }
  std::error_code ignored;
  std::filesystem::remove_all(root, ignored);
  std::cout << "\n" << passed << " passed, " << failed << " failed" << (skipped ? fmt::format(", {} skipped", skipped) : "")
            << " (" << (cli.steps > 0 ? cli.steps : ConformanceOptions{}.steps) << " steps each)\n";
  return failed == 0 && passed > 0 ? 0 : 1;
}

}  // namespace

// `trainer check --plugin X`: the conformance check against single.so.
int run_check(const CommandLine& cli) {
  if (cli.all) {
    set_log_level(cli.log_level.empty() ? "warn" : cli.log_level);
    return run_check_all(cli);
  }
  if (cli.plugin.empty()) throw Error("trainer check needs --plugin NAME_OR_PATH (or --all)");
  set_log_level(cli.log_level.empty() ? "warn" : cli.log_level);
  ConformanceOptions options;
  options.plugin = cli.plugin;
  options.nproc = std::max(1, cli.nproc);
  options.trainer_path = std::filesystem::read_symlink("/proc/self/exe").string();
  if (cli.steps > 0) options.steps = cli.steps;
  std::string settings;
  for (const auto& setting : cli.overrides) {
    if (setting.rfind("train.plugin=", 0) == 0) continue;  // --plugin itself
    apply_check_setting(options, setting);
    if (setting.rfind("plugin.", 0) != 0) settings += ", " + setting;
  }
  const auto report = check_conformance(options);
  for (const auto& s : options.plugin_settings) settings += ", plugin." + s;
  std::cout << "conformance of " << cli.plugin << " (" << options.nproc << " rank" << (options.nproc > 1 ? "s" : "")
            << settings << ") against single: " << report.describe() << "\n";
  return report.passed ? 0 : 1;
}


// `trainer bench`: A/B timing of plugins (core/bench/bench.h).
int run_bench(const CommandLine& cli) {
  set_log_level(cli.log_level.empty() ? "info" : cli.log_level);
  if (!cli.baseline.empty() && cli.baseline != "pytorch") {
    throw Error(fmt::format("--baseline '{}': the only baseline is 'pytorch'", cli.baseline));
  }
  BenchOptions options;
  options.config = cli.config;
  options.overrides = cli.overrides;
  options.plugins = cli.plugins;
  options.nproc = cli.nprocs;
  options.pytorch_baseline = cli.baseline == "pytorch";
  options.warmup_steps = cli.warmup;
  if (cli.steps > 0) options.steps = cli.steps;
  options.repetitions = cli.repetitions;
  options.eval_every = cli.eval_every;
  options.nnodes = cli.nnodes;
  options.node_rank = cli.node_rank;
  options.master_addr = cli.master_addr;
  options.master_port = cli.master_port;
  options.out_dir = cli.out;
  options.trainer_path = std::filesystem::read_symlink("/proc/self/exe").string();
  options.python_dir = python_dir();
  options.plot_python = plot_python();
  const char* python = std::getenv("WEFT_PYTHON");
  options.python = python != nullptr ? python : WEFT_DEFAULT_PYTHON;
  return run_bench(options);
}

// `trainer report RUN_DIR`: python/report.py turns the run's metrics into Markdown and plots.
int run_report(const CommandLine& cli) {
  if (cli.target.empty()) throw Error("trainer report needs the run directory: trainer report RUN_DIR");
  if (!std::filesystem::exists(cli.target + "/metrics.jsonl")) {
    throw Error(fmt::format("{}: not a run directory (no metrics.jsonl)", cli.target));
  }
  std::vector<std::string> args{plot_python(), python_dir() + "/report.py", cli.target};
  if (!cli.out.empty()) args.insert(args.end(), {"-o", cli.out});
  const int status = std::system(shell_join(args).c_str());
  return status == 0 ? 0 : 1;
}

// `trainer plugins`: every strategy plugin in the search path, described, failures marked.
int run_plugins() {
  // Plugins that link LibTorch must be built against this one (sdk/include/weft/strategy_torch.hpp).
  std::cout << fmt::format("host: LibTorch {}, NCCL {}, CUDA devices {}\n", libtorch_version(),
                           Communicator::nccl_compiled() ? "compiled in" : "not in this build",
                           torch::cuda::device_count());
  std::cout << format_plugin_table(list_plugins());
  return 0;
}


}  // namespace weft::app
