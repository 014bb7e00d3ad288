// Fused CUDA kernels for the decoder block and the loss: the CUDA backend of core/model/kernels.h.
// Each computes exactly what its CPU kernel there computes (fp32 math over fp32 or bf16 storage,
// one pass over memory instead of a chain of ATen elementwise kernels), on raw device pointers and
// the caller's stream; kernels.cpp wraps them in the same autograd functions as the CPU kernels.
// Compiled by nvcc only in builds with CUDA (WEFT_WITH_CUDA); no LibTorch headers here.
//
// Every function launches asynchronously on `stream` and returns the launch's status
// (cudaSuccess, or the error cudaGetLastError reports). Pointers are device pointers to
// contiguous row-major data; `rows` x `dim` (or `width`, `vocab`) elements.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace weft::cuda {

enum class Dtype { kFloat32, kBFloat16 };

// The widest row rms_norm_backward handles (its per-thread weight-gradient accumulators).
constexpr int64_t kRmsNormMaxDim = 8192;

// y = w * x / sqrt(mean(x^2) + eps) per row, in y's dtype; rstd[r] = 1 / sqrt(mean + eps).
cudaError_t rms_norm_forward(const void* x, Dtype x_type, const float* w, void* y, Dtype y_type, float* rstd,
                             int64_t rows, int64_t dim, float eps, cudaStream_t stream);

// The number of partial weight-gradient rows rms_norm_backward writes for `rows` rows.
int64_t rms_norm_backward_parts(int64_t rows);

// gx (x's dtype) from the output gradient g; when gw_partial is not null, it receives
// [rms_norm_backward_parts(rows), dim] fp32 partial sums of the weight gradient (sum them over
// the first dimension). dim <= kRmsNormMaxDim.
cudaError_t rms_norm_backward(const void* g, Dtype g_type, const void* x, Dtype x_type, const float* w,
                              const float* rstd, void* gx, float* gw_partial, int64_t rows, int64_t dim,
                              cudaStream_t stream);

// out[r, i] = silu(in[r, i]) * in[r, width + i]; in is [rows, 2 * width], out [rows, width].
cudaError_t swiglu_forward(const void* in, void* out, Dtype type, int64_t rows, int64_t width, cudaStream_t stream);

// grad [rows, 2 * width]: the gradients of gate and up from the output's gradient gout.
cudaError_t swiglu_backward(const void* in, const void* gout, void* grad, Dtype type, int64_t rows, int64_t width,
                            cudaStream_t stream);

// Forward (inverse = false): qkv [B, T, (H + 2 KVH) * D] -> q [B, H, T, D], k and v [B, KVH, T, D],
// rotating q and k by cos/sin [T, D] (HF's rotate_half layout). Inverse: the gradients of q, k, v
// -> the gradient of qkv (rotation by the opposite angle).
cudaError_t qkv_rope(void* qkv, void* q, void* k, void* v, Dtype type, const float* cos, const float* sin,
                     int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim, bool inverse,
                     cudaStream_t stream);

// Per row: lse[r] = log(sum(exp(logits[r]))) and loss[r] = lse[r] - logits[r, targets[r]] (fp32); a
// target outside [0, vocab) (PyTorch's ignore_index -100) gives loss 0.
cudaError_t cross_entropy_forward(const void* logits, Dtype type, const int64_t* targets, float* loss, float* lse,
                                  int64_t rows, int64_t vocab, cudaStream_t stream);

// grad[r, j] = grad_sum * (softmax(logits[r])[j] - (j == targets[r])) in logits' dtype, 0 on an
// ignored row; grad_sum is the gradient of the losses' sum (one fp32 on the device).
cudaError_t cross_entropy_backward(const void* logits, Dtype type, const int64_t* targets, const float* lse,
                                   const float* grad_sum, void* grad, int64_t rows, int64_t vocab,
                                   cudaStream_t stream);

// Dequantization of frozen quantized weights (core/model/quantize.h's layouts), into fp32 or bf16
// `out` [rows * cols], with the ATen formulation's fp32 arithmetic (each product and sum rounded on
// its own, no fused multiply-add), so both give the same values.
// int8: out[r, c] = data[r, c] * (scale[r] / 127).
cudaError_t int8_dequantize(const int8_t* data, const float* scale, void* out, Dtype type, int64_t rows, int64_t cols,
                            cudaStream_t stream);

// nf4: element i (of n) is code[nibble i of packed, high nibble first] * absmax of block i / 64, the
// absmax being absmax[b] where `absmax` is not null, else dynamic_code[absmax_codes[b]] *
// scale2[b / 256] + offset[0] (double quantization). code holds 16 values, dynamic_code 256.
cudaError_t nf4_dequantize(const uint8_t* packed, const float* code, const float* absmax, const uint8_t* absmax_codes,
                           const float* dynamic_code, const float* scale2, const float* offset, void* out, Dtype type,
                           int64_t n, cudaStream_t stream);

}  // namespace weft::cuda
