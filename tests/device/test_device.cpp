// What can be verified of the GPU path without a GPU: train.device's resolution per local rank
// and its refusals, the peak-FLOP table and the model FLOPs behind MFU, and fp16's dynamic loss
// scaler. (The routing of collectives by device is in tests/dist, the ATen kernels that CUDA runs
// in tests/model, fp16 training end to end in tests/cli.)
#include <cmath>
#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "core/model/config.h"
#include "core/train/flops.h"
#include "core/train/loss_scaler.h"
#include "core/util/device.h"
#include "core/util/error.h"
#include "test_paths.h"

namespace weft {
namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Device, EachRankComputesOnTheGpuOfItsLocalRank) {
  const DeviceInventory two_gpus{true, 2}, no_cuda{false, 0}, cuda_no_gpu{true, 0};
  EXPECT_EQ(resolve_device("cpu", 1, 5, two_gpus), c10::Device(c10::kCPU));
  EXPECT_EQ(resolve_device("cuda", 0, 4, two_gpus), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(resolve_device("cuda", 1, 5, two_gpus), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(resolve_device("auto", 1, 1, two_gpus), c10::Device(c10::kCUDA, 1));
  // auto falls back to the CPU where there is no CUDA or no GPU to see.
  EXPECT_EQ(resolve_device("auto", 0, 0, no_cuda), c10::Device(c10::kCPU));
  EXPECT_EQ(resolve_device("auto", 3, 3, cuda_no_gpu), c10::Device(c10::kCPU));
}

TEST(Device, ADeviceTheRankCannotHaveIsOneClearErrorBeforeCompute) {
  const std::string no_build = error_of([] { resolve_device("cuda", 0, 0, DeviceInventory{false, 0}); });
  EXPECT_NE(no_build.find("built without CUDA"), std::string::npos) << no_build;
  const std::string no_gpu = error_of([] { resolve_device("cuda", 0, 2, DeviceInventory{true, 0}); });
  EXPECT_NE(no_gpu.find("rank 2 sees no CUDA device"), std::string::npos) << no_gpu;
  // Three ranks on a machine with two GPUs: the third has none.
  const std::string missing = error_of([] { resolve_device("cuda", 2, 6, DeviceInventory{true, 2}); });
  EXPECT_NE(missing.find("rank 6 is local rank 2"), std::string::npos) << missing;
  EXPECT_NE(missing.find("cuda:2"), std::string::npos) << missing;
  EXPECT_NE(missing.find("shows 2 CUDA devices"), std::string::npos) << missing;
  EXPECT_NE(missing.find("CUDA_VISIBLE_DEVICES"), std::string::npos) << missing;
  // WEFT_SHARE_GPUS=1 (testing): more local ranks than GPUs share them round-robin.
  EXPECT_EQ(resolve_device("cuda", 2, 6, DeviceInventory{true, 2, true}), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(resolve_device("cuda", 3, 7, DeviceInventory{true, 2, true}), c10::Device(c10::kCUDA, 1));
  const std::string unknown = error_of([] { resolve_device("gpu", 0, 0, DeviceInventory{true, 1}); });
  EXPECT_NE(unknown.find("train.device must be"), std::string::npos) << unknown;
}

// This process: the build's CUDA is what CMake found in LibTorch, and auto picks a GPU exactly
// when one is visible (none on the CI machines; on a GPU machine, cuda:0).
TEST(Device, AutoIsTheCpuExactlyWhereNoGpuIsVisible) {
  const DeviceInventory here = this_process_devices();
  EXPECT_EQ(here.cuda_compiled, static_cast<bool>(WEFT_TEST_TORCH_CUDA));
  const c10::Device chosen = resolve_device("auto", 0, 0, here);
  EXPECT_EQ(chosen.is_cuda(), here.cuda_devices > 0);
  EXPECT_EQ(device_name(c10::Device(c10::kCPU)), "cpu");
  EXPECT_EQ(device_memory(c10::Device(c10::kCPU)).peak_allocated_bytes, 0);
}

TEST(Flops, KnownGpusPeaksComeFromTheTableAndTheSettingOverridesThem) {
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA H100 80GB HBM3", "bf16", 0), 989.4);
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA H100 PCIe", "bf16", 0), 756.0);  // not the SXM part
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA H200", "fp16", 0), 989.4);
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA A100-SXM4-80GB", "bf16", 0), 312.0);
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", 0), 19.5);
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA A10G", "bf16", 0), 70.0);  // not the A10
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA L40S", "bf16", 0), 362.1);  // not the L4
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA L4", "bf16", 0), 121.0);
  EXPECT_FALSE(peak_tflops("Tesla V100-SXM2-16GB", "bf16", 0).has_value());  // no bf16 on Volta
  EXPECT_DOUBLE_EQ(*peak_tflops("Tesla V100-SXM2-16GB", "fp16", 0), 125.0);
  EXPECT_FALSE(peak_tflops("cpu", "fp32", 0).has_value());
  EXPECT_FALSE(peak_tflops("Some Future GPU", "bf16", 0).has_value());
  EXPECT_DOUBLE_EQ(*peak_tflops("Some Future GPU", "bf16", 1234.5), 1234.5);
  EXPECT_DOUBLE_EQ(*peak_tflops("NVIDIA H100 80GB HBM3", "bf16", 500), 500.0);
}

// 6 N + 12 L T H D with N counted independently: the model's parameters minus the norms (and the
// embedding lookup, which is no matmul, unless tied: then it is the LM head's matmul too).
TEST(Flops, TrainingFlopsPerTokenAreSixPerWeightPlusAttention) {
  for (const char* preset : {"llama-3.2-1b", "llama-3.2-3b", "small"}) {
    const ModelConfig c = preset_config(preset);
    const int64_t norms = (2 * c.num_hidden_layers + 1) * c.hidden_size;
    const int64_t embedding = c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size;
    const double matmul_weights = static_cast<double>(c.parameter_count() - norms - embedding);
    const double attention = 12.0 * c.num_hidden_layers * 2048 * c.num_attention_heads * c.head_dim;
    EXPECT_DOUBLE_EQ(training_flops_per_token(c, 2048), 6 * matmul_weights + attention) << preset;
    // LoRA: no weight gradients for the frozen base, 6 per adapter weight.
    EXPECT_DOUBLE_EQ(training_flops_per_token(c, 2048, 1000000), 4 * matmul_weights + 6e6 + attention) << preset;
  }
  // Llama 3.2 1B at 2048 tokens: 6 x 1.236B matmul weights (the tied head included) = 7.42 GFLOPs,
  // plus attention's 12 x 16 layers x 2048 x 32 heads x 64 = 0.81 GFLOPs per token.
  EXPECT_NEAR(training_flops_per_token(preset_config("llama-3.2-1b"), 2048) / 1e9, 8.22, 0.01);
  // 10,000 tokens/s per device of a 1e9-FLOP token on a 100-TFLOP/s device: 10%.
  EXPECT_DOUBLE_EQ(model_flop_utilisation(1e4, 1e9, 100.0), 0.1);
}

TEST(LossScaler, HalvesAndSkipsOnOverflowAndDoublesAfterAStreakOfFiniteSteps) {
  LossScaler scaler(true, LossScalerOptions{1024.0, 2.0, 0.5, 3});
  EXPECT_DOUBLE_EQ(scaler.scale(), 1024.0);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_TRUE(scaler.update(true));
  EXPECT_DOUBLE_EQ(scaler.scale(), 1024.0);
  EXPECT_TRUE(scaler.update(true));  // the third finite step in a row: grow
  EXPECT_DOUBLE_EQ(scaler.scale(), 2048.0);
  EXPECT_EQ(scaler.finite_streak(), 0);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_TRUE(scaler.update(true));
  EXPECT_FALSE(scaler.update(false));  // overflow: skip, back off, and the streak starts again
  EXPECT_DOUBLE_EQ(scaler.scale(), 1024.0);
  EXPECT_EQ(scaler.finite_streak(), 0);
  EXPECT_FALSE(scaler.update(false));
  EXPECT_DOUBLE_EQ(scaler.scale(), 512.0);
  EXPECT_EQ(scaler.skipped_steps(), 2);
  EXPECT_TRUE(scaler.update(true));
  EXPECT_TRUE(scaler.update(true));
  EXPECT_DOUBLE_EQ(scaler.scale(), 512.0);  // two, not three, since the last overflow
  EXPECT_TRUE(scaler.update(true));
  EXPECT_DOUBLE_EQ(scaler.scale(), 1024.0);
  // PyTorch's GradScaler defaults.
  LossScaler defaults(true);
  EXPECT_DOUBLE_EQ(defaults.scale(), 65536.0);
}

TEST(LossScaler, DisabledItIsOneAndNeverSkips) {
  LossScaler off(false);
  EXPECT_DOUBLE_EQ(off.scale(), 1.0);
  EXPECT_TRUE(off.update(false));
  EXPECT_DOUBLE_EQ(off.scale(), 1.0);
  EXPECT_EQ(off.skipped_steps(), 0);
}

TEST(LossScaler, ACheckpointsScaleIsRestoredAndOneOutOfRangeRefused) {
  LossScaler scaler(true, LossScalerOptions{1024.0, 2.0, 0.5, 4});
  scaler.restore(256.0, 3);
  EXPECT_DOUBLE_EQ(scaler.scale(), 256.0);
  EXPECT_TRUE(scaler.update(true));  // the 4th finite step since the last change
  EXPECT_DOUBLE_EQ(scaler.scale(), 512.0);
  EXPECT_THROW(scaler.restore(0.0, 0), Error);
  EXPECT_THROW(scaler.restore(8.0, 4), Error);
  EXPECT_THROW(LossScaler(true, LossScalerOptions{1024.0, 1.0, 0.5, 4}), Error);
}

}  // namespace
}  // namespace weft
