// A job: what every command that runs a model builds, and builds the same way (trainer train,
// eval, generate and check; trainer bench exports it): this process's place in the run, the
// strategy (a plugin, or the built-in single), the tokenizer, the model as the strategy places
// and shards it, with its weights, and optionally the data. Everything that can be wrong with the
// input is refused here, with one error naming it, before any compute.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "core/data/classification.h"
#include "core/data/dataset.h"
#include "core/data/tokenizer.h"
#include "core/dist/process_groups.h"
#include "core/model/memory_estimate.h"
#include "core/dist/rendezvous.h"
#include "core/job/options.h"
#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/plugin/strategy_session.h"

namespace weft {

struct RunContext {
  int rank = 0;
  int world = 1;
  DistributedEnv env;  // how to join the job when world > 1 (torchrun / Slurm / --nproc)
};

// The model's shape for a run: model.config, else the config.json beside model.weights, else
// model.preset; model.vocab_size overrides; special-token ids the shape lacks come from the
// tokenizer (null: none, for a plan made without it). A model.weights folder without config.json
// takes model.preset's shape, with a warning. Throws weft::Error naming the problem when there is
// no shape, the tokenizer has more tokens than the vocabulary, or data.seq_len exceeds the model's
// positions.
ModelConfig resolve_model_config(const TrainOptions& options, const Tokenizer* tokenizer);

// The dtype train.precision computes in: fp32, bf16 or fp16 (masters stay fp32).
torch::Dtype compute_dtype(const std::string& precision);

// Every rank's memory plan and whether the run fits the limit (train.memory_limit_gib).
struct MemoryVerdict {
  std::vector<MemoryPlan> ranks;       // by rank
  std::vector<int> machine;            // by rank: ranks with the same number share a machine
  int64_t runtime_bytes = 0;           // per process: LibTorch and the process itself
  int64_t limit_bytes = 0;             // per machine (CPU) or per device (CUDA)
  std::string limit_source;            // "train.memory_limit_gib" or what the default came from
  bool per_device = false;             // CUDA: each rank against its device
  bool fits = true;
  std::string problem;                 // one line when it does not fit
  std::vector<std::string> advice;     // when it does not fit: what would, or may ("--set ... fits (2.1 GiB)")
};

class Job {
 public:
  enum class Data {
    kNone,      // the model only (trainer generate)
    kSplits,    // data.path prepared as training prepares it: the train and held-out splits
    kPlanOnly,  // the memory plan only (trainer plan): no model, no data, no refusal over the limit;
                // the tokenizer, weights and text may be missing (missing_inputs())
  };
  // Joins the run (rendezvous, process groups), loads the strategy and checks that every rank
  // runs the same plugin build and configuration, then builds the tokenizer, the model and `data`.
  Job(TrainOptions options, RunContext context, Data data);
  ~Job();
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  const TrainOptions& options() const { return options_; }
  const RunContext& context() const { return context_; }
  Communicator& communicator() { return *communicator_; }
  StrategySession& strategy() { return *strategy_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  LlamaForCausalLMImpl& model() { return *model_; }
  const Placement& placement() const { return placement_; }
  // Where this rank computes (train.device resolved: cpu, or cuda:LOCAL_RANK).
  const torch::Device& device() const { return device_; }
  // The trainable parameters, in the model's order (gradients defined from the start).
  const std::vector<torch::Tensor>& trainable() const { return trainable_; }
  // The LoRA adapters the model carries (model.adapter's, or new ones with train.mode = lora).
  const std::optional<LoraConfig>& lora() const { return lora_; }
  // Prompt tuning (train.mode = "prompt_tuning", or model.adapter a PROMPT_TUNING adapter): its
  // virtual tokens; unset otherwise.
  const std::optional<PromptTuningConfig>& prompt_tuning() const { return prompt_; }
  // Positions of a sequence as the model and the strategy see them: data.seq_len, and the virtual
  // tokens before it under prompt tuning.
  int64_t model_seq_len() const { return options_.data.seq_len + (prompt_ ? prompt_->num_virtual_tokens : 0); }
  // How the frozen base's linear weights are stored (model.quantize).
  QuantFormat quantize() const { return quantize_; }
  // Data::kSplits: the splits (held-out null when data.heldout_fraction = 0).
  const DatasetSplits& data() const { return data_; }
  // train.task = "classification" (with Data::kSplits or kPlanOnly): the labeled data, its classes
  // and its further held-out sets; null for causal language modelling.
  const ClassificationData* classification() const { return classification_ ? &*classification_ : nullptr; }
  // The memory plan of every rank (index: rank), made before the model was built.
  const MemoryVerdict& memory() const { return memory_; }
  // Data::kPlanOnly: the inputs the run would read that do not exist here ("data.tokenizer = '...'"),
  // which the plan does without (it needs the shapes only).
  const std::vector<std::string>& missing_inputs() const { return missing_inputs_; }
  // Where the model's weights came from: "<model.weights>" (and ", adapter <model.adapter>"), or
  // "random init (seed S)" when model.weights names none. Logged when the model is built.
  const std::string& weights_source() const { return weights_source_; }
  // Whether the base weights are a seeded random initialisation (no model.weights).
  bool random_weights() const { return options_.model.weights.empty(); }
  // Warns that `command` (eval, generate) runs on random weights, when it does: its numbers are
  // chance's, not a model's.
  void warn_if_random_weights(const std::string& command) const;

 private:
  void join();
  void describe_nodes() const;
  void build_model();
  // The settings a memory plan depends on that the host controls.
  struct PlanSettings {
    std::optional<LoraConfig> lora;
    bool checkpointing = false;
    int64_t rows = 1;           // per micro-batch on this rank
    int32_t micro_batches = 1;  // train.grad_accum_steps
  };
  void plan_memory(const ModelConfig& config, torch::Dtype dtype);
  // Every stage's memory as the host estimates it for `settings` (memory_estimate.h), prompt tuning's included.
  std::vector<StageMemory> stage_estimate(const ModelConfig& config, torch::Dtype dtype, const PlanSettings& settings) const;
  MemoryPlan rank_plan(const ModelConfig& config, torch::Dtype dtype, const PlanSettings& settings);
  std::vector<MemoryPlan> gather_plans(const MemoryPlan& mine);
  bool counted_here(int rank) const;
  int64_t bytes_needed_here(const std::vector<MemoryPlan>& plans) const;
  bool fits_everywhere(int64_t need);
  void advise(const ModelConfig& config, torch::Dtype dtype, const PlanSettings& run, const MemoryPlan& mine);

  TrainOptions options_;
  RunContext context_;
  std::unique_ptr<Communicator> communicator_;
  std::unique_ptr<StrategySession> strategy_;
  std::unique_ptr<Tokenizer> tokenizer_;
  LlamaForCausalLM model_{nullptr};
  Placement placement_;
  torch::Device device_ = torch::kCPU;
  bool nccl_ = false;  // NCCL groups for CUDA tensors
  std::vector<torch::Tensor> trainable_;
  std::optional<LoraConfig> lora_;
  std::optional<PromptTuningConfig> prompt_;
  QuantFormat quantize_ = QuantFormat::kNone;
  DatasetSplits data_;
  std::optional<ClassificationData> classification_;
  std::vector<std::string> missing_inputs_;
  ShardMap shards_;  // this rank's tensor-parallel slices (for the memory plan)
  MemoryVerdict memory_;
  bool plan_only_ = false;
  std::string weights_source_;
};

}  // namespace weft
