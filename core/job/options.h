// A run's options, and weft's configuration keys, declared once each (options.cpp): one row per
// key binds its name, the TrainOptions member it sets, its default, its documentation and its
// constraints. The rows give the schema that validates a configuration (run_schema), the reader
// (train_options_from_config), the defaults of a TrainOptions, `trainer --help` and the generated
// reference (docs/configuration.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "core/config/config.h"
#include "core/data/chat_data.h"
#include "core/data/classification.h"
#include "core/data/dataset.h"
#include "core/io/checkpoint_backup.h"
#include "core/model/lora.h"
#include "core/model/prompt_tuning.h"

namespace weft {

struct ModelSource {
  std::string preset;       // model.preset
  std::string config_path;  // model.config
  std::string weights;      // model.weights
  std::string adapter;      // model.adapter: a PEFT LoRA adapter directory on top of the weights
  double init_std;
  int64_t vocab_size;
  bool activation_checkpointing;
  bool chunked_loss = true;  // model.chunked_loss
  std::string quantize;     // model.quantize (QuantFormat, core/model/quantize.h)
  double int8_threshold = 6.0;  // model.int8_threshold (QuantConfig)
  bool int8_gemm = true;        // model.int8_gemm
  std::string frozen_dtype = "fp32";  // model.frozen_dtype
  bool cache_frozen_casts = true;     // model.cache_frozen_casts
};

struct OptimOptions {
  double lr, min_lr_ratio, weight_decay;
  double beta1, beta2, eps, grad_clip;
  int64_t warmup_steps;
  std::string schedule;
};

struct TrainOptions {
  // Every member a configuration key sets holds that key's default (from its row).
  TrainOptions();

  ModelSource model;
  DatasetOptions data;
  std::string tokenizer;      // data.tokenizer
  std::string task;           // train.task: causal_lm | classification
  ChatOptions chat;                      // data.loss_on (data.format = "chat")
  ClassificationOptions classification;  // data.glue_task, data.pair_field, data.label_field, data.labels, data.regression
  OptimOptions optim;
  std::string mode;           // train.mode: full | lora | adalora
  LoraConfig lora;            // lora.*: also AdaLoRA's alpha, dropout and target modules
  AdaLoraConfig adalora;      // adalora.* (its spec and target_modules unused: lora's)
  PromptTuningConfig prompt_tuning;  // prompt_tuning.*
  uint64_t seed;
  int64_t epochs, max_steps, batch_size, grad_accum_steps, threads;
  std::string precision;
  std::string fp32_cpu_gemm;  // train.fp32_cpu_gemm: auto | aten | onednn
  std::string device;         // train.device: auto | cpu | cuda
  double peak_tflops;
  double loss_scale;          // train.loss_scale: fp16's initial dynamic loss scale         // train.peak_tflops: 0 = the table's (core/train/flops.h)
  std::string out_dir;
  bool overwrite;
  std::string plugin;         // train.plugin: a path or name; empty = single, built into the host
  int64_t mesh_pp, mesh_dp, mesh_cp, mesh_tp;  // [mesh]: 0 = unset (Mesh::resolve)
  double collective_timeout_s;
  bool shared_memory_collectives;  // train.shared_memory_collectives
  double memory_limit_gib;    // train.memory_limit_gib: 0 = the machine's memory (CPU) / the device's (CUDA)
  bool save_merged;           // lora.save_merged
  int64_t eval_every, eval_max_batches, eval_batch_size, patience;
  bool eval_on_start;         // eval.on_start: evaluate the starting model before the first step
  int64_t checkpoint_every, keep_last;
  std::string resume;
  bool save_final, keep_best;
  BackupOptions backup;       // backup.*: checkpoints uploaded to S3-compatible storage
  std::string log_level, progress;
  int64_t log_every;
  std::string metrics_file;   // log.metrics_file, or <out_dir>/metrics.jsonl
  std::string trace_file;     // log.trace: Chrome trace of this run ("" = off)
  std::string torch_profile;  // log.torch_profile: Kineto trace of a few steps ("" = off)
  int64_t torch_profile_from;
  int64_t torch_profile_steps;
  std::string chat_system;     // generate.system: the system message of trainer generate --chat
  int64_t max_new_tokens;     // generate.*
  double temperature, top_p;
  uint64_t generate_seed;

  // Not configuration keys:
  toml::table plugin_config;  // the [plugin] section, handed to the plugin
  std::string config_hash;    // of the effective configuration: every rank must agree
};

// weft's configuration schema: the sections and every key's row.
const Schema& run_schema();

// A configuration of weft's schema (load_config, core/config/config.h).
Config load_run_config(const std::string& path, const std::vector<std::string>& overrides = {});

// The options `config` sets, and the defaults of the keys it leaves.
TrainOptions train_options_from_config(const Config& config);

// Writes the effective configuration to <out_dir>/config.toml, so a run can be reproduced with
// `trainer --config <out_dir>/config.toml`.
void write_run_config(const std::string& out_dir, const Config& config);

}  // namespace weft
