// Fused kernels for the decoder block and the loss, each an autograd function with a hand-written
// backward pass, and the ATen formulations they replace. Two backends: the CPU loops in
// kernels.cpp, and CUDA kernels (core/model/cuda, compiled where LibTorch and the machine have
// CUDA). The fused_* entry points run the hand-written kernel on CPU or CUDA tensors of fp32 or
// bf16 and the ATen formulation (aten_*) on anything else (fp16, other devices, a CPU-only build's
// CUDA tensors). The kernels test checks each fused kernel against its ATen formulation, values
// and gradients, on the CPU and, where a GPU is visible, on CUDA.
//
// The hand-written kernels read and write fp32 or bf16 tensors and always compute in fp32, so one
// pass over memory replaces the several elementwise kernels (and dtype casts) that the
// equivalent chain of ATen ops would run. Results equal the ATen formulation up to
// floating-point rounding order.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

#include <torch/types.h>

namespace weft {

// RMSNorm: y = weight * x / sqrt(mean(x^2, -1) + eps), returned in `out_dtype` (fp32 or bf16).
// x [..., D] is fp32 or bf16, weight [D] fp32. Gradients flow to x and weight.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             torch::Dtype out_dtype);

// SwiGLU on a fused gate/up projection: gate_up [..., 2I] -> silu(gate) * up [..., I] with
// gate = gate_up[..., :I], up = gate_up[..., I:], in gate_up's dtype (fp32 or bf16). On the CPU exp() is a
// vectorisable polynomial approximation (about 1 ulp in fp32).
torch::Tensor fused_swiglu(const torch::Tensor& gate_up);

// Splits a fused q/k/v projection qkv [B, T, (H + 2 KVH) * D] into q [B, H, T, D] and
// k, v [B, KVH, T, D] (contiguous, in qkv's dtype) and applies rotary embeddings to q and k
// with cos/sin [T, D], or [B, T, D] for a table per row (fp32, HF rotate_half layout: both halves of a row equal): the
// same values as transposing the heads and calling apply_rotary, in one pass.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> split_qkv_with_rope(
    const torch::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const torch::Tensor& cos,
    const torch::Tensor& sin);

// The sum over rows of the cross-entropy of logits [N, V] against targets [N] (int64; -100 is
// ignored; on CUDA any target outside [0, V) is too, elsewhere it is an error), in fp32. On CUDA
// tensors of fp32 or bf16 a fused kernel pair that reads the logits in their dtype (no fp32 copy of
// the [N, V] logits, forward or backward); on CPU ones cross_entropy_rows forward and backward;
// elsewhere ATen's cross_entropy over an fp32 copy.
torch::Tensor cross_entropy_sum_of(const torch::Tensor& logits, const torch::Tensor& targets);

// Attention's causal softmax over blocks of score rows [N, R, W] (CPU, fp32 or bf16, contiguous):
// in each of the N, row r holds the scores of the query at position first + r / group (`group`
// grouped-query heads' rows per position, position-major) over keys 0..W-1, and the keys past the
// query are masked (first + R / group <= W). In place: P = softmax(scale * scores) over keys <=
// query in fp32, 0 after, in the scores' dtype.
void causal_softmax_rows_(torch::Tensor& scores, double scale, int64_t group = 1, int64_t first = 0);
// Its backward in place over dp, the gradient of P: scale * P * (dp - rowsum(P * dp)) (the scores'
// gradient), 0 past the query.
void causal_softmax_backward_rows_(const torch::Tensor& p, torch::Tensor& dp, double scale, int64_t group = 1,
                                   int64_t first = 0);

// Per-row cross-entropy of CPU or CUDA logits [N, V] (contiguous, fp32 or bf16) against targets
// [N] (ignore_index: loss 0; any other target outside [0, V) is an error on the CPU and ignored on
// CUDA, as cross_entropy_sum_of): lse(row) - row[target] in fp32, each row read in its dtype with
// no fp32 copy of the logits. With `grad_scale`, the logits are then overwritten in place by
// grad_scale * (softmax(row) - onehot(target)) in their dtype (0 on ignored rows): the gradient of
// grad_scale * the losses' sum. On the CPU exp() is exp_approx's polynomial (about 1 ulp in fp32);
// on CUDA cross_entropy_sum_of's kernels. A non-finite logit gives a NaN loss.
bool cross_entropy_rows_applies(const torch::Tensor& logits);
torch::Tensor cross_entropy_rows(torch::Tensor& logits, const torch::Tensor& targets, int64_t ignore_index,
                                 std::optional<double> grad_scale);

// sum(t^2) accumulated in fp64, as a 0-dim fp64 tensor on t's device (what gradient clipping and
// the host's tensor_squared_norm compute), in bounded memory. On contiguous CPU tensors of fp32 or
// bf16 one pass over t in its dtype (fixed blocks summed in order: the same result at any thread
// count); elsewhere chunks of at most kSquaredSumChunk elements widened to fp64 (a whole fp64 copy
// of a 128k x 2048 embedding's gradient would cost 1-2 GiB at the step's peak).
inline constexpr int64_t kSquaredSumChunk = int64_t{1} << 22;  // 32 MiB of fp64
at::Tensor squared_sum_fp64(const at::Tensor& t);

// sum += x, x widened to sum's dtype: on contiguous CPU tensors of the same shape, fp32 += bf16 in
// one pass over both (ATen's add_ of mixed dtypes first makes an fp32 copy of x); elsewhere add_.
void add_into_fp32_(at::Tensor& sum, const at::Tensor& x);
// x + a, a widened to x's dtype: on contiguous CPU tensors of the same shape, fp32 + bf16 in one
// pass (ATen's add of mixed dtypes first makes an fp32 copy of a), the same bits; autograd's: x's
// gradient passed through, a's cast to bf16. Elsewhere x + a. The fp32 residual stream's adds.
torch::Tensor add_widened(const torch::Tensor& x, const torch::Tensor& a);

// Inverted dropout (training): each element kept with probability 1 - p and scaled by 1 / (1 - p),
// else 0, in x's dtype. On CPU tensors of fp32 or bf16 the mask is drawn from a counter-based hash
// of (a seed drawn from LibTorch's default CPU generator, the position), as geometric gaps between
// dropped elements (only those cost a draw; each element dropped independently with probability p
// to within 2^-23), and backward draws it again from the same seed: no mask is stored, and a
// restored generator state (activation checkpointing's recomputation) gives the same mask.
// Elsewhere ATen's dropout. p in [0, 1).
torch::Tensor fused_dropout(const torch::Tensor& x, double p);
// fused_dropout's parts, for a caller that draws the mask again itself: whether x takes the hashed
// mask (a CPU tensor of fp32 or bf16), a seed drawn from LibTorch's default CPU generator, and x
// through the mask of (p, seed) (the same on x's gradient gives the gradient's).
bool seeded_dropout_applies(const torch::Tensor& x);
uint64_t draw_dropout_seed();
torch::Tensor seeded_dropout(const torch::Tensor& x, double p, uint64_t seed);

// seeded_dropout's mask for n elements (of any tensor; at most 2^31 - 1), drawn without applying
// it: the ascending indices of its dropped elements (int32 [count], about p n), for a caller that
// keeps it for backward instead of drawing it again. p in (0, 1).
torch::Tensor dropout_mask_indices(int64_t n, double p, uint64_t seed);
// The kept elements' scale 1 / (1 - p), in fp32 as the mask's passes apply it.
float dropout_scale(double p);

// LoRA's products through its dropout, by the mask's complement (lora_linear): with p small nearly
// every element is kept, so D(x) A^T = (x A^T - x_dropped A^T) / (1 - p), where x_dropped holds x's
// dropped elements and zeros: the dense product over all of x (one GEMM with the other adapters'
// products, as without dropout), less the dropped elements' few terms, which these add up from the
// mask's indices (dropout_mask_indices over x's elements in order); backward likewise. For the
// adapters that take the same x, in one pass over x's rows. x: [R, I] contiguous CPU fp32 or bf16.
// Each sum in fp32 in a fixed order: the same result at any thread count.
struct DroppedAdapter {
  torch::Tensor dropped;  // its mask: the dropped elements' ascending indices (int32)
  torch::Tensor at;       // A^T [I, r], contiguous fp32
  torch::Tensor rows;     // u (forward) or v (backward): [R, r] of x's dtype, unit column stride (a view will do)
  float scale = 1.0f;     // forward's: 1 / (1 - p)
  torch::Tensor grad_a;   // backward's: A's gradient [r, I], contiguous fp32, updated in place
  // Optional: x's dropped elements in the mask's order ([count] of x's dtype, contiguous). Forward
  // fills it; backward then reads it instead of x's scattered elements, which miss in cache.
  torch::Tensor values;
};
// u[i, :] = (u[i, :] - sum over dropped (i, j) of x[i, j] at[j, :]) * scale for each adapter, each
// element rounded once: u = x A^T becomes D(x) A^T.
void subtract_dropped_products_(const torch::Tensor& x, const std::vector<DroppedAdapter>& adapters);
// For v the scaled gradient through each adapter's D(x) A^T, turns the dense products' gradients
// (grad_x + sum v A, grad_a + v^T x) into D's: grad_x[i, j] -= v[i, :] . at[j, :] at each dropped
// (i, j) (grad_x [R, I] contiguous of x's dtype, each adapter's term rounded in adapter order;
// undefined: skipped), and grad_a -= (x_dropped^T v)^T.
void dropped_backward_(torch::Tensor& grad_x, const torch::Tensor& x, const std::vector<DroppedAdapter>& adapters);
// x's gradient through the adapters with their masks, where the CPU multiplies bf16 tiles (AMX):
// grad_x[i, j] += the sum over the adapters whose masks keep (i, j) of v[i, :] . A[:, j], in fp32
// over A rounded to bf16, rounded once into grad_x per three adapters. In place of the dense rank-r
// product that dropped_backward_ then corrects (call it with an undefined x's gradient after: A's
// gradients only). Applies to grad_x [R, I] contiguous bf16 with I a multiple of 16, each adapter's
// rank a multiple of 16, v bf16 (`rows`), on CPUs with AMX-BF16 and AVX512_BF16 that the kernel lets
// use the tiles; returns false, changing nothing, elsewhere. The same bits at any thread count.
bool add_kept_products_(torch::Tensor& grad_x, const std::vector<DroppedAdapter>& adapters);
// Each adapter's A gradient through its mask where the CPU multiplies bf16 tiles (AMX): grad_a =
// v^T D(x) ([r, I] fp32, x's dropped elements zero; the scale is v's), set in place of the dense
// product that dropped_backward_ then corrects. Applies to x [R, I] contiguous bf16 with I a
// multiple of 16, v bf16 with rank a multiple of 16, where add_kept_products_ does; returns false,
// changing nothing, elsewhere. The same bits at any thread count.
bool kept_weight_grads_(const torch::Tensor& x, std::vector<DroppedAdapter>& adapters);
// A^T [I, r] contiguous fp32 of an adapter's A [r, I]: DroppedAdapter's `at`, in one pass from a
// contiguous CPU matrix of fp32 or bf16 (others: a cast and a transposing copy).
torch::Tensor transposed_fp32(const torch::Tensor& a);

// The ATen formulations: the same values up to rounding order, on every device and dtype.
torch::Tensor aten_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Dtype out_dtype);
torch::Tensor aten_swiglu(const torch::Tensor& gate_up);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> aten_split_qkv_with_rope(
    const torch::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const torch::Tensor& cos,
    const torch::Tensor& sin);

}  // namespace weft
