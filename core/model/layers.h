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
#include "core/model/linear.h"
#include "core/model/parallel.h"
#include "core/model/quantize.h"

namespace weft {

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

// Rows that hold several examples (packed instruction data, data.packing): RoPE takes each token's
// position within its example, and each query attends to the keys of its own example up to itself
// (transformers' packed position_ids: a new example wherever a position is not the previous one
// plus 1). Built once per forward (make_token_layout); a null layout: one sequence per row.
struct TokenLayout {
  torch::Tensor cos, sin;  // [B, T, head_dim] fp32: the tables of the tokens the attention's input holds
  torch::Tensor mask;      // [B, 1, S, S] bool over whole rows: query i may attend to key j
};
// positions: int64 [B, S], each token's position within its example over whole rows. `local`: the
// indices of the tokens the attention's input holds of each row (context parallelism:
// ContextSplit::positions), undefined for all of them. Throws weft::Error for a position outside [0, S).
TokenLayout make_token_layout(const RotaryEmbedding& rope, const torch::Tensor& positions, const torch::Tensor& local,
                              const torch::Device& device);

// Applies RoPE to x [batch, heads, seq, head_dim] with cos/sin [seq, head_dim]; fp32 math,
// result in x's dtype.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// Causal scaled-dot-product attention with grouped-query heads:
// q [B, H, T, D], k/v [B, KVH, T, D] with H % KVH == 0; query head h uses kv head h / (H / KVH).
// Returns [B, H, T, D] in q's dtype. On the CPU, causal, fp32 or bf16, up to 1024 tokens: GEMMs over
// blocks of queries (math_attention_applies). Elsewhere at::scaled_dot_product_attention (fused
// flash-attention kernels on CPU and CUDA that keep the softmax statistics in fp32); bf16 on the CPU
// past 1024 tokens, in training: the flash backward runs LibTorch's fp32 kernel over fp32 copies
// (faster there, and nearer fp32).
// With a defined `mask` [B, 1, T, T] (bool; TokenLayout::mask), query i attends to the keys the mask allows
// instead of the causal ones.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask = {});
// Whether causal_attention (without a mask) computes q, k, v as GEMMs (CPU fp32 or bf16, q and k of
// one length of at most 1024 tokens): per block of max(64, T / 8) query positions and sequence
// group, one batched product for the scores over the keys up to the block's last position (the
// masked blocks are skipped), a fused fp32 softmax over them, P V. Elsewhere LibTorch's flash kernels.
bool math_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v);
// Whether that path's training forward over `tokens` keeps every block's P (in q's dtype) for the
// backward, which recomputes them otherwise; and how many values of P that is per query head and
// sequence (0 where it keeps none).
bool math_attention_keeps_probabilities(int64_t tokens);
int64_t math_attention_kept_values(int64_t tokens);

// The heads and MLP width a process holds of each block (all of them without tensor
// parallelism), and which slices of the whole block they are: q_proj's, k_proj's / v_proj's and
// gate_proj's / up_proj's output rows (dim 0); o_proj and down_proj hold the same parts of their
// input columns (dim 1).
struct BlockShape {
  int64_t heads = 0, kv_heads = 0, intermediate = 0;
  QuantConfig quantize;  // how the block's linear weights are stored
  ParameterShard q, kv, mlp;
  // The whole block of `config`.
  static BlockShape whole(const ModelConfig& config, QuantConfig quantize = {});
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
  // This process's `shape.heads` query and `shape.kv_heads` key/value heads (column-parallel
  // q/k/v, row-parallel o: the output is a partial sum over the processes' heads).
  AttentionImpl(const ModelConfig& config, const BlockShape& shape);
  // x [B, T, hidden] -> [B, T, hidden]; rope gives the position tables, or `layout` (packed rows;
  // not with ring attention) the positions and the mask.
  torch::Tensor forward(const torch::Tensor& x, const RotaryEmbedding& rope, const TokenLayout* layout = nullptr);
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
  torch::Tensor forward_context_split(const torch::Tensor& x, const RotaryEmbedding& rope, const TokenLayout* layout);

  int64_t num_heads_, num_kv_heads_, head_dim_;
  const ContextSplit* context_ = nullptr;
  int64_t layer_ = -1;
};
TORCH_MODULE(Attention);

// SwiGLU: down(silu(gate(x)) * up(x)).
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  // `shape.intermediate` columns of the MLP (gate/up column-parallel, down row-parallel).
  MlpImpl(const ModelConfig& config, const BlockShape& shape);
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
  torch::Tensor forward(const torch::Tensor& x, const RotaryEmbedding& rope, const TokenLayout* layout = nullptr);
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
// (weight_grad.h; a split backward).
void set_weight_grads_deferrable(torch::nn::Module& module, bool deferrable);

}  // namespace weft
