// Which library multiplies fp32 matrices on the CPU: ATen's own (its BLAS: MKL in PyTorch's x86
// builds) or oneDNN's matmul (linked into the same LibTorch, reached through ATen's
// mkldnn_matmul), chosen once per process (train.fp32_cpu_gemm). MKL chooses its kernels by the
// CPU's vendor and runs AVX2 code on AMD CPUs that have AVX-512; oneDNN chooses by the
// instructions the CPU has. Both compute the same products in fp32 with fp32 accumulation, in
// different summation orders (results differ by rounding). bf16 and fp16 products are untouched:
// ATen already hands them to oneDNN on the CPU.
#pragma once

#include <optional>
#include <string>

#include <torch/types.h>

namespace weft {

enum class CpuFp32Gemm { aten, onednn };

const char* to_string(CpuFp32Gemm gemm);

// Why oneDNN cannot multiply fp32 matrices in this process (this LibTorch has no mkldnn_matmul,
// or it refuses fp32 on this CPU: it wants AVX-512 BW/VL/DQ or AVX-NE-CONVERT); nullopt where it can
// (checked once, on a small product).
std::optional<std::string> onednn_fp32_gemm_unavailable();

// The library for a train.fp32_cpu_gemm setting: "aten", "onednn", or "auto": oneDNN where ATen's
// BLAS is MKL on an AMD CPU of family 0x1A or later (Zen 5: 512-bit FMAs at full width, where MKL's
// AVX2 kernels reach half the FMA rate) and oneDNN takes fp32 here, ATen elsewhere (Intel's CPUs,
// where MKL runs AVX-512 and was faster inside a step; Zen 4, whose 512-bit FMAs are two 256-bit
// halves; CPUs without AVX-512). Throws weft::Error for another name, or for "onednn" where
// onednn_fp32_gemm_unavailable() says why not.
CpuFp32Gemm resolve_cpu_fp32_gemm(const std::string& setting);

// The CPU's vendor string ("GenuineIntel", "AuthenticAMD") and family (base + extended) from
// cpuid; "" and 0 off x86.
struct CpuId {
  std::string vendor;
  int family = 0;
};
CpuId cpu_id();

// The process's choice (ATen until set); set once before compute starts (Job does, from the
// configuration). Throws weft::Error for oneDNN where it is unavailable.
void set_cpu_fp32_gemm(CpuFp32Gemm gemm);
CpuFp32Gemm cpu_fp32_gemm();

// How many products oneDNN has multiplied in this process (the availability check's included).
int64_t onednn_fp32_products();

// a [m, k] by b [k, n]: through the process's library where cpu_gemm_routes() holds, torch::mm
// elsewhere (any dtype or device).
torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b);

// out = a b, or out += a b where `accumulate`; out [m, n] must not overlap a or b. The same routing.
// Throws weft::Error for shapes that do not make [m, n] (ATen's mm_out would resize `out`).
void gemm_out(const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate = false);

// The same with the library given (trainer bench's peak, the tests), when `gemm` can take the
// product (cpu_gemm_routes), ATen's otherwise; throws weft::Error for oneDNN where
// onednn_fp32_gemm_unavailable() says why not.
void gemm_out_with(CpuFp32Gemm gemm, const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b,
                   bool accumulate = false);

// Whether oneDNN would take this product: 2-D CPU fp32 operands, each contiguous or the transpose of
// a contiguous matrix (oneDNN's matmul copies any other layout first), a contiguous fp32 `out`
// (when given), none of them needing autograd, and at least 64 along each side (LoRA's rank-r
// products stay with ATen: oneDNN ran them at 25-65 GFLOP/s inside a step, the large ones at 75-88).
bool cpu_gemm_routes(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out = {});

// Whether the process's products of a and b go to oneDNN: it is chosen and cpu_gemm_routes holds.
bool onednn_takes(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out = {});

// Whether a layer's fp32 CPU weight computing in `dtype` has its products where oneDNN is chosen:
// fp32 compute on the CPU with oneDNN as the process's library (the layer then takes a path whose
// products go through gemm(), not autograd's linear).
bool onednn_multiplies(const torch::Tensor& weight, torch::Dtype dtype);

}  // namespace weft
