#include "core/model/gemm.h"

#include <dlfcn.h>

#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <ATen/Context.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "core/util/error.h"

namespace weft {
namespace {

// at::native::mkldnn_matmul(mat1, mat2, result, beta, alpha): result = beta result + alpha mat1 mat2,
// exported by libtorch_cpu but not in its installed headers; looked up by its (Itanium) name, so
// a LibTorch without it (no MKLDNN, another signature) leaves weft on ATen's products.
using MkldnnMatmul = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float, float);
constexpr const char* kMkldnnMatmul = "_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff";

MkldnnMatmul mkldnn_matmul() {
  static const auto fn = reinterpret_cast<MkldnnMatmul>(dlsym(RTLD_DEFAULT, kMkldnnMatmul));
  return fn;
}

std::atomic<CpuFp32Gemm> chosen{CpuFp32Gemm::aten};
std::atomic<int64_t> routed{0};

bool contiguous_or_transposed(const torch::Tensor& t) {
  return t.is_contiguous() || (t.stride(0) == 1 && t.stride(1) == t.size(0));
}

void onednn_out(const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  mkldnn_matmul()(a, b, out, accumulate ? 1.0f : 0.0f, 1.0f);
  routed.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

const char* to_string(CpuFp32Gemm gemm) { return gemm == CpuFp32Gemm::onednn ? "onednn" : "aten"; }

std::optional<std::string> onednn_fp32_gemm_unavailable() {
  static const std::optional<std::string> why = []() -> std::optional<std::string> {
    if (mkldnn_matmul() == nullptr) return "this LibTorch exports no at::native::mkldnn_matmul";
    if (!at::hasMKLDNN()) return "this LibTorch was built without oneDNN (MKLDNN)";
    try {  // a product it can check: it refuses fp32 on CPUs without AVX-512 BW/VL/DQ or AVX-NE-CONVERT
      torch::NoGradGuard no_grad;
      const auto a = torch::arange(1, 1 + 32 * 24, torch::kFloat32).reshape({32, 24}).div_(97.0);
      const auto b = torch::arange(1, 1 + 24 * 40, torch::kFloat32).reshape({24, 40}).div_(89.0);
      auto out = torch::empty({32, 40});
      onednn_out(out, a, b, false);
      const auto want = torch::mm(a.to(torch::kFloat64), b.to(torch::kFloat64));
      const double err = (out.to(torch::kFloat64) - want).abs().max().item<double>();
      if (!(err < 1e-4 * want.abs().max().item<double>())) {
        return fmt::format("oneDNN's fp32 product of a [32 x 24] by [24 x 40] check was {:.3g} off", err);
      }
    } catch (const std::exception& e) {
      std::string message = e.what();
      if (const auto line = message.find('\n'); line != std::string::npos) message.resize(line);
      return "oneDNN refused an fp32 product here: " + message;
    }
    return std::nullopt;
  }();
  return why;
}

CpuId cpu_id() {
  CpuId id;
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return id;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  id.vendor = vendor;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0) {
    const unsigned base = (eax >> 8) & 0xf;
    id.family = static_cast<int>(base == 0xf ? base + ((eax >> 20) & 0xff) : base);
  }
#endif
  return id;
}

CpuFp32Gemm resolve_cpu_fp32_gemm(const std::string& setting) {
  if (setting == "aten") return CpuFp32Gemm::aten;
  if (setting == "onednn") {
    const auto why = onednn_fp32_gemm_unavailable();
    WEFT_CHECK(!why, "train.fp32_cpu_gemm = \"onednn\", but {}", *why);
    return CpuFp32Gemm::onednn;
  }
  WEFT_CHECK(setting == "auto", "train.fp32_cpu_gemm = \"{}\": expected auto, aten or onednn", setting);
  const auto id = cpu_id();
  const bool mkl_at_half_width = at::hasMKL() && id.vendor == "AuthenticAMD" && id.family >= 0x1a;
  return mkl_at_half_width && !onednn_fp32_gemm_unavailable() ? CpuFp32Gemm::onednn : CpuFp32Gemm::aten;
}

void set_cpu_fp32_gemm(CpuFp32Gemm gemm) {
  if (gemm == CpuFp32Gemm::onednn) {
    const auto why = onednn_fp32_gemm_unavailable();
    WEFT_CHECK(!why, "oneDNN cannot multiply fp32 matrices here: {}", *why);
  }
  chosen.store(gemm);
}

CpuFp32Gemm cpu_fp32_gemm() { return chosen.load(); }

int64_t onednn_fp32_products() { return routed.load(std::memory_order_relaxed); }

bool cpu_gemm_routes(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out) {
  const auto fits = [](const torch::Tensor& t) {
    return t.defined() && t.dim() == 2 && t.device().is_cpu() && t.scalar_type() == torch::kFloat32 &&
           t.layout() == torch::kStrided;
  };
  if (!fits(a) || !fits(b) || (out.defined() && (!fits(out) || !out.is_contiguous()))) return false;
  if (a.size(1) != b.size(0) || a.size(0) < 64 || a.size(1) < 64 || b.size(1) < 64) return false;
  if (torch::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad() || (out.defined() && out.requires_grad()))) {
    return false;
  }
  return contiguous_or_transposed(a) && contiguous_or_transposed(b);
}

bool onednn_takes(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& out) {
  return cpu_fp32_gemm() == CpuFp32Gemm::onednn && cpu_gemm_routes(a, b, out);
}

bool onednn_multiplies(const torch::Tensor& weight, torch::Dtype dtype) {
  return weight.device().is_cpu() && weight.scalar_type() == torch::kFloat32 && dtype == torch::kFloat32 &&
         cpu_fp32_gemm() == CpuFp32Gemm::onednn;
}

void gemm_out_with(CpuFp32Gemm gemm, const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b,
                   bool accumulate) {
  WEFT_CHECK(out.dim() == 2 && a.dim() == 2 && b.dim() == 2 && out.size(0) == a.size(0) && out.size(1) == b.size(1),
             "gemm_out: [{}] by [{}] into [{}]", fmt::join(a.sizes(), " x "), fmt::join(b.sizes(), " x "),
             fmt::join(out.sizes(), " x "));
  if (gemm == CpuFp32Gemm::onednn && cpu_gemm_routes(a, b, out)) {
    const auto why = onednn_fp32_gemm_unavailable();
    WEFT_CHECK(!why, "gemm_out: oneDNN cannot multiply fp32 matrices here: {}", *why);
    onednn_out(out, a, b, accumulate);
    return;
  }
  auto target = out;
  if (accumulate) {
    target.addmm_(a, b);
  } else {
    torch::mm_out(target, a, b);
  }
}

void gemm_out(const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, bool accumulate) {
  gemm_out_with(cpu_fp32_gemm(), out, a, b, accumulate);
}

torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& b) {
  if (!onednn_takes(a, b)) return torch::mm(a, b);
  auto out = torch::empty({a.size(0), b.size(1)}, a.options());
  onednn_out(out, a, b, false);
  return out;
}

}  // namespace weft
