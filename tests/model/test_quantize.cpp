// Quantized frozen base weights (core/model/quantize.h, model.quantize): each format's error bound
// per tensor, its stored layout, the quantized linear's gradients, and a model whose blocks are
// quantized at load computing what the dequantized weights compute. The stored bytes against
// bitsandbytes itself: tools/quant_reference.py (ctest Quantize.*).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/model/memory_estimate.h"
#include "core/model/quantize.h"
#include "core/model/weights.h"
#include "common/process.h"
#include "core/util/error.h"

namespace weft {
namespace {

// Normal weights with a few large outliers, as trained weights have.
torch::Tensor sample_weight(int64_t rows, int64_t cols, uint64_t seed) {
  torch::manual_seed(seed);
  auto w = torch::randn({rows, cols}) * 0.02;
  w.view({-1}).index_put_({torch::randint(0, rows * cols, {rows / 4 + 1})}, 0.5);
  return w;
}

TEST(Quantize, Int8ErrorIsAtMostHalfAStepOfItsRow) {
  const auto w = sample_weight(96, 200, 1);
  const auto q = quantize_matrix(w, QuantFormat::kInt8);
  ASSERT_EQ(q.data.scalar_type(), torch::kInt8);
  EXPECT_EQ(q.bytes(), 96 * 200 + 4 * 96);
  EXPECT_EQ(q.bytes(), quantized_weight_bytes(96, 200, QuantFormat::kInt8));
  const auto error = (q.dequantize() - w).abs();
  const auto step = q.scale / 127.0;  // one int8 step of each row
  const auto bound = step.unsqueeze(1) * 0.5 * (1 + 1e-5);
  EXPECT_TRUE((error <= bound).all().item<bool>()) << "max error " << error.max().item<float>();
  EXPECT_TRUE(torch::equal(q.scale, std::get<0>(w.abs().max(1))));  // absmax per row, exactly
  // A row of zeros stays zeros (no division by its zero absmax).
  auto z = w.clone();
  z[3].zero_();
  const auto qz = quantize_matrix(z, QuantFormat::kInt8);
  EXPECT_TRUE(qz.dequantize()[3].eq(0).all().item<bool>());
  EXPECT_FALSE(qz.dequantize().isnan().any().item<bool>());
}

TEST(Quantize, Nf4ErrorIsWithinHalfTheCodeBooksGapOfEachBlock) {
  const auto& code = nf4_code();
  ASSERT_EQ(code.front(), -1.0f);
  ASSERT_EQ(code.back(), 1.0f);
  float half_gap = 0;
  for (size_t i = 1; i < code.size(); ++i) {
    ASSERT_LT(code[i - 1], code[i]);
    half_gap = std::max(half_gap, (code[i] - code[i - 1]) / 2);
  }
  const auto& dynamic = dynamic_code();  // the block scales' code: ascending, 0 and 1 exactly
  for (size_t i = 1; i < dynamic.size(); ++i) ASSERT_LT(dynamic[i - 1], dynamic[i]);
  EXPECT_EQ(dynamic.back(), 1.0f);
  EXPECT_NE(std::find(dynamic.begin(), dynamic.end(), 0.0f), dynamic.end());
  // 300 x 200 = 937.5 blocks of 64 (a short last block) and 3.7 groups of 256 block scales.
  const auto w = sample_weight(300, 200, 2);
  const auto q = quantize_matrix(w, QuantFormat::kNf4);
  const int64_t n = w.numel(), blocks = (n + 63) / 64;
  ASSERT_EQ(q.data.numel(), n / 2);
  ASSERT_EQ(q.scale.numel(), blocks);
  ASSERT_EQ(q.scale2.numel(), (blocks + 255) / 256);
  EXPECT_EQ(q.bytes(), quantized_weight_bytes(300, 200, QuantFormat::kNf4));
  EXPECT_LT(static_cast<double>(q.bytes()) / (2.0 * n), 0.28);  // against bf16's 2 bytes per weight
  // Per element: half the code book's widest gap times the block's absmax, plus what the
  // double quantization moved that absmax by (it scales every value of the block).
  auto flat = torch::cat({w.reshape({-1}), torch::zeros({blocks * 64 - n})}).reshape({blocks, 64});
  const auto true_absmax = std::get<0>(flat.abs().max(1));
  const auto deq = torch::cat({q.dequantize().reshape({-1}), torch::zeros({blocks * 64 - n})}).reshape({blocks, 64});
  const auto stored_absmax = std::get<0>(deq.abs().max(1));  // the largest value decodes to +-1 x absmax
  const auto bound = (true_absmax * half_gap + (true_absmax - stored_absmax).abs()).unsqueeze(1) * (1 + 1e-5) + 1e-7;
  const auto error = (deq - flat).abs();
  EXPECT_TRUE((error <= bound).all().item<bool>()) << "max error " << error.max().item<float>();
  // On normal weights (no outliers) the double-quantized absmaxes stay within 1% and the matrix
  // within 10% in the mean (NF4 is information-theoretically optimal for normal data).
  torch::manual_seed(3);
  const auto normal = torch::randn({256, 256}) * 0.02;
  const auto qn = quantize_matrix(normal, QuantFormat::kNf4);
  const auto normal_absmax = std::get<0>(normal.reshape({-1, 64}).abs().max(1));
  const auto decoded_absmax = std::get<0>(qn.dequantize().reshape({-1, 64}).abs().max(1));
  EXPECT_LT(((decoded_absmax - normal_absmax).abs() / normal_absmax).max().item<float>(), 0.01);
  EXPECT_LT(((qn.dequantize() - normal).norm() / normal.norm()).item<float>(), 0.10);
}

TEST(Quantize, Nf4PacksTwoCodesPerByteTheFirstInTheHighNibble) {
  // One block whose values are exactly 2 x the code book, in order: indices 0, 1, ..., 15, 0, ...
  const auto& code = nf4_code();
  auto w = torch::empty({4, 16});
  for (int64_t i = 0; i < 64; ++i) w.view({-1})[i] = 2.0f * code[static_cast<size_t>(i % 16)];
  const auto q = quantize_matrix(w, QuantFormat::kNf4);
  const auto bytes = q.data.to(torch::kInt);
  for (int64_t i = 0; i < 32; ++i) {
    EXPECT_EQ(bytes[i].item<int>(), ((2 * i) % 16) * 16 + (2 * i + 1) % 16) << "byte " << i;
  }
  EXPECT_TRUE(torch::equal(q.dequantize(), w));  // one block: its absmax survives exactly (the offset)
  EXPECT_THROW(parse_quant_format("int4"), Error);
  EXPECT_EQ(parse_quant_format("nf4"), QuantFormat::kNf4);
}

TEST(Quantize, ASliceHoldsExactlyTheWholesValues) {
  for (auto format : {QuantFormat::kInt8, QuantFormat::kNf4}) {
    const auto whole = quantize_matrix(sample_weight(96, 256, 9), format);
    const auto dense = whole.dequantize();
    for (int64_t dim : {0, 1}) {  // rows in any split; columns in whole blocks of 64
      const std::vector<std::pair<int64_t, int64_t>> slices =
          dim == 0 ? std::vector<std::pair<int64_t, int64_t>>{{0, 48}, {48, 48}, {17, 3}}
                   : std::vector<std::pair<int64_t, int64_t>>{{0, 128}, {128, 128}, {64, 64}};
      for (auto [start, length] : slices) {
        const auto part = slice_quantized(whole, dim, start, length);
        EXPECT_TRUE(torch::equal(part.dequantize(), dense.narrow(dim, start, length)))
            << quant_format_name(format) << " dim " << dim << " [" << start << ", " << start + length << ")";
      }
    }
  }
  // nf4 blocks of 64 cannot be cut across columns.
  const auto nf4 = quantize_matrix(sample_weight(96, 256, 9), QuantFormat::kNf4);
  EXPECT_THROW(slice_quantized(nf4, 1, 32, 64), Error);
  EXPECT_LT(slice_quantized(nf4, 0, 0, 48).bytes(), 48 * 256 * 0.57);  // fp32 absmax per block: 0.5625 B/weight
}

TEST(Quantize, QuantizedLinearComputesAndDifferentiatesTheDequantizedProduct) {
  for (auto format : {QuantFormat::kInt8, QuantFormat::kNf4}) {
    const auto q = quantize_matrix(sample_weight(48, 64, 3), format);
    const auto dense = q.dequantize();
    torch::manual_seed(4);
    auto x = torch::randn({2, 5, 64}, torch::requires_grad());
    auto x_ref = x.detach().clone().requires_grad_(true);
    auto y = quantized_linear(x, q);
    auto y_ref = torch::matmul(x_ref, dense.t());
    EXPECT_TRUE(torch::allclose(y, y_ref, 1e-5, 1e-6)) << quant_format_name(format);
    const auto g = torch::randn_like(y);
    y.backward(g);
    y_ref.backward(g);
    EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6)) << quant_format_name(format);
  }
}

// The CUDA dequantization kernels (core/model/cuda) against the CPU's ATen formulation: the same
// values, bit for bit, for whole matrices (nf4 double-quantized, an odd element count) and slices
// (nf4's absmaxes in fp32), in fp32 and bf16; and the quantizer on the GPU stores the CPU's codes.
TEST(Quantize, OnCudaDequantizationEqualsTheCpusBitForBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here; tools/gpu/kit.sh runs this on a GPU";
  const torch::Device gpu(torch::kCUDA, 0);
  const auto to_gpu = [&](QuantizedMatrix m) {
    for (auto* t : {&m.data, &m.scale, &m.scale2, &m.offset}) {
      if (t->defined()) *t = t->to(gpu);
    }
    return m;
  };
  for (auto format : {QuantFormat::kInt8, QuantFormat::kNf4}) {
    const auto whole = quantize_matrix(sample_weight(512, 2048, 5), format);
    const auto odd = quantize_matrix(sample_weight(33, 71, 6), format);
    std::vector<std::pair<std::string, QuantizedMatrix>> cases{
        {"whole", whole}, {"odd", odd}, {"row slice", slice_quantized(whole, 0, 128, 256)},
        {"column slice", slice_quantized(whole, 1, 1024, 512)}};
    for (const auto& [name, m] : cases) {
      for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
        const auto cpu = m.dequantize(dtype);
        const auto cuda = to_gpu(m).dequantize(dtype);
        EXPECT_EQ(cuda.device(), gpu);
        EXPECT_EQ(cuda.scalar_type(), dtype);
        EXPECT_TRUE(torch::equal(cuda.cpu(), cpu))
            << quant_format_name(format) << " " << name << " " << c10::toString(dtype) << ": largest difference "
            << (cuda.cpu().to(torch::kFloat32) - cpu.to(torch::kFloat32)).abs().max().item<float>();
      }
    }
    const auto on_gpu = quantize_matrix(sample_weight(512, 2048, 5).to(gpu), format);
    EXPECT_TRUE(torch::equal(on_gpu.data.cpu(), whole.data)) << quant_format_name(format);
    // nf4's offset is a mean, summed in another order on the GPU: equal up to its rounding.
    EXPECT_TRUE(torch::allclose(on_gpu.dequantize().cpu(), whole.dequantize(), 1e-6, 0)) << quant_format_name(format);
  }
}

// A tiny model with every block's linear weights as `format` holds them; its logits equal the
// unquantized model's with those weights replaced by their dequantized values.
void expect_quantized_model_matches_dequantized(QuantFormat format, bool from_file) {
  const auto config = preset_config("tiny");
  ModelOptions options;
  options.quantize = format;
  LlamaForCausalLM quantized(config, options);
  LlamaForCausalLM reference(config);
  init_weights(*reference, 5, 0.05);
  if (from_file) {
    const auto dir = testing::fresh_dir("weft_test_quantize", std::string("load_") + quant_format_name(format));
    save_pretrained(*reference, dir);
    load_weights(*quantized, dir);
  } else {
    init_weights(*quantized, 5, 0.05);  // the same values, by (seed, name)
  }
  int64_t quantized_layers = 0;
  {
    torch::NoGradGuard no_grad;
    for (auto& item : quantized->named_modules("", false)) {
      auto* linear = item.value()->as<LinearImpl>();
      if (linear == nullptr || !linear->quantized()) continue;
      ++quantized_layers;
      EXPECT_FALSE(linear->weight.defined());
      reference->named_parameters()[item.key() + ".weight"].copy_(linear->dense_weight(torch::kFloat32));
    }
  }
  EXPECT_EQ(quantized_layers, 7 * config.num_hidden_layers);  // q, k, v, o, gate, up, down; not lm_head
  for (auto& item : quantized->named_parameters()) {
    EXPECT_TRUE(item.key().find("_proj.weight") == std::string::npos) << item.key() << " is still a parameter";
  }
  torch::manual_seed(6);
  const auto tokens = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
  EXPECT_TRUE(torch::allclose(quantized->forward(tokens), reference->forward(tokens), 1e-4, 1e-5))
      << quant_format_name(format) << (from_file ? " loaded" : " initialised");
}

TEST(Quantize, ModelQuantizedAtInitComputesItsDequantizedWeightsFunction) {
  expect_quantized_model_matches_dequantized(QuantFormat::kInt8, false);
  expect_quantized_model_matches_dequantized(QuantFormat::kNf4, false);
}

TEST(Quantize, ModelQuantizedAsItLoadsComputesItsDequantizedWeightsFunction) {
  expect_quantized_model_matches_dequantized(QuantFormat::kInt8, true);
  expect_quantized_model_matches_dequantized(QuantFormat::kNf4, true);
}

TEST(Quantize, LoraTrainsOnAQuantizedBaseAndMergesIntoItsDequantizedWeights) {
  const auto config = preset_config("tiny");
  ModelOptions options;
  options.quantize = QuantFormat::kNf4;
  options.activation_checkpointing = true;
  LlamaForCausalLM model(config, options);
  init_weights(*model, 5, 0.05);
  LoraConfig lora;
  lora.spec.r = 4;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  apply_lora(*model, lora, 1);
  torch::manual_seed(8);
  const auto tokens = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
  // Give B values (it starts at zero), then one backward: only the adapters receive gradients.
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : trainable_parameters(*model)) p.normal_(0.0, 0.05);
  }
  auto loss = model->loss(model->forward(tokens.slice(1, 0, -1)), tokens.slice(1, 1));
  loss.backward();
  for (auto& [name, p] : trainable_parameters(*model)) {
    EXPECT_TRUE(name.find("lora_") != std::string::npos) << name;
    ASSERT_TRUE(p.grad().defined()) << name;
    EXPECT_GT(p.grad().abs().sum().item<double>(), 0.0) << name;
  }
  // Saving the base refuses to write weights it does not hold; merging dequantizes them first.
  EXPECT_THROW(hf_state(*model), Error);
  torch::NoGradGuard no_grad;
  const auto before = model->forward(tokens);
  merge_lora(*model);
  EXPECT_TRUE(torch::allclose(model->forward(tokens), before, 1e-4, 1e-5));
  EXPECT_EQ(hf_state(*model).size(), model->parameters().size());
}

TEST(Quantize, MemoryPlanCountsTheQuantizedBytes) {
  const auto config = preset_config("llama-3.2-1b");
  LoraConfig lora;
  lora.spec.r = 16;
  const auto stage_bytes = [&](QuantFormat format) {
    const auto stages = estimate_stage_memory(config, {}, lora, torch::kBFloat16, 512, true, false, format);
    return stages[1].parameter_bytes;  // one decoder block
  };
  const int64_t block_weights = 2048 * (2048 + 512 + 512 + 2048) + 3 * 2048 * 8192;
  const int64_t rest = stage_bytes(QuantFormat::kNone) - 4 * block_weights;  // norms and adapters
  EXPECT_EQ(stage_bytes(QuantFormat::kInt8) - rest,
            block_weights + 4 * (2048 + 512 + 512 + 2048 + 8192 + 8192 + 2048));
  EXPECT_LT(static_cast<double>(stage_bytes(QuantFormat::kNf4) - rest) / (2.0 * block_weights), 0.28);
}

}  // namespace
}  // namespace weft
