// Typed run options, read once from the validated Config so the training code never looks up
// string keys. Each field mirrors a schema key (core/config/schema.cpp documents them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/data/dataset.h"
#include "core/model/lora.h"

namespace weft {

struct ModelSource {
  std::string preset;
  std::string config_path;
  std::string weights;
  std::string adapter;  // model.adapter: a PEFT LoRA adapter directory applied on top of the weights
  double init_std = 0.02;
  int64_t vocab_size = 0;
  bool activation_checkpointing = false;
  std::string attention = "auto";  // model.attention (AttentionKernel, core/model/config.h)
};

struct OptimOptions {
  double lr = 3e-4, min_lr_ratio = 0.1, weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, grad_clip = 1.0;
  int64_t warmup_steps = 0;
  std::string schedule = "cosine";
};

struct TrainOptions {
  ModelSource model;
  DatasetOptions data;
  std::string tokenizer = "byte";
  OptimOptions optim;
  std::string mode = "full";  // full | lora
  LoraConfig lora;
  uint64_t seed = 0;
  int64_t epochs = 1, max_steps = 0, batch_size = 8, grad_accum_steps = 1, threads = 1;
  std::string precision = "fp32";
  std::string out_dir;
  bool overwrite = false;
  std::string plugin;          // strategy plugin path or name; empty = built-in step
  toml::table plugin_config;   // the [plugin] section, handed to the plugin
  std::string config_hash;     // of the effective config: every rank must agree
  double collective_timeout_s = 300;
  bool save_merged = false;  // LoRA: also save the merged model at the end
  int64_t eval_every = 0, eval_max_batches = 0, eval_batch_size = 0, patience = 0;
  int64_t checkpoint_every = 0, keep_last = 2;
  std::string resume;
  bool save_final = true, keep_best = true;
  std::string progress = "auto";
  int64_t log_every = 10;
  std::string metrics_file;
  std::string trace_file;    // log.trace: Chrome trace of this run ("" = off)
  // Generation (trainer generate): build the strategy and the model only (no data, no
  // optimizer, no run directory).
  bool inference_only = false;
  int64_t max_new_tokens = 64;  // generate.max_new_tokens
  double temperature = 0.0;     // generate.temperature: 0 = greedy
  double top_p = 1.0;           // generate.top_p
  uint64_t generate_seed = 0;   // generate.seed
};

TrainOptions train_options_from_config(const Config& config);

}  // namespace weft

namespace weft {
// Writes the effective configuration to <out_dir>/config.toml, so a run can be reproduced with
// `trainer --config <out_dir>/config.toml`.
void write_run_config(const std::string& out_dir, const Config& config);
}  // namespace weft
