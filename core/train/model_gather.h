// Saving a model that is split over ranks: pipeline stages (every rank sends the stages it owns
// to rank 0) or tensor-parallel slices (rank 0 gathers every slice and concatenates them), so
// rank 0 saves the whole model in the standard HF layout and a run under any plugin resumes
// under any other. Stages and slices at once (tensor x pipeline parallelism over a device mesh):
// each slice of each stage's parameters goes from the lowest rank holding it to rank 0, which
// concatenates them.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/model/llama.h"
#include "core/model/lora.h"

namespace weft {

class Communicator;

class ModelGather {
 public:
  // Collective over the world: learns which model stages every rank holds. `local` must outlive
  // this object.
  ModelGather(LlamaForCausalLMImpl& local, Communicator& communicator, std::optional<LoraConfig> lora);

  // True when some rank does not hold every stage (then saving must gather).
  bool split() const { return split_; }
  // True when some rank holds only some of the model stages (a pipeline).
  bool staged() const { return staged_; }
  // Whether this rank writes parameter `name` (as it holds it) to a sharded checkpoint: it is the
  // lowest rank holding that stage and slice, so every piece is written once.
  bool writes(const std::string& name) const { return writes_.count(name) != 0; }

  // Collective over the world. On rank 0: the whole model with every rank's current values
  // (this process's model itself when nothing is split); nullptr on other ranks.
  LlamaForCausalLMImpl* gather();

 private:
  LlamaForCausalLMImpl& local_;
  Communicator& communicator_;
  std::optional<LoraConfig> lora_;
  bool split_ = false;
  bool staged_ = false;
  bool sliced_ = false;                              // some parameter is a tensor-parallel slice
  std::vector<std::vector<std::pair<int32_t, int32_t>>> slices_;  // [rank][parameter] (parts, index); not staged
  // Staged: [rank][stage][j] = {parts, index, dim} of the stage's j-th parameter as the rank holds
  // it (parts 0: the rank does not hold the stage). The owner of slice k is the lowest such rank.
  std::vector<std::vector<std::vector<std::array<int64_t, 3>>>> stage_slices_;
  int32_t slice_owner(int64_t stage, size_t j, int64_t index) const;
  std::set<std::string> writes_;
  LlamaForCausalLM full_{nullptr};  // rank 0, built on first use
};

}  // namespace weft
