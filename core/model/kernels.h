// Fused CPU kernels for the decoder block, each an autograd function with a hand-written
// backward pass, and the ATen formulations they replace. The fused_* entry points run the
// hand-written kernel on CPU tensors of fp32 or bf16 and the ATen formulation (aten_*) on anything
// else: CUDA tensors (ATen's kernels there) and fp16. The CPU is one backend among others; the
// kernels test checks each fused kernel against its ATen formulation, values and gradients.
//
// The hand-written kernels read and write fp32 or bf16 tensors and always compute in fp32, so one
// pass over memory replaces the several elementwise kernels (and dtype casts) that the
// equivalent chain of ATen ops would run. Results equal the ATen formulation up to
// floating-point rounding order.
#pragma once

#include <cstdint>
#include <tuple>

#include <torch/types.h>

namespace weft {

// RMSNorm: y = weight * x / sqrt(mean(x^2, -1) + eps), returned in `out_dtype` (fp32 or bf16).
// x [..., D] is fp32 or bf16, weight [D] fp32. Gradients flow to x and weight.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             torch::Dtype out_dtype);

// SwiGLU on a fused gate/up projection: gate_up [..., 2I] -> silu(gate) * up [..., I] with
// gate = gate_up[..., :I], up = gate_up[..., I:], in gate_up's dtype (fp32 or bf16). exp() is a
// vectorisable polynomial approximation (about 1 ulp in fp32).
torch::Tensor fused_swiglu(const torch::Tensor& gate_up);

// Splits a fused q/k/v projection qkv [B, T, (H + 2 KVH) * D] into q [B, H, T, D] and
// k, v [B, KVH, T, D] (contiguous, in qkv's dtype) and applies rotary embeddings to q and k
// with cos/sin [T, D] (fp32, HF rotate_half layout: both halves of a row equal): the same values as transposing the heads
// and calling apply_rotary, in one pass.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> split_qkv_with_rope(
    const torch::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const torch::Tensor& cos,
    const torch::Tensor& sin);

// The ATen formulations: the same values up to rounding order, on every device and dtype.
torch::Tensor aten_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Dtype out_dtype);
torch::Tensor aten_swiglu(const torch::Tensor& gate_up);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> aten_split_qkv_with_rope(
    const torch::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const torch::Tensor& cos,
    const torch::Tensor& sin);

}  // namespace weft
