// trainer bench: A/B timing of strategy plugins on one job, made fair.
//
// Every variant (a plugin, its settings and a process count; optionally PyTorch's DDP and DTensor
// tensor-parallel baselines) trains the same configuration - same data, seed, global batch and model - for
// warm-up + measured steps, in alternation (A B C A B C ...) so that slow drifts of the machine
// hit every variant alike, R repetitions each. Only steps after the warm-up count. Each run is
// a child `trainer train` (or tools/pytorch_baseline.py) whose metrics.jsonl is read back; the
// figures per variant are in VariantSummary (bench_stats.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

// One thing to time.
struct BenchVariant {
  std::string name;                   // e.g. "ddp x2", "gpipe microbatches=8 x2", "pytorch-ddp x2"
                                      // (the baseline's name also at x1, where it runs without DDP)
  std::string plugin;                 // plugin name or path; empty for the PyTorch baseline
  int nproc = 1;
  std::vector<std::string> settings;  // extra "--set key=value" for this variant only
  bool pytorch = false;               // a PyTorch baseline (python/pytorch_baseline.py)
  std::string pytorch_parallel;       // its parallelism: "ddp" (DistributedDataParallel), "tp"
                                      // (DTensor tensor parallelism over all processes) or "pp" (one
                                      // torch.distributed.pipelining pipeline over all processes)
  std::string pytorch_schedule;       // pp: "gpipe", "1f1b" or "interleaved1f1b"
  int pytorch_microbatches = 4;       // pp: micro-batches per pipeline step
  std::string transformers;           // ddp: "full" or "lora" for transformers' LlamaForCausalLM on the
                                      // job's checkpoint (+ PEFT's LoRA) instead of the script's Llama
  int nnodes = 1;                     // nodes the run spans, nproc ranks on each (named by the total)
};

struct BenchOptions {
  std::string config;                      // the job (--config)
  std::vector<std::string> overrides;      // --set for every variant
  std::vector<std::string> plugins;        // --plugin, repeatable: "NAME [--set plugin.k=v ...]"
  std::vector<std::string> nproc;          // --nproc, "N" or "N,M,..."; one for all or one per plugin
  bool pytorch_baseline = false;           // --baseline pytorch
  int64_t warmup_steps = 3;                // not counted
  int64_t steps = 10;                      // counted, per run
  int64_t repetitions = 3;
  int64_t eval_every = 0;                  // --eval-every: held-out loss every N steps (0: none)
  // --nnodes M --node-rank R --master-addr HOST [--master-port P]: every run spans M nodes, as
  // `trainer --nproc N --nnodes M ...` (--nproc: ranks per node). The same bench runs on each node;
  // its runs meet in the same order, run k's rendezvous at HOST:P+k on node 0. Node 0 reads the
  // results and writes the table; the others take part and record whether each run succeeded.
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 29500;
  std::string out_dir;                     // bench.json, bench.md, plots, runs/
  std::string trainer_path;                // the trainer executable (for the child runs)
  std::string python_dir;                  // python/ (plots, the PyTorch baseline)
  std::string python;                      // interpreter with torch, for the baseline
  std::string plot_python;                 // interpreter with matplotlib, for the plots
};

// The variants in run order: each plugin at each of its process counts, then the PyTorch DDP
// baseline at every process count used, PyTorch's DTensor tensor parallelism ("pytorch-tp") at
// every count of 2 or more at which a plugin that owns the tp dimension runs alone, and PyTorch's
// pipeline schedules ("pytorch-gpipe", "pytorch-1f1b", "pytorch-interleaved1f1b") at every count of
// 2 or more and plugin.microbatches at which a plugin that owns pp runs alone (with the baseline,
// the plugins are loaded to read their dimensions), and, when the job loads a checkpoint
// (model.weights) with train.mode full or lora, transformers on it at every process count
// ("transformers-peft" for LoRA, "transformers" for full fine-tuning; DDP beyond one process). Throws weft::Error for a malformed --plugin or
// --nproc, a count list that matches neither one nor every plugin, no plugin at all, or, with the
// baseline, a plugin that does not load.
std::vector<BenchVariant> plan_bench(const BenchOptions& options);

// Runs the bench and writes (on node 0 of a bench across nodes; the other nodes write bench.json
// with each run's outcome) out_dir/bench.json, out_dir/bench.md (the table) and the plots;
// prints the table. A variant whose run fails is not run again; the others go on, and the table
// and bench.json ("failed") name it with its error and log. Returns 0, or 1 when a variant failed.
int run_bench(const BenchOptions& options);

}  // namespace weft
