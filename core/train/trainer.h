// The single-process training loop of the host: builds the model, data and optimizer from
// TrainOptions, validates everything before compute starts, then trains with evaluation,
// early stopping, checkpoints and metrics.
//
// The loop is shaped for strategies: a step is `accumulate micro-batches -> clip -> AdamW`,
// the data loader already takes (rank, world), and the model runs any range of stages.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "core/data/loader.h"
#include "core/data/tokenizer.h"
#include "core/model/llama.h"
#include "core/plugin/process_groups.h"
#include "core/plugin/rendezvous.h"
#include "core/plugin/strategy_session.h"
#include "core/train/model_gather.h"
#include "core/train/checkpoint.h"
#include "core/train/metrics.h"
#include "core/train/options.h"
#include "core/train/schedule.h"

namespace weft {

struct RunContext {
  int rank = 0;
  int world = 1;
  DistributedEnv env;  // how to join the job when world > 1 (torchrun / Slurm / --nproc)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated after the prompt (stop token excluded)
  std::string text;             // their decoding
  int64_t prompt_tokens = 0;
  double seconds = 0;           // prompt processing and generation
  double first_token_seconds = 0;  // prompt processing and the first new token
  // This rank's communication through the plugin during generation (tensor parallelism's
  // all-reduces): operations, bytes, and seconds spent waiting for them to complete.
  int64_t comm_operations = 0, comm_bytes = 0;
  double comm_wait_seconds = 0;
};

struct EvalResult {
  double loss = 0;        // token-weighted mean cross-entropy over the held-out batches used
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;
  double seconds = 0;
};

struct TrainResult {
  int64_t steps = 0;                   // optimizer steps completed (including before a resume)
  int64_t epochs_completed = 0;
  std::vector<double> step_losses;     // losses of the steps run by this process
  std::vector<double> epoch_seconds;   // wall time of each completed epoch
  double tokens_per_second = 0;        // over the steps run by this process
  std::optional<EvalResult> final_eval;
  double best_eval_loss = 0;
  bool early_stopped = false;
  bool interrupted = false;            // stopped by SIGINT/SIGTERM (after saving a checkpoint if it could)
  int interrupt_signal = 0;            // that signal (the same on every rank)
  double peak_rss_mib = 0;
};

// The model's shape for a run: model.config, else the config.json beside model.weights, else
// model.preset; model.vocab_size overrides. Throws weft::Error naming the problem when there is
// no shape, the tokenizer has more tokens than the vocabulary, or data.seq_len exceeds the
// model's positions.
ModelConfig resolve_model_config(const TrainOptions& options, const Tokenizer& tokenizer);

class Trainer {
 public:
  // Everything that can be wrong with the input (tokenizer, model config, weights, data,
  // batch sizes, resume checkpoint) is checked here, before any training compute.
  explicit Trainer(TrainOptions options, RunContext context = {});
  ~Trainer();

  // Trains until epochs/max_steps are done, early stopping triggers, or SIGINT/SIGTERM arrives
  // (then a checkpoint is saved first; see core/train/interrupt.h). The signal handlers are
  // installed here: before training (joining the job, loading) a signal ends the process at once.
  TrainResult run();
  // Continues `prompt` with the model (built with options.inference_only): up to
  // generate.max_new_tokens tokens, greedy or sampled, stopping at the tokenizer's end token.
  // Collective under a plugin: every rank runs it and gets the same tokens.
  GenerateResult generate(const std::string& prompt);
  EvalResult evaluate();

  LlamaForCausalLMImpl& model() { return *model_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const DatasetSummary& dataset_summary() const { return dataset_.summary; }
  // The loaded strategy plugin, if train.plugin is set.
  const StrategySession* strategy() const { return strategy_.get(); }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t total_steps() const { return total_steps_; }

 private:
  ModelConfig resolve_model_config() const;
  void build_model();
  void build_data();
  void build_optimizer();
  ShardMap ask_shards(const ModelConfig& config, int64_t first_stage, int64_t last_stage);
  void start_strategy();
  void maybe_resume();
  void protect_saved_work() const;
  struct Session;
  bool run_epoch_steps(Session& session);
  int agreed_interrupt();
  bool complete_epoch(Session& session);
  bool evaluate_and_track(Session& session);
  TrainResult finish_run(Session& session);
  double train_step(int64_t epoch, int64_t step_in_epoch);
  bool after_eval(const EvalResult& eval, Progress& progress, MetricsWriter& metrics);
  // Saves a checkpoint (rank 0 writes it); false when the plugin's split state cannot be saved.
  bool save_checkpoint(Progress& progress);
  // The whole model to save, on rank 0 (nullptr elsewhere); collective when stages are split.
  LlamaForCausalLMImpl* model_to_save();
  std::optional<LoraConfig> lora() const;

  TrainOptions options_;
  RunContext context_;
  std::unique_ptr<Communicator> communicator_;  // set when a strategy plugin runs
  std::unique_ptr<StrategySession> strategy_;
  std::unique_ptr<ModelGather> gather_;  // set when a strategy plugin runs
  std::unique_ptr<Tokenizer> tokenizer_;
  LlamaForCausalLM model_{nullptr};
  std::vector<torch::Tensor> trainable_;
  DatasetSplits dataset_;
  std::unique_ptr<BatchLoader> train_loader_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  LrSchedule schedule_;
  TrainerState state_;
  int64_t steps_per_epoch_ = 0;
  int data_parallel_rank_ = 0, data_parallel_size_ = 1;  // from the plugin's plan
  int64_t total_steps_ = 0;
  double last_lr_ = 0;
  double last_grad_norm_ = 0;
  int interrupt_ = 0;  // the signal every rank agreed to stop on, or 0
};

}  // namespace weft
