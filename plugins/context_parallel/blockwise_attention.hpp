// Blockwise causal attention with its log-sum-exp: the arithmetic of ring attention (and of
// FlashAttention's outer loop), in ATen ops on any device. A block is queries q [B, H, sq, D]
// at global positions q_position.. against keys and values k, v [B, Hkv, sk, D] at
// k_position.. (H a multiple of Hkv: query head h uses kv head h / (H / Hkv), as causal_attention).
// The forward merges blocks into a running fp32 output and log-sum-exp (online softmax), so that
// after every block of keys has been merged the output is attention over all of them; the
// backward recomputes a block's probabilities from the final log-sum-exp and adds the block's
// gradients (never storing a [sq, sk] matrix past the call, and computing it a tile of queries at a
// time). Scores and softmax are fp32; the two GEMMs of each product run in q's dtype, as the
// model's causal attention's.
// Ring attention's maths, in its plugin's folder: context_parallel.so computes with it.
#ifndef WEFT_PLUGINS_CONTEXT_PARALLEL_BLOCKWISE_ATTENTION_HPP
#define WEFT_PLUGINS_CONTEXT_PARALLEL_BLOCKWISE_ATTENTION_HPP

#include <cstdint>

#include <torch/types.h>

namespace weft {
namespace context_parallel {

struct AttentionBlockSpan {
  int64_t q_position = 0;  // global position of the first query
  int64_t k_position = 0;  // and of the first key
  bool causal = true;      // the key at pk is seen by the query at pq iff pk <= pq
  double scale = 1.0;      // softmax scale
};

// Forward: out (fp32 [B, H, sq, D]) and lse (fp32 [B, H, sq]) get this block's output and
// log-sum-exp (accumulate = false) or the merge of theirs with it (accumulate = true). A query
// that sees no key of the block keeps its values (lse -inf and out 0 when written). out and lse
// may be strided views; they are written in place.
void attention_block_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const AttentionBlockSpan& span, torch::Tensor& out, torch::Tensor& lse, bool accumulate);

// Backward: with the final out and lse of these queries (over all blocks) and grad_out, adds the
// block's gradients to grad_q (fp32 [B, H, sq, D]), grad_k and grad_v (fp32 [B, Hkv, sk, D]).
void attention_block_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const AttentionBlockSpan& span, const torch::Tensor& out, const torch::Tensor& lse,
                              const torch::Tensor& grad_out, torch::Tensor& grad_q, torch::Tensor& grad_k,
                              torch::Tensor& grad_v);

// The size of the fp32 scores a block computes at once (default 8 MiB): blocks are computed one
// tile of queries at a time so that their transient memory stays bounded. Returns the previous
// value (tests make tiles of a few rows).
int64_t set_attention_block_tile_bytes(int64_t bytes);

}  // namespace context_parallel
}  // namespace weft

#endif
