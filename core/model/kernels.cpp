#include "core/model/kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "core/util/error.h"

// at::parallel_for splits this file's loops among LibTorch's threads only where OpenMP compiles it
// (on a LibTorch that runs its loops on OpenMP, as PyTorch's wheels do): cmake/libtorch.cmake.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "core/model/kernels.cpp needs OpenMP (-fopenmp) with this LibTorch: its loops would run on one thread"
#endif

#ifdef WEFT_WITH_CUDA  // the CUDA backend: core/model/cuda
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/model/cuda/kernels.h"
#endif

// The loops below only vectorise if GCC may if-convert float comparisons (the clamp in
// exp_approx, bf16 rounding's NaN test); this changes no results, only allows that.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

// WEFT_SIMD_CLONES: GCC function multi-versioning for x86-64 (an ifunc picks the clone for the
// CPU at load time); elsewhere the plain function.
// The loops they run are WEFT_ALWAYS_INLINE, so that each clone compiles them for its target.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WEFT_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WEFT_SIMD_CLONES
#endif
#define WEFT_ALWAYS_INLINE inline __attribute__((always_inline))

namespace weft {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Element storage: float for fp32, Bf16Bits (the raw bits) for bf16. The conversions are written
// out here rather than taken from c10::BFloat16 so they inline into the vectorised loops.
using Bf16Bits = uint16_t;

WEFT_ALWAYS_INLINE float to_float(float v) { return v; }
WEFT_ALWAYS_INLINE float to_float(Bf16Bits v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T>
inline T from_float(float v);
template <>
WEFT_ALWAYS_INLINE float from_float<float>(float v) { return v; }
// Round to nearest even, NaN to the canonical quiet NaN: as c10::BFloat16(float).
template <>
WEFT_ALWAYS_INLINE Bf16Bits from_float<Bf16Bits>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<Bf16Bits>(v != v ? 0x7FC0u : rounded);
}

template <typename T>
T* data(const torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Calls f(T{}) with T = float or Bf16Bits matching `dtype`.
template <typename F>
void dispatch_float_or_bf16(torch::Dtype dtype, const char* what, F&& f) {
  if (dtype == torch::kFloat32) {
    f(float{});
  } else if (dtype == torch::kBFloat16) {
    f(Bf16Bits{});
  } else {
    fail("{}: expected an fp32 or bf16 tensor, got {}", what, std::string(c10::toString(dtype)));
  }
}

// Sum of a[i] * b[i] * c[i] over n elements in fp32 with 8 partial sums (vectorisable).
template <typename A, typename B>
float dot3(const A* a, const B* b, const float* c, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += to_float(a[i + j]) * to_float(b[i + j]) * c[i + j];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += to_float(a[i]) * to_float(b[i]) * c[i];
  for (int j = 0; j < 8; ++j) total += acc[j];
  return total;
}

template <typename X>
float sum_of_squares(const X* x, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float v = to_float(x[i + j]);
      acc[j] += v * v;
    }
  }
  float total = 0.0f;
  for (; i < n; ++i) total += to_float(x[i]) * to_float(x[i]);
  for (int j = 0; j < 8; ++j) total += acc[j];
  return total;
}

// exp(x - n ln2) for a float or a GCC vector of floats: the range reduction by ln2 in two parts and
// Cephes' degree-6 polynomial (exp_approx and exp_approx16 scale it by 2^n).
template <typename F>
WEFT_ALWAYS_INLINE F exp_of_reduced(F x, F n) {
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}
// exp(x) for x in fp32 without branches or library calls, so loops over it vectorise: Cephes'
// range reduction x = n ln2 + r and degree-6 polynomial, then scaling by 2^n through the
// exponent bits. Inputs are clamped to [-87.3, 88.3] (the results stay normal and finite).
WEFT_ALWAYS_INLINE float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.3f ? 88.3f : x;
  // t > 0, so truncation is floor: n = round(x / ln2), biased by 127 as in the exponent field.
  const int32_t biased = static_cast<int32_t>(x * 1.44269504088896341f + 127.5f);
  const int32_t bits = biased << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_of_reduced(x, static_cast<float>(biased - 127)) * scale;
}

// GCC's vector types of 16 fp32 lanes (one AVX-512 register; two AVX2 ones): loops written on
// them vectorise as written, where a plain loop may not, or may be if-converted into computing
// both sides of a branch for every lane (SwiGLU's did: a division by exp(87.3) whose denormal
// results, blended away, still cost microcode assists on every vector).
constexpr int64_t kLanes = 16;
typedef float Lanes16 __attribute__((vector_size(64)));
typedef int32_t Int16s __attribute__((vector_size(64)));
typedef uint32_t Uint16s __attribute__((vector_size(64)));
typedef uint16_t Half16s __attribute__((vector_size(32)));
WEFT_ALWAYS_INLINE Lanes16 load16(const float* x) {
  Lanes16 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
WEFT_ALWAYS_INLINE Lanes16 load16(const Bf16Bits* x) {
  Half16s h;
  std::memcpy(&h, x, sizeof(h));
  return reinterpret_cast<Lanes16>(__builtin_convertvector(h, Uint16s) << 16);
}
WEFT_ALWAYS_INLINE void store16(float* x, Lanes16 v) { std::memcpy(x, &v, sizeof(v)); }
WEFT_ALWAYS_INLINE void store16(Bf16Bits* x, Lanes16 v) {  // from_float's rounding, lane by lane
  const Uint16s bits = reinterpret_cast<Uint16s>(v);
  const Uint16s rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const Uint16s out = v != v ? Uint16s{} + 0x7FC0u : rounded;
  const Half16s h = __builtin_convertvector(out, Half16s);
  std::memcpy(x, &h, sizeof(h));
}
WEFT_ALWAYS_INLINE Lanes16 exp_approx16(Lanes16 x) {
  x = x < -87.3f ? Lanes16{} - 87.3f : x;
  x = x > 88.3f ? Lanes16{} + 88.3f : x;
  const Int16s biased = __builtin_convertvector(x * 1.44269504088896341f + 127.5f, Int16s);
  return exp_of_reduced(x, __builtin_convertvector(biased - 127, Lanes16)) * reinterpret_cast<Lanes16>(biased << 23);
}

int64_t rows_grain(int64_t row_size) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_size)); }

#ifdef WEFT_WITH_CUDA
// Runs launch(stream) on `t`'s device and its current stream, and turns a failed launch into an
// error naming the kernel.
template <typename F>
void on_cuda(const torch::Tensor& t, const char* what, F&& launch) {
  c10::cuda::CUDAGuard guard(t.device());
  const cudaError_t status = launch(c10::cuda::getCurrentCUDAStream(t.device().index()).stream());
  WEFT_CHECK(status == cudaSuccess, "{}: CUDA kernel launch failed: {}", what, cudaGetErrorString(status));
}

cuda::Dtype cuda_dtype(const torch::Tensor& t) {
  return t.scalar_type() == torch::kBFloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat32;
}
#endif

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight, double eps,
                               int64_t out_dtype) {
    x = x.contiguous();
    const auto w = weight.contiguous();
    WEFT_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.size(0) == x.size(-1),
               "rms_norm: weight must be fp32 [{}]", x.size(-1));
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    auto y = torch::empty(x.sizes(), x.options().dtype(static_cast<torch::Dtype>(out_dtype)));
    auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
    const float* wp = data<float>(w);
    float* rp = data<float>(rstd);
    const float epsf = static_cast<float>(eps);
#ifdef WEFT_WITH_CUDA
    if (x.is_cuda()) {
      on_cuda(x, "rms_norm", [&](cudaStream_t stream) {
        return cuda::rms_norm_forward(x.data_ptr(), cuda_dtype(x), wp, y.data_ptr(), cuda_dtype(y), rp, rows, dim, epsf,
                                      stream);
      });
      ctx->save_for_backward({x, w, rstd});
      return y;
    }
#endif
    dispatch_float_or_bf16(x.scalar_type(), "rms_norm", [&](auto x_tag) {
      using X = decltype(x_tag);
      dispatch_float_or_bf16(y.scalar_type(), "rms_norm", [&](auto y_tag) {
        using Y = decltype(y_tag);
        const X* xp = data<X>(x);
        Y* yp = data<Y>(y);
        at::parallel_for(0, rows, rows_grain(dim), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const X* xr = xp + r * dim;
            Y* yr = yp + r * dim;
            const float mean = sum_of_squares(xr, dim) / static_cast<float>(dim);
            const float rs = 1.0f / std::sqrt(mean + epsf);
            rp[r] = rs;
            for (int64_t i = 0; i < dim; ++i) yr[i] = from_float<Y>(to_float(xr[i]) * rs * wp[i]);
          }
        });
      });
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &rstd = saved[2];
    const auto g = grads[0].contiguous();
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    const bool want_w = ctx->needs_input_grad(1);
    auto gx = torch::empty_like(x);
#ifdef WEFT_WITH_CUDA
    if (x.is_cuda()) {
      WEFT_CHECK(g.scalar_type() == torch::kFloat32 || g.scalar_type() == torch::kBFloat16,
                 "rms_norm backward: expected an fp32 or bf16 gradient");
      torch::Tensor parts;
      if (want_w) parts = torch::empty({cuda::rms_norm_backward_parts(rows), dim}, x.options().dtype(torch::kFloat32));
      on_cuda(x, "rms_norm backward", [&](cudaStream_t stream) {
        return cuda::rms_norm_backward(g.data_ptr(), cuda_dtype(g), x.data_ptr(), cuda_dtype(x), w.data_ptr<float>(),
                                       rstd.data_ptr<float>(), gx.data_ptr(),
                                       want_w ? parts.data_ptr<float>() : nullptr, rows, dim, stream);
      });
      return {gx, want_w ? parts.sum(0) : torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
#endif
    // Weight gradient: per-chunk partial sums (fp64), reduced after the parallel loop.
    const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
    auto partial = torch::zeros({want_w ? chunks : 0, dim}, x.options().dtype(torch::kFloat64));
    const float* wp = data<float>(w);
    const float* rp = data<float>(rstd);
    double* pp = data<double>(partial);
    dispatch_float_or_bf16(x.scalar_type(), "rms_norm backward", [&](auto x_tag) {
      using X = decltype(x_tag);
      dispatch_float_or_bf16(g.scalar_type(), "rms_norm backward", [&](auto g_tag) {
        using G = decltype(g_tag);
        const X* xp = data<X>(x);
        const G* gp = data<G>(g);
        X* gxp = data<X>(gx);
        at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
          for (int64_t c = cbegin; c < cend; ++c) {
            double* gw = want_w ? pp + c * dim : nullptr;
            for (int64_t r = rows * c / chunks; r < rows * (c + 1) / chunks; ++r) {
              const X* xr = xp + r * dim;
              const G* gr = gp + r * dim;
              X* gxr = gxp + r * dim;
              const float rs = rp[r];
              const float coef = rs * rs * rs * dot3(gr, xr, wp, dim) / static_cast<float>(dim);
              for (int64_t i = 0; i < dim; ++i) {
                const float gi = to_float(gr[i]), xi = to_float(xr[i]);
                gxr[i] = from_float<X>(rs * wp[i] * gi - xi * coef);
              }
              if (gw) {
                for (int64_t i = 0; i < dim; ++i) gw[i] += to_float(gr[i]) * to_float(xr[i]) * rs;
              }
            }
          }
        });
      });
    });
    torch::Tensor gw = want_w ? partial.sum(0).to(torch::kFloat32) : torch::Tensor();
    return {gx, gw, torch::Tensor(), torch::Tensor()};
  }
};

// SwiGLU over rows [begin, end) of `width` gate and `width` up values each: out = silu(g) * u,
// in vectors of 16 lanes (see Lanes16), the rest lane by lane with the same operations.
template <typename T>
WEFT_ALWAYS_INLINE void swiglu_rows(const T* in, T* out, int64_t begin, int64_t end, int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = in + r * 2 * width;
    const T* u = g + width;
    T* o = out + r * width;
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) {
      const Lanes16 gi = load16(g + i);
      store16(o + i, gi / (1.0f + exp_approx16(-gi)) * load16(u + i));
    }
    for (; i < width; ++i) {
      const float gi = to_float(g[i]);
      o[i] = from_float<T>(gi / (1.0f + exp_approx(-gi)) * to_float(u[i]));
    }
  }
}

// Its gradient with respect to gate and up, from the output's gradient `go`.
template <typename T>
WEFT_ALWAYS_INLINE void swiglu_backward_rows(const T* in, const T* go, T* grad, int64_t begin, int64_t end, int64_t width) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = in + r * 2 * width;
    const T* u = g + width;
    const T* gor = go + r * width;
    T* gg = grad + r * 2 * width;
    T* gu = gg + width;
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) {
      const Lanes16 gi = load16(g + i), ui = load16(u + i), goi = load16(gor + i);
      const Lanes16 sig = 1.0f / (1.0f + exp_approx16(-gi));
      store16(gg + i, goi * ui * (sig * (1.0f + gi * (1.0f - sig))));
      store16(gu + i, goi * (gi * sig));
    }
    for (; i < width; ++i) {
      const float gi = to_float(g[i]), ui = to_float(u[i]), goi = to_float(gor[i]);
      const float sig = 1.0f / (1.0f + exp_approx(-gi));
      gg[i] = from_float<T>(goi * ui * (sig * (1.0f + gi * (1.0f - sig))));
      gu[i] = from_float<T>(goi * (gi * sig));
    }
  }
}

// The element-wise loops compiled for AVX-512, AVX2 and the baseline, picked at load time for
// the CPU at hand (LibTorch's own kernels dispatch the same way; without this they would run on
// 4-wide SSE vectors).
WEFT_SIMD_CLONES void swiglu_rows_dispatch(const float* in, float* out, int64_t begin, int64_t end, int64_t width) {
  swiglu_rows(in, out, begin, end, width);
}
WEFT_SIMD_CLONES void swiglu_rows_dispatch(const Bf16Bits* in, Bf16Bits* out, int64_t begin, int64_t end,
                                           int64_t width) {
  swiglu_rows(in, out, begin, end, width);
}
WEFT_SIMD_CLONES void swiglu_backward_rows_dispatch(const float* in, const float* go, float* grad, int64_t begin,
                                                    int64_t end, int64_t width) {
  swiglu_backward_rows(in, go, grad, begin, end, width);
}
WEFT_SIMD_CLONES void swiglu_backward_rows_dispatch(const Bf16Bits* in, const Bf16Bits* go, Bf16Bits* grad,
                                                    int64_t begin, int64_t end, int64_t width) {
  swiglu_backward_rows(in, go, grad, begin, end, width);
}

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor gate_up) {
    gate_up = gate_up.contiguous();
    const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(1, 2 * width);
    WEFT_CHECK(gate_up.size(-1) == 2 * width, "swiglu: last dim {} is odd", gate_up.size(-1));
    auto sizes = gate_up.sizes().vec();
    sizes.back() = width;
    auto out = torch::empty(sizes, gate_up.options());
    ctx->save_for_backward({gate_up});
#ifdef WEFT_WITH_CUDA
    if (gate_up.is_cuda()) {
      on_cuda(gate_up, "swiglu", [&](cudaStream_t stream) {
        return cuda::swiglu_forward(gate_up.data_ptr(), out.data_ptr(), cuda_dtype(gate_up), rows, width, stream);
      });
      return out;
    }
#endif
    dispatch_float_or_bf16(gate_up.scalar_type(), "swiglu", [&](auto tag) {
      using T = decltype(tag);
      const T* in = data<T>(gate_up);
      T* op = data<T>(out);
      at::parallel_for(0, rows, rows_grain(2 * width), [&](int64_t begin, int64_t end) {
        swiglu_rows_dispatch(in, op, begin, end, width);
      });
    });
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto gate_up = ctx->get_saved_variables()[0];
    const auto go = grads[0].contiguous();
    const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / std::max<int64_t>(1, 2 * width);
    auto grad = torch::empty_like(gate_up);
#ifdef WEFT_WITH_CUDA
    if (gate_up.is_cuda()) {
      WEFT_CHECK(go.scalar_type() == gate_up.scalar_type(), "swiglu backward: gradient dtype mismatch");
      on_cuda(gate_up, "swiglu backward", [&](cudaStream_t stream) {
        return cuda::swiglu_backward(gate_up.data_ptr(), go.data_ptr(), grad.data_ptr(), cuda_dtype(gate_up), rows,
                                     width, stream);
      });
      return {grad};
    }
#endif
    dispatch_float_or_bf16(gate_up.scalar_type(), "swiglu backward", [&](auto tag) {
      using T = decltype(tag);
      WEFT_CHECK(go.scalar_type() == gate_up.scalar_type(), "swiglu backward: gradient dtype mismatch");
      const T* in = data<T>(gate_up);
      const T* gop = data<T>(go);
      T* gp = data<T>(grad);
      at::parallel_for(0, rows, rows_grain(2 * width), [&](int64_t begin, int64_t end) {
        swiglu_backward_rows_dispatch(in, gop, gp, begin, end, width);
      });
    });
    return {grad};
  }
};

// Dropout's mask, as the ascending indices of its dropped elements. Elements are taken in blocks of
// kDropBlock (block b: [b kDropBlock, (b + 1) kDropBlock)), each an independent stream of gaps: the
// number of kept elements before the next dropped one is geometric, floor(log U / log(1 - p)) for U
// uniform on (0, 1), so that each element is dropped with probability p independently of every other
// (to within U's 23 bits), and only the dropped elements cost a draw. Draw t of block b: U from a
// 32-bit hash of (seed, b, t), MurmurHash3's finalizer twice with the seed's halves mixed in.
constexpr int64_t kDropBlock = int64_t{1} << 16;
constexpr int kDraws = 64;  // gaps drawn at once: the hash and the logarithm in vectors, four chains in flight

WEFT_ALWAYS_INLINE uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}
// ln(u) for u in (0, 1], normal: Cephes' logf (relative error ~1e-7), branch-free.
WEFT_ALWAYS_INLINE float log_approx(float u) {
  uint32_t bits;
  std::memcpy(&bits, &u, sizeof(bits));
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);
  bits = (bits & 0x007FFFFFu) | 0x3F000000u;  // mantissa in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof(m));
  const bool small = m < 0.707106781186547524f;
  e = small ? e - 1.0f : e;
  const float x = (small ? m + m : m) - 1.0f;
  const float z = x * x;
  float y = 7.0376836292E-2f;
  y = y * x - 1.1514610310E-1f;
  y = y * x + 1.1676998740E-1f;
  y = y * x - 1.2420140846E-1f;
  y = y * x + 1.4249322787E-1f;
  y = y * x - 1.6668057665E-1f;
  y = y * x + 2.0000714765E-1f;
  y = y * x - 2.4999993993E-1f;
  y = y * x + 3.3333331174E-1f;
  y = y * x * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return x + y + 0.693359375f * e;
}
// Gaps t .. t + kDraws - 1 of a block's stream (`hi`: the seed's high half with the block mixed in),
// each at most kDropBlock.
WEFT_SIMD_CLONES void draw_gaps(uint32_t t, uint32_t seed_lo, uint32_t hi, float inv_log_keep, int32_t* gaps) {
  for (int k = 0; k < kDraws; ++k) {
    const uint32_t h = fmix32(fmix32((t + static_cast<uint32_t>(k)) ^ seed_lo) + hi);
    // (m + 1/2) / 2^23 for m < 2^23: exact in fp32, uniform on (0, 1) to 23 bits, never 0 or 1
    const float u = (static_cast<float>(h >> 9) + 0.5f) * 0x1p-23f;
    const float gap = log_approx(u) * inv_log_keep;  // (std::min would not inline under this file's pragma)
    gaps[k] = static_cast<int32_t>(gap < static_cast<float>(kDropBlock) ? gap : static_cast<float>(kDropBlock));
  }
}

// A mask's constants for (p, seed): 1 / ln(1 - p) (the gaps' scale), 1 / (1 - p) (the kept
// elements'), the seed's halves.
struct MaskParams {
  float inv_log_keep, scale;
  uint32_t seed_lo, seed_hi;
};
MaskParams mask_params(double p, uint64_t seed) {
  return {static_cast<float>(1.0 / std::log1p(-p)), dropout_scale(p), static_cast<uint32_t>(seed),
          static_cast<uint32_t>(seed >> 32)};
}

// The dropped indices of block b of n elements, ascending, appended to `out`.
void dropped_in_block(int64_t b, int64_t n, const MaskParams& m, std::vector<int32_t>& out) {
  const int64_t end = std::min(n, (b + 1) * kDropBlock);
  const uint32_t hi = m.seed_hi ^ (static_cast<uint32_t>(b) * 0x9E3779B9u);
  alignas(64) int32_t gaps[kDraws];
  int64_t position = b * kDropBlock - 1;
  for (uint32_t t = 0;; t += kDraws) {
    draw_gaps(t, m.seed_lo, hi, m.inv_log_keep, gaps);
    for (int k = 0; k < kDraws; ++k) {
      position += gaps[k] + 1;
      if (position >= end) return;
      out.push_back(static_cast<int32_t>(position));
    }
  }
}

// The mask of (p, seed) over n elements: the dropped ones' indices, ascending (int32 [count]).
torch::Tensor dropped_indices(int64_t n, double p, uint64_t seed) {
  WEFT_CHECK(n >= 0 && n <= std::numeric_limits<int32_t>::max(),
             "dropout: at most 2^31 - 1 elements per tensor, got {}", n);
  const MaskParams m = mask_params(p, seed);
  const int64_t blocks = (n + kDropBlock - 1) / kDropBlock;
  // The blocks' buffers are the calling thread's, kept from call to call instead of allocated per
  // mask (a LoRA step draws one per adapter: 210 masks of up to 24 blocks on the bundled model).
  // (Named by a reference here: in the workers' lambda the thread_local's name is each worker's own.)
  thread_local std::vector<std::vector<int32_t>> kept;
  auto& parts = kept;
  if (parts.size() < static_cast<size_t>(blocks)) parts.resize(static_cast<size_t>(blocks));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      auto& part = parts[static_cast<size_t>(b)];
      part.clear();
      part.reserve(static_cast<size_t>(static_cast<double>(std::min(kDropBlock, n - b * kDropBlock)) * p * 1.1) + 64);
      dropped_in_block(b, n, m, part);
    }
  });
  int64_t count = 0;
  for (int64_t b = 0; b < blocks; ++b) count += static_cast<int64_t>(parts[static_cast<size_t>(b)].size());
  auto out = torch::empty({count}, torch::kInt32);
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t b = 0; b < blocks; ++b) o = std::copy(parts[static_cast<size_t>(b)].begin(), parts[static_cast<size_t>(b)].end(), o);
  return out;
}

// x through the mask of `dropped` (indices into x's elements): x * scale, 0 at the dropped elements.
template <typename T>
WEFT_ALWAYS_INLINE void scale_range(const T* in, T* out, int64_t begin, int64_t end, float scale) {
  for (int64_t i = begin; i < end; ++i) out[i] = from_float<T>(to_float(in[i]) * scale);
}
WEFT_SIMD_CLONES void scale_range_dispatch(const float* in, float* out, int64_t begin, int64_t end, float scale) {
  scale_range(in, out, begin, end, scale);
}
WEFT_SIMD_CLONES void scale_range_dispatch(const Bf16Bits* in, Bf16Bits* out, int64_t begin, int64_t end, float scale) {
  scale_range(in, out, begin, end, scale);
}

// x's elements through the mask of (p, seed): forward on the input, backward on its gradient.
torch::Tensor apply_dropout_mask(const torch::Tensor& x, double p, uint64_t seed) {
  const auto in = x.contiguous();
  auto out = torch::empty_like(in);
  const auto dropped = dropped_indices(in.numel(), p, seed);
  const float scale = mask_params(p, seed).scale;
  const int32_t* d = dropped.data_ptr<int32_t>();
  const int64_t count = dropped.numel();
  dispatch_float_or_bf16(in.scalar_type(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    const T* ip = data<T>(in);
    T* op = data<T>(out);
    at::parallel_for(0, in.numel(), 16384, [&](int64_t begin, int64_t end) {
      scale_range_dispatch(ip, op, begin, end, scale);
    });
    for (int64_t k = 0; k < count; ++k) op[d[k]] = from_float<T>(0.0f);
  });
  return out;
}

// The complement's sums (kernels.h, subtract_dropped_products_ and dropped_backward_) over x [R, I]'s
// dropped elements, for the adapters that share x in one pass over its rows (they are memory-bound:
// nearly every cache line of x, and of x's gradient, holds a dropped element, so each row is read
// once for all of them), in column blocks of kLanes of the r-wide operands (one vector register of
// fp32 on AVX-512).

// One adapter's operands: its mask's ascending indices d[0, count), A^T [cols, r] fp32, its rows
// (u forward, v backward: [R, r] of x's type, row stride `stride`), forward's scale, and backward's
// parts of A's gradient ([blocks, cols, r] fp32).
struct Complement {
  const int32_t* d;
  int64_t count;
  const float* at;
  void* rows;
  int64_t stride, r;
  float scale;
  float* part;
  void* values;  // x's dropped elements in d's order, of x's type (null: none): forward writes, backward reads
};
constexpr int64_t kMaxComplements = 16;  // adapters per pass (more go in further passes)
// Backward's prefetch distance in dropped elements: x's and x's gradient's elements are read and
// written out of cache order (a pass per adapter over each row), and miss.
constexpr int64_t kPrefetchAhead = 16;

// The dropped indices of rows [begin, end) of a [R, cols] matrix: d's range [lo, hi).
std::pair<int64_t, int64_t> rows_range(const int32_t* d, int64_t count, int64_t begin, int64_t end, int64_t cols) {
  const auto lo = std::lower_bound(d, d + count, begin * cols) - d;
  const auto hi = std::lower_bound(d + lo, d + count, end * cols) - d;
  return {lo, hi};
}

// Calls f(op, i, row, k, k1) for each row i of [begin, end) (row: its first element's index) and
// each adapter in order, [k, k1) being the adapter's dropped indices in that row. f must be
// always-inline, so that it compiles for the caller's target clone.
template <typename F>
WEFT_ALWAYS_INLINE void over_rows_and_adapters(const Complement* ops, int64_t n_ops, int64_t cols, int64_t begin,
                                               int64_t end, F&& f) {
  int64_t cursor[kMaxComplements];
  for (int64_t o = 0; o < n_ops; ++o) cursor[o] = rows_range(ops[o].d, ops[o].count, begin, end, cols).first;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = i * cols;
    for (int64_t o = 0; o < n_ops; ++o) {
      int64_t k1 = cursor[o];
      while (k1 < ops[o].count && ops[o].d[k1] < row + cols) ++k1;
      f(ops[o], i, row, cursor[o], k1);
      cursor[o] = k1;
    }
  }
}

// Forward over rows [begin, end), for each adapter: u[i, :] = (u[i, :] - sum over dropped (i, j) of
// x[i, j] at[j, :]) * scale, each sum in fp32 in two alternating partial sums (independent chains),
// each element rounded once.
template <typename T>
WEFT_ALWAYS_INLINE void complement_forward_span(const T* __restrict x, int64_t cols, const Complement* ops, int64_t n_ops,
                                                int64_t begin, int64_t end) {
  over_rows_and_adapters(ops, n_ops, cols, begin, end,
                         [&](const Complement& op, int64_t i, int64_t row, int64_t k, int64_t k1)
                             __attribute__((always_inline)) {
    const int32_t* __restrict d = op.d;
    const float* __restrict at = op.at;
    const int64_t r = op.r;
    T* __restrict ui = static_cast<T*>(op.rows) + i * op.stride;
    if (r == kLanes) {  // one vector: x's element read once, for the sum and forward's copy
      Lanes16 acc0 = {}, acc1 = {};
      T* __restrict values = static_cast<T*>(op.values);
      int64_t q = k;
      for (; q + 1 < k1; q += 2) {
        const T x0 = x[d[q]], x1 = x[d[q + 1]];
        if (values != nullptr) values[q] = x0, values[q + 1] = x1;
        acc0 += to_float(x0) * load16(at + (d[q] - row) * kLanes);
        acc1 += to_float(x1) * load16(at + (d[q + 1] - row) * kLanes);
      }
      if (q < k1) {
        const T x0 = x[d[q]];
        if (values != nullptr) values[q] = x0;
        acc0 += to_float(x0) * load16(at + (d[q] - row) * kLanes);
      }
      store16(ui, (load16(ui) - (acc0 + acc1)) * op.scale);
      return;
    }
    if (op.values != nullptr) {
      T* __restrict values = static_cast<T*>(op.values);
      for (int64_t q = k; q < k1; ++q) values[q] = x[d[q]];
    }
    int64_t c0 = 0;
    for (; c0 + kLanes <= r; c0 += kLanes) {
      Lanes16 acc0 = {}, acc1 = {};
      int64_t q = k;
      for (; q + 1 < k1; q += 2) {
        acc0 += to_float(x[d[q]]) * load16(at + (d[q] - row) * r + c0);
        acc1 += to_float(x[d[q + 1]]) * load16(at + (d[q + 1] - row) * r + c0);
      }
      if (q < k1) acc0 += to_float(x[d[q]]) * load16(at + (d[q] - row) * r + c0);
      store16(ui + c0, (load16(ui + c0) - (acc0 + acc1)) * op.scale);
    }
    for (int64_t c = c0; c < r; ++c) {
      float acc = 0.0f;
      for (int64_t q = k; q < k1; ++q) acc += to_float(x[d[q]]) * at[(d[q] - row) * r + c];
      ui[c] = from_float<T>((to_float(ui[c]) - acc) * op.scale);
    }
  });
}

// The lane sums of 16 vectors at once, sums[l] = the sum of p[kSum16Slot[l]]'s lanes: a
// transposing tree of two-source shuffles (30 shuffles and 15 additions for 16 sums, against 3
// shuffles and 4 additions each one by one). A caller that wants element l's sum in lane l puts it
// in p[kSum16Slot[l]].
constexpr int kSum16Slot[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
WEFT_ALWAYS_INLINE Lanes16 sum16x16(const Lanes16* p) {
  Lanes16 q[8], r4[4], t[2];
  for (int m = 0; m < 8; ++m) {  // lanes 0-7: p[2m]'s halves added; 8-15: p[2m + 1]'s
    q[m] = __builtin_shufflevector(p[2 * m], p[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * m], p[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int m = 0; m < 4; ++m) {  // quarters: p[4m], p[4m + 2], p[4m + 1], p[4m + 3]
    r4[m] = __builtin_shufflevector(q[2 * m], q[2 * m + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(q[2 * m], q[2 * m + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int m = 0; m < 2; ++m) {  // pairs: p[8m + 0, 4, 2, 6, 1, 5, 3, 7]
    t[m] = __builtin_shufflevector(r4[2 * m], r4[2 * m + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(r4[2 * m], r4[2 * m + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  return __builtin_shufflevector(t[0], t[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(t[0], t[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// g[at_of[l]] -= the lane sum of products[kSum16Slot[l]], for l < n in order (the other slots are
// zeroed).
template <typename T>
WEFT_ALWAYS_INLINE void subtract_sums(T* __restrict g, Lanes16* products, const int64_t* at_of, int n) {
  for (int l = n; l < kLanes; ++l) products[kSum16Slot[l]] = Lanes16{};
  const Lanes16 sums = sum16x16(products);
  for (int l = 0; l < n; ++l) g[at_of[l]] = from_float<T>(to_float(g[at_of[l]]) - sums[l]);
}

// Backward over rows [begin, end), for each adapter: g[i, j] -= v[i, :] . at[j, :] at each dropped
// (i, j) (g may be null; an element dropped by several adapters takes their terms in adapter
// order, each rounded), and part[j, :] += x[i, j] v[i, :] (`part`: this block's [cols, r], summed
// in row order). Where r is a multiple of 16 the dot products go 16 at a time through sum16x16.
template <typename T>
WEFT_ALWAYS_INLINE void complement_backward_span(T* __restrict g, const T* __restrict x, int64_t cols,
                                                 const Complement* ops, int64_t n_ops, int64_t block, int64_t begin,
                                                 int64_t end) {
  Lanes16 products[kLanes];
  int64_t at_of[kLanes];
  int n = 0;
  over_rows_and_adapters(ops, n_ops, cols, begin, end,
                         [&](const Complement& op, int64_t i, int64_t row, int64_t k0, int64_t k1)
                             __attribute__((always_inline)) {
    const int32_t* __restrict d = op.d;
    const float* __restrict at = op.at;
    const int64_t r = op.r;
    const T* __restrict vi = static_cast<const T*>(op.rows) + i * op.stride;
    float* __restrict part = op.part + block * cols * r;
    // x's dropped elements: forward's copy in d's order where it kept one (read in order), else x's.
    const T* __restrict values = static_cast<const T*>(op.values);
    if (r == kLanes) {  // one vector: v's row converted once for the row's elements
      const Lanes16 vv = load16(vi);
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t e = d[k];
        if (k + kPrefetchAhead < k1) {
          if (values == nullptr) __builtin_prefetch(x + d[k + kPrefetchAhead], 0, 3);
          if (g != nullptr) __builtin_prefetch(g + d[k + kPrefetchAhead], 1, 3);
        }
        const float xv = to_float(values != nullptr ? values[k] : x[e]);
        float* out = part + (e - row) * kLanes;
        store16(out, load16(out) + xv * vv);
        if (g != nullptr) {
          products[kSum16Slot[n]] = vv * load16(at + (e - row) * kLanes);
          at_of[n++] = e;
          if (n == kLanes) subtract_sums(g, products, at_of, n), n = 0;
        }
      }
      return;
    }
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t e = d[k];
      const float xv = to_float(values != nullptr ? values[k] : x[e]);
      const float* a = at + (e - row) * r;
      float* out = part + (e - row) * r;
      if (r % kLanes == 0) {
        Lanes16 prod = {};
        for (int64_t c0 = 0; c0 < r; c0 += kLanes) {
          const Lanes16 vv = load16(vi + c0);
          prod += vv * load16(a + c0);
          store16(out + c0, load16(out + c0) + xv * vv);
        }
        if (g != nullptr) {
          products[kSum16Slot[n]] = prod;
          at_of[n++] = e;
          if (n == kLanes) subtract_sums(g, products, at_of, n), n = 0;
        }
      } else {
        float dot = 0.0f;
        for (int64_t c = 0; c < r; ++c) {
          const float vc = to_float(vi[c]);
          dot += vc * a[c];
          out[c] += xv * vc;
        }
        if (g != nullptr) {
          if (n > 0) subtract_sums(g, products, at_of, n), n = 0;  // keep each element's terms in order
          g[e] = from_float<T>(to_float(g[e]) - dot);
        }
      }
    }
  });
  if (g != nullptr && n > 0) subtract_sums(g, products, at_of, n);
}
#define WEFT_COMPLEMENT_CLONES(T)                                                                                   \
  WEFT_SIMD_CLONES void complement_forward_dispatch(const T* x, int64_t cols, const Complement* ops, int64_t n_ops, \
                                                    int64_t begin, int64_t end) {                                    \
    complement_forward_span(x, cols, ops, n_ops, begin, end);                                                        \
  }                                                                                                                 \
  WEFT_SIMD_CLONES void complement_backward_dispatch(T* g, const T* x, int64_t cols, const Complement* ops,        \
                                                     int64_t n_ops, int64_t block, int64_t begin, int64_t end) {    \
    complement_backward_span(g, x, cols, ops, n_ops, block, begin, end);                                             \
  }
WEFT_COMPLEMENT_CLONES(float)
WEFT_COMPLEMENT_CLONES(Bf16Bits)
#undef WEFT_COMPLEMENT_CLONES

// One stage of a 16 x 16 transpose held as 16 row vectors: for each pair of rows i and i + S (i & S
// clear), the off-diagonal S x S blocks of their 2S x 2S block swapped. Stages 8, 4, 2 and 1, in
// any order, transpose the whole.
template <int S>
WEFT_ALWAYS_INLINE void transpose_stage(Lanes16* m) {
#define WEFT_LO(c) (((c) & S) == 0 ? (c) : 16 + (c) - S)
#define WEFT_HI(c) (((c) & S) == 0 ? (c) + S : 16 + (c))
  for (int i = 0; i < kLanes; ++i) {
    if ((i & S) != 0) continue;
    const Lanes16 a = m[i], b = m[i + S];
    m[i] = __builtin_shufflevector(a, b, WEFT_LO(0), WEFT_LO(1), WEFT_LO(2), WEFT_LO(3), WEFT_LO(4), WEFT_LO(5),
                                   WEFT_LO(6), WEFT_LO(7), WEFT_LO(8), WEFT_LO(9), WEFT_LO(10), WEFT_LO(11),
                                   WEFT_LO(12), WEFT_LO(13), WEFT_LO(14), WEFT_LO(15));
    m[i + S] = __builtin_shufflevector(a, b, WEFT_HI(0), WEFT_HI(1), WEFT_HI(2), WEFT_HI(3), WEFT_HI(4), WEFT_HI(5),
                                       WEFT_HI(6), WEFT_HI(7), WEFT_HI(8), WEFT_HI(9), WEFT_HI(10), WEFT_HI(11),
                                       WEFT_HI(12), WEFT_HI(13), WEFT_HI(14), WEFT_HI(15));
  }
#undef WEFT_LO
#undef WEFT_HI
}

// Backward's A gradient from its blocks' parts where r = 16: ga[c, j] -= the sum over blocks b, in
// order from 0, of part[b, j, c], for j in [j0, j1). Sixteen columns at a time: their parts' lines
// summed, transposed in registers, and subtracted from ga's rows a vector at a time. (Column by
// column, each of ga's 16 elements is a line of its own at ga's row stride: the complement's
// backward on a layer of the bundled model took 5% longer.)
WEFT_SIMD_CLONES void subtract_parts16_dispatch(const float* part, int64_t blocks, int64_t cols, float* ga, int64_t j0,
                                                int64_t j1) {
  int64_t j = j0;
  for (; j + kLanes <= j1; j += kLanes) {
    Lanes16 m[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      Lanes16 sum = {};
      for (int64_t b = 0; b < blocks; ++b) sum += load16(part + (b * cols + j + l) * kLanes);
      m[l] = sum;
    }
    transpose_stage<8>(m);
    transpose_stage<4>(m);
    transpose_stage<2>(m);
    transpose_stage<1>(m);
    for (int c = 0; c < kLanes; ++c) store16(ga + c * cols + j, load16(ga + c * cols + j) - m[c]);
  }
  for (; j < j1; ++j) {
    for (int64_t c = 0; c < kLanes; ++c) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) sum += part[(b * cols + j) * kLanes + c];
      ga[c * cols + j] -= sum;
    }
  }
}

class DropoutFunction : public torch::autograd::Function<DropoutFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, double p, int64_t seed) {
    ctx->saved_data["p"] = p;
    ctx->saved_data["seed"] = seed;
    return apply_dropout_mask(x, p, static_cast<uint64_t>(seed));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto seed = static_cast<uint64_t>(ctx->saved_data["seed"].toInt());
    return {apply_dropout_mask(grads[0], ctx->saved_data["p"].toDouble(), seed), torch::Tensor(), torch::Tensor()};
  }
};

// Shapes of a fused qkv projection.
struct QkvShape {
  int64_t batch, seq, heads, kv_heads, dim;
  int64_t total_heads() const { return heads + 2 * kv_heads; }
};

// Copies head `n` of token (b, t) between the fused layout and the [B, heads, T, D] layouts,
// rotating q and k heads. Forward: src = qkv row, dst = q/k/v row. Backward uses the transposed
// rotation (inverse = rotation by -angle) from the q/k/v gradients into the qkv gradient.
template <typename T>
WEFT_ALWAYS_INLINE void rotate_row(const T* src, T* dst, const float* cos, const float* sin, int64_t dim,
                                   bool inverse) {
  const int64_t half = dim / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
    dst[i] = from_float<T>(x1 * cos[i] - x2 * (sign * sin[i]));
    dst[i + half] = from_float<T>(x2 * cos[i + half] + x1 * (sign * sin[i + half]));
  }
}

WEFT_SIMD_CLONES void rotate_row_dispatch(const float* src, float* dst, const float* cos, const float* sin,
                                          int64_t dim, bool inverse) {
  rotate_row(src, dst, cos, sin, dim, inverse);
}
WEFT_SIMD_CLONES void rotate_row_dispatch(const Bf16Bits* src, Bf16Bits* dst, const float* cos, const float* sin,
                                          int64_t dim, bool inverse) {
  rotate_row(src, dst, cos, sin, dim, inverse);
}

// Forward (inverse=false): qkv -> q, k, v. Backward (inverse=true): gq, gk, gv -> gqkv.
template <typename T>
void qkv_rope_pass(const QkvShape& s, T* qkv, T* q, T* k, T* v, const float* cos, const float* sin,
                   bool inverse, bool per_row) {
  const int64_t nh = s.total_heads(), d = s.dim;
  at::parallel_for(0, s.batch * s.seq, rows_grain(nh * d), [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / s.seq, t = bt % s.seq;
      const float* c = cos + (per_row ? bt : t) * d;  // per_row: tables [B, T, D]
      const float* sn = sin + (per_row ? bt : t) * d;
      for (int64_t n = 0; n < nh; ++n) {
        T* fused = qkv + (bt * nh + n) * d;
        T* split;
        if (n < s.heads) {
          split = q + ((b * s.heads + n) * s.seq + t) * d;
        } else if (n < s.heads + s.kv_heads) {
          split = k + ((b * s.kv_heads + (n - s.heads)) * s.seq + t) * d;
        } else {
          split = v + ((b * s.kv_heads + (n - s.heads - s.kv_heads)) * s.seq + t) * d;
          if (inverse) {
            std::copy(split, split + d, fused);
          } else {
            std::copy(fused, fused + d, split);
          }
          continue;
        }
        if (inverse) {
          rotate_row_dispatch(split, fused, c, sn, d, true);
        } else {
          rotate_row_dispatch(fused, split, c, sn, d, false);
        }
      }
    }
  });
}

class QkvRopeFunction : public torch::autograd::Function<QkvRopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                               int64_t heads, int64_t kv_heads) {
    WEFT_CHECK(qkv.dim() == 3 && qkv.size(-1) % (heads + 2 * kv_heads) == 0,
               "split_qkv_with_rope: qkv must be [B, T, (H + 2 KVH) * D]");
    qkv = qkv.contiguous();
    const QkvShape s{qkv.size(0), qkv.size(1), heads, kv_heads, qkv.size(2) / (heads + 2 * kv_heads)};
    const auto c = cos.to(torch::kFloat32).contiguous(), sn = sin.to(torch::kFloat32).contiguous();
    const bool per_row = c.dim() == 3;
    WEFT_CHECK((c.dim() == 2 || (per_row && c.size(0) == s.batch)) && c.size(-2) == s.seq && c.size(-1) == s.dim &&
                   sn.sizes() == c.sizes(),
               "split_qkv_with_rope: cos/sin must be [{}, {}] or [{}, {}, {}]", s.seq, s.dim, s.batch, s.seq, s.dim);
    auto q = torch::empty({s.batch, heads, s.seq, s.dim}, qkv.options());
    auto k = torch::empty({s.batch, kv_heads, s.seq, s.dim}, qkv.options());
    auto v = torch::empty({s.batch, kv_heads, s.seq, s.dim}, qkv.options());
#ifdef WEFT_WITH_CUDA
    if (qkv.is_cuda()) {
      on_cuda(qkv, "split_qkv_with_rope", [&](cudaStream_t stream) {
        return cuda::qkv_rope(qkv.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), cuda_dtype(qkv),
                              c.data_ptr<float>(), sn.data_ptr<float>(), s.batch, s.seq, heads, kv_heads, s.dim,
                              /*inverse=*/false, stream);
      });
    } else
#endif
    dispatch_float_or_bf16(qkv.scalar_type(), "split_qkv_with_rope", [&](auto tag) {
      using T = decltype(tag);
      qkv_rope_pass<T>(s, data<T>(qkv), data<T>(q), data<T>(k), data<T>(v),
                       data<float>(c), data<float>(sn), /*inverse=*/false, per_row);
    });
    ctx->save_for_backward({c, sn});
    ctx->saved_data["shape"] = std::vector<int64_t>{s.batch, s.seq, heads, kv_heads, s.dim};
    return {q, k, v};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto dims = ctx->saved_data["shape"].toIntVector();
    const QkvShape s{dims[0], dims[1], dims[2], dims[3], dims[4]};
    const auto gq = grads[0].contiguous(), gk = grads[1].contiguous(), gv = grads[2].contiguous();
    auto gqkv = torch::empty({s.batch, s.seq, s.total_heads() * s.dim}, gq.options());
#ifdef WEFT_WITH_CUDA
    if (gq.is_cuda()) {
      WEFT_CHECK(gk.scalar_type() == gq.scalar_type() && gv.scalar_type() == gq.scalar_type() &&
                     (gq.scalar_type() == torch::kFloat32 || gq.scalar_type() == torch::kBFloat16),
                 "split_qkv_with_rope backward: gradients of mixed dtypes");
      on_cuda(gq, "split_qkv_with_rope backward", [&](cudaStream_t stream) {
        return cuda::qkv_rope(gqkv.data_ptr(), gq.data_ptr(), gk.data_ptr(), gv.data_ptr(), cuda_dtype(gq),
                              saved[0].data_ptr<float>(), saved[1].data_ptr<float>(), s.batch, s.seq, s.heads,
                              s.kv_heads, s.dim, /*inverse=*/true, stream);
      });
      return {gqkv, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
#endif
    dispatch_float_or_bf16(gq.scalar_type(), "split_qkv_with_rope backward", [&](auto tag) {
      using T = decltype(tag);
      WEFT_CHECK(gk.scalar_type() == gq.scalar_type() && gv.scalar_type() == gq.scalar_type(),
                 "split_qkv_with_rope backward: gradients of mixed dtypes");
      qkv_rope_pass<T>(s, data<T>(gqkv), data<T>(gq), data<T>(gk), data<T>(gv),
                       saved[0].data_ptr<float>(), saved[1].data_ptr<float>(), /*inverse=*/true, saved[0].dim() == 3);
    });
    return {gqkv, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// One row of cross-entropy over logits x[0, v): returns lse(x) - x[target] (0 where `target` is
// ignored, < 0); where `grad` is set, writes scale * (softmax(x) - onehot(target)) into it in T
// (0 on an ignored row), which may be x itself. A non-finite logit gives a NaN loss, as ATen's
// would for +inf or NaN. Three passes over the row (its maximum, the sum of exponentials, the
// gradient), the second and third from cache.
template <typename T>
WEFT_ALWAYS_INLINE float cross_entropy_row(const T* x, int64_t v, int64_t target, float scale, T* grad,
                                           float* __restrict tmp) {
  // In vectors of 16 lanes (see Lanes16; the plain loops' in-place gradient did not vectorise),
  // the rest lane by lane with the same operations. With a gradient, tmp (v floats) keeps each
  // exp(x - max) for it.
  const float inf = std::numeric_limits<float>::infinity();
  Lanes16 mx = Lanes16{} - inf, bad = {};
  int64_t i = 0;
  for (; i + kLanes <= v; i += kLanes) {
    const Lanes16 e = load16(x + i);
    mx = e > mx ? e : mx;
    bad += e - e;  // NaN from a NaN or an infinity
  }
  float m = -inf, nonfinite = 0.0f;
  for (; i < v; ++i) {
    const float e = to_float(x[i]);
    m = e > m ? e : m;
    nonfinite += e - e;
  }
  for (int j = 0; j < kLanes; ++j) m = mx[j] > m ? mx[j] : m, nonfinite += bad[j];
  Lanes16 acc = {};
  float sum = 0.0f;
  if (grad != nullptr) {
    for (i = 0; i + kLanes <= v; i += kLanes) {
      const Lanes16 e = exp_approx16(load16(x + i) - m);
      store16(tmp + i, e);
      acc += e;
    }
    for (; i < v; ++i) sum += tmp[i] = exp_approx(to_float(x[i]) - m);
  } else {
    for (i = 0; i + kLanes <= v; i += kLanes) acc += exp_approx16(load16(x + i) - m);
    for (; i < v; ++i) sum += exp_approx(to_float(x[i]) - m);
  }
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  if (nonfinite != 0.0f || nonfinite != nonfinite) {
    if (grad != nullptr) {
      for (i = 0; i < v; ++i) grad[i] = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    }
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float loss = target < 0 ? 0.0f : m + std::log(sum) - to_float(x[target]);
  if (grad != nullptr) {
    // softmax(x) = exp(x - max) / sum, from tmp.
    const float s = target < 0 ? 0.0f : scale, ratio = s / sum;
    const float t_exp = target < 0 ? 0.0f : tmp[target];
    for (i = 0; i + kLanes <= v; i += kLanes) store16(grad + i, load16(tmp + i) * ratio);
    for (; i < v; ++i) grad[i] = from_float<T>(tmp[i] * ratio);
    if (target >= 0) grad[target] = from_float<T>((t_exp / sum - 1.0f) * s);
  }
  return loss;
}

// Attention's causal softmax over one row of scores x[0, S) (query `n - 1` of its sequence, so keys
// [0, n) are visible): p[j] = exp(scale x[j] - max) / sum for j < n, 0 after; in place (p == x
// allowed). `tmp` holds n floats. In GCC's vector types of 16 lanes (the plain loops' stores to
// tmp beside the reduction did not vectorise): exp_approx16 is exp_approx lane by lane.
// Rows whose width is a multiple of 16 run the last, partial block of visible keys as a whole
// vector with the keys past the query masked (its lanes read the row's masked scores, never past
// the row); other widths finish it lane by lane.
template <typename T>
WEFT_ALWAYS_INLINE void causal_softmax_row(const T* x, T* p, int64_t n, int64_t width, float scale,
                                           float* __restrict tmp) {
  const Int16s iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const bool whole_blocks = width % kLanes == 0;
  const int64_t full = n / kLanes * kLanes, end = whole_blocks ? (n + kLanes - 1) / kLanes * kLanes : full;
  const float inf = std::numeric_limits<float>::infinity();
  Lanes16 mx = Lanes16{} - inf;
  for (int64_t i = 0; i < end; i += kLanes) {
    Lanes16 e = load16(x + i);
    e = iota + static_cast<int32_t>(i) < static_cast<int32_t>(n) ? e : Lanes16{} - inf;
    mx = e > mx ? e : mx;
  }
  float m = -inf;
  for (int64_t i = end; i < n; ++i) m = to_float(x[i]) > m ? to_float(x[i]) : m;
  for (int j = 0; j < kLanes; ++j) m = mx[j] > m ? mx[j] : m;
  const float shift = m * scale;  // scale > 0: the maximum of the scaled row
  Lanes16 acc = {};
  for (int64_t i = 0; i < end; i += kLanes) {
    Lanes16 e = exp_approx16(load16(x + i) * scale - shift);
    e = iota + static_cast<int32_t>(i) < static_cast<int32_t>(n) ? e : Lanes16{};
    store16(tmp + i, e);
    acc += e;
  }
  float sum = 0.0f;
  for (int64_t i = end; i < n; ++i) {
    tmp[i] = exp_approx(to_float(x[i]) * scale - shift);
    sum += tmp[i];
  }
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < end; i += kLanes) store16(p + i, load16(tmp + i) * inv);  // 0 past the query
  for (int64_t i = end; i < n; ++i) p[i] = from_float<T>(tmp[i] * inv);
  int64_t i = std::max(n, end);
  for (; i < width && i % kLanes != 0; ++i) p[i] = from_float<T>(0.0f);
  for (; i + kLanes <= width; i += kLanes) store16(p + i, Lanes16{});
  for (; i < width; ++i) p[i] = from_float<T>(0.0f);
}
// Its backward over one row: dp[j] := scale p[j] (dp[j] - sum_k p[k] dp[k]) for j < n, 0 after (p
// is 0 past the query, so whole blocks may run over it).
template <typename T>
WEFT_ALWAYS_INLINE void causal_softmax_backward_row(const T* p, T* dp, int64_t n, int64_t width, float scale) {
  const bool whole_blocks = width % kLanes == 0;
  const int64_t end = whole_blocks ? (n + kLanes - 1) / kLanes * kLanes : n / kLanes * kLanes;
  Lanes16 acc = {};
  for (int64_t i = 0; i < end; i += kLanes) acc += load16(p + i) * load16(dp + i);
  float dot = 0.0f;
  for (int64_t i = end; i < n; ++i) dot += to_float(p[i]) * to_float(dp[i]);
  for (int j = 0; j < kLanes; ++j) dot += acc[j];
  for (int64_t i = 0; i < end; i += kLanes) store16(dp + i, load16(p + i) * (load16(dp + i) - dot) * scale);
  for (int64_t i = end; i < n; ++i) dp[i] = from_float<T>(scale * to_float(p[i]) * (to_float(dp[i]) - dot));
  int64_t i = std::max(n, end);
  for (; i < width && i % kLanes != 0; ++i) dp[i] = from_float<T>(0.0f);
  for (; i + kLanes <= width; i += kLanes) store16(dp + i, Lanes16{});
  for (; i < width; ++i) dp[i] = from_float<T>(0.0f);
}
// Rows [0, rows) of one score block: row r is the query at position first + r / group.
#define WEFT_SOFTMAX_CLONES(T)                                                                                   \
  WEFT_SIMD_CLONES void causal_softmax_rows_dispatch(T* x, int64_t rows, int64_t width, int64_t group,            \
                                                     int64_t first, float scale, float* tmp) {                    \
    for (int64_t r = 0; r < rows; ++r) {                                                                           \
      causal_softmax_row(x + r * width, x + r * width, first + r / group + 1, width, scale, tmp);                  \
    }                                                                                                              \
  }                                                                                                                \
  WEFT_SIMD_CLONES void causal_softmax_backward_rows_dispatch(const T* p, T* dp, int64_t rows, int64_t width,      \
                                                              int64_t group, int64_t first, float scale) {        \
    for (int64_t r = 0; r < rows; ++r) {                                                                           \
      causal_softmax_backward_row(p + r * width, dp + r * width, first + r / group + 1, width, scale);             \
    }                                                                                                              \
  }
WEFT_SOFTMAX_CLONES(float)
WEFT_SOFTMAX_CLONES(Bf16Bits)
#undef WEFT_SOFTMAX_CLONES

WEFT_SIMD_CLONES float cross_entropy_row_dispatch(const float* x, int64_t v, int64_t target, float scale, float* grad,
                                                  float* tmp) {
  return cross_entropy_row(x, v, target, scale, grad, tmp);
}
WEFT_SIMD_CLONES float cross_entropy_row_dispatch(const Bf16Bits* x, int64_t v, int64_t target, float scale,
                                                  Bf16Bits* grad, float* tmp) {
  return cross_entropy_row(x, v, target, scale, grad, tmp);
}

// sum(x[i]^2) over [0, n) in fp64: each square is exact in fp64 (a 24-bit significand squared),
// summed in 16 lanes.
template <typename T>
WEFT_ALWAYS_INLINE double squared_sum_range(const T* x, int64_t n) {
  constexpr int kLanes = 16;
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double e = to_float(x[i + j]);
      acc[j] += e * e;
    }
  }
  double sum = 0.0;
  for (; i < n; ++i) {
    const double e = to_float(x[i]);
    sum += e * e;
  }
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

WEFT_SIMD_CLONES double squared_sum_dispatch(const float* x, int64_t n) { return squared_sum_range(x, n); }
WEFT_SIMD_CLONES double squared_sum_dispatch(const Bf16Bits* x, int64_t n) { return squared_sum_range(x, n); }

WEFT_SIMD_CLONES void add_widened_dispatch(float* sum, const Bf16Bits* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) sum[i] += to_float(x[i]);
}
WEFT_SIMD_CLONES void add_widened_out_dispatch(float* out, const float* x, const Bf16Bits* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + to_float(a[i]);
}

// add_widened's node (fp32 x, bf16 a): the sum in one pass; backward as ATen's add of mixed dtypes.
class WidenedAddFunction : public torch::autograd::Function<WidenedAddFunction> {
 public:
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x, const torch::Tensor& a) {
    RECORD_FUNCTION("weft::add_widened", std::vector<c10::IValue>());  // named in profiles
    auto out = torch::empty_like(x, torch::MemoryFormat::Contiguous);
    float* o = data<float>(out);
    const float* xp = data<float>(x);
    const Bf16Bits* ap = data<Bf16Bits>(a);
    at::parallel_for(0, x.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
      add_widened_out_dispatch(o + begin, xp + begin, ap + begin, end - begin);
    });
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    return {grads[0], ctx->needs_input_grad(1) ? grads[0].to(torch::kBFloat16) : torch::Tensor()};
  }
};

#ifdef WEFT_WITH_CUDA
// The sum of the per-token cross-entropy of logits [N, V] (fp32 or bf16) against targets [N], in
// fp32; backward writes the logits' gradient in their dtype from the saved logits and per-row
// log-sum-exp (what ATen's log_softmax + nll_loss over an fp32 copy compute, without the copy).
class CrossEntropySumFunction : public torch::autograd::Function<CrossEntropySumFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor targets) {
    logits = logits.contiguous();
    const auto t = targets.to(logits.device(), torch::kLong).contiguous();
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    WEFT_CHECK(t.numel() == rows, "cross_entropy: {} targets for {} rows of logits", t.numel(), rows);
    auto loss = torch::empty({rows}, logits.options().dtype(torch::kFloat32));
    auto lse = torch::empty({rows}, logits.options().dtype(torch::kFloat32));
    on_cuda(logits, "cross_entropy", [&](cudaStream_t stream) {
      return cuda::cross_entropy_forward(logits.data_ptr(), cuda_dtype(logits), t.data_ptr<int64_t>(),
                                         loss.data_ptr<float>(), lse.data_ptr<float>(), rows, vocab, stream);
    });
    ctx->save_for_backward({logits, t, lse});
    return loss.sum();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &t = saved[1], &lse = saved[2];
    const auto g = grads[0].to(torch::kFloat32).contiguous();
    auto grad = torch::empty_like(logits);
    on_cuda(logits, "cross_entropy backward", [&](cudaStream_t stream) {
      return cuda::cross_entropy_backward(logits.data_ptr(), cuda_dtype(logits), t.data_ptr<int64_t>(),
                                          lse.data_ptr<float>(), g.data_ptr<float>(), grad.data_ptr(), logits.size(0),
                                          logits.size(1), stream);
    });
    return {grad, torch::Tensor()};
  }
};
#endif

}  // namespace

namespace {

// The hand-written kernels run on CPU tensors of fp32 or bf16; anything else (a CUDA tensor, fp16)
// takes ATen's ops, which run on every device.
bool fused_applies(const torch::Tensor& x) {
  if (x.scalar_type() != torch::kFloat32 && x.scalar_type() != torch::kBFloat16) return false;
#ifdef WEFT_WITH_CUDA
  if (x.is_cuda()) return true;
#endif
  return x.device().is_cpu();
}

}  // namespace

torch::Tensor aten_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Dtype out_dtype) {
  const auto xf = x.to(torch::kFloat32);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight).to(out_dtype);
}

torch::Tensor aten_swiglu(const torch::Tensor& gate_up) {
  const int64_t width = gate_up.size(-1) / 2;
  return torch::silu(gate_up.narrow(-1, 0, width)) * gate_up.narrow(-1, width, width);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> aten_split_qkv_with_rope(
    const torch::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const torch::Tensor& cos_in,
    const torch::Tensor& sin_in) {
  const int64_t batch = qkv.size(0), seq = qkv.size(1);
  const int64_t dim = qkv.size(2) / (num_heads + 2 * num_kv_heads);
  auto heads = qkv.view({batch, seq, num_heads + 2 * num_kv_heads, dim}).transpose(1, 2);
  // Per-row tables [B, T, D] broadcast over the heads.
  const auto cos = cos_in.dim() == 3 ? cos_in.unsqueeze(1) : cos_in, sin = sin_in.dim() == 3 ? sin_in.unsqueeze(1) : sin_in;
  auto rotate = [&](const torch::Tensor& x) {  // fp32 math, HF's rotate_half, in x's dtype
    const auto xf = x.to(torch::kFloat32);
    const int64_t half = dim / 2;
    const auto rotated = torch::cat({-xf.narrow(-1, half, half), xf.narrow(-1, 0, half)}, -1);
    return (xf * cos + rotated * sin).to(x.scalar_type()).contiguous();
  };
  return {rotate(heads.narrow(1, 0, num_heads)), rotate(heads.narrow(1, num_heads, num_kv_heads)),
          heads.narrow(1, num_heads + num_kv_heads, num_kv_heads).contiguous()};
}

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             torch::Dtype out_dtype) {
  bool fused = fused_applies(x) && (out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16);
#ifdef WEFT_WITH_CUDA
  fused = fused && (x.device().is_cpu() || x.size(-1) <= cuda::kRmsNormMaxDim);
#endif
  if (!fused) return aten_rms_norm(x, weight, eps, out_dtype);
  return RmsNormFunction::apply(x, weight, eps, static_cast<int64_t>(out_dtype));
}

torch::Tensor fused_swiglu(const torch::Tensor& gate_up) {
  return fused_applies(gate_up) ? SwigluFunction::apply(gate_up) : aten_swiglu(gate_up);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> split_qkv_with_rope(
    const torch::Tensor& qkv, int64_t num_heads, int64_t num_kv_heads, const torch::Tensor& cos,
    const torch::Tensor& sin) {
  // The CUDA kernel takes one table for every row: per-row tables (packed rows) go through ATen there.
  if (!fused_applies(qkv) || cos.device() != qkv.device() || (qkv.is_cuda() && cos.dim() == 3)) {
    return aten_split_qkv_with_rope(qkv, num_heads, num_kv_heads, cos, sin);
  }
  auto out = QkvRopeFunction::apply(qkv, cos, sin, num_heads, num_kv_heads);
  return {out[0], out[1], out[2]};
}

bool seeded_dropout_applies(const torch::Tensor& x) {
  return x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16);
}

uint64_t draw_dropout_seed() {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

torch::Tensor seeded_dropout(const torch::Tensor& x, double p, uint64_t seed) {
  WEFT_CHECK(seeded_dropout_applies(x), "seeded_dropout: a CPU tensor of fp32 or bf16 expected");
  return apply_dropout_mask(x, p, seed);
}

float dropout_scale(double p) { return static_cast<float>(1.0 / (1.0 - p)); }

torch::Tensor dropout_mask_indices(int64_t n, double p, uint64_t seed) {
  RECORD_FUNCTION("weft::dropout_mask_indices", std::vector<c10::IValue>());  // named in profiles
  WEFT_CHECK(p > 0.0 && p < 1.0, "dropout_mask_indices: p in (0, 1) expected, got {}", p);
  return dropped_indices(n, p, seed);
}

namespace {
// x [R, I] contiguous CPU fp32 or bf16; each adapter's mask as ascending indices of x's elements,
// at [I, r] contiguous fp32, and rows (u or v) [R, r] of x's dtype with unit column stride; their
// kernel operands.
std::vector<Complement> complements(const torch::Tensor& x, const std::vector<DroppedAdapter>& adapters,
                                    const char* what) {
  WEFT_CHECK(seeded_dropout_applies(x) && x.dim() == 2 && x.is_contiguous(),
             "{}: x must be a contiguous 2-d CPU tensor of fp32 or bf16", what);
  std::vector<Complement> ops;
  for (const auto& a : adapters) {
    const auto& dropped = a.dropped;
    WEFT_CHECK(dropped.defined() && dropped.device().is_cpu() && dropped.scalar_type() == torch::kInt32 &&
                   dropped.dim() == 1 && dropped.is_contiguous() && dropped.numel() <= x.numel() &&
                   (dropped.numel() == 0 || (dropped.data_ptr<int32_t>()[0] >= 0 &&
                                             dropped.data_ptr<int32_t>()[dropped.numel() - 1] < x.numel())),
               "{}: x's mask as int32 indices of its {} elements expected", what, x.numel());
    WEFT_CHECK(a.at.defined() && a.at.device().is_cpu() && a.at.scalar_type() == torch::kFloat32 &&
                   a.at.is_contiguous() && a.at.dim() == 2 && a.at.size(0) == x.size(1),
               "{}: A^T as a contiguous fp32 CPU matrix of {} rows expected", what, x.size(1));
    const auto& rows = a.rows;
    WEFT_CHECK(rows.defined() && rows.device().is_cpu() && rows.scalar_type() == x.scalar_type() && rows.dim() == 2 &&
                   rows.size(0) == x.size(0) && rows.size(1) == a.at.size(1) && (rows.size(1) <= 1 || rows.stride(1) == 1) &&
                   (rows.size(0) <= 1 || rows.stride(0) >= rows.size(1)),
               "{}: a [{}, {}] CPU matrix of x's dtype with unit column stride expected", what, x.size(0),
               a.at.size(1));
    const auto& values = a.values;
    WEFT_CHECK(!values.defined() || (values.device().is_cpu() && values.scalar_type() == x.scalar_type() &&
                                     values.dim() == 1 && values.is_contiguous() && values.numel() == dropped.numel()),
               "{}: the dropped elements' values as a contiguous CPU vector of x's dtype and the mask's {} elements "
               "expected", what, dropped.numel());
    ops.push_back(Complement{dropped.data_ptr<int32_t>(), dropped.numel(), a.at.data_ptr<float>(), rows.data_ptr(),
                             rows.stride(0), a.at.size(1), a.scale, nullptr,
                             values.defined() ? values.data_ptr() : nullptr});
  }
  return ops;
}
}  // namespace

void subtract_dropped_products_(const torch::Tensor& x, const std::vector<DroppedAdapter>& adapters) {
  RECORD_FUNCTION("weft::subtract_dropped_products_", std::vector<c10::IValue>());  // named in profiles
  const auto ops = complements(x, adapters, "subtract_dropped_products_");
  const int64_t rows = x.size(0), cols = x.size(1);
  dispatch_float_or_bf16(x.scalar_type(), "subtract_dropped_products_", [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, rows, rows_grain(cols), [&](int64_t begin, int64_t end) {
      for (size_t o = 0; o < ops.size(); o += kMaxComplements) {
        complement_forward_dispatch(data<T>(x), cols, ops.data() + o,
                                    std::min<int64_t>(kMaxComplements, static_cast<int64_t>(ops.size() - o)), begin, end);
      }
    });
  });
}

void dropped_backward_(torch::Tensor& grad_x, const torch::Tensor& x, const std::vector<DroppedAdapter>& adapters) {
  RECORD_FUNCTION("weft::dropped_backward_", std::vector<c10::IValue>());  // named in profiles
  auto ops = complements(x, adapters, "dropped_backward_");
  const int64_t rows = x.size(0), cols = x.size(1);
  WEFT_CHECK(!grad_x.defined() || (grad_x.sizes() == x.sizes() && grad_x.scalar_type() == x.scalar_type() &&
                                   grad_x.device().is_cpu() && grad_x.is_contiguous()),
             "dropped_backward_: x's gradient must be a contiguous CPU tensor of x's shape and dtype");
  // A's shares in fixed blocks of rows, each summed in row order into its own [cols, r] part, the
  // parts then added in block order: the same bits at any thread count.
  constexpr int64_t kBlockRows = 512;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<torch::Tensor> parts;
  for (size_t o = 0; o < ops.size(); ++o) {
    const auto& ga = adapters[o].grad_a;
    WEFT_CHECK(ga.defined() && ga.device().is_cpu() && ga.scalar_type() == torch::kFloat32 && ga.is_contiguous() &&
                   ga.dim() == 2 && ga.size(0) == ops[o].r && ga.size(1) == cols,
               "dropped_backward_: A's gradient as a contiguous fp32 CPU matrix [{}, {}] expected", ops[o].r, cols);
    parts.push_back(torch::zeros({blocks, cols, ops[o].r}, torch::kFloat32));
    ops[o].part = parts.back().data_ptr<float>();
  }
  dispatch_float_or_bf16(x.scalar_type(), "dropped_backward_", [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        for (size_t o = 0; o < ops.size(); o += kMaxComplements) {
          complement_backward_dispatch(grad_x.defined() ? data<T>(grad_x) : nullptr, data<T>(x), cols, ops.data() + o,
                                       std::min<int64_t>(kMaxComplements, static_cast<int64_t>(ops.size() - o)), b,
                                       b * kBlockRows, std::min(rows, (b + 1) * kBlockRows));
        }
      }
    });
  });
  for (size_t o = 0; o < ops.size(); ++o) {
    const float* pp = ops[o].part;
    float* ga = adapters[o].grad_a.data_ptr<float>();
    const int64_t r = ops[o].r;
    if (r == kLanes) {
      at::parallel_for(0, cols, 64, [&](int64_t j0, int64_t j1) { subtract_parts16_dispatch(pp, blocks, cols, ga, j0, j1); });
      continue;
    }
    at::parallel_for(0, cols, 64, [&](int64_t j0, int64_t j1) {
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t c = 0; c < r; ++c) {
          float sum = 0.0f;
          for (int64_t b = 0; b < blocks; ++b) sum += pp[(b * cols + j) * r + c];
          ga[c * cols + j] -= sum;
        }
      }
    });
  }
}

torch::Tensor transposed_fp32(const torch::Tensor& a) {
  WEFT_CHECK(a.dim() == 2, "transposed_fp32: a matrix expected, got {} dimensions", a.dim());
  if (!seeded_dropout_applies(a) || !a.is_contiguous()) return a.to(torch::kFloat32).t().contiguous();
  const int64_t rows = a.size(0), cols = a.size(1);
  auto out = torch::empty({cols, rows}, a.options().dtype(torch::kFloat32));
  float* o = out.data_ptr<float>();
  dispatch_float_or_bf16(a.scalar_type(), "transposed_fp32", [&](auto tag) {
    using T = decltype(tag);
    const T* in = data<T>(a);
    for (int64_t c = 0; c < rows; ++c) {
      for (int64_t j = 0; j < cols; ++j) o[j * rows + c] = to_float(in[c * cols + j]);
    }
  });
  return out;
}

torch::Tensor fused_dropout(const torch::Tensor& x, double p) {
  WEFT_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got {}", p);
  if (p == 0.0) return x;
  if (!seeded_dropout_applies(x)) {
    return torch::nn::functional::dropout(x, torch::nn::functional::DropoutFuncOptions().p(p).training(true));
  }
  return DropoutFunction::apply(x, p, static_cast<int64_t>(draw_dropout_seed()));
}

void add_into_fp32_(at::Tensor& sum, const at::Tensor& x) {
  if (sum.device().is_cpu() && x.device().is_cpu() && sum.scalar_type() == torch::kFloat32 &&
      x.scalar_type() == torch::kBFloat16 && sum.is_contiguous() && x.is_contiguous() && sum.sizes() == x.sizes()) {
    RECORD_FUNCTION("weft::add_into_fp32_", std::vector<c10::IValue>());  // named in profiles
    float* out = data<float>(sum);
    const Bf16Bits* in = data<Bf16Bits>(x);
    at::parallel_for(0, sum.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
      add_widened_dispatch(out + begin, in + begin, end - begin);
    });
    return;
  }
  sum.add_(x);
}

torch::Tensor add_widened(const torch::Tensor& x, const torch::Tensor& a) {
  if (x.device().is_cpu() && a.device().is_cpu() && x.scalar_type() == torch::kFloat32 &&
      a.scalar_type() == torch::kBFloat16 && x.is_contiguous() && a.is_contiguous() && x.sizes() == a.sizes()) {
    return WidenedAddFunction::apply(x, a);
  }
  return x + a;
}

at::Tensor squared_sum_fp64(const at::Tensor& t) {
  const int64_t n = t.numel();
  if (t.device().is_cpu() && t.is_contiguous() &&
      (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16)) {
    RECORD_FUNCTION("weft::squared_sum_fp64", std::vector<c10::IValue>());  // named in profiles
    // Fixed blocks summed in order: the same bits at any thread count.
    constexpr int64_t kBlock = int64_t{1} << 16;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
    dispatch_float_or_bf16(t.scalar_type(), "squared_sum_fp64", [&](auto tag) {
      using T = decltype(tag);
      const T* x = data<T>(t);
      at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
          partial[static_cast<size_t>(b)] = squared_sum_dispatch(x + b * kBlock, std::min(kBlock, n - b * kBlock));
        }
      });
    });
    double sum = 0.0;
    for (const double p : partial) sum += p;
    return at::scalar_tensor(sum, t.options().dtype(at::kDouble));
  }
  const at::Tensor flat = t.reshape({-1});
  if (n <= kSquaredSumChunk) return flat.to(at::kDouble).pow(2).sum();
  at::Tensor total = at::zeros({}, flat.options().dtype(at::kDouble));
  for (int64_t begin = 0; begin < n; begin += kSquaredSumChunk) {
    total += flat.narrow(0, begin, std::min(kSquaredSumChunk, n - begin)).to(at::kDouble).pow(2).sum();
  }
  return total;
}

namespace {
void check_score_rows(const torch::Tensor& t, int64_t group, int64_t first, const char* what) {
  WEFT_CHECK(t.device().is_cpu() && t.dim() == 3 && t.is_contiguous() &&
                 (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
             "{}: contiguous fp32 or bf16 CPU scores [N, rows, keys] expected, got {} of {}", what,
             fmt::join(t.sizes().vec(), "x"), c10::toString(t.scalar_type()));
  WEFT_CHECK(group > 0 && first >= 0 && t.size(1) % group == 0 && (t.size(1) == 0 || first + t.size(1) / group <= t.size(2)),
             "{}: {} rows of {} per position from position {} do not fit {} keys", what, t.size(1), group, first,
             t.size(2));
}
}  // namespace

void causal_softmax_rows_(torch::Tensor& scores, double scale, int64_t group, int64_t first) {
  check_score_rows(scores, group, first, "causal_softmax_rows_");
  RECORD_FUNCTION("weft::causal_softmax_rows_", std::vector<c10::IValue>());  // named in profiles
  const int64_t n = scores.size(0), rows = scores.size(1), width = scores.size(2);
  if (width == 0 || rows == 0) return;
  dispatch_float_or_bf16(scores.scalar_type(), "causal_softmax_rows_", [&](auto tag) {
    using T = decltype(tag);
    T* x = data<T>(scores);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(static_cast<size_t>(width));
      for (int64_t i = begin; i < end; ++i) {
        causal_softmax_rows_dispatch(x + i * rows * width, rows, width, group, first, static_cast<float>(scale),
                                     tmp.data());
      }
    });
  });
}

void causal_softmax_backward_rows_(const torch::Tensor& p, torch::Tensor& dp, double scale, int64_t group,
                                   int64_t first) {
  check_score_rows(p, group, first, "causal_softmax_backward_rows_");
  check_score_rows(dp, group, first, "causal_softmax_backward_rows_");
  WEFT_CHECK(p.sizes() == dp.sizes() && p.scalar_type() == dp.scalar_type(),
             "causal_softmax_backward_rows_: probabilities and their gradient of one shape and dtype expected");
  RECORD_FUNCTION("weft::causal_softmax_backward_rows_", std::vector<c10::IValue>());
  const int64_t n = p.size(0), rows = p.size(1), width = p.size(2);
  if (width == 0 || rows == 0) return;
  dispatch_float_or_bf16(p.scalar_type(), "causal_softmax_backward_rows_", [&](auto tag) {
    using T = decltype(tag);
    const T* pp = data<T>(p);
    T* g = data<T>(dp);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        causal_softmax_backward_rows_dispatch(pp + i * rows * width, g + i * rows * width, rows, width, group, first,
                                              static_cast<float>(scale));
      }
    });
  });
}

bool cross_entropy_rows_applies(const torch::Tensor& logits) {
  bool device_ok = logits.device().is_cpu();
#ifdef WEFT_WITH_CUDA
  device_ok = device_ok || logits.is_cuda();
#endif
  return device_ok && logits.dim() == 2 && logits.is_contiguous() &&
         (logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16);
}

torch::Tensor cross_entropy_rows(torch::Tensor& logits, const torch::Tensor& targets, int64_t ignore_index,
                                 std::optional<double> grad_scale) {
  WEFT_CHECK(cross_entropy_rows_applies(logits),
             "cross_entropy_rows: contiguous fp32 or bf16 CPU or CUDA logits [N, V] expected");
  RECORD_FUNCTION("weft::cross_entropy_rows", std::vector<c10::IValue>());  // named in profiles
  const int64_t rows = logits.size(0), vocab = logits.size(1);
#ifdef WEFT_WITH_CUDA
  if (logits.is_cuda()) {
    // The kernels ignore any target outside [0, vocab): ignore_index's rows, and (unchecked, as
    // reading the targets back would wait for the device) out-of-range ones.
    auto t = targets.to(logits.device(), torch::kLong).contiguous();
    WEFT_CHECK(t.numel() == rows, "cross_entropy: {} targets for {} rows of logits", t.numel(), rows);
    if (ignore_index >= 0 && ignore_index < vocab) t = t.masked_fill(t == ignore_index, -1);
    auto loss = torch::empty({rows}, logits.options().dtype(torch::kFloat32));
    auto lse = torch::empty({rows}, logits.options().dtype(torch::kFloat32));
    on_cuda(logits, "cross_entropy_rows", [&](cudaStream_t stream) {
      return cuda::cross_entropy_forward(logits.data_ptr(), cuda_dtype(logits), t.data_ptr<int64_t>(),
                                         loss.data_ptr<float>(), lse.data_ptr<float>(), rows, vocab, stream);
    });
    if (grad_scale) {  // in place: each thread reads an element, then writes its gradient over it
      const auto scale = torch::full({}, *grad_scale, logits.options().dtype(torch::kFloat32));
      on_cuda(logits, "cross_entropy_rows backward", [&](cudaStream_t stream) {
        return cuda::cross_entropy_backward(logits.data_ptr(), cuda_dtype(logits), t.data_ptr<int64_t>(),
                                            lse.data_ptr<float>(), scale.data_ptr<float>(), logits.data_ptr(), rows,
                                            vocab, stream);
      });
    }
    return loss;
  }
#endif
  const auto t = targets.to(torch::kLong).contiguous();
  WEFT_CHECK(t.numel() == rows, "cross_entropy: {} targets for {} rows of logits", t.numel(), rows);
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    WEFT_CHECK(tp[r] == ignore_index || (tp[r] >= 0 && tp[r] < vocab),
               "cross_entropy: target {} of row {} is outside the vocabulary of {} (ignore_index {})", tp[r], r,
               vocab, ignore_index);
  }
  auto loss = torch::empty({rows}, logits.options().dtype(torch::kFloat32));
  float* lp = loss.data_ptr<float>();
  const float scale = static_cast<float>(grad_scale.value_or(0.0));
  dispatch_float_or_bf16(logits.scalar_type(), "cross_entropy_rows", [&](auto tag) {
    using T = decltype(tag);
    T* xp = data<T>(logits);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(grad_scale ? static_cast<size_t>(vocab) : 0);
      for (int64_t r = begin; r < end; ++r) {
        T* row = xp + r * vocab;
        const int64_t target = tp[r] == ignore_index ? -1 : tp[r];
        lp[r] = cross_entropy_row_dispatch(row, vocab, target, scale, grad_scale ? row : nullptr, tmp.data());
      }
    });
  });
  return loss;
}

namespace {

// cross_entropy_sum_of on the CPU: cross_entropy_rows forward (the logits saved in their dtype, no
// fp32 copy) and again in backward over a copy, which it overwrites with the gradient.
class CpuCrossEntropySumFunction : public torch::autograd::Function<CpuCrossEntropySumFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, const torch::Tensor& targets) {
    logits = logits.contiguous();
    const auto t = targets.to(torch::kLong).contiguous();
    const auto loss = cross_entropy_rows(logits, t, /*ignore_index=*/-100, std::nullopt).sum();
    ctx->save_for_backward({logits, t});
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    cross_entropy_rows(grad, saved[1], /*ignore_index=*/-100, grads[0].item<double>());
    return {grad, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor cross_entropy_sum_of(const torch::Tensor& logits, const torch::Tensor& targets) {
#ifdef WEFT_WITH_CUDA
  if (logits.is_cuda() && fused_applies(logits) && logits.dim() == 2) return CrossEntropySumFunction::apply(logits, targets);
#endif
  if (logits.dim() == 2 && logits.device().is_cpu() &&
      (logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kBFloat16)) {
    return CpuCrossEntropySumFunction::apply(logits, targets);
  }
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), targets,
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

}  // namespace weft
