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
  // AdamW's epsilon in both runs (train.eps; lr 1e-3, 2 warm-up steps). Not the default 1e-8: a
  // gradient element that is zero in exact arithmetic comes out of either run as rounding noise
  // (~1e-10), and with eps 1e-8 AdamW turns that into ~1% of a step, every step, so one such
  // element decided the comparison: layer 3's o_proj, 1.1-1.4e-5 apart after 8 steps for ddp and
  // zero on 3 ranks, ring attention, tensor_parallel x gpipe (an Intel Xeon's AVX-512 MKL; its AVX2
  // path, as on AMD, gave 1.9e-6). With 1e-6 the same runs differ by 1.3e-7; the update of any
  // element whose gradient exceeds ~1e-5 is as with 1e-8.
  double adam_eps = 1e-6;
  std::string work_dir;              // scratch directory (a synthetic corpus, run dirs)
  // The plugin's settings for the run under test, "key=value" with a TOML value (e.g.
  // "stages=2", "balance=[3, 1]", "mode=\"flush\"").
  std::vector<std::string> plugin_settings;
  // The device mesh of a composed candidate (plugin "tensor_parallel,gpipe"): "tp=2" for mesh.tp
  // and so on (the reference runs alone).
  std::vector<std::string> mesh_settings;
  // "full", or "lora": both runs train LoRA adapters (r 4, alpha 8, no dropout) on every
  // targetable layer with the base frozen, and the adapters are compared; or "adalora": AdaLoRA's
  // adapters (init_r 4, target_r 2, tinit 2, tfinal 4, deltaT 2 over the run's steps, alpha 8,
  // no dropout) on the same layers, every triplet's P, Lambda and Q compared whole (a different
  // mask on any rank shows as a Lambda that is zero on one side only).
  // Or "prompt_tuning": 8 virtual tokens (random init) before each row, the base frozen, the
  // prompt compared.
  std::string mode = "full";
  // model.quantize for both runs ("none", "int8", "nf4"; not "none" needs mode "lora"): the frozen
  // base held quantized, each rank quantizing the slices it holds.
  std::string quantize = "none";
  // model.int8_threshold for both runs (int8 on the CPU's int8 GEMM: LLM.int8's outliers).
  double int8_threshold = 6.0;
  // model.frozen_dtype for both runs ("fp32", "bf16": the frozen base's matrices stored in bf16;
  // needs mode "lora" or "adalora").
  std::string frozen_dtype = "fp32";
  // model.activation_checkpointing for both runs: each decoder block recomputed in the backward (so
  // the plugin's communication inside a block runs again there, in the same order on every rank).
  bool activation_checkpointing = false;
  // model.chunked_loss for both runs (the LM head and its loss in row chunks where the candidate's
  // head allows; where it computed whole logits instead, the reference is run again that way).
  bool chunked_loss = true;
  // int8 multiplied in the CPU's int8 GEMM (LLM.int8, activations rounded to 7 bits per token):
  // a rounding step in the forward, so the inputs' last-bit differences between two runs that
  // split the work differently move some values by a whole step. Measured on LibTorch 2.11 (AMD
  // EPYC, 20 steps): ddp, tensor_parallel and gpipe within 7.6e-06 (loss) and 2.4e-04
  // (parameters); tensor_parallel without WEFT_COMM_ROW_ABSMAX's all-reduce: 2.9e-05 and 2.8e-03.
  // A check on CUDA (train.device = "cuda", which dequantizes) runs the CPU reference dequantizing
  // too (model.int8_gemm = false) with the fp32 tolerances, and so does a classification check:
  // its loss averages one token per row, so a step moves it more (measured: 2.3e-04 and 2.6e-04,
  // ddp and tensor_parallel with LoRA); the int8 GEMM's splits are checked on the causal LM.
  // Either way that check still verifies each rank's int8 slices against one process's.
  double int8_gemm_loss_rtol = 3e-5;
  double int8_gemm_param_atol = 1e-3;
  // train.task for both runs: "causal_lm", or "classification": a labeled corpus of rows of
  // different lengths (3 classes), the classification head pooled at each row's last token; or
  // "chat" (causal_lm on data.format = "chat"): prompt-completion pairs, one per row, the loss on the
  // completions' tokens, which differ in number between rows, micro-batches and ranks.
  std::string task = "causal_lm";
  // data.packing for both runs (task "chat"): several pairs per row, each with its own positions and
  // attending to itself only.
  bool packing = false;
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
  std::string note;                      // why they are not the usual ones, if they are not
  std::vector<double> plugin_losses, reference_losses;
  std::string describe() const;  // a few lines: verdict, the largest differences
};

// The reference always runs in this process. With nproc > 1 the plugin under test runs as
// `trainer --nproc N` (real processes over Gloo) on the same settings, and its losses and saved
// final parameters are compared. Throws weft::Error if either run fails or refuses the setup.
ConformanceReport check_conformance(const ConformanceOptions& options);

// Applies one `trainer check --set` setting ("train.mode=lora", "plugin.stage=3", ...) to `options`.
// Throws weft::Error naming what check takes for a setting it does not.
void apply_check_setting(ConformanceOptions& options, const std::string& setting);

// One case of `trainer check --all`: a shipped strategy on `nproc` ranks with `settings` (what
// apply_check_setting takes).
struct ConformanceCase {
  std::string plugin;
  int nproc = 2;
  std::vector<std::string> settings;
  std::string label() const;  // "tensor_parallel x4 mesh.tp=2, train.mode=lora"
};
// The matrix `trainer check --all` runs: the cases each plugin lists in its
// <plugin>.conformance.toml beside it (plugins/<name>/conformance.toml in the source tree), each
// run full and with LoRA, from the first of `plugin_dirs` holding a plugin's file; ordered by
// plugin name. The ctest Conformance.* checks cover more settings. Throws weft::Error naming the
// file for a malformed one.
std::vector<ConformanceCase> conformance_matrix(const std::vector<std::string>& plugin_dirs);

}  // namespace weft
