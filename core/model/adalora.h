// AdaLoRA (Zhang et al., "Adaptive Budget Allocation for Parameter-Efficient Fine-Tuning", ICLR
// 2023) as PEFT implements it (peft.tuners.adalora, 0.21): SVD-form adapters P Lambda Q on the
// targeted linear layers (LinearImpl::add_adalora), a rank allocator that scores every triplet
// (P row, Lambda entry, Q column) by smoothed sensitivity x uncertainty and masks the lowest to a
// budget falling from init_r to target_r per layer on a cubic schedule, the orthogonal
// regularisation of P and Q, and PEFT's adapter files (peft_type ADALORA, rank_pattern, tensors
// truncated to the kept triplets).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

#include "core/model/llama.h"

namespace weft {

struct AdaLoraConfig {
  LoraSpec spec;                  // spec.r = init_r (the rank every layer starts at), alpha, dropout
  std::vector<std::string> target_modules{"q_proj", "k_proj", "v_proj", "o_proj"};
  int64_t target_r = 8;           // the average rank per layer the budget falls to
  int64_t tinit = 0;              // steps of warm-up at the full budget
  int64_t tfinal = 0;             // steps at the final budget, its pattern fixed
  int64_t delta_t = 1;            // steps between two reallocations (PEFT's deltaT)
  double beta1 = 0.85;            // EMA of the sensitivity
  double beta2 = 0.85;            // EMA of its uncertainty
  double orth_reg_weight = 0.5;   // weight of the orthogonal regularisation in the loss
  int64_t total_step = 0;         // the run's optimizer steps (the schedule's length)
};

// Which triplets of each adapted layer are kept: layer name ("model.layers.0.self_attn.q_proj")
// -> one flag per triplet (init_r of them). Layers absent keep all.
using RankPattern = std::map<std::string, std::vector<bool>>;

// Adds AdaLoRA adapters of rank config.spec.r to every linear layer named in target_modules and
// freezes everything else; P and Q of each layer are seeded by (seed, layer name). Returns the
// number of adapted layers; unknown targets are errors. On a model split by tensor parallelism
// the adapters follow their layer's split (LinearImpl::add_adalora).
int64_t apply_adalora(LlamaForCausalLMImpl& model, const AdaLoraConfig& config, uint64_t seed);

// PEFT's orthogonal regularisation: the mean over the adapted layers' P and Q of
// ||P P^T - I||_F and ||Q^T Q - I||_F (differentiable; to be added to the loss times
// orth_reg_weight). Zero for a model without AdaLoRA adapters. On a tensor-parallel model the
// Gram matrix of a split factor is summed over its slices through the model's comm hook
// (sum_over_slices): collective over the processes holding them, and each gets the gradient of
// its own slice.
torch::Tensor adalora_orthogonal_regularization(LlamaForCausalLMImpl& model);

// Whether the model has AdaLoRA adapters.
bool has_adalora(LlamaForCausalLMImpl& model);

// Zeroes Lambda of every masked triplet of `pattern` and records the pattern in the layers.
void apply_rank_pattern(LlamaForCausalLMImpl& model, const RankPattern& pattern);

// The pattern the layers record (the last reallocation's); layers without one are absent.
RankPattern rank_pattern_of(LlamaForCausalLMImpl& model);

// Writes PEFT's adapter_config.json (peft_type ADALORA, init_r, target_r, ..., rank_pattern keyed
// "<layer>.lora_E") and adapter_model.safetensors ("base_model.model.<layer>.lora_A" [kept, in],
// ".lora_E" [kept, 1], ".lora_B" [out, kept]: only the kept triplets of `pattern`, as PEFT saves
// them; between two reallocations a masked triplet's Lambda may have moved again, and the file
// drops it, as PEFT's does).
void save_adalora_adapter(LlamaForCausalLMImpl& model, const AdaLoraConfig& config, const RankPattern& pattern,
                          const std::string& dir, const std::string& base_model = "");

// The adapter's settings and rank pattern from dir/adapter_config.json (PEFT's, peft_type ADALORA).
// Throws weft::Error naming the file when it is missing, malformed or another kind of adapter.
AdaLoraConfig read_adalora_adapter_config(const std::string& dir, RankPattern* pattern = nullptr);

// Loads an adapter saved by save_adalora_adapter or PEFT into a model with matching AdaLoRA
// adapters (apply_adalora with the file's config): the kept triplets get the file's values, the
// masked ones zeros (Lambda 0: they add nothing, as in PEFT's resized modules).
void load_adalora_adapter(LlamaForCausalLMImpl& model, const std::string& dir);

// The peft_type of dir/adapter_config.json ("LORA" where the field is absent).
std::string adapter_peft_type(const std::string& dir);

// PEFT's RankAllocator and AdaLoraModel.update_and_allocate. Call update_and_allocate(step) after
// the optimizer step of every (0-based) step, while the adapters' gradients are still there.
class RankAllocator {
 public:
  RankAllocator(LlamaForCausalLMImpl& model, AdaLoraConfig config);

  struct Budget {
    int64_t budget;  // triplets kept over all layers
    bool mask;       // whether this step reallocates
  };
  // The paper's cubic schedule: init_r * layers up to tinit, target_r * layers after
  // total_step - tfinal, and between them target + (init - target) (1 - (step - tinit) /
  // (total_step - tfinal - tinit))^3 (rounded down), reallocating every delta_t steps.
  Budget budget_schedule(int64_t step) const;

  // Before total_step - tfinal: updates the importance EMAs from the gradients and, on the
  // schedule's reallocation steps, masks the least important triplets to the budget; at
  // total_step - tfinal: masks to the final budget and fixes the pattern; after: re-applies it.
  // On a tensor-parallel model, collective over the processes holding the layers' slices (the
  // scores of split factors are summed over them), so all mask the same triplets.
  void update_and_allocate(int64_t step);

  const RankPattern& rank_pattern() const { return pattern_; }
  int64_t initial_budget() const { return initial_budget_; }
  int64_t target_budget() const { return target_budget_; }
  const AdaLoraConfig& config() const { return config_; }

  // Kept triplets per layer (the current pattern; init_r where none is set yet).
  std::map<std::string, int64_t> ranks() const;

  // The state a resume needs, as named tensors: the EMAs per adapter parameter, the pattern, and
  // every adapter parameter whole (the masked triplets' too, which the adapter files drop). And
  // back: load_state also sets the parameters and the layers' pattern.
  std::vector<std::pair<std::string, torch::Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, torch::Tensor>>& state);
  // The adapter parameter whose split a state tensor of state() shares (an EMA or a parameter's
  // values: "<layer>.lora_A" ...), or "" for one every process holds whole and alike (the rank
  // pattern); nullopt for a name state() never gives. A checkpoint of a split model stores the
  // state in pieces like the parameters'.
  static std::optional<std::string> state_parameter(const std::string& name);

 private:
  void update_importance();
  RankPattern mask_to_budget(int64_t budget);

  LlamaForCausalLMImpl& model_;
  AdaLoraConfig config_;
  std::vector<std::pair<std::string, LinearImpl*>> layers_;  // adapted layers, by name
  int64_t initial_budget_ = 0, target_budget_ = 0;
  std::map<std::string, torch::Tensor> exp_avg_ipt_, exp_avg_unc_;  // "<layer>.lora_A" etc.
  RankPattern pattern_;
};

}  // namespace weft
