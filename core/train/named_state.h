// A checkpoint's training state by parameter name, so that a run under any layout of the model over
// ranks saves it and a run under any other layout resumes it (resharding at load).
//
// Two layouts of the same content, both inside one checkpoint directory (core/train/checkpoint.h):
//  - whole (single, ddp, zero, context_parallel: some rank holds every parameter whole): the model
//    as an HF directory or a PEFT adapter, and AdamW's moments in optimizer.safetensors:
//    "<parameter>.exp_avg" and "<parameter>.exp_avg_sq" (fp32, the parameter's shape), with
//    metadata "weft.steps" = {"<parameter>": step count} (JSON text). Readable by anything that
//    reads safetensors.
//  - sharded (tensor_parallel slices, pipeline stages): every rank writes, in parallel, the pieces
//    it is the first holder of to shards/rank-<r>.safetensors: "<parameter>" (the model's values)
//    and its two moments, with metadata "weft.pieces" = {"<tensor>": {"shape": [whole shape],
//    "dim": d, "start": s}} (the piece is [s, s + its size) along d of the whole tensor) and
//    "weft.steps" as above. Rank 0 writes shards/index.json last, once every rank's file is
//    complete and every tensor is covered exactly once: {"format": "weft-shards", "version": 1,
//    "world_size": W, "files": [...], "tensors": {"<tensor>": ["<file>", ...]}}.
// A reader puts each whole tensor together from its pieces (one tensor at a time) and cuts out the
// slice that this rank holds (shard_of), so the saving and the resuming layouts are independent.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/optim/adamw.h>

#include "core/model/llama.h"

namespace weft {

class SafetensorsFile;

// The names the format uses (shared by the reader and the writers).
namespace named_state_format {
inline constexpr const char* kPieces = "weft.pieces";  // safetensors metadata: where each piece sits
inline constexpr const char* kSteps = "weft.steps";    // safetensors metadata: AdamW step counts
inline constexpr const char* kIndex = "index.json";    // shards/index.json
std::string rank_file(int32_t rank);                   // "rank-00003.safetensors"
}  // namespace named_state_format

// The parameters a checkpoint holds for `model`: every parameter (full fine-tuning), or the LoRA
// adapters only (`lora`: the base is re-created from its source at resume).
std::vector<std::pair<std::string, torch::Tensor>> checkpoint_parameters(LlamaForCausalLMImpl& model, bool lora);

// Writes `path` (optimizer.safetensors) from `optimizer`'s state of `model`'s trainable
// parameters, which must be whole. Parameters the optimizer has not stepped yet are left out.
void save_optimizer_state(const std::string& path, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer);

// Parameters `parameters` (by name) of `model` whole, with their AdamW moments and step counts
// (metadata "weft.steps"), to `path`: a rank's own state of parameters placed LOCAL. And back:
// restore_local_state throws weft::Error naming the file and the tensor that is missing or of
// another shape.
void save_local_state(const std::string& path, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                      const std::vector<std::string>& parameters);
void restore_local_state(const std::string& path, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                         const std::vector<std::string>& parameters);

// A tensor of training state beyond the optimizer's (AdaLoRA's EMAs) split like parameter
// `parameter` of the model, or held whole and alike by every rank where `parameter` is empty.
struct StatePiece {
  std::string name;
  torch::Tensor tensor;
  std::string parameter;
};

// Writes this rank's pieces to <dir>/rank-<rank>.safetensors: the parameters (and their moments)
// for which `writes(name)` holds, as this rank holds them (a tensor-parallel slice: the whole
// shape and offset from shard_of), and the `extra` pieces whose parameter it writes (the whole
// ones on rank 0). Throws weft::Error on I/O failure.
void save_rank_shard(const std::string& dir, int32_t rank, LlamaForCausalLMImpl& model,
                     torch::optim::AdamW& optimizer, bool lora, const std::function<bool(const std::string&)>& writes,
                     const std::vector<StatePiece>& extra = {});

// After every rank's save_rank_shard: checks that every tensor the files hold is covered exactly
// once by its pieces, then writes <dir>/index.json atomically. Throws weft::Error naming the
// tensor otherwise.
void write_shard_index(const std::string& dir, int32_t world_size);

// The tensors of a checkpoint by name, whole, from either layout. Every file is untrusted: a
// malformed index, metadata or piece is a weft::Error naming the file.
class NamedState {
 public:
  // `dir`: a checkpoint directory. Sharded when it has shards/index.json; otherwise the moments
  // come from optimizer.safetensors (the model is then read by load_weights / load_lora_adapter).
  static NamedState open(const std::string& dir);

  bool sharded() const { return sharded_; }
  // Whether the checkpoint has optimizer moments (a whole one written before optimizer.safetensors
  // has optimizer.pt instead: the caller reads that).
  bool has_moments() const { return sharded_ || optimizer_ != nullptr; }
  // The whole tensor `name` ("<parameter>", "<parameter>.exp_avg", ...), or nullopt when the
  // checkpoint does not hold it.
  std::optional<at::Tensor> whole(const std::string& name) const;
  // The tensors a sharded checkpoint holds in pieces (empty for the whole layout).
  std::vector<std::string> names() const;
  // AdamW's step count for `parameter`, or nullopt when it was not stepped.
  std::optional<int64_t> step(const std::string& parameter) const;

  // Copies this rank's part of every parameter of `model` (checkpoint_parameters) out of a sharded
  // checkpoint. Throws weft::Error naming a parameter that is missing or of another shape.
  void restore_parameters(LlamaForCausalLMImpl& model, bool lora) const;
  // Puts this rank's part of the saved moments of every parameter of `model` into `optimizer`
  // (keyed by the parameter tensors, as the optimizer steps them).
  void restore_optimizer(LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer) const;
  // This rank's part of tensor `name` of a sharded checkpoint, split as `model`'s parameter
  // `parameter` is (and of its shape), or the whole tensor where `parameter` is empty.
  at::Tensor part_like(LlamaForCausalLMImpl& model, const std::string& parameter, const std::string& name) const;

 private:
  struct Piece {
    std::shared_ptr<SafetensorsFile> file;
    std::vector<int64_t> shape;  // of the whole tensor
    int64_t dim = 0, start = 0;
  };
  at::Tensor part_for(LlamaForCausalLMImpl& model, const std::string& parameter, const std::string& name,
                      const at::Tensor& like) const;

  std::string dir_;
  bool sharded_ = false;
  std::shared_ptr<SafetensorsFile> optimizer_;        // whole layout
  std::map<std::string, std::vector<Piece>> pieces_;  // sharded layout
  std::map<std::string, int64_t> steps_;
};

}  // namespace weft
