#include "core/model/layers.h"

#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include <torch/torch.h>

#include "core/model/kernels.h"
#include "core/model/weight_grad.h"
#include "core/util/error.h"

namespace weft {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) { return normalize(x, x.scalar_type()); }

torch::Tensor RMSNormImpl::normalize(const torch::Tensor& x, torch::Dtype out_dtype) {
  return fused_rms_norm(x, weight, eps_, out_dtype);
}

RotaryEmbedding::RotaryEmbedding(const ModelConfig& config) {
  const int64_t dim = config.head_dim;
  auto exponents = torch::arange(0, dim, 2, torch::kFloat64) / static_cast<double>(dim);
  auto inv_freq = 1.0 / torch::pow(config.rope_theta, exponents);
  if (config.rope_scaling) {
    // Llama 3: long wavelengths divided by `factor`, short kept, a smooth blend in between.
    const auto& s = *config.rope_scaling;
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_len / s.low_freq_factor;
    const double high_freq_wavelen = old_len / s.high_freq_factor;
    auto accessor = inv_freq.accessor<double, 1>();
    for (int64_t i = 0; i < inv_freq.size(0); ++i) {
      const double freq = accessor[i];
      const double wavelen = 2.0 * M_PI / freq;
      if (wavelen < high_freq_wavelen) continue;
      if (wavelen > low_freq_wavelen) {
        accessor[i] = freq / s.factor;
      } else {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        accessor[i] = (1.0 - smooth) * freq / s.factor + smooth * freq;
      }
    }
  }
  inv_freq_ = inv_freq.to(torch::kFloat32);
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::tables(int64_t start, int64_t seq_len,
                                                                const torch::Device& device) const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->tables.first.defined() && cache_->start == start && cache_->seq_len == seq_len &&
      cache_->device == device) {
    return cache_->tables;
  }
  auto [cos, sin] = compute_tables(start, seq_len);  // on the CPU, in double-checked fp32 as before
  cache_->tables = {cos.to(device), sin.to(device)};
  cache_->start = start;
  cache_->seq_len = seq_len;
  cache_->device = device;
  return cache_->tables;
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::compute_tables(int64_t start, int64_t seq_len) const {
  torch::NoGradGuard no_grad;
  auto positions = torch::arange(start, start + seq_len, torch::kFloat32);
  auto freqs = torch::outer(positions, inv_freq_);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto xf = x.to(torch::kFloat32);
  const int64_t half = xf.size(-1) / 2;
  auto x1 = xf.narrow(-1, 0, half);
  auto x2 = xf.narrow(-1, half, half);
  auto rotated = torch::cat({-x2, x1}, -1);
  return (xf * cos + rotated * sin).to(x.scalar_type());
}

namespace {

// Causal attention of bf16 CPU tensors: LibTorch's flash kernel forward in bf16, backward through
// its fp32 kernel over fp32 copies of the saved tensors and the gradient. On CPUs with AMX, PyTorch
// 2.11's bf16 backward kernel took ~1.4x its fp32 one on the bundled model's shapes (4 x 9 heads x
// 256 tokens), and the fp32 backward's gradients are the nearer to an fp32 reference.
class Bf16CpuAttentionFunction : public torch::autograd::Function<Bf16CpuAttentionFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, /*dropout_p=*/0.0, /*is_causal=*/true);
    ctx->save_for_backward({q, k, v, out, lse});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat32); };
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        f(grads[0]), f(s[0]), f(s[1]), f(s[2]), f(s[3]), s[4], /*dropout_p=*/0.0, /*is_causal=*/true);
    return {gq.to(s[0].scalar_type()), gk.to(s[1].scalar_type()), gv.to(s[2].scalar_type())};
  }
};

// Causal attention of fp32 or bf16 CPU tensors of short sequences as GEMMs in blocks of queries,
// skipping the masked blocks: each sequence's grouped-query heads share its kv head, their rows laid
// out position-major ([B * KVH, T * G, D]: row t * G + g is query head g's position t, no copy of k
// or v per query head), so the queries of positions [p0, p1) are one run of rows and see keys
// [0, p1). Per block: S = Q K^T [rows, p1], the softmax in fp32 by one row kernel
// (causal_softmax_rows_), O = P V. Backward reads the blocks' P, which a training forward of at
// most kKeptProbabilitiesMaxTokens tokens keeps (53-62% of T^2 values per head: ~12-16% more
// activation memory on this model's and llama-3.2-1b's shapes, for the recomputed product and
// softmax, ~13% of the attention's time), or recomputes them past that; then dV += P^T dO,
// dP = dO V^T, dS (causal_softmax_backward_rows_), dQ = dS K, dK += dS^T Q, summing dK and dV over
// the blocks in fp32. Blocks of max(64, T / 8) positions compute 53-62% of the whole score
// matrix's products, and on the bundled model's shapes ran fwd + bwd in 0.6x the whole matrix's time
// on an AMD Zen 4 core, 0.76x LibTorch's fp32 flash kernels' (which skip the masked blocks too but
// run below the GEMM's rate at these lengths, kMathAttentionMaxTokens). bf16 runs every product on
// the CPU's bf16 GEMM (AMX, AVX512_BF16) and rounds scores and P to bf16, as eager attention under
// autocast does. Work goes in chunks of sequence groups so that a block's two [rows, T]
// temporaries stay within kMathAttentionChunkBytes.
constexpr int64_t kMathAttentionMaxTokens = 1024;
constexpr int64_t kMathAttentionChunkBytes = int64_t{64} << 20;
constexpr int64_t kKeptProbabilitiesMaxTokens = 256;

class CpuMathAttentionFunction : public torch::autograd::Function<CpuMathAttentionFunction> {
 public:
  // Positions per block of queries.
  static int64_t block_of(int64_t t) { return std::max<int64_t>(64, (t + 7) / 8); }

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, bool keep_probabilities) {
    const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3), kvh = k.size(1), g = h / kvh;
    const auto q3 = q.reshape({b, kvh, g, t, d}).transpose(2, 3).contiguous().view({b * kvh, t * g, d});
    const auto k3 = k.contiguous().view({b * kvh, t, d}), v3 = v.contiguous().view({b * kvh, t, d});
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    auto out3 = torch::empty_like(q3);
    const auto blocks = blocks_of(q3, g, t);
    // Every block's P, one after the other, where backward is to read them instead of recomputing.
    const auto kept = keep_probabilities ? torch::empty({blocks.back().offset + blocks.back().elements()}, q3.options())
                                         : torch::Tensor();
    Scratch scores(q3, g, t, /*needed=*/!kept.defined());
    for (const auto& blk : blocks) {
      const auto rows = q3.narrow(0, blk.n0, blk.n).narrow(1, blk.p0 * g, (blk.p1 - blk.p0) * g);
      auto p = probabilities(kept.defined() ? blk.view(kept, rows) : scores.take(rows, blk.p1), rows,
                             k3.narrow(0, blk.n0, blk.n).narrow(1, 0, blk.p1), scale, g, blk.p0);
      auto o = out3.narrow(0, blk.n0, blk.n).narrow(1, blk.p0 * g, (blk.p1 - blk.p0) * g);
      at::bmm_out(o, p, v3.narrow(0, blk.n0, blk.n).narrow(1, 0, blk.p1));
    }
    ctx->save_for_backward({q3, k3, v3, kept});
    ctx->saved_data["shape"] = q.sizes().vec();
    // [B, H, T, D] as the transpose of a [B, T, H, D] tensor: the caller's merge of the heads is a view.
    return out3.view({b, kvh, t, g, d}).permute({0, 2, 1, 3, 4}).contiguous().view({b, t, h, d}).transpose(1, 2);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &q3 = s[0], &k3 = s[1], &v3 = s[2], &kept = s[3];
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const int64_t b = shape[0], h = shape[1], t = shape[2], d = shape[3], kvh = k3.size(0) / b, g = h / kvh;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const auto dtype = q3.scalar_type();
    const auto go = grads[0].to(dtype).reshape({b, kvh, g, t, d}).transpose(2, 3).contiguous().view(q3.sizes());
    auto gq = torch::empty_like(q3);
    // dK and dV sum over the query blocks in fp32 (bf16 products are added to them once per block).
    // The blocks go last to first: a group chunk's last block sees every key, so its products are
    // written (no zero fill) and the earlier blocks' added to their prefixes.
    auto gk = torch::empty(k3.sizes(), k3.options().dtype(torch::kFloat32));
    auto gv = torch::empty(v3.sizes(), v3.options().dtype(torch::kFloat32));
    const auto accumulate = [&](torch::Tensor sum, const torch::Tensor& a, const torch::Tensor& m, bool first) {
      if (dtype == torch::kFloat32) {
        if (first) {
          at::bmm_out(sum, a, m);
        } else {
          sum.baddbmm_(a, m);
        }
      } else if (first) {
        sum.copy_(at::bmm(a, m));
      } else {
        sum.add_(at::bmm(a, m));
      }
    };
    Scratch scores(q3, g, t, /*needed=*/!kept.defined()), score_grads(q3, g, t);
    const auto blocks = blocks_of(q3, g, t);
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
      const Block& blk = *it;
      const bool first = blk.p1 == t;  // the chunk's first block in this order
      const auto qb = q3.narrow(0, blk.n0, blk.n).narrow(1, blk.p0 * g, (blk.p1 - blk.p0) * g);
      const auto gb = go.narrow(0, blk.n0, blk.n).narrow(1, blk.p0 * g, (blk.p1 - blk.p0) * g);
      const auto kc = k3.narrow(0, blk.n0, blk.n).narrow(1, 0, blk.p1);
      const auto vc = v3.narrow(0, blk.n0, blk.n).narrow(1, 0, blk.p1);
      const auto p =
          kept.defined() ? blk.view(kept, qb) : probabilities(scores.take(qb, blk.p1), qb, kc, scale, g, blk.p0);
      accumulate(gv.narrow(0, blk.n0, blk.n).narrow(1, 0, blk.p1), p.transpose(1, 2), gb, first);
      auto ds = score_grads.take(gb, blk.p1);  // dP, then the scores' gradient over it
      at::bmm_out(ds, gb, vc.transpose(1, 2));
      causal_softmax_backward_rows_(p, ds, scale, g, blk.p0);
      auto gqb = gq.narrow(0, blk.n0, blk.n).narrow(1, blk.p0 * g, (blk.p1 - blk.p0) * g);
      at::bmm_out(gqb, ds, kc);
      accumulate(gk.narrow(0, blk.n0, blk.n).narrow(1, 0, blk.p1), ds.transpose(1, 2), qb, first);
    }
    auto kv_shape = shape;
    kv_shape[1] = kvh;
    return {gq.view({b, kvh, t, g, d}).transpose(2, 3).reshape(shape), gk.to(dtype).view(kv_shape),
            gv.to(dtype).view(kv_shape), torch::Tensor()};
  }

 private:
  // One buffer for a call's blocks of scores (or their gradients): each block is a contiguous
  // [groups, rows, keys] prefix of it, so every layer's call allocates the same size whatever its
  // block (the allocator's cache of freed blocks keys on size).
  struct Scratch {
    torch::Tensor flat;
    Scratch(const torch::Tensor& q3, int64_t g, int64_t t, bool needed = true)
        : flat(needed ? torch::empty({std::min(q3.size(0), chunk_groups(q3, g, t)) * std::min(block_of(t), t) * g * t},
                                     q3.options())
                      : torch::Tensor()) {}
    torch::Tensor take(const torch::Tensor& rows, int64_t keys) const {
      return flat.narrow(0, 0, rows.size(0) * rows.size(1) * keys).view({rows.size(0), rows.size(1), keys});
    }
  };
  static int64_t chunk_groups(const torch::Tensor& q3, int64_t g, int64_t t) {
    const int64_t each = std::max<int64_t>(1, 2 * q3.element_size() * std::min(block_of(t), t) * g * t);
    return std::max<int64_t>(1, kMathAttentionChunkBytes / each);
  }
  static torch::Tensor probabilities(torch::Tensor p, const torch::Tensor& q_rows, const torch::Tensor& keys,
                                     double scale, int64_t group, int64_t first) {
    at::bmm_out(p, q_rows, keys.transpose(1, 2));
    causal_softmax_rows_(p, scale, group, first);
    return p;
  }
  // Groups [n0, n0 + n) of the [B * KVH] sequence groups, positions [p0, p1); `offset`: where the
  // block's P starts in a buffer of every block's, in this order.
  struct Block {
    int64_t n0, n, p0, p1, offset, group;
    int64_t elements() const { return n * (p1 - p0) * group * p1; }
    torch::Tensor view(const torch::Tensor& flat, const torch::Tensor& rows) const {
      return flat.narrow(0, offset, elements()).view({n, rows.size(1), p1});
    }
  };
  // The blocks over chunks of the sequence groups whose two [block rows, T] temporaries (P and dP)
  // fit kMathAttentionChunkBytes (at least one group each), and within each the blocks of positions
  // [p0, p1) in order.
  static std::vector<Block> blocks_of(const torch::Tensor& q3, int64_t g, int64_t t) {
    const int64_t block = block_of(t), n = q3.size(0), step = chunk_groups(q3, g, t);
    std::vector<Block> blocks;
    int64_t offset = 0;
    for (int64_t n0 = 0; n0 < n; n0 += step) {
      for (int64_t p0 = 0; p0 < t; p0 += block) {
        blocks.push_back(Block{n0, std::min(step, n - n0), p0, std::min(t, p0 + block), offset, g});
        offset += blocks.back().elements();
      }
    }
    return blocks;
  }
};

}  // namespace

bool math_attention_keeps_probabilities(int64_t tokens) { return tokens <= kKeptProbabilitiesMaxTokens; }

int64_t math_attention_kept_values(int64_t tokens) {
  if (tokens <= 0 || tokens > kMathAttentionMaxTokens || !math_attention_keeps_probabilities(tokens)) return 0;
  int64_t values = 0;
  for (int64_t p0 = 0, block = CpuMathAttentionFunction::block_of(tokens); p0 < tokens; p0 += block) {
    const int64_t p1 = std::min(tokens, p0 + block);
    values += (p1 - p0) * p1;
  }
  return values;
}

bool math_attention_applies(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const auto dtype = q.scalar_type();
  return q.device().is_cpu() && (dtype == torch::kBFloat16 || dtype == torch::kFloat32) && k.scalar_type() == dtype &&
         v.scalar_type() == dtype && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 &&
         q.size(2) == k.size(2) && q.size(2) > 0 && q.size(2) <= kMathAttentionMaxTokens && k.size(1) > 0 &&
         q.size(1) % k.size(1) == 0 && k.sizes() == v.sizes() && q.size(3) == k.size(3) && q.size(0) == k.size(0);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& mask) {
  if (!mask.defined() && math_attention_applies(q, k, v)) {
    const bool training =
        torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    return CpuMathAttentionFunction::apply(q, k, v, training && math_attention_keeps_probabilities(q.size(2)));
  }
  if (!mask.defined() && q.device().is_cpu() && q.scalar_type() == torch::kBFloat16 &&
      k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16 && torch::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
    return Bf16CpuAttentionFunction::apply(q, k, v);
  }
  if (mask.defined()) {
    return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, /*is_causal=*/false,
                                            /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != k.size(1));
  }
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != k.size(1));
}

TokenLayout make_token_layout(const RotaryEmbedding& rope, const torch::Tensor& positions, const torch::Tensor& local,
                              const torch::Device& device) {
  torch::NoGradGuard no_grad;
  WEFT_CHECK(positions.dim() == 2 && positions.scalar_type() == torch::kLong, "token layout: positions must be int64 "
             "[rows, tokens]");
  const int64_t rows = positions.size(0), tokens = positions.size(1);
  const auto pos = positions.to(device);
  if (pos.numel() > 0) {
    WEFT_CHECK(pos.min().item<int64_t>() >= 0 && pos.max().item<int64_t>() < tokens,
               "token layout: positions must lie in [0, {})", tokens);
  }
  // A new example wherever a position is not the previous one's plus 1 (transformers'
  // find_packed_sequence_indices); each query sees its own example's keys up to itself.
  const auto step = torch::diff(pos, 1, -1, pos.narrow(1, 0, 1) - 1);
  const auto example = (step != 1).cumsum(-1);
  const auto causal = torch::ones({tokens, tokens}, torch::TensorOptions().dtype(torch::kBool).device(device)).tril();
  TokenLayout layout;
  layout.mask = (example.unsqueeze(2) == example.unsqueeze(1)).logical_and(causal).unsqueeze(1);
  const auto held = local.defined() ? pos.index_select(1, local.to(device)) : pos;
  const auto [whole_cos, whole_sin] = rope.tables(0, tokens, device);
  layout.cos = whole_cos.index_select(0, held.reshape({-1})).view({rows, held.size(1), -1});
  layout.sin = whole_sin.index_select(0, held.reshape({-1})).view({rows, held.size(1), -1});
  return layout;
}

BlockShape BlockShape::whole(const ModelConfig& c, QuantConfig quantize) {
  return BlockShape{c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, quantize, {}, {}, {}};
}

namespace {

// A slice of a layer's input columns: the same parts as `rows` took of the output rows before it.
ParameterShard columns_like(const ParameterShard& rows) { return ParameterShard{1, rows.parts, rows.index}; }

}  // namespace

AttentionImpl::AttentionImpl(const ModelConfig& c) : AttentionImpl(c, BlockShape::whole(c)) {}

AttentionImpl::AttentionImpl(const ModelConfig& c, const BlockShape& shape)
    : num_heads_(shape.heads), num_kv_heads_(shape.kv_heads), head_dim_(c.head_dim) {
  const int64_t hidden = c.hidden_size, q_width = c.num_attention_heads * head_dim_,
                kv_width = c.num_key_value_heads * head_dim_;
  q_proj = register_module("q_proj", Linear(LinearSpec{hidden, q_width, shape.quantize, shape.q}));
  k_proj = register_module("k_proj", Linear(LinearSpec{hidden, kv_width, shape.quantize, shape.kv}));
  v_proj = register_module("v_proj", Linear(LinearSpec{hidden, kv_width, shape.quantize, shape.kv}));
  o_proj = register_module("o_proj", Linear(LinearSpec{q_width, hidden, shape.quantize, columns_like(shape.q)}));
  WEFT_CHECK(q_proj->out_features() == num_heads_ * head_dim_ && k_proj->out_features() == num_kv_heads_ * head_dim_,
             "attention: {} heads and {} kv heads are not the slices q_proj and k_proj hold", num_heads_, num_kv_heads_);
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const RotaryEmbedding& rope, const TokenLayout* layout) {
  if (context_ != nullptr && context_->size > 1) return forward_context_split(x, rope, layout);
  const int64_t batch = x.size(0), seq = x.size(1);
  // One GEMM for q, k and v; one pass splits the heads and applies RoPE to q and k.
  auto qkv = fused_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  auto [cos, sin] = layout != nullptr ? std::pair{layout->cos, layout->sin} : rope.tables(0, seq, x.device());
  auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, cos, sin);
  auto out = causal_attention(q, k, v, layout != nullptr ? layout->mask : torch::Tensor());
  return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
}

torch::Tensor AttentionImpl::forward_context_split(const torch::Tensor& x, const RotaryEmbedding& rope,
                                                   const TokenLayout* layout) {
  const int64_t batch = x.size(0), seq = x.size(1), parts = context_->size;
  WEFT_CHECK(context_->attention || num_heads_ % parts == 0,
             "context parallelism: {} attention heads cannot be split over {} processes", num_heads_, parts);
  WEFT_CHECK(layout == nullptr || !context_->attention,
             "context parallelism: packed rows need the attention over whole sequences (the all-to-all), not the "
             "plugin's attention core");
  auto qkv = fused_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  if (layout != nullptr) {  // packed rows: RoPE at each token's position in its example, the rows' mask
    WEFT_CHECK(context_->layout == ContextLayout::kContiguous,
               "context parallelism: the all-to-all (Ulysses) needs the contiguous layout");
    auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, layout->cos, layout->sin);
    if (num_kv_heads_ % parts != 0) {
      k = k.repeat_interleave(num_heads_ / num_kv_heads_, 1);
      v = v.repeat_interleave(num_heads_ / num_kv_heads_, 1);
    }
    q = sequence_to_heads(q, *context_, layer_);
    k = sequence_to_heads(k, *context_, layer_);
    v = sequence_to_heads(v, *context_, layer_);
    auto out = heads_to_sequence(causal_attention(q, k, v, layout->mask), *context_, layer_);
    return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
  }
  // RoPE at the global positions of this process's tokens (one or two runs of the sequence), cut
  // from the whole sequence's tables (cached: the same for every block and step).
  const auto [whole_cos, whole_sin] = rope.tables(0, parts * seq, x.device());
  std::vector<torch::Tensor> cos_runs, sin_runs;
  for (const auto& [start, count] : context_->token_runs(parts * seq)) {
    cos_runs.push_back(whole_cos.narrow(0, start, count));
    sin_runs.push_back(whole_sin.narrow(0, start, count));
  }
  const auto cos = cos_runs.size() == 1 ? cos_runs[0] : torch::cat(cos_runs);
  const auto sin = sin_runs.size() == 1 ? sin_runs[0] : torch::cat(sin_runs);
  auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, cos, sin);
  if (context_->attention) {  // ring attention: this process's queries, key/value blocks moved by the caller
    auto out = context_attention(q, k, v, *context_, layer_);  // [B, H, s, D]
    return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
  }
  WEFT_CHECK(context_->layout == ContextLayout::kContiguous,
             "context parallelism: the all-to-all (Ulysses) needs the contiguous layout");
  if (num_kv_heads_ % parts != 0) {  // GQA with fewer kv heads than processes: one per query head
    k = k.repeat_interleave(num_heads_ / num_kv_heads_, 1);
    v = v.repeat_interleave(num_heads_ / num_kv_heads_, 1);
  }
  q = sequence_to_heads(q, *context_, layer_);
  k = sequence_to_heads(k, *context_, layer_);
  v = sequence_to_heads(v, *context_, layer_);
  auto out = heads_to_sequence(causal_attention(q, k, v), *context_, layer_);  // [B, H, s, D]
  return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
}

torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start) {
  const int64_t heads = q.size(1), seq = q.size(2), dim = q.size(3), kv_heads = k.size(1), keys = k.size(2);
  WEFT_CHECK(heads % kv_heads == 0 && keys == start + seq, "cached attention: {} heads over {} kv heads, {} keys for "
             "positions {}..{}", heads, kv_heads, keys, start, start + seq - 1);
  const auto kk = k.repeat_interleave(heads / kv_heads, 1), vv = v.repeat_interleave(heads / kv_heads, 1);
  auto scores = torch::matmul(q, kk.transpose(2, 3)).to(torch::kFloat32) / std::sqrt(static_cast<double>(dim));
  // Query i (position start + i) sees keys 0 .. start + i.
  auto future = torch::ones({seq, keys}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(start + 1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  return torch::matmul(scores.softmax(-1).to(v.scalar_type()), vv);
}

torch::Tensor AttentionImpl::forward_cached(const torch::Tensor& x, const RotaryEmbedding& rope, LayerKvCache& cache) {
  const int64_t batch = x.size(0), seq = x.size(1), start = cache.length();
  auto qkv = fused_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  auto [cos, sin] = rope.tables(start, seq, x.device());
  auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, cos, sin);
  cache.k = cache.k.defined() ? torch::cat({cache.k, k}, 2) : k;
  cache.v = cache.v.defined() ? torch::cat({cache.v, v}, 2) : v;
  auto out = cached_attention(q, cache.k, cache.v, start);
  return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const ModelConfig& c) : MlpImpl(c, BlockShape::whole(c)) {}

MlpImpl::MlpImpl(const ModelConfig& c, const BlockShape& shape) {
  const int64_t hidden = c.hidden_size, width = c.intermediate_size;
  gate_proj = register_module("gate_proj", Linear(LinearSpec{hidden, width, shape.quantize, shape.mlp}));
  up_proj = register_module("up_proj", Linear(LinearSpec{hidden, width, shape.quantize, shape.mlp}));
  down_proj = register_module("down_proj", Linear(LinearSpec{width, hidden, shape.quantize, columns_like(shape.mlp)}));
  WEFT_CHECK(gate_proj->out_features() == shape.intermediate, "MLP: width {} is not the slice gate_proj holds",
             shape.intermediate);
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  // One GEMM for gate and up, one fused pass for silu(gate) * up.
  return down_proj(fused_swiglu(fused_linear(x, {gate_proj.get(), up_proj.get()})));
}

DecoderBlockImpl::DecoderBlockImpl(const ModelConfig& c)
    : DecoderBlockImpl(c, BlockShape::whole(c), -1, nullptr) {}

DecoderBlockImpl::DecoderBlockImpl(const ModelConfig& c, const BlockShape& shape, int64_t layer, const CommHook* comm)
    : layer_(layer), comm_(comm) {
  self_attn = register_module("self_attn", Attention(c, shape));
  mlp = register_module("mlp", Mlp(c, shape));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (comm_ != nullptr) {  // row-parallel int8 layers: each token's absmax over the whole row
    auto sync = [comm, layer](torch::Tensor& absmax) { (*comm)(CommPoint::kRowAbsMax, false, layer, absmax); };
    self_attn->o_proj->set_row_absmax_sync(sync);
    mlp->down_proj->set_row_absmax_sync(sync);
  }
}

namespace {

// x + sublayer output, in x's dtype: one pass that widens a bf16 output on the fly where x's dtype
// is the wider one (the fp32 residual stream; add_widened), instead of a cast and an add.
torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& a) {
  if (c10::promoteTypes(x.scalar_type(), a.scalar_type()) == x.scalar_type()) return add_widened(x, a);
  return x + a.to(x.scalar_type());
}

}  // namespace

torch::Tensor DecoderBlockImpl::forward(const torch::Tensor& x, const RotaryEmbedding& rope, const TokenLayout* layout) {
  // The residual stream stays fp32; sublayer outputs (compute dtype) are promoted on add.
  // Norms write their output directly in the compute dtype the projections read.
  // With tensor parallelism, comm points wrap each sublayer: f before (all-reduce backward),
  // g after (all-reduce forward of the row-parallel partial sums).
  const auto dtype = self_attn->q_proj->compute_dtype();
  if (shards_ != nullptr && shards_->size > 1) {  // x holds this process's tokens
    // Each region's gathered input is released after its forward and gathered again in its
    // backward (release_gathered): between the two only this process's tokens are kept.
    const auto a_local = input_layernorm->normalize(x, dtype);
    const auto a_all = sequence_gather(*shards_, CommPoint::kAttentionInput, layer_, a_local);
    auto a = release_gathered(*shards_, CommPoint::kAttentionInput, layer_, self_attn->forward(a_all, rope, layout), a_local, a_all);
    a = sequence_reduce_scatter(*shards_, CommPoint::kAttentionOutput, layer_, a);
    auto h = residual_add(x, a);
    const auto m_local = post_attention_layernorm->normalize(h, dtype);
    const auto m_all = sequence_gather(*shards_, CommPoint::kMlpInput, layer_, m_local);
    auto m = release_gathered(*shards_, CommPoint::kMlpInput, layer_, mlp(m_all), m_local, m_all);
    m = sequence_reduce_scatter(*shards_, CommPoint::kMlpOutput, layer_, m);
    return residual_add(h, m);
  }
  if (comm_ == nullptr || !*comm_) {
    auto h = residual_add(x, self_attn->forward(input_layernorm->normalize(x, dtype), rope, layout));
    return residual_add(h, mlp(post_attention_layernorm->normalize(h, dtype)));
  }
  auto a = comm_point(comm_, CommPoint::kAttentionInput, layer_, input_layernorm->normalize(x, dtype));
  a = comm_point(comm_, CommPoint::kAttentionOutput, layer_, self_attn->forward(a, rope, layout));
  auto h = residual_add(x, a);
  auto m = comm_point(comm_, CommPoint::kMlpInput, layer_, post_attention_layernorm->normalize(h, dtype));
  m = comm_point(comm_, CommPoint::kMlpOutput, layer_, mlp(m));
  return residual_add(h, m);
}

torch::Tensor DecoderBlockImpl::forward_cached(const torch::Tensor& x, const RotaryEmbedding& rope, LayerKvCache& cache) {
  const auto dtype = self_attn->q_proj->compute_dtype();
  auto a = comm_point(comm_, CommPoint::kAttentionInput, layer_, input_layernorm->normalize(x, dtype));
  a = comm_point(comm_, CommPoint::kAttentionOutput, layer_, self_attn->forward_cached(a, rope, cache));
  auto h = residual_add(x, a);
  auto m = comm_point(comm_, CommPoint::kMlpInput, layer_, post_attention_layernorm->normalize(h, dtype));
  m = comm_point(comm_, CommPoint::kMlpOutput, layer_, mlp(m));
  return residual_add(h, m);
}

void set_weight_grads_deferrable(torch::nn::Module& module, bool deferrable) {
  if (auto* self = module.as<LinearImpl>()) self->set_weight_grad_deferrable(deferrable);
  for (auto& child : module.modules(/*include_self=*/false)) {
    if (auto* linear = child->as<LinearImpl>()) linear->set_weight_grad_deferrable(deferrable);
  }
}

void set_compute_dtype(torch::nn::Module& module, torch::Dtype dtype) {
  if (auto* self = module.as<LinearImpl>()) self->set_compute_dtype(dtype);
  for (auto& child : module.modules(/*include_self=*/false)) {
    if (auto* linear = child->as<LinearImpl>()) linear->set_compute_dtype(dtype);
  }
}

}  // namespace weft
