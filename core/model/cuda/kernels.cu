// The CUDA kernels of core/model/cuda/kernels.h: one thread block per row for the row-wise ones
// (RMSNorm, SwiGLU, RoPE per token, cross-entropy per token), fp32 arithmetic throughout.
#include "core/model/cuda/kernels.h"

#include <cuda_bf16.h>

#include <cmath>

namespace weft::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// The sum (or max) of one value per thread over the block, returned to every thread. blockDim.x
// is a multiple of 32, at most 1024.
template <bool kMax>
__device__ float block_reduce(float v) {
  __shared__ float warp_results[32];
  __shared__ float result;
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  __syncthreads();  // the previous call's readers are done with warp_results and result
  if (lane == 0) warp_results[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? warp_results[lane] : (kMax ? -INFINITY : 0.0f);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v, offset);
      v = kMax ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) result = v;
  }
  __syncthreads();
  return result;
}

template <typename X, typename Y>
__global__ void rms_norm_forward_kernel(const X* x, const float* w, Y* y, float* rstd, int64_t dim, float eps) {
  const int64_t row = blockIdx.x;
  const X* xr = x + row * dim;
  Y* yr = y + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = load(xr, i);
    sum += v * v;
  }
  const float rs = 1.0f / sqrtf(block_reduce<false>(sum) / static_cast<float>(dim) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) store(yr, i, load(xr, i) * rs * w[i]);
}

constexpr int kMaxColumnsPerThread = static_cast<int>(kRmsNormMaxDim / kThreads);

// Block b handles rows [rows * b / parts, rows * (b + 1) / parts); thread t keeps the weight
// gradient of columns t, t + 256, ... in registers and writes them to its block's partial row.
template <typename G, typename X>
__global__ void rms_norm_backward_kernel(const G* g, const X* x, const float* w, const float* rstd, X* gx,
                                         float* gw_partial, int64_t rows, int64_t dim) {
  const int64_t parts = gridDim.x, part = blockIdx.x;
  float acc[kMaxColumnsPerThread];
#pragma unroll
  for (int k = 0; k < kMaxColumnsPerThread; ++k) acc[k] = 0.0f;
  for (int64_t row = rows * part / parts; row < rows * (part + 1) / parts; ++row) {
    const G* gr = g + row * dim;
    const X* xr = x + row * dim;
    X* gxr = gx + row * dim;
    const float rs = rstd[row];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxColumnsPerThread; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kThreads;
      if (i < dim) dot += load(gr, i) * load(xr, i) * w[i];
    }
    const float coef = rs * rs * rs * block_reduce<false>(dot) / static_cast<float>(dim);
#pragma unroll
    for (int k = 0; k < kMaxColumnsPerThread; ++k) {
      const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kThreads;
      if (i < dim) {
        const float gi = load(gr, i), xi = load(xr, i);
        store(gxr, i, rs * w[i] * gi - xi * coef);
        acc[k] += gi * xi * rs;
      }
    }
  }
  if (gw_partial == nullptr) return;
#pragma unroll
  for (int k = 0; k < kMaxColumnsPerThread; ++k) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(k) * kThreads;
    if (i < dim) gw_partial[part * dim + i] = acc[k];
  }
}

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* in, T* out, int64_t width) {
  const int64_t row = blockIdx.x;
  const T* gate = in + row * 2 * width;
  const T* up = gate + width;
  T* o = out + row * width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float gi = load(gate, i);
    store(o, i, gi * sigmoid(gi) * load(up, i));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* in, const T* gout, T* grad, int64_t width) {
  const int64_t row = blockIdx.x;
  const T* gate = in + row * 2 * width;
  const T* up = gate + width;
  const T* go = gout + row * width;
  T* gg = grad + row * 2 * width;
  T* gu = gg + width;
  for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    const float gi = load(gate, i), ui = load(up, i), goi = load(go, i);
    const float sig = sigmoid(gi);
    store(gg, i, goi * ui * (sig * (1.0f + gi * (1.0f - sig))));
    store(gu, i, goi * (gi * sig));
  }
}

// One block per token (b, t): every head's pairs (i, i + D/2).
template <typename T>
__global__ void qkv_rope_kernel(T* qkv, T* q, T* k, T* v, const float* cos, const float* sin, int64_t seq,
                                int heads, int kv_heads, int dim, bool inverse) {
  const int64_t bt = blockIdx.x, b = bt / seq, t = bt % seq;
  const int total = heads + 2 * kv_heads, half = dim / 2;
  const float* c = cos + t * dim;
  const float* s = sin + t * dim;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int p = threadIdx.x; p < total * half; p += blockDim.x) {
    const int n = p / half, i = p % half;
    T* fused = qkv + (bt * total + n) * dim;
    T* split;
    if (n < heads) {
      split = q + ((b * heads + n) * seq + t) * dim;
    } else if (n < heads + kv_heads) {
      split = k + ((b * kv_heads + (n - heads)) * seq + t) * dim;
    } else {
      split = v + ((b * kv_heads + (n - heads - kv_heads)) * seq + t) * dim;
      T* dst = inverse ? fused : split;
      const T* src = inverse ? split : fused;
      dst[i] = src[i];
      dst[i + half] = src[i + half];
      continue;
    }
    T* dst = inverse ? fused : split;
    const T* src = inverse ? split : fused;
    const float x1 = load(src, i), x2 = load(src, i + half);
    store(dst, i, x1 * c[i] - x2 * (sign * s[i]));
    store(dst, i + half, x2 * c[i + half] + x1 * (sign * s[i + half]));
  }
}

constexpr int kLossThreads = 512;

template <typename T>
__global__ void cross_entropy_forward_kernel(const T* logits, const int64_t* targets, float* loss, float* lse,
                                             int64_t vocab) {
  const int64_t row = blockIdx.x;
  const T* lr = logits + row * vocab;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, load(lr, j));
  m = block_reduce<true>(m);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(load(lr, j) - m);
  sum = block_reduce<false>(sum);
  if (threadIdx.x == 0) {
    const float log_sum = m + logf(sum);
    const int64_t target = targets[row];
    lse[row] = log_sum;
    loss[row] = target >= 0 && target < vocab ? log_sum - load(lr, target) : 0.0f;
  }
}

template <typename T>
__global__ void cross_entropy_backward_kernel(const T* logits, const int64_t* targets, const float* lse,
                                              const float* grad_sum, T* grad, int64_t vocab) {
  const int64_t row = blockIdx.x;
  const int64_t target = targets[row];
  const T* lr = logits + row * vocab;
  T* gr = grad + row * vocab;
  if (target < 0 || target >= vocab) {
    for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) store(gr, j, 0.0f);
    return;
  }
  const float scale = *grad_sum, log_sum = lse[row];
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float p = expf(load(lr, j) - log_sum);
    store(gr, j, scale * (j == target ? p - 1.0f : p));
  }
}

// One thread per element.
template <typename T>
__global__ void int8_dequantize_kernel(const int8_t* data, const float* scale, T* out, int64_t n, int64_t cols) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  store(out, i, __fmul_rn(static_cast<float>(data[i]), __fdiv_rn(scale[i / cols], 127.0f)));
}

// One thread per packed byte: two elements of the same block of 64.
template <typename T>
__global__ void nf4_dequantize_kernel(const uint8_t* packed, const float* code, const float* absmax,
                                      const uint8_t* absmax_codes, const float* dynamic_code, const float* scale2,
                                      const float* offset, T* out, int64_t n) {
  const int64_t byte = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t first = 2 * byte;
  if (first >= n) return;
  const int64_t block = first / 64;
  const float scale = absmax != nullptr ? absmax[block]
                                        : __fadd_rn(__fmul_rn(dynamic_code[absmax_codes[block]], scale2[block / 256]),
                                                    offset[0]);
  const unsigned bits = packed[byte];
  store(out, first, __fmul_rn(code[bits >> 4], scale));
  if (first + 1 < n) store(out, first + 1, __fmul_rn(code[bits & 15u], scale));
}

// Calls f(T{}) with T = float or __nv_bfloat16.
template <typename F>
void dispatch(Dtype type, F&& f) {
  if (type == Dtype::kFloat32) {
    f(float{});
  } else {
    f(__nv_bfloat16{});
  }
}

cudaError_t launched() { return cudaGetLastError(); }

}  // namespace

cudaError_t rms_norm_forward(const void* x, Dtype x_type, const float* w, void* y, Dtype y_type, float* rstd,
                             int64_t rows, int64_t dim, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  dispatch(x_type, [&](auto x_tag) {
    using X = decltype(x_tag);
    dispatch(y_type, [&](auto y_tag) {
      using Y = decltype(y_tag);
      rms_norm_forward_kernel<X, Y><<<rows, kThreads, 0, stream>>>(static_cast<const X*>(x), w, static_cast<Y*>(y),
                                                                 rstd, dim, eps);
    });
  });
  return launched();
}

int64_t rms_norm_backward_parts(int64_t rows) { return rows < 512 ? rows : 512; }

cudaError_t rms_norm_backward(const void* g, Dtype g_type, const void* x, Dtype x_type, const float* w,
                              const float* rstd, void* gx, float* gw_partial, int64_t rows, int64_t dim,
                              cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (dim > kRmsNormMaxDim) return cudaErrorInvalidValue;
  const auto parts = static_cast<unsigned>(rms_norm_backward_parts(rows));
  dispatch(g_type, [&](auto g_tag) {
    using G = decltype(g_tag);
    dispatch(x_type, [&](auto x_tag) {
      using X = decltype(x_tag);
      rms_norm_backward_kernel<G, X><<<parts, kThreads, 0, stream>>>(
          static_cast<const G*>(g), static_cast<const X*>(x), w, rstd, static_cast<X*>(gx), gw_partial, rows, dim);
    });
  });
  return launched();
}

cudaError_t swiglu_forward(const void* in, void* out, Dtype type, int64_t rows, int64_t width, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<rows, kThreads, 0, stream>>>(static_cast<const T*>(in), static_cast<T*>(out), width);
  });
  return launched();
}

cudaError_t swiglu_backward(const void* in, const void* gout, void* grad, Dtype type, int64_t rows, int64_t width,
                            cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<rows, kThreads, 0, stream>>>(static_cast<const T*>(in), static_cast<const T*>(gout),
                                                             static_cast<T*>(grad), width);
  });
  return launched();
}

cudaError_t qkv_rope(void* qkv, void* q, void* k, void* v, Dtype type, const float* cos, const float* sin,
                     int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim, bool inverse,
                     cudaStream_t stream) {
  if (batch * seq == 0) return cudaSuccess;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    qkv_rope_kernel<T><<<batch * seq, kThreads, 0, stream>>>(
        static_cast<T*>(qkv), static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), cos, sin, seq,
        static_cast<int>(heads), static_cast<int>(kv_heads), static_cast<int>(dim), inverse);
  });
  return launched();
}

cudaError_t cross_entropy_forward(const void* logits, Dtype type, const int64_t* targets, float* loss, float* lse,
                                  int64_t rows, int64_t vocab, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_forward_kernel<T><<<rows, kLossThreads, 0, stream>>>(static_cast<const T*>(logits), targets, loss,
                                                                       lse, vocab);
  });
  return launched();
}

cudaError_t cross_entropy_backward(const void* logits, Dtype type, const int64_t* targets, const float* lse,
                                   const float* grad_sum, void* grad, int64_t rows, int64_t vocab,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_backward_kernel<T><<<rows, kLossThreads, 0, stream>>>(
        static_cast<const T*>(logits), targets, lse, grad_sum, static_cast<T*>(grad), vocab);
  });
  return launched();
}

cudaError_t int8_dequantize(const int8_t* data, const float* scale, void* out, Dtype type, int64_t rows, int64_t cols,
                            cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return cudaSuccess;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    int8_dequantize_kernel<T><<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(data, scale, static_cast<T*>(out),
                                                                                       n, cols);
  });
  return launched();
}

cudaError_t nf4_dequantize(const uint8_t* packed, const float* code, const float* absmax, const uint8_t* absmax_codes,
                           const float* dynamic_code, const float* scale2, const float* offset, void* out, Dtype type,
                           int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t bytes = (n + 1) / 2;
  dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    nf4_dequantize_kernel<T><<<(bytes + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        packed, code, absmax, absmax_codes, dynamic_code, scale2, offset, static_cast<T*>(out), n);
  });
  return launched();
}

}  // namespace weft::cuda
