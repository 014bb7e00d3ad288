// The trainer's commands (core/app/commands.cpp), each run with the parsed command line; each
// returns the process's exit status and throws weft::Error for bad input.
#pragma once

#include "core/app/cli.h"

namespace weft::app {

int run_train(const CommandLine& cli);
int run_eval(const CommandLine& cli);
int run_generate(const CommandLine& cli);
int run_export(const CommandLine& cli);
int run_check(const CommandLine& cli);
int run_plan(const CommandLine& cli);
int run_bench(const CommandLine& cli);
int run_report(const CommandLine& cli);
int run_plugins();

}  // namespace weft::app
