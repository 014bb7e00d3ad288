// Training checkpoints: everything needed to continue a run exactly where it stopped.
//
// Layout under <out_dir>/checkpoints/:
//   step-00000120/             one checkpoint (written as .tmp-..., then renamed: atomic)
//     config.json, model.safetensors          full fine-tuning (an HF model directory)
//     adapter_config.json, adapter_model.safetensors   LoRA (the base is re-created from its source)
//     optimizer.safetensors    AdamW's moments by parameter name (core/train/named_state.h)
//     shards/                  instead of the model and optimizer files, when a plugin splits the
//                              model over ranks (slices, pipeline stages): every rank's
//                              pieces, written in parallel, and index.json (named_state.h)
//     rng.pt                   the CPU generator state
//     local/                   where a strategy keeps parameters each rank's own (ABI 2's LOCAL
//                              placements, e.g. local SGD's workers): every rank's values, AdamW moments
//                              and generators of them (rank-<r>.safetensors, rank-<r>.generators.pt)
//                              and index.json {"world_size": W, "parameters": [...]}; the model
//                              and optimizer files hold rank 0's
//     trainer_state.json       step, data position, early-stopping state, data identity
//   latest                     name of the newest complete checkpoint (replaced atomically)
// Both layouts resume under any plugin and world size: the reader puts each tensor together and
// cuts out the part a rank holds. (Checkpoints written before optimizer.safetensors have
// optimizer.pt, a LibTorch archive, which resumes where every rank holds the whole model.)
// A crash while saving leaves a .tmp directory that is ignored, and removed when the next run
// starts (remove_leftovers). A save that fails (a full disk) removes its .tmp directory and
// throws: the previous checkpoint and `latest` stay as they were. Old checkpoints are deleted by
// renaming them to .tmp-... first, so none is ever seen half-deleted.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/optim/adamw.h>

#include "core/io/safetensors.h"
#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/train/trainer_state.h"

namespace weft {

class CheckpointStore {
 public:
  // lora: set when training adapters only (the checkpoint then holds just the adapters).
  CheckpointStore(std::string out_dir, int64_t keep_last, std::optional<LoraConfig> lora);

  // Writes a checkpoint for state.global_step atomically, points `latest` at it, then prunes
  // all but the newest keep_last. Returns the checkpoint directory. `model` holds every parameter
  // whole; called on one rank.
  // `local`: a folder save_local filled, moved into the checkpoint as local/ before it is published.
  std::string save(const TrainerState& state, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                   const std::string& local = "");

  // Parameters each rank holds as its own (`parameters`, by name): called on every rank of a world
  // of `world_size` before rank 0's save(), it writes this rank's values, AdamW moments and
  // generators of them into a staged folder of the step's (rank 0 adds index.json) and returns the
  // folder. Throws weft::Error on I/O failure; the caller agrees over the ranks before save().
  std::string save_local(const TrainerState& state, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                         const std::vector<std::string>& parameters, int32_t rank, int32_t world_size) const;
  // After restore(): this rank's own values, moments and generators of `parameters` from the
  // checkpoint's local/ where it was saved by as many ranks with the same parameters. Otherwise
  // every rank keeps rank 0's (what restore() gave) and the returned text says why ("" when the
  // checkpoint's own were restored or `parameters` is empty).
  std::string restore_local(const std::string& dir, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                            const std::vector<std::string>& parameters, int32_t rank, int32_t world_size) const;
  // When a rank could not write its own state (`cause`, or another rank's failure): removes the
  // staged folder of the step (every rank may call it) and throws the one error a failed save
  // gives, naming the step, the cause and the checkpoint that is still the latest.
  [[noreturn]] void abandon_local(int64_t step, const std::string& cause) const;

  // The same for a model split over ranks, called on every rank: each writes the pieces for which
  // `writes(name)` holds to shards/rank-<r>.safetensors in one staged folder, then rank 0 checks
  // and indexes them and publishes the checkpoint. `all_ok(ok)` is collective over the world and
  // returns whether every rank passed true: a failure on any rank (a full disk) leaves no
  // checkpoint and throws on every rank. Returns the checkpoint directory.
  std::string save_sharded(const TrainerState& state, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                           int32_t rank, int32_t world_size, const std::function<bool(const std::string&)>& writes,
                           const std::function<bool(bool)>& all_ok);

  // The directory `latest` names, if any.
  std::optional<std::string> latest() const;

  // The trainer state saved in `dir` (its trainer_state.json). Throws weft::Error naming the file
  // when it is missing or malformed.
  TrainerState read_state(const std::string& dir) const;
  // Restores model weights (or adapters), optimizer and RNG state from `dir` into this rank's
  // model, whatever its layout (whole, tensor-parallel slices, pipeline stages) and whichever
  // layout saved it. The RNG state (dropout's) is this rank's own where the checkpoint was saved in
  // pieces by as many ranks (each rank's generators, CPU and CUDA, are in shards/), else rank 0's
  // (a whole checkpoint's rng-generators.pt: CPU and CUDA; else its rng.pt: CPU). Throws weft::Error naming the file when something is missing or malformed.
  void restore(const std::string& dir, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer, int32_t rank = 0,
               int32_t world_size = 1) const;

  // Removes what an interrupted save or deletion left in the run directory (.tmp folders and
  // files) and puts back a model directory that a crash left renamed aside (best, final, a
  // checkpoint). Call on one rank, before the run saves anything.
  void remove_leftovers() const;

  std::string checkpoints_dir() const { return out_dir_ + "/checkpoints"; }

  // Training state beyond the model, the optimizer and the trainer's counters that every
  // checkpoint written by save() carries as its own safetensors file `file` (AdaLoRA's rank
  // allocator): `collect` gives it at each save, `restore` takes it back, and a checkpoint
  // without the file is refused by name. `follows(name)` says which parameter a tensor of the
  // state is split like ("" for one every rank holds whole and alike; nullopt for a name not of
  // this state): then save_sharded writes the state as pieces of the rank files, like the
  // parameters', and restore gives this rank's part of it from either layout. Without
  // `follows`, save_sharded refuses the state.
  // `optional`: a checkpoint without the file (or, in pieces, without its tensors) restores
  // nothing of it instead of being refused.
  using StateFollows = std::function<std::optional<std::string>(const std::string&)>;
  void add_state_file(std::string file, std::function<NamedTensors()> collect,
                      std::function<void(const NamedTensors&)> restore, StateFollows follows = nullptr,
                      bool optional = false);

 private:
  struct StateFile {
    std::string file;
    std::function<NamedTensors()> collect;
    std::function<void(const NamedTensors&)> restore;
    StateFollows follows;
    bool optional = false;
  };

  void prune() const;
  void publish(const std::string& staged, const std::string& name, const TrainerState& state) const;
  [[noreturn]] void fail_save(const std::string& staged, int64_t step, const std::string& cause) const;

  std::string out_dir_;
  int64_t keep_last_;
  std::optional<LoraConfig> lora_;
  std::vector<StateFile> state_files_;
};

// Saves a model for use elsewhere: an HF model directory (full) or a PEFT adapter (LoRA),
// replacing `dir` atomically (written beside it, then swapped in).
void save_model_atomically(LlamaForCausalLMImpl& model, const std::optional<LoraConfig>& lora,
                           const std::string& dir, const std::string& base_model);

}  // namespace weft
