// trainer: weft's host executable.
//
//   trainer [train] --config configs/x.toml [--set section.key=value ...]
//   trainer --help
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <torch/cuda.h>

#include "core/app/launcher.h"
#include "core/bench/bench.h"
#include "core/config/config.h"
#include "core/plugin/rendezvous.h"
#include "core/config/schema.h"
#include "core/plugin/library.h"
#include "core/plugin/process_groups.h"
#include "core/train/conformance.h"
#include "core/train/options.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/log.h"
#include "core/util/shell.h"
#include "core/util/torch_compat.h"

namespace po = boost::program_options;

namespace {

struct CommandLine {
  std::string command = "train";
  std::string config;
  std::vector<std::string> overrides;
  std::string log_level;
  std::string prompt;
  std::string plugin;
  int nproc = 0;
  bool help = false;
  // trainer bench: every --plugin and --nproc as given; trainer report: the run directory.
  std::vector<std::string> plugins, nprocs;
  std::string target, out, baseline;
  int64_t warmup = 3, steps = 10, repetitions = 3;
};

po::options_description describe_options() {
  po::options_description options("Options");
  options.add_options()
      ("help,h", "print this help, including every configuration key")
      ("config,c", po::value<std::string>(), "TOML configuration file (may `extends` another)")
      ("plugin,p", po::value<std::vector<std::string>>()->composing(),
       "strategy plugin: a path, or a name found in build/plugins or WEFT_PLUGIN_PATH (same as --set train.plugin=...); "
       "trainer bench: repeat it, each may add settings: --plugin 'gpipe --set plugin.microbatches=8'")
      ("set,s", po::value<std::vector<std::string>>()->composing(),
       "override a configuration key: --set train.lr=1e-4 (repeatable; applied after the file)")
      ("nproc", po::value<std::vector<std::string>>()->composing(),
       "run N local ranks of this command (TCPStore on 127.0.0.1); under torchrun or Slurm leave it out; "
       "trainer bench: N or a list 1,2 for every plugin, or one per --plugin")
      ("warmup", po::value<int64_t>(), "trainer bench: steps per run not counted (default 3)")
      ("steps", po::value<int64_t>(), "trainer bench: counted steps per run (default 10)")
      ("repetitions", po::value<int64_t>(), "trainer bench: runs per variant, alternated (default 3)")
      ("baseline", po::value<std::string>(), "trainer bench: 'pytorch' adds PyTorch DDP (tools/pytorch_baseline.py)")
      ("out,o", po::value<std::string>(), "trainer bench: output directory; trainer report: the Markdown file")
      ("log-level", po::value<std::string>(), "trace, debug, info, warn or error (default: log.level)")
      ("prompt", po::value<std::string>(), "trainer generate: the text to continue")
      ("trace", po::value<std::string>(),
       "write a Chrome/Perfetto trace of the run to FILE (FILE.rank<r>.json per rank; same as --set log.trace=FILE)");
  return options;
}

CommandLine parse_command_line(int argc, char** argv) {
  po::options_description visible = describe_options();
  po::options_description all;
  all.add(visible).add_options()("command", po::value<std::string>(), "command")(
      "target", po::value<std::string>(), "the command's operand (trainer report RUN_DIR)");
  po::positional_options_description positional;
  positional.add("command", 1).add("target", 1);
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(all).positional(positional).run(), vm);
  po::notify(vm);
  CommandLine cli;
  cli.help = vm.count("help") > 0;
  if (vm.count("command")) cli.command = vm["command"].as<std::string>();
  if (vm.count("config")) cli.config = vm["config"].as<std::string>();
  if (vm.count("set")) cli.overrides = vm["set"].as<std::vector<std::string>>();
  if (vm.count("plugin")) cli.plugins = vm["plugin"].as<std::vector<std::string>>();
  if (vm.count("nproc")) cli.nprocs = vm["nproc"].as<std::vector<std::string>>();
  if (vm.count("target")) cli.target = vm["target"].as<std::string>();
  if (vm.count("out")) cli.out = vm["out"].as<std::string>();
  if (vm.count("baseline")) cli.baseline = vm["baseline"].as<std::string>();
  if (vm.count("warmup")) cli.warmup = vm["warmup"].as<int64_t>();
  if (vm.count("steps")) cli.steps = vm["steps"].as<int64_t>();
  if (vm.count("repetitions")) cli.repetitions = vm["repetitions"].as<int64_t>();
  if (!cli.target.empty() && cli.command != "report") {
    throw weft::Error(fmt::format("unexpected argument '{}' after '{}'", cli.target, cli.command));
  }
  if (cli.command == "bench") return cli;
  if (cli.plugins.size() > 1) throw weft::Error("--plugin is given more than once (only trainer bench takes several)");
  if (cli.nprocs.size() > 1) throw weft::Error("--nproc is given more than once (only trainer bench takes several)");
  if (!cli.plugins.empty()) {
    cli.plugin = cli.plugins.front();
    cli.overrides.insert(cli.overrides.begin(), "train.plugin=" + cli.plugin);
  }
  if (!cli.nprocs.empty()) {
    try {
      size_t used = 0;
      cli.nproc = std::stoi(cli.nprocs.front(), &used);
      if (used != cli.nprocs.front().size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw weft::Error(fmt::format("--nproc '{}': expected a number of processes", cli.nprocs.front()));
    }
    if (cli.nproc < 1) {
      throw weft::Error(fmt::format("--nproc {}: the number of processes must be at least 1", cli.nproc));
    }
  }
  if (vm.count("prompt")) cli.prompt = vm["prompt"].as<std::string>();
  if (vm.count("trace")) cli.overrides.push_back("log.trace=" + vm["trace"].as<std::string>());
  if (vm.count("log-level")) cli.log_level = vm["log-level"].as<std::string>();
  return cli;
}

void print_help() {
  std::cout << "weft trainer: fine-tunes LLaMA-family models.\n\n"
               "Usage:\n"
               "  trainer [train] --config FILE [--plugin NAME] [--nproc N] [--set section.key=value ...]\n"
               "  trainer plugins               list the strategy plugins found, with versions and ABI\n"
               "  trainer generate --config FILE [--plugin NAME] [--nproc N] --prompt TEXT   continue TEXT (generate.*)\n"
               "  trainer check --plugin NAME [--nproc N] [--set plugin.KEY=VALUE ...]   conformance: 20 steps under NAME vs single.so\n"
               "  trainer bench --config FILE --plugin A --plugin B [--nproc N] [--baseline pytorch] [--warmup W]\n"
               "        [--steps S] [--repetitions R] [--out DIR]   A/B timing: table, bench.json, plots\n"
               "  trainer report RUN_DIR [--out REPORT.md]   a finished run as a Markdown report with plots\n"
               "  trainer config-reference      print the configuration reference as Markdown\n\n"
            << describe_options() << "\n"
            << weft::render_help();
}

void print_summary(const weft::TrainResult& r) {
  double total = 0;
  for (double s : r.epoch_seconds) total += s;
  spdlog::info("=== run summary ===");
  if (!r.epoch_seconds.empty()) {
    std::vector<std::string> each;
    for (double s : r.epoch_seconds) each.push_back(weft::format_duration(s));
    spdlog::info("time per epoch: {} (mean over {} epochs: {})", fmt::join(each, ", "), r.epoch_seconds.size(),
                 weft::format_duration(total / r.epoch_seconds.size()));
  }
  spdlog::info("steps: {}, throughput: {:.0f} tokens/s", r.steps, r.tokens_per_second);
  if (r.final_eval) {
    spdlog::info("held-out loss {:.4f}, perplexity {:.2f} (best loss {:.4f})", r.final_eval->loss,
                 r.final_eval->perplexity, r.best_eval_loss);
  }
  if (r.early_stopped) spdlog::info("stopped early (eval.patience)");
  spdlog::info("peak memory: {:.0f} MiB", r.peak_rss_mib);
}

// The configuration, options and rank context of a train or generate run, with logging set
// up for this rank.
struct RunSetup {
  weft::Config config;
  weft::TrainOptions options;
  weft::RunContext context;
};

RunSetup prepare_run(const CommandLine& cli) {
  if (cli.config.empty() && cli.overrides.empty()) {
    throw weft::Error("no configuration: pass --config FILE (see configs/) and/or --set key=value");
  }
  RunSetup run{weft::load_config(cli.config, cli.overrides), {}, {}};
  weft::set_log_level(cli.log_level.empty() ? run.config.get_string("log.level") : cli.log_level);
  run.options = weft::train_options_from_config(run.config);
  run.options.config_hash = run.config.hash();
  run.context.env = weft::detect_distributed_env();
  run.context.rank = run.context.env.rank;
  run.context.world = run.context.env.world;
  if (run.context.world > 1) {
    spdlog::set_pattern(fmt::format("[%H:%M:%S] [rank {}] %^%l%$ %v", run.context.rank));
    // One voice: ranks other than 0 report warnings and errors unless a level is asked for.
    if (run.context.rank != 0 && cli.log_level.empty()) weft::set_log_level("warn");
  }
  spdlog::info("config {} (hash {})", cli.config.empty() ? "<overrides>" : cli.config, run.config.hash());
  return run;
}

// `trainer generate`: continue --prompt with the configured model (and plugin); rank 0 prints.
int run_generate(const CommandLine& cli) {
  if (cli.prompt.empty()) throw weft::Error("trainer generate needs --prompt TEXT");
  RunSetup run = prepare_run(cli);
  run.options.inference_only = true;
  weft::Trainer trainer(run.options, run.context);
  const auto result = trainer.generate(cli.prompt);
  if (run.context.rank == 0) {
    std::string ids;
    for (int32_t id : result.tokens) ids += (ids.empty() ? "" : " ") + std::to_string(id);
    std::cout << "tokens: " << ids << "\n" << cli.prompt << result.text << "\n";
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

int run_train(const CommandLine& cli) {
  RunSetup run = prepare_run(cli);
  const weft::Config& config = run.config;
  const auto& options = run.options;
  weft::Trainer trainer(options, run.context);
  std::filesystem::create_directories(options.out_dir);
  if (run.context.rank == 0) {  // one writer: the effective config, and how to run this again (trainer report)
    weft::write_run_config(options.out_dir, config);
    const char* command = std::getenv("WEFT_COMMAND_LINE");  // unset under torchrun / Slurm: not recorded
    if (command != nullptr) weft::write_file_atomically(options.out_dir + "/command.txt", std::string(command) + "\n");
  }
  const auto result = trainer.run();
  print_summary(result);
  return result.interrupted ? 128 + result.interrupt_signal : 0;
}

// `trainer check --plugin X`: the conformance check against single.so.
int run_check(const CommandLine& cli) {
  if (cli.plugin.empty()) throw weft::Error("trainer check needs --plugin NAME_OR_PATH");
  weft::set_log_level(cli.log_level.empty() ? "warn" : cli.log_level);
  weft::ConformanceOptions options;
  options.plugin = cli.plugin;
  options.nproc = std::max(1, cli.nproc);
  options.trainer_path = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string settings;
  for (const auto& setting : cli.overrides) {
    if (setting.rfind("train.plugin=", 0) == 0) continue;  // --plugin itself
    if (setting == "train.mode=lora" || setting == "train.mode=full") {
      options.mode = setting.substr(std::string("train.mode=").size());
      settings += ", " + setting;
      continue;
    }
    if (setting == "train.precision=fp32" || setting == "train.precision=bf16") {
      options.precision = setting.substr(std::string("train.precision=").size());
      settings += ", " + setting;
      continue;
    }
    if (setting.rfind("plugin.", 0) != 0) {
      throw weft::Error(fmt::format("trainer check takes only --set plugin.KEY=VALUE (the plugin's settings), --set "
                                    "train.mode=full|lora and --set train.precision=fp32|bf16, got '{}'",
                                    setting));
    }
    options.plugin_settings.push_back(setting.substr(std::string("plugin.").size()));
  }
  const auto report = weft::check_conformance(options);
  for (const auto& s : options.plugin_settings) settings += ", plugin." + s;
  std::cout << "conformance of " << cli.plugin << " (" << options.nproc << " rank" << (options.nproc > 1 ? "s" : "")
            << settings << ") against single: " << report.describe() << "\n";
  return report.passed ? 0 : 1;
}

std::string tools_dir() {
  const char* dir = std::getenv("WEFT_TOOLS_DIR");
  return dir != nullptr ? dir : WEFT_TOOLS_DIR;
}

// `trainer bench`: A/B timing of plugins (core/bench/bench.h).
int run_bench(const CommandLine& cli) {
  weft::set_log_level(cli.log_level.empty() ? "info" : cli.log_level);
  if (!cli.baseline.empty() && cli.baseline != "pytorch") {
    throw weft::Error(fmt::format("--baseline '{}': the only baseline is 'pytorch'", cli.baseline));
  }
  weft::BenchOptions options;
  options.config = cli.config;
  options.overrides = cli.overrides;
  options.plugins = cli.plugins;
  options.nproc = cli.nprocs;
  options.pytorch_baseline = cli.baseline == "pytorch";
  options.warmup_steps = cli.warmup;
  options.steps = cli.steps;
  options.repetitions = cli.repetitions;
  options.out_dir = cli.out;
  options.trainer_path = std::filesystem::read_symlink("/proc/self/exe").string();
  options.tools_dir = tools_dir();
  const char* python = std::getenv("WEFT_PYTHON");
  options.python = python != nullptr ? python : WEFT_DEFAULT_PYTHON;
  return weft::run_bench(options);
}

// `trainer report RUN_DIR`: tools/report.py turns the run's metrics into Markdown and plots.
int run_report(const CommandLine& cli) {
  if (cli.target.empty()) throw weft::Error("trainer report needs the run directory: trainer report RUN_DIR");
  if (!std::filesystem::exists(cli.target + "/metrics.jsonl")) {
    throw weft::Error(fmt::format("{}: not a run directory (no metrics.jsonl)", cli.target));
  }
  std::vector<std::string> args{"python3", tools_dir() + "/report.py", cli.target};
  if (!cli.out.empty()) args.insert(args.end(), {"-o", cli.out});
  const int status = std::system(weft::shell_join(args).c_str());
  return status == 0 ? 0 : 1;
}

// `trainer plugins`: every strategy plugin in the search path, described, failures marked.
int run_plugins() {
  // Plugins that link LibTorch must be built against this one (sdk/include/weft/strategy_torch.hpp).
  std::cout << fmt::format("host: LibTorch {}, NCCL {}, CUDA devices {}\n", weft::compat::libtorch_version(),
                           weft::Communicator::nccl_compiled() ? "compiled in" : "not in this build",
                           torch::cuda::device_count());
  std::cout << weft::format_plugin_table(weft::list_plugins());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr, so that stdout carries only what a command produces (generated text, a
  // table, a verdict) and can be piped.
  spdlog::set_default_logger(spdlog::stderr_color_mt("weft"));
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  try {
    const CommandLine cli = parse_command_line(argc, argv);
    if (cli.help) {
      print_help();
      return 0;
    }
    // The command as the user typed it; ranks that a --nproc launch starts inherit the launcher's.
    if (std::getenv("RANK") == nullptr) {
      ::setenv("WEFT_COMMAND_LINE", weft::reproducible_command_line(argc, argv).c_str(), /*overwrite=*/1);
    }
    if ((cli.command == "train" || cli.command == "generate") && cli.nproc > 0 && std::getenv("RANK") == nullptr) {
      if (!cli.log_level.empty()) weft::set_log_level(cli.log_level);  // the launcher's own lines
      return weft::launch_local_ranks(cli.nproc, argc, argv);
    }
    if (cli.command == "train") return run_train(cli);
    if (cli.command == "generate") return run_generate(cli);
    if (cli.command == "plugins") return run_plugins();
    if (cli.command == "check") return run_check(cli);
    if (cli.command == "bench") return run_bench(cli);
    if (cli.command == "report") return run_report(cli);
    if (cli.command == "config-reference") {
      std::cout << weft::render_markdown_reference();
      return 0;
    }
    throw weft::Error(
        fmt::format("unknown command '{}' (commands: train, generate, plugins, check, bench, report, config-reference)",
                    cli.command));
  } catch (const weft::Error& e) {
    spdlog::error("{}", e.what());
  } catch (const po::error& e) {
    spdlog::error("command line: {} (see trainer --help)", e.what());
  } catch (const c10::Error& e) {
    spdlog::error("torch: {}", weft::printable(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    spdlog::error("{}", weft::printable(e.what()));
  }
  return 1;
}
