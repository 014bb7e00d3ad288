#include "blockwise_attention.hpp"

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>

#include <torch/torch.h>

namespace weft {
namespace context_parallel {
namespace {

std::string shape(const torch::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
  return out + "]";
}

// q, k, v grouped by kv head: [B * Hkv, g * sq, D] and [B * Hkv, sk, D] (g = H / Hkv).
struct Grouped {
  int64_t batch, heads, kv_heads, group, sq, sk, dim;
  torch::Tensor q, k, v;
};

// The shapes, and k and v grouped once per block (q: [B, H, sq, D], k, v: [B, Hkv, sk, D]).
Grouped group_kv(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "attention_block: q [B, H, sq, D] and k, v [B, Hkv, sk, D] with Hkv dividing H needed, got ", shape(q),
              ", ", shape(k), ", ", shape(v));
  Grouped g{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2), q.size(3), {}, {}, {}};
  g.k = k.to(q.scalar_type()).reshape({g.batch * g.kv_heads, g.sk, g.dim});
  g.v = v.to(q.scalar_type()).reshape({g.batch * g.kv_heads, g.sk, g.dim});
  return g;
}

// The block's grouped k and v with a tile of its queries q [B, H, sq_tile, D].
Grouped with_queries(const Grouped& kv, const torch::Tensor& q) {
  Grouped g = kv;
  g.sq = q.size(2);
  g.q = q.reshape({g.batch * g.kv_heads, g.group * g.sq, g.dim});
  return g;
}

// No query of the block sees any of its keys.
bool nothing_visible(const Grouped& g, const AttentionBlockSpan& span) {
  return span.causal && span.k_position > span.q_position + g.sq - 1;
}

// scale * q k^T in fp32 [B * Hkv, g * sq, sk], -inf where the causal mask hides the key.
torch::Tensor masked_scores(const Grouped& g, const AttentionBlockSpan& span) {
  auto scores = torch::bmm(g.q, g.k.transpose(1, 2)).to(torch::kFloat32).mul_(span.scale);
  if (span.causal && span.k_position + g.sk - 1 > span.q_position) {  // some key lies after some query
    const auto longs = torch::TensorOptions().dtype(torch::kLong).device(g.q.device());
    const auto hidden = torch::arange(span.k_position, span.k_position + g.sk, longs).unsqueeze(0) >
                        torch::arange(span.q_position, span.q_position + g.sq, longs).unsqueeze(1);  // [sq, sk]
    scores = scores.view({g.batch * g.kv_heads, g.group, g.sq, g.sk})
                 .masked_fill_(hidden, -std::numeric_limits<float>::infinity())
                 .view({g.batch * g.kv_heads, g.group * g.sq, g.sk});
  }
  return scores;
}

// exp(scores - lse) with rows whose lse is -inf (no key seen) all zero.
torch::Tensor probabilities(const torch::Tensor& scores, const torch::Tensor& lse) {
  const auto finite = lse.masked_fill(lse.isinf(), 0.0);
  return (scores - finite.unsqueeze(-1)).exp_();
}

// Queries per tile: the scores and probabilities of a block exist for one tile of queries at a
// time (about tile_bytes each), so a block's transient memory stays bounded however long its
// chunks are (the point of ring attention is that no [L, L] matrix is ever whole).
std::atomic<int64_t> tile_bytes{8 << 20};

int64_t tile_rows(const torch::Tensor& q, const torch::Tensor& k) {
  const int64_t per_row = std::max<int64_t>(1, q.size(0) * q.size(1) * k.size(2) * 4);
  return std::max<int64_t>(1, std::min<int64_t>(q.size(2), tile_bytes.load() / per_row));
}

void forward_tile(const Grouped& g, const AttentionBlockSpan& span, torch::Tensor& out, torch::Tensor& lse,
                  bool accumulate) {
  if (nothing_visible(g, span)) {
    if (!accumulate) {
      out.zero_();
      lse.fill_(-std::numeric_limits<float>::infinity());
    }
    return;
  }
  const auto scores = masked_scores(g, span);
  const auto block_lse = scores.logsumexp(-1);  // [B * Hkv, g * sq]
  const auto block_out = torch::bmm(probabilities(scores, block_lse).to(g.v.scalar_type()), g.v)
                             .to(torch::kFloat32)
                             .view({g.batch, g.heads, g.sq, g.dim});
  const auto block_lse_view = block_lse.view({g.batch, g.heads, g.sq});
  if (!accumulate) {
    out.copy_(block_out);
    lse.copy_(block_lse_view);
    return;
  }
  const auto merged = torch::logaddexp(lse, block_lse_view);
  const auto finite = merged.masked_fill(merged.isinf(), 0.0);
  out.mul_((lse - finite).exp_().unsqueeze(-1)).add_(block_out * (block_lse_view - finite).exp_().unsqueeze(-1));
  lse.copy_(merged);
}

void backward_tile(const Grouped& g, const AttentionBlockSpan& span, const torch::Tensor& out, const torch::Tensor& lse,
                   const torch::Tensor& grad_out, torch::Tensor& grad_q, torch::Tensor& grad_k, torch::Tensor& grad_v) {
  if (nothing_visible(g, span)) return;
  const auto rows = g.batch * g.kv_heads;
  const auto dtype = g.q.scalar_type();
  const auto p = probabilities(masked_scores(g, span), lse.reshape({rows, g.group * g.sq}));  // fp32
  const auto dout = grad_out.reshape({rows, g.group * g.sq, g.dim});
  // D_i = sum_d dout_id out_id: the row's sum of dP * P over all blocks (out is the final one).
  const auto delta = (dout.to(torch::kFloat32) * out.reshape({rows, g.group * g.sq, g.dim})).sum(-1, true);
  const auto dout_c = dout.to(dtype);
  grad_v.add_(torch::bmm(p.to(dtype).transpose(1, 2), dout_c).to(torch::kFloat32).view(grad_v.sizes()));
  const auto dp = torch::bmm(dout_c, g.v.transpose(1, 2)).to(torch::kFloat32);
  const auto ds = (p * (dp - delta)).mul_(span.scale).to(dtype);  // dL/d(q k^T)
  grad_q.add_(torch::bmm(ds, g.k).to(torch::kFloat32).view(grad_q.sizes()));
  grad_k.add_(torch::bmm(ds.transpose(1, 2), g.q).to(torch::kFloat32).view(grad_k.sizes()));
}

}  // namespace

void attention_block_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionBlockSpan& span, torch::Tensor& out, torch::Tensor& lse, bool accumulate) {
  torch::NoGradGuard no_grad;
  const Grouped kv = group_kv(q, k, v);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat32 && lse.dim() == 3 &&
                  lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2) &&
                  lse.scalar_type() == torch::kFloat32,
              "attention_block: out must be fp32 ", shape(q), " and lse fp32 [B, H, sq], got ", shape(out), " and ",
              shape(lse));
  const int64_t sq = q.size(2), tile = tile_rows(q, k);
  for (int64_t t = 0; t < sq; t += tile) {
    const int64_t n = std::min(tile, sq - t);
    AttentionBlockSpan part = span;
    part.q_position += t;
    auto o = out.narrow(2, t, n), l = lse.narrow(2, t, n);
    forward_tile(with_queries(kv, q.narrow(2, t, n)), part, o, l, accumulate);
  }
}

void attention_block_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const AttentionBlockSpan& span, const torch::Tensor& out, const torch::Tensor& lse,
                              const torch::Tensor& grad_out, torch::Tensor& grad_q, torch::Tensor& grad_k,
                              torch::Tensor& grad_v) {
  torch::NoGradGuard no_grad;
  const Grouped kv = group_kv(q, k, v);
  TORCH_CHECK(out.sizes() == q.sizes() && grad_out.sizes() == q.sizes() && grad_q.sizes() == q.sizes() &&
                  grad_k.sizes() == k.sizes() && grad_v.sizes() == v.sizes() && grad_q.scalar_type() == torch::kFloat32 &&
                  grad_k.scalar_type() == torch::kFloat32 && grad_v.scalar_type() == torch::kFloat32,
              "attention_block: backward needs out and grad_out like q ", shape(q), ", fp32 gradients like q, k, v");
  const int64_t sq = q.size(2), tile = tile_rows(q, k);
  for (int64_t t = 0; t < sq; t += tile) {  // grad_k and grad_v sum over the tiles
    const int64_t n = std::min(tile, sq - t);
    AttentionBlockSpan part = span;
    part.q_position += t;
    auto gq = grad_q.narrow(2, t, n);
    backward_tile(with_queries(kv, q.narrow(2, t, n)), part, out.narrow(2, t, n), lse.narrow(2, t, n),
                  grad_out.narrow(2, t, n), gq, grad_k, grad_v);
  }
}

int64_t set_attention_block_tile_bytes(int64_t bytes) { return tile_bytes.exchange(std::max<int64_t>(1, bytes)); }

}  // namespace context_parallel
}  // namespace weft
