#include "core/model/memory_estimate.h"

#include "core/model/layers.h"

#include <algorithm>
#include <string>

#include "core/model/llama.h"

namespace weft {
namespace {

int64_t elements_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

// The module name "q_proj" of "model.layers.0.self_attn.q_proj.weight" ("lm_head" for the head).
std::string leaf_module(const std::string& name) {
  const auto end = name.rfind(".weight");
  if (end == std::string::npos) return "";
  const auto start = name.rfind('.', end - 1);
  return name.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1));
}

}  // namespace

std::vector<StageMemory> estimate_stage_memory(const ModelConfig& c, const ShardMap& shards,
                                               const std::optional<LoraConfig>& lora, torch::Dtype compute_dtype,
                                               int64_t seq_len, bool checkpointing,
                                               bool blockwise_attention, QuantFormat quantize, torch::Dtype frozen_dtype,
                                               int64_t sequence_shards, bool frozen_cast_cache,
                                               bool kept_probabilities) {
  const int64_t layers = c.num_hidden_layers, stages = layers + 2;
  const int64_t cb = compute_dtype == torch::kFloat32 ? 4 : 2;  // bytes per compute element
  std::vector<StageMemory> out(static_cast<size_t>(stages));
  // Local widths of a block (tensor-parallel slices shrink heads and the intermediate size).
  int64_t q_width = c.num_attention_heads * c.head_dim, kv_width = c.num_key_value_heads * c.head_dim;
  int64_t inter = c.intermediate_size, vocab = c.vocab_size, heads = c.num_attention_heads;
  for (const auto& [name, shape] : parameter_specs(c, 0, stages)) {
    const int64_t stage = stage_of_parameter(name, layers);
    auto& s = out[static_cast<size_t>(stage)];
    std::vector<int64_t> local = shape;
    const ParameterShard shard = shard_of(shards, name);
    if (!shard.whole()) local[static_cast<size_t>(shard.dim)] = shard.range(shape[static_cast<size_t>(shard.dim)]).second;
    const std::string module = leaf_module(name);
    const bool matrix = local.size() == 2;
    const bool block = stage >= 1 && stage <= layers;
    const bool quantized = quantize != QuantFormat::kNone && matrix && block;
    const bool frozen_narrow = lora && module != "score" && matrix && !quantized && frozen_dtype != torch::kFloat32;
    const int64_t bytes = quantized       ? quantized_weight_bytes(local[0], local[1], quantize)
                          : frozen_narrow ? static_cast<int64_t>(c10::elementSize(frozen_dtype)) * elements_of(local)
                                          : 4 * elements_of(local);
    // as COMPUTE_DTYPE materialises it (a quantized weight stays quantized)
    const int64_t compute_bytes = matrix && !quantized ? cb * elements_of(local) : bytes;
    s.parameter_bytes += bytes;
    s.compute_parameter_bytes += compute_bytes;
    // Compute-dtype copies of the weights stay saved for backward, except in checkpointed blocks,
    // which make them again one block at a time (unless the frozen ones are cached), and quantized
    // weights, dequantized again in backward.
    const bool cached = frozen_cast_cache && lora && module != "score";
    if (matrix && !quantized && compute_dtype != torch::kFloat32 && (!(checkpointing && block) || cached)) {
      s.weight_copy_bytes += cb * elements_of(local);
    }
    if (!lora || module == "score") {  // the classification head trains with the adapters (PEFT's modules_to_save)
      s.trainable_bytes += bytes;
      s.compute_trainable_bytes += compute_bytes;
    } else if (matrix && std::find(lora->target_modules.begin(), lora->target_modules.end(), module) !=
                             lora->target_modules.end()) {
      const int64_t adapter = lora->spec.r * (local[0] + local[1]);  // A [r, in] + B [out, r]
      s.parameter_bytes += 4 * adapter;
      s.trainable_bytes += 4 * adapter;
      s.compute_parameter_bytes += cb * adapter;
      s.compute_trainable_bytes += cb * adapter;
    }
    if (stage == 1 && module == "q_proj") q_width = local[0];
    if (stage == 1 && module == "k_proj") kv_width = local[0];
    if (stage == 1 && module == "gate_proj") inter = local[0];
    if (module == "lm_head" || module == "score" || (c.tie_word_embeddings && !c.classification() && module == "embed_tokens" && stage == 0)) vocab = local[0];
  }
  heads = c.head_dim > 0 ? q_width / c.head_dim : heads;
  const int64_t H = c.hidden_size, S = seq_len;
  // A decoder block, per token (layers.cpp): the fp32 residual at each norm (2 x 4H; 1 / T of the
  // tokens under sequence parallelism over T ranks), the norms' outputs (2 x cb H, gathered whole
  // into the regions), q, k, v after RoPE, the attention output and o_proj's input (cb (q + 2 kv)
  // + 2 cb q), gate/up and SwiGLU's output (3 cb I). Blockwise (ring) attention keeps an fp32
  // output (instead of a compute-dtype one) and an fp32 log-sum-exp per head.
  const int64_t T = std::max<int64_t>(1, sequence_shards);
  int64_t block = 8 * H / T + 2 * cb * H + cb * (q_width + 2 * kv_width) + 2 * cb * q_width + 3 * cb * inter;
  if (blockwise_attention) block += (4 - cb) * q_width + 4 * heads;
  if (checkpointing) block = 4 * H / T;  // the block's input; its activations come back one block at a time
  // The attention's kept probabilities: per query head, each block's rows over the keys up to it.
  const int64_t kept =
      kept_probabilities && !checkpointing && !blockwise_attention ? heads * cb * math_attention_kept_values(S) : 0;
  for (int64_t l = 1; l <= layers; ++l) {
    out[static_cast<size_t>(l)].activation_bytes_per_row = block * S + kept;
    out[static_cast<size_t>(l)].output_bytes_per_row = 4 * H * S;
  }
  // The embedding keeps the token ids; the head the residual at the norm, the norm's output, the
  // logits (compute dtype) and the fp32 log-probabilities of the loss.
  out[0].activation_bytes_per_row = 8 * S;
  out[0].output_bytes_per_row = 4 * H * S;
  auto& head = out[static_cast<size_t>(stages - 1)];
  head.activation_bytes_per_row = (4 * H / T + cb * H + (cb + 4) * vocab) * S;
  head.output_bytes_per_row = cb * vocab * S;
  return out;
}

}  // namespace weft
