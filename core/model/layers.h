// The building blocks of a LLaMA decoder, as LibTorch modules whose parameter names follow HF
// (`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, `input_layernorm.weight`, ...).
//
// Precision: parameters are fp32 masters. Each module computes in `compute_dtype` (fp32 or
// bf16): linear layers cast input and weight to it (bf16 matmuls run on oneDNN/AMX), norms and
// softmax run in fp32, and the residual stream stays fp32. Autograd carries gradients back to the
// fp32 masters through the casts, as autocast would.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "core/model/config.h"
#include "core/model/parallel.h"
#include "core/model/quantize.h"

namespace weft {

// LoRA adapter settings for one linear layer (PEFT semantics: W x + (alpha / r) B A dropout(x)).
struct LoraSpec {
  int64_t r = 8;
  double alpha = 16.0;
  double dropout = 0.0;
};

// Holds one parameter named "weight"; used for LoRA's lora_A/lora_B so their names match PEFT.
class WeightHolderImpl : public torch::nn::Module {
 public:
  explicit WeightHolderImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor weight;
};
TORCH_MODULE(WeightHolder);

// y = x W^T, optionally plus a LoRA update. `weight` is [out_features, in_features]: a parameter,
// or, for a layer built with a quantized format (model.quantize), absent: the frozen weight is
// then held quantized (quantize.h) in the buffers weight_data, weight_scale, weight_scale2 and
// weight_offset, and set with set_weight().
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, QuantConfig quantize = {});
  torch::Tensor forward(const torch::Tensor& x);

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  bool quantized() const { return quantize_.enabled(); }
  // Sets the base weight from `value` [out, in] (any float dtype): copied into `weight`, or
  // quantized on `device` (the fp32 value is not kept).
  void set_weight(const torch::Tensor& value, const torch::Device& device);
  // The same from the whole (unsplit) layer's weight, of which this layer holds `shard`
  // (parallel.h). A quantized layer quantizes the whole weight and keeps its slice
  // (slice_quantized), so every split of a model holds the unsplit model's quantized values.
  void set_weight_slice_of(const torch::Tensor& whole, const ParameterShard& shard, const torch::Device& device);
  // The base weight in `dtype`: `weight` cast, or the quantized weight dequantized.
  torch::Tensor dense_weight(torch::Dtype dtype) const;
  // The quantized weight (quantized() layers only). An int8 layer on the CPU computes its forward
  // with LLM.int8's int8_linear (model.int8_threshold) where this LibTorch has an exact int8 GEMM
  // (cpu_int8_gemm_available()) and model.int8_gemm is on.
  const QuantizedMatrix& quantized_weight() const { return quantized_; }
  // For a row-parallel layer (a slice along dim 1) computing with int8_linear: how the rows'
  // absmax over this process's input columns becomes the whole row's (CommPoint::kRowAbsMax).
  // Set before the weight; used only once a dim-1 slice is set.
  void set_row_absmax_sync(RowAbsmaxSync sync) { row_absmax_sync_ = std::move(sync); }

  // Adds LoRA adapters (A: [r, in] kaiming-uniform from `generator_seed`, B: [out, r] zeros)
  // and freezes the base weight. When `weight` is a slice of a split layer (`base`), the
  // adapters are sliced to match (parallel.h's shard_of): A's values are then those of the
  // whole layer's A, so every split of a model starts from the same adapters.
  void add_lora(const LoraSpec& spec, uint64_t generator_seed, const ParameterShard& base = {});
  // Adds AdaLoRA's SVD-form adapters, as PEFT's SVDLinear: P (lora_A [r, in]) and Q (lora_B
  // [out, r]) ~ N(0, 0.02^2) from `generator_seed`, Lambda (lora_E [r, 1]) zeros; the update is
  // (alpha / (r + 1e-5)) B (A * E) dropout(x), r staying the initial rank however many of the
  // triplets a rank allocator masks (adalora.h). Freezes the base weight. Parameters are named
  // lora_A, lora_E and lora_B, as in PEFT's adapter files. When `weight` is a slice of a split
  // layer (`base`), P and Q are drawn whole and sliced like LoRA's factors (parallel.h's shard_of:
  // a column-parallel base splits Q's rows, a row-parallel one P's columns; Lambda stays whole), so
  // every split of a model starts from the same adapters.
  void add_adalora(const LoraSpec& spec, uint64_t generator_seed, const ParameterShard& base = {});
  // The split of the layer the adapters were added to (whole when it is not split).
  const ParameterShard& adapter_base_shard() const { return adapter_base_; }
  bool has_lora() const { return !lora_A_.is_empty() || ada_A_.defined(); }
  bool has_adalora() const { return ada_A_.defined(); }
  // AdaLoRA's P, Lambda and Q (has_adalora() layers).
  torch::Tensor& adalora_A() { return ada_A_; }
  torch::Tensor& adalora_E() { return ada_E_; }
  torch::Tensor& adalora_B() { return ada_B_; }
  // Which of the triplets the last reallocation kept (empty: all), as the rank allocator set it.
  std::vector<bool>& adalora_keep() { return ada_keep_; }
  // Folds (alpha / r) B A into the base weight and removes the adapters. A quantized layer's
  // weight (with or without adapters) is dequantized first into a plain fp32 `weight` parameter:
  // the layer is no longer quantized.
  void merge_lora();

  // The LoRA term (alpha / r) B A dropout(input) for `input` already in the compute dtype (AdaLoRA's
  // term for add_adalora layers).
  // Throws weft::Error if the layer has no adapters.
  torch::Tensor lora_update(const torch::Tensor& input);

  void set_compute_dtype(torch::Dtype dtype) { compute_dtype_ = dtype; }
  torch::Dtype compute_dtype() const { return compute_dtype_; }
  // Whether a trainable weight's gradient may be deferred (weight_grad.h: the layer computes
  // through deferrable_linear, which a DeferWeightGradients scope turns into a deferral).
  void set_weight_grad_deferrable(bool deferrable) { deferrable_ = deferrable; }
  bool weight_grad_deferrable() const { return deferrable_ && weight.defined() && weight.requires_grad(); }

  torch::Tensor weight;  // undefined in a quantized layer

 private:
  torch::Tensor base_output(const torch::Tensor& input);
  void store_quantized(QuantizedMatrix q);

  int64_t in_features_, out_features_;
  QuantConfig quantize_;
  QuantizedMatrix quantized_;
  Int8LinearOptions int8_;          // int8_linear's threshold, and the row sync once row-split
  RowAbsmaxSync row_absmax_sync_;
  WeightHolder lora_A_{nullptr};
  WeightHolder lora_B_{nullptr};
  torch::Tensor ada_A_, ada_E_, ada_B_;
  std::vector<bool> ada_keep_;
  ParameterShard adapter_base_;
  double lora_scale_ = 0.0;
  double lora_dropout_ = 0.0;
  torch::Dtype compute_dtype_ = torch::kFloat32;
  bool deferrable_ = false;
};
TORCH_MODULE(Linear);

// The outputs of several linear layers that read the same x, concatenated on the last dim, from
// one GEMM against their stacked weights (plus each layer's LoRA term). Equals
// cat({layer(x) ...}, -1) up to rounding order. The layers must share a compute dtype.
torch::Tensor fused_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers);

// x [..., in] @ w^T in `dtype` for a frozen w [out, in] stored in another dtype (model.frozen_dtype
// = "bf16" under fp32 compute): w is cast `chunk_rows` rows at a time (0: blocks of at most 64 MiB
// in `dtype`), in the forward and again in the backward, which gives x's gradient only. No whole
// cast copy of w is held or saved for backward: for a 128k-vocabulary head that is 1 GiB in fp32.
torch::Tensor frozen_cast_linear(const torch::Tensor& x, const torch::Tensor& w, torch::Dtype dtype,
                                 int64_t chunk_rows = 0);

// RMSNorm (fp32 math, one fused kernel): y = w * x / sqrt(mean(x^2) + eps), returned in the
// input's dtype.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  // The same, returned in `out_dtype` (fp32 or bf16) without a separate cast.
  torch::Tensor normalize(const torch::Tensor& x, torch::Dtype out_dtype);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Rotary position embedding tables (HF "rotate_half" layout), with Llama 3 frequency scaling.
class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(const ModelConfig& config);
  // Inverse frequencies [head_dim / 2] after Llama 3 scaling (fp32).
  const torch::Tensor& inv_freq() const { return inv_freq_; }
  // cos and sin tables [seq_len, head_dim] for positions start..start+seq_len-1 (fp32, on
  // `device`). The last (start, seq_len, device)'s tables are cached (thread-safe): callers must
  // not modify them.
  std::pair<torch::Tensor, torch::Tensor> tables(int64_t start, int64_t seq_len,
                                                 const torch::Device& device = torch::kCPU) const;

 private:
  std::pair<torch::Tensor, torch::Tensor> compute_tables(int64_t start, int64_t seq_len) const;

  struct TableCache {
    std::mutex mutex;
    int64_t start = 0, seq_len = 0;
    torch::Device device = torch::kCPU;
    std::pair<torch::Tensor, torch::Tensor> tables;
  };
  torch::Tensor inv_freq_;
  std::shared_ptr<TableCache> cache_ = std::make_shared<TableCache>();
};

// Applies RoPE to x [batch, heads, seq, head_dim] with cos/sin [seq, head_dim]; fp32 math,
// result in x's dtype.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// Causal scaled-dot-product attention with grouped-query heads:
// q [B, H, T, D], k/v [B, KVH, T, D] with H % KVH == 0; query head h uses kv head h / (H / KVH).
// Returns [B, H, T, D] in q's dtype: at::scaled_dot_product_attention (fused flash-attention
// kernels on CPU and CUDA that keep the softmax statistics in fp32).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);

// The heads and MLP width a process holds of each block (all of them without tensor
// parallelism).
struct BlockShape {
  int64_t heads = 0, kv_heads = 0, intermediate = 0;
  QuantConfig quantize;  // how the block's linear weights are stored
};

// One layer's key/value cache for incremental decoding: [B, kv_heads, length, head_dim] each,
// grown by concatenation (this process's kv heads only, so a tensor-parallel cache is sharded
// by heads).
struct LayerKvCache {
  torch::Tensor k, v;
  int64_t length() const { return k.defined() ? k.size(2) : 0; }
};

// Attention of queries at absolute positions start .. start + Tq - 1 over keys 0 .. Tk - 1
// (Tk = start + Tq): q [B, H, Tq, D], k/v [B, KVH, Tk, D], grouped-query as causal_attention.
torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start);

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const ModelConfig& config);
  // This process's `heads` query and `kv_heads` key/value heads (column-parallel q/k/v,
  // row-parallel o: the output is a partial sum over the processes' heads).
  AttentionImpl(const ModelConfig& config, int64_t heads, int64_t kv_heads, QuantConfig quantize = {});
  // x [B, T, hidden] -> [B, T, hidden]; rope gives the position tables.
  torch::Tensor forward(const torch::Tensor& x, const RotaryEmbedding& rope);
  // The same for new tokens at positions cache.length() .. + T - 1, attending to the cached
  // keys and values too; appends the new keys and values to `cache` (inference, no autograd).
  torch::Tensor forward_cached(const torch::Tensor& x, const RotaryEmbedding& rope, LayerKvCache& cache);
  // Context parallelism (parallel.h's ContextSplit, owned by the caller and outliving this
  // module; nullptr or size 1: off): forward() then takes this process's tokens of every
  // sequence (in the split's layout), applies RoPE at their global positions and runs the
  // attention core over the whole sequence for its share of the heads (Ulysses; kv heads repeated
  // to one per query head when they cannot be split evenly), or, when the split has an
  // `attention`, hands this process's q, k, v to it (ring attention). `layer` names the block to
  // the all-to-all or the attention.
  void set_context_split(const ContextSplit* split, int64_t layer) {
    context_ = split;
    layer_ = layer;
  }

  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  torch::Tensor forward_context_split(const torch::Tensor& x, const RotaryEmbedding& rope);

  int64_t num_heads_, num_kv_heads_, head_dim_;
  const ContextSplit* context_ = nullptr;
  int64_t layer_ = -1;
};
TORCH_MODULE(Attention);

// SwiGLU: down(silu(gate(x)) * up(x)).
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  // `intermediate` columns of the MLP (gate/up column-parallel, down row-parallel).
  MlpImpl(const ModelConfig& config, int64_t intermediate, QuantConfig quantize = {});
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

// Pre-norm decoder block: h = x + attn(norm(x)); y = h + mlp(norm(h)).
class DecoderBlockImpl : public torch::nn::Module {
 public:
  explicit DecoderBlockImpl(const ModelConfig& config);
  // Block `layer` holding `shape` of it; `comm` (may be null; must outlive the block) is called
  // at the four Megatron points around attention and MLP, and at kRowAbsMax by o_proj and
  // down_proj when they are row-split int8 layers computing with int8_linear.
  DecoderBlockImpl(const ModelConfig& config, const BlockShape& shape, int64_t layer, const CommHook* comm);
  torch::Tensor forward(const torch::Tensor& x, const RotaryEmbedding& rope);
  // Incremental decoding with this block's cache (see AttentionImpl::forward_cached).
  torch::Tensor forward_cached(const torch::Tensor& x, const RotaryEmbedding& rope, LayerKvCache& cache);
  // Megatron sequence parallelism (must outlive the block; null: off): forward() then takes and
  // returns this process's tokens, all-gathering them into attention and the MLP and
  // reduce-scattering their outputs. forward_cached keeps whole sequences and the comm points.
  void set_sequence_shards(const SequenceShards* shards) { shards_ = shards; }
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};

 private:
  int64_t layer_ = -1;
  const CommHook* comm_ = nullptr;
  const SequenceShards* shards_ = nullptr;
};
TORCH_MODULE(DecoderBlock);

// Sets the compute dtype of every weft::Linear under `module`.
void set_compute_dtype(torch::nn::Module& module, torch::Dtype dtype);
// Lets (or stops) every weft::Linear under `module` defer its trainable weight's gradient
// (weight_grad.h; a split backward, ABI 1.11).
void set_weight_grads_deferrable(torch::nn::Module& module, bool deferrable);

}  // namespace weft
