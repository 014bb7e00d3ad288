#include "core/app/cli.h"

#include <iostream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include "core/config/schema.h"
#include "core/job/options.h"
#include "core/util/error.h"

namespace weft::app {

namespace po = boost::program_options;

namespace {

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
      ("nnodes", po::value<int>(), "with --nproc: the job's nodes (run the same command on each, with its --node-rank)")
      ("node-rank", po::value<int>(), "with --nnodes: this node, 0 to nnodes - 1 (its ranks: node-rank x nproc onwards)")
      ("master-addr", po::value<std::string>(), "with --nnodes: node 0's address (its launcher hosts the rendezvous)")
      ("master-port", po::value<int>(), "with --nnodes: the rendezvous port on node 0 (default 29500)")
      ("warmup", po::value<int64_t>(), "trainer bench: steps per run not counted (default 3)")
      ("steps", po::value<int64_t>(), "trainer bench: counted steps per run (default 10); trainer check: steps (default 20)")
      ("all", po::bool_switch(), "trainer check: every shipped strategy and layout against single, as a table (--nproc N: "
       "only cases of at most N ranks; --plugin NAME: only the cases that run NAME; --set applies to every case)")
      ("repetitions", po::value<int64_t>(), "trainer bench: runs per variant, alternated (default 3)")
      ("eval-every", po::value<int64_t>(), "trainer bench: held-out loss every N steps, against training time (default: none)")
      ("baseline", po::value<std::string>(), "trainer bench: 'pytorch' adds PyTorch DDP, DTensor tensor parallelism beside a plugin that owns tp, PyTorch's pipeline schedules beside one that owns pp, and transformers (+ PEFT's LoRA) on the job's checkpoint (python/pytorch_baseline.py)")
      ("out,o", po::value<std::string>(), "trainer bench: output directory; trainer report: the Markdown file; trainer export: the GGUF file")
      ("log-level", po::value<std::string>(), "trace, debug, info, warn or error (default: log.level)")
      ("prompt", po::value<std::string>(), "trainer generate: the text to continue")
      ("chat", po::bool_switch(), "trainer generate: the prompt is a user message, rendered with the tokenizer's chat "
       "template and its generation prompt; the reply is generated")
      ("data", po::value<std::vector<std::string>>()->composing(),
       "trainer eval: evaluate every sequence of these files (repeatable) instead of the held-out split")
      ("json", po::value<std::string>(), "trainer eval: write tokens, loss, perplexity and every sequence's loss to FILE")
      ("type", po::value<std::string>(), "trainer export: the GGUF tensor type of the matrices: f16 (default), bf16, q8_0 or f32")
      ("trace", po::value<std::string>(),
       "write a Chrome/Perfetto trace of the run to FILE (FILE.rank<r>.json per rank; same as --set log.trace=FILE)");
  return options;
}

// The flags each command takes (besides --help); a flag of another command is an error naming the
// commands that take it and, where one exists, the setting the user may have meant.
void check_flags_of_command(const po::variables_map& vm, const std::string& command) {
  static const std::map<std::string, std::set<std::string>> takes{
      {"train", {"config", "plugin", "set", "nproc", "nnodes", "node-rank", "master-addr", "master-port", "trace", "log-level"}},
      {"eval", {"config", "plugin", "set", "nproc", "nnodes", "node-rank", "master-addr", "master-port", "trace", "log-level", "data", "json"}},
      {"generate", {"config", "plugin", "set", "nproc", "nnodes", "node-rank", "master-addr", "master-port", "trace", "log-level", "prompt", "chat"}},
      {"export", {"config", "set", "log-level", "out", "type"}},
      {"plan", {"config", "plugin", "set", "nproc", "nnodes", "node-rank", "master-addr", "master-port", "log-level"}},
      {"check", {"plugin", "set", "nproc", "steps", "all", "log-level"}},
      {"bench", {"config", "plugin", "set", "nproc", "nnodes", "node-rank", "master-addr", "master-port", "warmup", "steps",
                 "repetitions", "eval-every", "baseline", "out", "log-level"}},
      {"report", {"out", "log-level"}},
      {"plugins", {"log-level"}},
      {"config-reference", {}},
  };
  static const std::map<std::string, std::string> meant{
      {"steps", "the training's steps: --set train.max_steps=N"},
      {"warmup", "the learning rate's warm-up: --set train.warmup_steps=N"},
      {"data", "the training data: --set data.path=FILE"},
      {"config", "trainer check builds its own tiny model and data"},
  };
  const auto allowed = takes.find(command);
  if (allowed == takes.end()) return;  // an unknown command is refused as such (main)
  for (const auto& [flag, value] : vm) {
    if (value.defaulted() || flag == "help" || flag == "command" || flag == "target" || allowed->second.count(flag)) {
      continue;
    }
    std::vector<std::string> others;
    for (const auto& [other, flags] : takes) {
      if (flags.count(flag)) others.push_back("trainer " + other);
    }
    const auto hint = meant.find(flag);
    throw Error(fmt::format("trainer {} does not take --{}{}{}", command, flag,
                            others.empty() ? "" : fmt::format(" (an option of {})", fmt::join(others, ", ")),
                            hint == meant.end() ? "" : "; " + hint->second));
  }
}

}  // namespace

CommandLine parse_command_line(int argc, char** argv) {
  po::options_description visible = describe_options();
  po::options_description all;
  all.add(visible).add_options()("command", po::value<std::string>(), "command")(
      "target", po::value<std::string>(), "the command's operand (trainer report RUN_DIR)");
  po::positional_options_description positional;
  positional.add("command", 1).add("target", 1);
  po::variables_map vm;
  // No abbreviations: --step is not --steps (boost's default guesses a unique prefix).
  po::store(po::command_line_parser(argc, argv)
                .options(all)
                .positional(positional)
                .style(po::command_line_style::default_style & ~po::command_line_style::allow_guessing)
                .run(),
            vm);
  po::notify(vm);
  CommandLine cli;
  cli.help = vm.count("help") > 0;
  if (vm.count("command")) cli.command = vm["command"].as<std::string>();
  if (!cli.help) check_flags_of_command(vm, cli.command);
  if (vm.count("config")) cli.config = vm["config"].as<std::string>();
  if (vm.count("set")) cli.overrides = vm["set"].as<std::vector<std::string>>();
  if (vm.count("plugin")) cli.plugins = vm["plugin"].as<std::vector<std::string>>();
  if (vm.count("nproc")) cli.nprocs = vm["nproc"].as<std::vector<std::string>>();
  if (vm.count("target")) cli.target = vm["target"].as<std::string>();
  if (vm.count("out")) cli.out = vm["out"].as<std::string>();
  if (vm.count("baseline")) cli.baseline = vm["baseline"].as<std::string>();
  if (vm.count("warmup")) cli.warmup = vm["warmup"].as<int64_t>();
  if (vm.count("steps")) {
    cli.steps = vm["steps"].as<int64_t>();
    if (cli.steps < 1) throw Error(fmt::format("--steps {}: must be at least 1", cli.steps));
  }
  if (vm.count("repetitions")) cli.repetitions = vm["repetitions"].as<int64_t>();
  cli.all = vm.count("all") > 0 && vm["all"].as<bool>();
  if (!cli.target.empty() && cli.command != "report") {
    throw Error(fmt::format("unexpected argument '{}' after '{}'", cli.target, cli.command));
  }
  if (vm.count("eval-every")) cli.eval_every = vm["eval-every"].as<int64_t>();
  if (vm.count("nnodes")) cli.nnodes = vm["nnodes"].as<int>();
  if (vm.count("node-rank")) cli.node_rank = vm["node-rank"].as<int>();
  if (vm.count("master-addr")) cli.master_addr = vm["master-addr"].as<std::string>();
  if (vm.count("master-port")) cli.master_port = vm["master-port"].as<int>();
  if (cli.command == "bench") return cli;
  if (cli.plugins.size() > 1) throw Error("--plugin is given more than once (only trainer bench takes several)");
  if (cli.nprocs.size() > 1) throw Error("--nproc is given more than once (only trainer bench takes several)");
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
      throw Error(fmt::format("--nproc '{}': expected a number of processes", cli.nprocs.front()));
    }
    if (cli.nproc < 1) {
      throw Error(fmt::format("--nproc {}: the number of processes must be at least 1", cli.nproc));
    }
  }
  if (cli.nproc == 0 && (vm.count("nnodes") || vm.count("node-rank") || vm.count("master-addr") || vm.count("master-port"))) {
    throw Error("--nnodes, --node-rank, --master-addr and --master-port go with --nproc (the ranks of each node)");
  }
  if (cli.nnodes > 1 && (!vm.count("node-rank") || cli.master_addr.empty())) {
    throw Error(fmt::format("--nnodes {}: each node needs its --node-rank and node 0's --master-addr", cli.nnodes));
  }
  if (vm.count("prompt")) cli.prompt = vm["prompt"].as<std::string>();
  cli.chat = vm.count("chat") > 0 && vm["chat"].as<bool>();
  if (vm.count("data")) cli.data = vm["data"].as<std::vector<std::string>>();
  if (vm.count("json")) cli.json = vm["json"].as<std::string>();
  if (vm.count("type")) cli.type = vm["type"].as<std::string>();
  if (vm.count("trace")) cli.overrides.push_back("log.trace=" + vm["trace"].as<std::string>());
  if (vm.count("log-level")) cli.log_level = vm["log-level"].as<std::string>();
  return cli;
}

void print_help() {
  std::cout << "weft trainer: fine-tunes LLaMA-family models.\n\n"
               "Usage:\n"
               "  trainer [train] --config FILE [--plugin NAME] [--nproc N] [--set section.key=value ...]\n"
               "  trainer [train] ... --nproc N --nnodes M --node-rank R --master-addr NODE0 [--master-port P]   on\n"
               "        each of M machines: N ranks each (or use torchrun / Slurm, docs/distributed.md)\n"
               "  trainer plugins               list the strategy plugins found, with versions and ABI\n"
               "  trainer eval --config FILE [--plugin NAME] [--nproc N] [--data FILE ...] [--json OUT]   held-out\n"
               "        loss and perplexity of the configured model (or of every sequence of the --data files)\n"
               "  trainer generate --config FILE [--plugin NAME] [--nproc N] --prompt TEXT [--chat]   continue TEXT, or\n"
               "        answer it as a user message in the chat template (generate.*)\n"
               "  trainer check --plugin NAME [--nproc N] [--steps S] [--set plugin.KEY=VALUE ...]   conformance: S (20) steps under NAME vs single.so\n"
               "  trainer plan --config FILE [--plugin NAME] [--nproc N]   the memory plan per rank (parameters,\n"
               "        gradients, optimizer, activations, buffers) and whether it fits, without building the model\n"
               "  trainer bench --config FILE --plugin A --plugin B [--nproc N] [--baseline pytorch] [--warmup W]\n"
               "        [--steps S] [--repetitions R] [--eval-every E] [--out DIR]   A/B timing: table, bench.json, plots;\n"
               "        across nodes: the same command on each with --nnodes M --node-rank R --master-addr NODE0\n"
               "  trainer report RUN_DIR [--out REPORT.md]   a finished run as a Markdown report with plots\n"
               "  trainer export --config FILE --out MODEL.gguf [--type f16|bf16|q8_0|f32]   the model (LoRA merged)\n"
               "        as a GGUF file of the llama architecture, with its tokenizer\n"
               "  trainer config-reference      print the configuration reference as Markdown\n\n"
            << describe_options() << "\n"
            << render_help(run_schema());
}

}  // namespace weft::app
