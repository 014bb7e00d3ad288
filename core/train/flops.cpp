#include "core/train/flops.h"

#include <array>

namespace weft {

double training_flops_per_token(const ModelConfig& c, int64_t seq_len, int64_t lora_parameters) {
  const double d = static_cast<double>(c.hidden_size), hd = static_cast<double>(c.head_dim);
  const double heads = static_cast<double>(c.num_attention_heads), kv = static_cast<double>(c.num_key_value_heads);
  const double per_layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * static_cast<double>(c.intermediate_size);
  const double matmul_weights =
      per_layer * static_cast<double>(c.num_hidden_layers) + d * static_cast<double>(c.vocab_size);  // + LM head
  const double attention = 12.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(seq_len) * heads * hd;
  if (lora_parameters < 0) return 6.0 * matmul_weights + attention;
  return 4.0 * matmul_weights + 6.0 * static_cast<double>(lora_parameters) + attention;
}

namespace {

// Dense tensor-core peaks from NVIDIA's data sheets (the sparse figures halved). SXM and PCIe
// parts differ for the H100; an unqualified "H100" is taken as the SXM part.
constexpr std::array<PeakTflops, 14> kGpus{{
    {"H100 PCIe", 756.0, 756.0, 51.2},
    {"H100 NVL", 835.0, 835.0, 60.0},
    {"H100", 989.4, 989.4, 66.9},  // SXM5 (HBM3)
    {"H200", 989.4, 989.4, 66.9},
    {"GH200", 989.4, 989.4, 66.9},
    {"A100", 312.0, 312.0, 19.5},
    {"A10G", 70.0, 70.0, 31.2},
    {"A10", 125.0, 125.0, 31.2},
    {"L40S", 362.1, 362.1, 91.6},
    {"L4", 121.0, 121.0, 30.3},
    {"RTX 4090", 165.2, 165.2, 82.6},
    {"RTX A6000", 154.8, 154.8, 38.7},
    {"V100", 0.0, 125.0, 15.7},  // no bf16
    {"T4", 0.0, 65.0, 8.1},      // no bf16
}};

}  // namespace

std::optional<PeakTflops> known_gpu_peak(const std::string& device_name) {
  for (const auto& gpu : kGpus) {
    if (device_name.find(gpu.name) != std::string::npos) return gpu;
  }
  return std::nullopt;
}

std::optional<double> peak_tflops(const std::string& device_name, const std::string& precision, double override_tflops) {
  if (override_tflops > 0) return override_tflops;
  const auto gpu = known_gpu_peak(device_name);
  if (!gpu) return std::nullopt;
  const double peak = precision == "bf16" ? gpu->bf16 : precision == "fp16" ? gpu->fp16 : gpu->fp32;
  if (peak <= 0) return std::nullopt;
  return peak;
}

double model_flop_utilisation(double tokens_per_second_per_device, double flops_per_token, double peak) {
  return peak > 0 ? tokens_per_second_per_device * flops_per_token / (peak * 1e12) : 0.0;
}

}  // namespace weft
