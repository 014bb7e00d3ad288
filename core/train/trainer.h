// The training loop: epochs of optimizer steps through the job's strategy, held-out evaluation,
// early stopping, checkpoints and the run's records. Everything it trains (the job: ranks,
// strategy, tokenizer, model, data) is built by Job, the same way for every command.
//
// A step is: the strategy's forward and backward passes over the step's micro-batches -> clip
// the global gradient norm -> AdamW. With no plugin the strategy is the built-in single. Under
// fp16 the backward runs on the scaled loss and a step with non-finite gradients is skipped
// (core/train/loss_scaler.h).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "core/data/loader.h"
#include "core/dist/link_counter.h"
#include "core/util/torch_profiler.h"
#include "core/job/evaluate.h"
#include "core/job/job.h"
#include "core/model/adalora.h"
#include "core/io/checkpoint_backup.h"
#include "core/train/checkpoint.h"
#include "core/train/loss_scaler.h"
#include "core/train/model_gather.h"
#include "core/train/optimizer.h"
#include "core/train/records.h"
#include "core/train/schedule.h"

namespace weft {

class Trainer {
 public:
  // Builds the job and the training state. Everything that can be wrong with the input
  // (tokenizer, model config, weights, data, batch sizes, resume checkpoint) is checked here,
  // before any training compute.
  explicit Trainer(TrainOptions options, RunContext context = {});
  ~Trainer();

  // Trains until epochs/max_steps are done, early stopping triggers, or SIGINT/SIGTERM arrives
  // (then a checkpoint is saved first; see core/train/interrupt.h). The signal handlers are
  // installed here: before training (joining the job, loading) a signal ends the process at once.
  TrainResult run();
  // The held-out split's loss (the whole split, or eval.max_batches batches).
  EvalResult evaluate();
  std::string describe_eval(const EvalResult& eval) const;

  Job& job() { return *job_; }
  LlamaForCausalLMImpl& model() { return job_->model(); }
  // Copies (on the CPU) of the whole model's parameters as a save would write them: gathered from
  // the ranks that split the model, made whole where a plugin releases them between steps. On
  // rank 0; empty elsewhere. Collective.
  std::map<std::string, torch::Tensor> whole_parameters();
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t total_steps() const { return total_steps_; }

 private:
  void maybe_resume();
  std::optional<std::string> restore_from_backup();  // collective
  void protect_saved_work() const;
  bool run_epoch_steps(RunRecords& records);
  bool periodic_eval_due() const;
  bool complete_epoch(RunRecords& records);
  bool evaluate_and_track(RunRecords& records);
  StepReport train_step(int64_t epoch, int64_t step_in_epoch);
  // Saves a checkpoint (rank 0 writes it); false when the plugin's split state cannot be saved.
  bool save_checkpoint(Progress& progress);
  // The whole model to save, on rank 0 (nullptr elsewhere); collective when the model is split.
  void with_whole_model(const std::function<void(LlamaForCausalLMImpl&)>& use);  // collective
  int agreed_interrupt();
  void profile_around_step(bool last = false);
  void save_models(RunRecords& records);
  RunSetting run_setting();  // collective (LoRA: the adapters' count)

  TrainOptions options_;
  std::unique_ptr<Job> job_;
  std::unique_ptr<ModelGather> gather_;
  std::unique_ptr<BatchLoader> train_loader_;
  std::optional<LinkCounter> link_;  // rank 0 of a job across nodes: its node's link, per step
  int64_t tensor_peak_bytes_ = 0;  // the run's peak of tracked tensor memory (before each step's reset)
  std::vector<OptimizedTensor> optimized_;  // what optimizer_ updates (parameters or their shards)
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<CheckpointStore> checkpoints_;
  std::unique_ptr<CheckpointBackup> backup_;  // backup.url set: rank 0's uploader
  std::unique_ptr<RankAllocator> allocator_;  // train.mode = adalora: the adapters' rank budget
  LrSchedule schedule_;
  TrainerState state_;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
  double last_lr_ = 0;
  double last_grad_norm_ = 0;
  LossScaler scaler_;  // fp16's dynamic loss scaling (disabled otherwise)
  TorchProfiler profiler_;  // log.torch_profile
  double last_loss_scale_ = 1;
  bool last_step_skipped_ = false;
  int interrupt_ = 0;  // the signal every rank agreed to stop on, or 0
  int64_t last_eval_step_ = -1;
  std::optional<EvalResult> last_eval_;
};

}  // namespace weft
