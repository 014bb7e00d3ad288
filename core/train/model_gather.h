// Saving a model that is split over ranks (pipeline stages): every rank sends the stages it
// owns to rank 0, which assembles the whole model and saves it in the standard HF layout, so a
// run under gpipe.so or pipedream.so resumes under single.so or ddp.so and vice versa.
#pragma once

#include <cstdint>
#include <optional>
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

  // Collective over the world. On rank 0: the whole model with every rank's current values
  // (this process's model itself when nothing is split); nullptr on other ranks.
  LlamaForCausalLMImpl* gather();

 private:
  LlamaForCausalLMImpl& local_;
  Communicator& communicator_;
  std::optional<LoraConfig> lora_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // per rank: model stages [first, last)
  bool split_ = false;
  LlamaForCausalLM full_{nullptr};  // rank 0, built on first use
};

}  // namespace weft
