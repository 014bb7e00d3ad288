// The trainer's command line: the command, its options and the configuration overrides they
// imply (--plugin is --set train.plugin=..., --trace is --set log.trace=...).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft::app {

struct CommandLine {
  std::string command = "train";
  std::string config;
  std::vector<std::string> overrides;
  std::string log_level;
  std::string prompt;
  bool chat = false;  // trainer generate --chat: the prompt is a user message in the chat template
  std::string plugin;
  int nproc = 0;
  // --nproc across machines (torchrun's static rendezvous): this node of nnodes, node 0's address
  // and the store's port there.
  int nnodes = 1, node_rank = 0, master_port = 29500;
  std::string master_addr;
  bool help = false;
  // trainer bench: every --plugin and --nproc as given; trainer report: the run directory.
  std::vector<std::string> plugins, nprocs;
  std::string target, out, baseline;
  // steps: trainer bench's counted steps per run, trainer check's steps; 0 = the command's default.
  int64_t warmup = 3, steps = 0, repetitions = 3, eval_every = 0;  // trainer bench
  // trainer eval: files to evaluate instead of the held-out split, and where to write the JSON.
  std::vector<std::string> data;
  std::string json;
  // trainer export: the GGUF tensor type (f16 when empty).
  std::string type;
  // trainer check: the conformance matrix (conformance_matrix()); with --plugin, its cases that run it.
  bool all = false;
};

// Parses argv; throws weft::Error (or boost::program_options::error) for a malformed command line.
CommandLine parse_command_line(int argc, char** argv);
// Usage, every option and every configuration key.
void print_help();

}  // namespace weft::app
