// Every difference between the LibTorch versions weft builds against, in one place: Debian 12's
// libtorch-dev 1.13 (CPU) and PyTorch's 2.x wheels (CUDA + NCCL compiled in; 2.11 is the pin in
// tools/requirements.txt). Code elsewhere calls these names and never tests TORCH_VERSION itself
// (the one other file that does is torch_profiler.cpp: PyTorch's profiler, 2.x only).
#pragma once

#include <stdexcept>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#define WEFT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if WEFT_TORCH_AT_LEAST(2, 0)
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#endif

namespace c10d {
class Backend;
class ProcessGroup;
}  // namespace c10d

namespace weft::compat {

// "2.11.0": the LibTorch this weft was compiled against (in run summaries and `trainer plugins`).
inline std::string libtorch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

// The base class of c10d's process-group implementations (ProcessGroupGloo, ProcessGroupNCCL):
// c10d::Backend since 2.0, c10d::ProcessGroup before.
#if WEFT_TORCH_AT_LEAST(2, 0)
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

// TCPStoreOptions::useLibUV exists from 2.4 on (default true there); a LibTorch built without
// libuv (Debian 13's 2.6) refuses `true` when the server starts. 1.13's store has no libuv backend.
inline constexpr bool kStoreHasLibuvOption = WEFT_TORCH_AT_LEAST(2, 4);
template <class TCPStoreOptions>
void set_store_libuv(TCPStoreOptions& options, bool use_libuv) {
#if WEFT_TORCH_AT_LEAST(2, 4)
  options.useLibUV = use_libuv;
#else
  (void)options;
  (void)use_libuv;
#endif
}

// The key torch::optim::Optimizer::state() files a parameter's state under: its TensorImpl* (2.x),
// or that pointer printed as a string (1.13).
#if WEFT_TORCH_AT_LEAST(2, 0)
inline void* optimizer_state_key(const at::Tensor& parameter) { return parameter.unsafeGetTensorImpl(); }
#else
inline std::string optimizer_state_key(const at::Tensor& parameter) {
  return c10::guts::to_string(parameter.unsafeGetTensorImpl());
}
#endif

// PyTorch's profiler (Kineto) through its C++ API: 2.x (torch_profiler.cpp).
inline constexpr bool kHasTorchProfiler = WEFT_TORCH_AT_LEAST(2, 0);

// Ends a backend's communicators and background threads (what destroy_process_group does) before
// its last reference goes: Backend::shutdown since 2.4. An NCCL group destroyed without it leaves
// its watchdog to outlive it (a later test crashed on the GPU machine). Before 2.4 the destructor
// alone does it.
template <typename B = Backend>  // a template: Backend is only declared here
inline void shutdown_backend(B& backend) {
#if WEFT_TORCH_AT_LEAST(2, 4)
  backend.shutdown();
#else
  (void)backend;
#endif
}

// aten::_fused_adamw_ (2.0+ on CUDA): one AdamW step over many tensors in one kernel, the
// update torch.optim.AdamW(fused=True) makes. `steps` holds each tensor's step count after this
// step (float32 on the tensors' device; the kernel reads it, as torch.optim increments it first).
inline constexpr bool kHasFusedAdamW = WEFT_TORCH_AT_LEAST(2, 0);
inline constexpr bool kHasFusedAdamWOnCpu = WEFT_TORCH_AT_LEAST(2, 4);
inline void fused_adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList steps, double lr, double beta1, double beta2,
                        double weight_decay, double eps) {
#if WEFT_TORCH_AT_LEAST(2, 0)
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                    weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)exp_avgs, (void)exp_avg_sqs, (void)steps, (void)lr, (void)beta1, (void)beta2,
      (void)weight_decay, (void)eps;
  throw std::logic_error("fused_adamw needs LibTorch 2.x (check kHasFusedAdamW)");
#endif
}

// fp16 matmuls on the CPU: LibTorch 2.x (1.13 has no Half addmm on the CPU). fp16 training on a
// CPU (slow: no fp16 GEMM units) exists to test the loss scaler without a GPU.
inline constexpr bool kCpuComputesFp16 = WEFT_TORCH_AT_LEAST(2, 2);

// at::scaled_dot_product_attention (2.0+; fused flash-attention kernels on CPU and CUDA). 1.13
// has none: callers check kHasScaledDotProductAttention first.
inline constexpr bool kHasScaledDotProductAttention = WEFT_TORCH_AT_LEAST(2, 0);
// Causal attention over q [B, H, S, D] and k, v [B, Hkv, S, D] (H a multiple of Hkv).
inline at::Tensor scaled_dot_product_attention_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if WEFT_TORCH_AT_LEAST(2, 5)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != k.size(1));
#elif WEFT_TORCH_AT_LEAST(2, 0)
  const int64_t group = q.size(1) / k.size(1);
  return at::scaled_dot_product_attention(q, group == 1 ? k : k.repeat_interleave(group, 1),
                                          group == 1 ? v : v.repeat_interleave(group, 1), {}, 0.0, true);
#else
  (void)q, (void)k, (void)v;
  return {};
#endif
}

}  // namespace weft::compat
