// Blockwise attention with log-sum-exp (plugins/context_parallel/blockwise_attention.hpp), the arithmetic of ring
// attention, against whole causal attention written out with autograd: the sequence cut into
// chunks, every causal (query chunk, key chunk) block merged into strided views of one output
// in an order that is not the sequence's, must give the whole attention's output, log-sum-exp
// and, from the blocks' backward passes, its gradients of q, k and v; with grouped-query heads.
#include <limits>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "blockwise_attention.hpp"

namespace {

using weft::context_parallel::AttentionBlockSpan;

struct Reference {
  torch::Tensor out, lse, grad_q, grad_k, grad_v;
};

// softmax(scale q k^T + causal mask) v with kv heads repeated, and its gradients for grad_out.
Reference whole_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& grad_out) {
  auto q1 = q.detach().clone().requires_grad_(true), k1 = k.detach().clone().requires_grad_(true),
       v1 = v.detach().clone().requires_grad_(true);
  const int64_t group = q.size(1) / k.size(1), seq = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  auto scores = torch::matmul(q1, k1.repeat_interleave(group, 1).transpose(2, 3)) * scale;
  scores = scores.masked_fill(torch::ones({seq, seq}, torch::kBool).triu(1), -std::numeric_limits<float>::infinity());
  auto out = torch::matmul(scores.softmax(-1), v1.repeat_interleave(group, 1));
  out.backward(grad_out);
  return {out.detach(), scores.detach().logsumexp(-1), q1.grad(), k1.grad(), v1.grad()};
}

// The chunks' (query, key) pairs the causal mask keeps, in a deliberately shuffled order, with
// each query chunk's first block writing and the rest merging.
std::vector<std::pair<int64_t, int64_t>> causal_pairs(int64_t chunks) {
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t qc = chunks - 1; qc >= 0; --qc) {
    for (int64_t kc = (qc * 7) % (qc + 1), n = 0; n <= qc; ++n, kc = (kc + 1) % (qc + 1)) pairs.emplace_back(qc, kc);
  }
  return pairs;
}

void expect_blocks_match_whole(int64_t heads, int64_t kv_heads, int64_t chunks) {
  torch::manual_seed(3);
  const int64_t batch = 2, seq = 24, dim = 8, c = seq / chunks;
  const auto q = torch::randn({batch, heads, seq, dim}), k = torch::randn({batch, kv_heads, seq, dim}),
             v = torch::randn({batch, kv_heads, seq, dim}), grad_out = torch::randn({batch, heads, seq, dim});
  const Reference want = whole_attention(q, k, v, grad_out);

  auto out = torch::full({batch, heads, seq, dim}, std::numeric_limits<float>::quiet_NaN());
  auto lse = torch::full({batch, heads, seq}, std::numeric_limits<float>::quiet_NaN());
  std::vector<bool> written(static_cast<size_t>(chunks), false);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  for (const auto& [qc, kc] : causal_pairs(chunks)) {
    auto o = out.narrow(2, qc * c, c), l = lse.narrow(2, qc * c, c);  // strided views
    weft::context_parallel::attention_block_forward(q.narrow(2, qc * c, c), k.narrow(2, kc * c, c), v.narrow(2, kc * c, c),
                                  AttentionBlockSpan{qc * c, kc * c, kc == qc, scale}, o, l,
                                  written[static_cast<size_t>(qc)]);
    written[static_cast<size_t>(qc)] = true;
  }
  EXPECT_TRUE(torch::allclose(out, want.out, 1e-5, 1e-5)) << (out - want.out).abs().max().item<float>();
  EXPECT_TRUE(torch::allclose(lse, want.lse, 1e-5, 1e-5)) << (lse - want.lse).abs().max().item<float>();

  auto grad_q = torch::zeros_like(q), grad_k = torch::zeros_like(k), grad_v = torch::zeros_like(v);
  for (const auto& [qc, kc] : causal_pairs(chunks)) {
    auto gq = grad_q.narrow(2, qc * c, c), gk = grad_k.narrow(2, kc * c, c), gv = grad_v.narrow(2, kc * c, c);
    weft::context_parallel::attention_block_backward(q.narrow(2, qc * c, c), k.narrow(2, kc * c, c), v.narrow(2, kc * c, c),
                                   AttentionBlockSpan{qc * c, kc * c, kc == qc, scale}, out.narrow(2, qc * c, c),
                                   lse.narrow(2, qc * c, c), grad_out.narrow(2, qc * c, c), gq, gk, gv);
  }
  EXPECT_TRUE(torch::allclose(grad_q, want.grad_q, 1e-4, 1e-5)) << (grad_q - want.grad_q).abs().max().item<float>();
  EXPECT_TRUE(torch::allclose(grad_k, want.grad_k, 1e-4, 1e-5)) << (grad_k - want.grad_k).abs().max().item<float>();
  EXPECT_TRUE(torch::allclose(grad_v, want.grad_v, 1e-4, 1e-5)) << (grad_v - want.grad_v).abs().max().item<float>();
}

TEST(BlockwiseAttention, OneBlockIsWholeCausalAttention) { expect_blocks_match_whole(4, 4, 1); }
TEST(BlockwiseAttention, FourChunksMergeToWholeAttention) { expect_blocks_match_whole(4, 4, 4); }
TEST(BlockwiseAttention, GroupedQueryHeadsOverSixChunks) { expect_blocks_match_whole(4, 2, 6); }
TEST(BlockwiseAttention, MultiQueryAttentionOverThreeChunks) { expect_blocks_match_whole(4, 1, 3); }

TEST(BlockwiseAttention, TilesOfAFewQueriesGiveTheSameAnswer) {
  // 2 x 4 x 12 keys x 4 bytes per query row: tiles of 3 queries, causal masks cut across them.
  const int64_t previous = weft::context_parallel::set_attention_block_tile_bytes(2 * 4 * 12 * 4 * 3);
  expect_blocks_match_whole(4, 2, 2);
  weft::context_parallel::set_attention_block_tile_bytes(previous);
}

TEST(BlockwiseAttention, ABlockNoQuerySeesLeavesTheOutputAlone) {
  torch::manual_seed(4);
  const auto q = torch::randn({1, 2, 4, 8}), k = torch::randn({1, 2, 4, 8}), v = torch::randn({1, 2, 4, 8});
  const AttentionBlockSpan later{0, 4, true, 0.5};  // keys at 4..7, queries at 0..3
  auto out = torch::ones({1, 2, 4, 8}), lse = torch::ones({1, 2, 4});
  weft::context_parallel::attention_block_forward(q, k, v, later, out, lse, /*accumulate=*/true);
  EXPECT_TRUE(out.eq(1).all().item<bool>());
  EXPECT_TRUE(lse.eq(1).all().item<bool>());
  weft::context_parallel::attention_block_forward(q, k, v, later, out, lse, /*accumulate=*/false);
  EXPECT_TRUE(out.eq(0).all().item<bool>());
  EXPECT_TRUE(lse.isneginf().all().item<bool>());
  // Merging a real block into that empty state gives the block alone.
  auto want_out = torch::empty_like(out), want_lse = torch::empty_like(lse);
  const AttentionBlockSpan same{0, 0, true, 0.5};
  weft::context_parallel::attention_block_forward(q, k, v, same, want_out, want_lse, false);
  weft::context_parallel::attention_block_forward(q, k, v, same, out, lse, true);
  EXPECT_TRUE(torch::allclose(out, want_out));
  EXPECT_TRUE(torch::allclose(lse, want_lse));
}

TEST(BlockwiseAttention, BfloatInputsStayCloseToFloat) {
  torch::manual_seed(5);
  const auto q = torch::randn({1, 4, 16, 8}), k = torch::randn({1, 2, 16, 8}), v = torch::randn({1, 2, 16, 8});
  const AttentionBlockSpan span{0, 0, true, 1.0 / std::sqrt(8.0)};
  auto out32 = torch::empty({1, 4, 16, 8}), lse32 = torch::empty({1, 4, 16});
  auto out16 = torch::empty({1, 4, 16, 8}), lse16 = torch::empty({1, 4, 16});
  weft::context_parallel::attention_block_forward(q, k, v, span, out32, lse32, false);
  weft::context_parallel::attention_block_forward(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16), span, out16,
                                lse16, false);
  EXPECT_LT((out16 - out32).abs().max().item<float>(), 0.05);
  EXPECT_LT((lse16 - lse32).abs().max().item<float>(), 0.05);
}

}  // namespace
