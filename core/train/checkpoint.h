// Training checkpoints: everything needed to continue a run exactly where it stopped.
//
// Layout under <out_dir>/checkpoints/:
//   step-00000120/             one checkpoint (written as .tmp-..., then renamed: atomic)
//     config.json, model.safetensors          full fine-tuning (an HF model directory)
//     adapter_config.json, adapter_model.safetensors   LoRA (the base is re-created from its source)
//     optimizer.pt             AdamW state (LibTorch archive)
//     rng.pt                   the CPU generator state
//     trainer_state.json       step, data position, early-stopping state, data identity
//   latest                     name of the newest complete checkpoint (replaced atomically)
// A crash while saving leaves a .tmp directory that is ignored, and removed when the next run
// starts (remove_leftovers). A save that fails (a full disk) removes its .tmp directory and
// throws: the previous checkpoint and `latest` stay as they were. Old checkpoints are deleted by
// renaming them to .tmp-... first, so none is ever seen half-deleted.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include "core/model/llama.h"
#include "core/model/lora.h"

namespace weft {

struct TrainerState {
  int64_t global_step = 0;     // optimizer steps completed
  int64_t epoch = 0;           // epoch of the next step (0-based)
  int64_t step_in_epoch = 0;   // index of the next step within its epoch
  double best_eval_loss = std::numeric_limits<double>::infinity();
  int64_t best_step = -1;
  int64_t evals_since_best = 0;
  double epoch_seconds = 0;    // time already spent in the current epoch
  int64_t epoch_tokens = 0;    // tokens already processed in the current epoch
  std::string data_identity;   // train sequences / seq_len / tokens: must match on resume
  bool early_stopped = false;
  double loss_scale = 0;          // fp16: the dynamic loss scale to go on with (0: none saved)
  int64_t loss_scale_streak = 0;  // fp16: finite steps since the scale last changed

  nlohmann::json to_json() const;
  static TrainerState from_json(const nlohmann::json& j, const std::string& origin);
  // A checkpoint's state is untrusted input: throws weft::Error naming `origin` unless every value
  // is in range and the position is one a run with `steps_per_epoch` steps per epoch and `epochs`
  // epochs can be at (global_step = epoch * steps_per_epoch + step_in_epoch).
  void validate(int64_t steps_per_epoch, int64_t epochs, const std::string& origin) const;
};

class CheckpointStore {
 public:
  // lora: set when training adapters only (the checkpoint then holds just the adapters).
  CheckpointStore(std::string out_dir, int64_t keep_last, std::optional<LoraConfig> lora);

  // Writes a checkpoint for state.global_step atomically, points `latest` at it, then prunes
  // all but the newest keep_last. Returns the checkpoint directory.
  std::string save(const TrainerState& state, LlamaForCausalLMImpl& model, torch::optim::Optimizer& optimizer);

  // The directory `latest` names, if any.
  std::optional<std::string> latest() const;

  // The trainer state saved in `dir` (its trainer_state.json). Throws weft::Error naming the file
  // when it is missing or malformed.
  TrainerState read_state(const std::string& dir) const;
  // Restores model weights (or adapters), optimizer and RNG state from `dir`. Throws weft::Error
  // naming the file when something is missing or malformed.
  void restore(const std::string& dir, LlamaForCausalLMImpl& model, torch::optim::Optimizer& optimizer) const;

  // Removes what an interrupted save or deletion left in the run directory (.tmp folders and
  // files) and puts back a model directory that a crash left renamed aside (best, final, a
  // checkpoint). Call on one rank, before the run saves anything.
  void remove_leftovers() const;

  std::string checkpoints_dir() const { return out_dir_ + "/checkpoints"; }

 private:
  void prune() const;

  std::string out_dir_;
  int64_t keep_last_;
  std::optional<LoraConfig> lora_;
};

// Saves a model for use elsewhere: an HF model directory (full) or a PEFT adapter (LoRA),
// replacing `dir` atomically (written beside it, then swapped in).
void save_model_atomically(LlamaForCausalLMImpl& model, const std::optional<LoraConfig>& lora,
                           const std::string& dir, const std::string& base_model);

}  // namespace weft
