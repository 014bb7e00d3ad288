// The conformance check: K steps (fp32, or bf16) of a tiny model (the `tiny` preset with 4 layers and tied
// embeddings, so that pipelines can use up to 4 stages and must handle the tied head) under a
// plugin and under the reference single.so, on the same data, global batch and seed; the losses
// and final parameters must match within tight tolerances. Every shipped plugin runs it in ctest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

struct ConformanceOptions {
  std::string plugin;                // the plugin under test (path or name)
  std::string reference = "single";  // the reference plugin
  int64_t steps = 20;
  int nproc = 1;                     // ranks for the plugin under test (> 1: real processes)
  std::string trainer_path;          // the trainer executable (for nproc > 1)
  int64_t batch_size = 24;           // global sequences per micro-batch (divisible by 1-4, 6, 8, 12)
  int64_t grad_accum_steps = 2;
  double loss_rtol = 1e-5;           // relative tolerance on every step's loss
  double param_atol = 1e-5;          // absolute tolerance on every final parameter
  std::string work_dir;              // scratch directory (a synthetic corpus, run dirs)
  // The plugin's settings for the run under test, "key=value" with a TOML value (e.g.
  // "stages=2", "balance=[3, 1]", "mode=\"flush\"").
  std::vector<std::string> plugin_settings;
  // "full", or "lora": both runs train LoRA adapters (r 4, alpha 8, no dropout) on every
  // targetable layer with the base frozen, and the adapters are compared.
  std::string mode = "full";
  // "fp32", or "bf16" / "fp16": both runs compute in that half precision (fp32 weights and
  // optimizer; fp16 with dynamic loss scaling), compared with the half-precision tolerances
  // (bf16_loss_rtol, bf16_param_atol) instead of fp32's.
  std::string precision = "fp32";
  double bf16_loss_rtol = 1e-4;     // measured: <= 3e-5 for ddp, tensor_parallel and the pipelines
  double bf16_param_atol = 5e-3;    // measured: <= 2.2e-3 (20 steps at lr 1e-3)
  // Where the plugin under test computes (train.device: "cpu", "cuda", "auto"); the reference
  // always computes on the CPU, so "cuda" checks the CUDA path against the CPU's.
  std::string device = "cpu";
};

struct ConformanceReport {
  bool passed = false;
  int64_t steps = 0;
  double max_loss_rel_diff = 0;
  double max_param_abs_diff = 0;
  std::string worst_parameter;
  std::string precision;
  double loss_rtol = 0, param_atol = 0;  // the tolerances applied
  std::vector<double> plugin_losses, reference_losses;
  std::string describe() const;  // a few lines: verdict, the largest differences
};

// The reference always runs in this process. With nproc > 1 the plugin under test runs as
// `trainer --nproc N` (real processes over Gloo) on the same settings, and its losses and saved
// final parameters are compared. Throws weft::Error if either run fails or refuses the setup.
ConformanceReport check_conformance(const ConformanceOptions& options);

}  // namespace weft
