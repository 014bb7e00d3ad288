// Model FLOP utilisation: the FLOPs a training step of the model needs per token, and the peak
// FLOP/s of known GPUs, so that a run's tokens/s can be read as a fraction of what the device could
// do (PaLM's MFU; torchtitan's and picotron's figures use the same definition).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/model/config.h"

namespace weft {

// Training FLOPs per token: forward (2 per weight of every matmul, plus attention's 4 x layers x
// seq_len x heads x head_dim for scores and values, no causal discount) and backward (twice the
// forward for activations; the weights' gradients only for trainable weights). Full fine-tuning:
// 6 N + 12 L T H D, N the matmul weights (the LM head included, embedding lookups not). LoRA:
// 4 N + 6 N_adapters + 12 L T H D, where `lora_parameters` counts the adapters' weights.
double training_flops_per_token(const ModelConfig& config, int64_t seq_len, int64_t lora_parameters = -1);

// A GPU's dense peak TFLOP/s (no structured sparsity) for bf16, fp16 (tensor cores, fp32
// accumulate) and fp32 (without TF32), from NVIDIA's data sheets. 0: the GPU lacks that type.
struct PeakTflops {
  const char* name;  // matched as a substring of the device's name, most specific first
  double bf16, fp16, fp32;
};

// The table's entry for a device name ("NVIDIA H100 80GB HBM3"), if any.
std::optional<PeakTflops> known_gpu_peak(const std::string& device_name);

// The peak TFLOP/s to compare with: `override_tflops` when > 0 (train.peak_tflops), else the
// table's for the device and precision ("fp32", "bf16", "fp16"); nullopt when neither knows (a CPU,
// an unlisted GPU, a type the GPU lacks).
std::optional<double> peak_tflops(const std::string& device_name, const std::string& precision, double override_tflops);

// Model FLOP utilisation in [0, 1]: achieved training FLOP/s per device over its peak.
double model_flop_utilisation(double tokens_per_second_per_device, double flops_per_token, double peak_tflops);

}  // namespace weft
