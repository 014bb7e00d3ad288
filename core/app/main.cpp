// trainer: weft's host executable.
//
//   trainer [train] --config configs/x.toml [--plugin NAME] [--nproc N] [--set section.key=value ...]
//   trainer eval | generate | check | plan | bench | report | plugins | config-reference   (trainer --help)
#include <cstdlib>
#include <iostream>

#include <boost/program_options/errors.hpp>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "core/app/cli.h"
#include "core/app/commands.h"
#include "core/config/schema.h"
#include "core/job/options.h"
#include "core/dist/launcher.h"
#include "core/util/error.h"
#include "core/util/log.h"
#include "core/util/quick_exit.h"
#include "core/util/shell.h"

namespace {
int run(int argc, char** argv) {
  using namespace weft::app;
  // Logs go to stderr, so that stdout carries only what a command produces (generated text, a
  // table, a verdict) and can be piped.
  spdlog::set_default_logger(spdlog::stderr_color_mt("weft"));
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  try {
    CommandLine cli = parse_command_line(argc, argv);
    if (cli.help) {
      print_help();
      return 0;
    }
    // The command as the user typed it; ranks that a --nproc launch starts inherit the launcher's.
    if (std::getenv("RANK") == nullptr) {
      ::setenv("WEFT_COMMAND_LINE", weft::reproducible_command_line(argc, argv).c_str(), /*overwrite=*/1);
    }
    const bool runs_ranks =
        cli.command == "train" || cli.command == "eval" || cli.command == "generate" || cli.command == "plan";
    if (runs_ranks && cli.nproc > 0 && std::getenv("RANK") == nullptr) {
      if (!cli.log_level.empty()) weft::set_log_level(cli.log_level);  // the launcher's own lines
      const weft::LaunchPlan plan{cli.nproc, cli.nnodes, cli.node_rank, cli.master_addr, cli.master_port};
      const weft::LaunchResult launched = weft::launch_local_ranks(plan, argc, argv);
      if (!launched.rank_process) return launched.exit_code;
      cli.nproc = 0;  // a rank: the command runs here, as torchrun's ranks run it
      cli.nprocs.clear();
    }
    if (cli.command == "train") return run_train(cli);
    if (cli.command == "eval") return run_eval(cli);
    if (cli.command == "generate") return run_generate(cli);
    if (cli.command == "export") return run_export(cli);
    if (cli.command == "check") return run_check(cli);
    if (cli.command == "plan") return run_plan(cli);
    if (cli.command == "bench") return run_bench(cli);
    if (cli.command == "report") return run_report(cli);
    if (cli.command == "plugins") return run_plugins();
    if (cli.command == "config-reference") {
      std::cout << weft::render_markdown_reference(weft::run_schema());
      return 0;
    }
    throw weft::Error(fmt::format(
        "unknown command '{}' (commands: train, eval, generate, check, plan, bench, report, plugins, config-reference)",
        cli.command));
  } catch (const weft::Error& e) {
    spdlog::error("{}", e.what());
  } catch (const boost::program_options::error& e) {
    spdlog::error("command line: {} (see trainer --help)", e.what());
  } catch (const c10::Error& e) {
    spdlog::error("torch: {}", weft::printable(e.what_without_backtrace()));
  } catch (const std::exception& e) {
    spdlog::error("{}", weft::printable(e.what()));
  }
  return 1;
}
}  // namespace

// Every command's files are closed when run returns: the process ends there, without LibTorch's
// static teardown (quick_exit.h), which a --nproc run would otherwise pay once per rank.
int main(int argc, char** argv) {
  const int status = run(argc, argv);
  spdlog::shutdown();
  weft::exit_without_teardown(status);
}
