#include "core/job/options.h"

namespace weft {

TrainOptions train_options_from_config(const Config& c) {
  TrainOptions o;
  o.model.preset = c.get_string("model.preset");
  o.model.config_path = c.get_string("model.config");
  o.model.weights = c.get_string("model.weights");
  o.model.adapter = c.get_string("model.adapter");
  o.model.init_std = c.get_float("model.init_std");
  o.model.vocab_size = c.get_int("model.vocab_size");
  o.model.activation_checkpointing = c.get_bool("model.activation_checkpointing");
  o.model.attention = c.get_string("model.attention");

  o.data.paths = c.get_string_list("data.path");
  o.data.format = c.get_string("data.format");
  o.data.text_field = c.get_string("data.text_field");
  o.data.text_document = c.get_string("data.text_document");
  o.data.seq_len = c.get_int("data.seq_len");
  o.data.heldout_fraction = c.get_float("data.heldout_fraction");
  o.data.split_seed = static_cast<uint64_t>(c.get_int("data.split_seed"));
  o.data.max_documents = c.get_int("data.max_documents");
  o.data.cache_dir = c.get_string("data.cache_dir");
  o.data.add_bos = c.get_bool("data.add_bos");
  o.data.add_eos = c.get_bool("data.add_eos");
  o.tokenizer = c.get_string("data.tokenizer");

  o.mode = c.get_string("train.mode");
  o.seed = static_cast<uint64_t>(c.get_int("train.seed"));
  o.epochs = c.get_int("train.epochs");
  o.max_steps = c.get_int("train.max_steps");
  o.batch_size = c.get_int("train.batch_size");
  o.grad_accum_steps = c.get_int("train.grad_accum_steps");
  o.optim.lr = c.get_float("train.lr");
  o.optim.min_lr_ratio = c.get_float("train.min_lr_ratio");
  o.optim.warmup_steps = c.get_int("train.warmup_steps");
  o.optim.schedule = c.get_string("train.schedule");
  o.optim.weight_decay = c.get_float("train.weight_decay");
  o.optim.beta1 = c.get_float("train.beta1");
  o.optim.beta2 = c.get_float("train.beta2");
  o.optim.eps = c.get_float("train.eps");
  o.optim.grad_clip = c.get_float("train.grad_clip");
  o.precision = c.get_string("train.precision");
  o.threads = c.get_int("train.threads");
  o.out_dir = c.get_string("train.out_dir");
  o.overwrite = c.get_bool("train.overwrite");
  o.plugin = c.get_string("train.plugin");
  o.plugin_config = c.section_table("plugin");
  o.collective_timeout_s = c.get_float("train.collective_timeout_s");

  o.lora.spec.r = c.get_int("lora.r");
  o.lora.spec.alpha = c.get_float("lora.alpha");
  o.lora.spec.dropout = c.get_float("lora.dropout");
  o.lora.target_modules = c.get_string_list("lora.target_modules");
  o.save_merged = c.get_bool("lora.save_merged");

  o.eval_every = c.get_int("eval.every_steps");
  o.eval_max_batches = c.get_int("eval.max_batches");
  o.eval_batch_size = c.get_int("eval.batch_size");
  o.patience = c.get_int("eval.patience");

  o.checkpoint_every = c.get_int("checkpoint.every_steps");
  o.keep_last = c.get_int("checkpoint.keep_last");
  o.resume = c.get_string("checkpoint.resume");
  o.save_final = c.get_bool("checkpoint.save_final");
  o.keep_best = c.get_bool("checkpoint.keep_best");

  o.progress = c.get_string("log.progress");
  o.log_every = c.get_int("log.every_steps");
  o.metrics_file = c.get_string("log.metrics_file");
  o.trace_file = c.get_string("log.trace");
  o.max_new_tokens = c.get_int("generate.max_new_tokens");
  o.temperature = c.get_float("generate.temperature");
  o.top_p = c.get_float("generate.top_p");
  o.generate_seed = static_cast<uint64_t>(c.get_int("generate.seed"));
  if (o.metrics_file.empty()) o.metrics_file = o.out_dir + "/metrics.jsonl";
  return o;
}

}  // namespace weft

#include <filesystem>

#include "core/util/fs.h"

namespace weft {
void write_run_config(const std::string& out_dir, const Config& config) {
  std::filesystem::create_directories(out_dir);
  write_file_atomically(out_dir + "/config.toml", config.to_toml());
}
}  // namespace weft
