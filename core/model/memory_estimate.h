// What the model will cost in memory, per stage, before it is built: parameters and trainable
// bytes from the parameter shapes (tensor-parallel slices and LoRA adapters included), and an
// estimate of what a forward keeps for backward per sequence, from the tensors this host's layers
// save (layers.cpp): the memory plan (trainer plan, train.memory_limit_gib) adds these up. The
// activation estimate is a model of this implementation, checked against measured peaks in
// tests/train (MemoryPlan.*), not a bound.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/types.h>

#include "core/model/lora.h"
#include "core/model/parallel.h"
#include "core/model/quantize.h"

namespace weft {

struct StageMemory {
  int64_t parameter_bytes = 0;           // fp32 masters of the stage as this rank holds them
  int64_t trainable_bytes = 0;           // the optimizer's part (LoRA: the adapters)
  int64_t activation_bytes_per_row = 0;  // kept for backward per sequence of seq_len
  int64_t weight_copy_bytes = 0;         // compute-dtype weight copies kept for backward or cached (0 in fp32)
  int64_t output_bytes_per_row = 0;      // fp32 hidden states, or the last stage's logits
  int64_t compute_parameter_bytes = 0;   // parameter_bytes with the matrices in the compute dtype
  int64_t compute_trainable_bytes = 0;   // trainable_bytes likewise
};

// One entry per model stage (embedding, each block, norm + head). `shards`: this rank's slices
// (stages it does not hold are estimated whole when absent from the map). `lora`: adapters train,
// the base is frozen. `checkpointing`: blocks keep only their input. `blockwise_attention`: the
// attention core is ring attention's (ContextSplit::attention), which keeps its fp32 output and
// log-sum-exp instead of the probabilities. `quantize`: the blocks' linear weights are stored in
// that format (quantize.h) and dequantized for each product, never kept for backward.
// `frozen_dtype` (adapter training, model.frozen_dtype): the dtype the frozen base's matrices that
// are not quantized are stored in (the embedding, the head, the blocks' weights; not a
// classification head, which trains). `sequence_shards` (Megatron sequence parallelism,
// SequenceShards::size): the fp32 residual stream between the tensor-parallel regions holds 1 / that
// of each sequence's tokens. `frozen_cast_cache` (adapter training, model.cache_frozen_casts): the
// frozen matrices' compute-dtype copies live between steps, checkpointed blocks' too.
// `kept_probabilities`: the attention keeps each block's softmax probabilities for the backward
// (the CPU's GEMM attention over short sequences: math_attention_kept_values).
std::vector<StageMemory> estimate_stage_memory(const ModelConfig& config, const ShardMap& shards,
                                               const std::optional<LoraConfig>& lora, torch::Dtype compute_dtype,
                                               int64_t seq_len, bool checkpointing,
                                               bool blockwise_attention = false,
                                               QuantFormat quantize = QuantFormat::kNone,
                                               torch::Dtype frozen_dtype = torch::kFloat32,
                                               int64_t sequence_shards = 1, bool frozen_cast_cache = false,
                                               bool kept_probabilities = false);

}  // namespace weft
