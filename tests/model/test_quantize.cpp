// Quantized frozen base weights (core/model/quantize.h, model.quantize): each format's error bound
// per tensor, its stored layout, the quantized linear's gradients, and a model whose blocks are
// quantized at load computing what the dequantized weights compute. The stored bytes against
// bitsandbytes itself: tools/quant_reference.py (ctest Quantize.*).
#include <map>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/model/layers.h"
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

// LLM.int8's forward (int8_linear), written out in double precision: outlier elements times their
// dequantized columns, the others rounded per row to 63 levels and multiplied by the int8 values.
torch::Tensor int8_linear_reference(const torch::Tensor& x, const torch::Tensor& values, const torch::Tensor& scale,
                                    double threshold, const torch::Tensor& row_absmax = {}) {
  const auto a = x.to(torch::kDouble);
  const auto outlier = threshold > 0 ? (a.abs() >= threshold) : torch::zeros_like(a, torch::kBool);
  const auto inliers = a.masked_fill(outlier, 0.0);
  const auto absmax = row_absmax.defined() ? row_absmax.to(torch::kDouble) : std::get<0>(inliers.abs().max(1));
  const auto row_scale = absmax.clamp_min(1e-30) / 63.0;
  // Rounded in fp32 as the product is, so a value at a rounding boundary goes the same way.
  const auto integers =
      torch::round(inliers.to(torch::kFloat32) / row_scale.to(torch::kFloat32).unsqueeze(1)).to(torch::kDouble);
  const auto w = values.to(torch::kDouble);
  const auto column_scale = (scale.to(torch::kDouble) / 127.0).unsqueeze(0);
  auto y = torch::matmul(integers, w.t()) * row_scale.unsqueeze(1) * column_scale;
  return y + torch::matmul(a * outlier, (w * column_scale.t()).t());
}

torch::Tensor relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max() / want.to(torch::kDouble).abs().max();
}

// Activations with LLM.int8's outlier features: a few columns far above the threshold in most
// rows, one row of zeros.
torch::Tensor sample_activations(int64_t rows, int64_t cols, uint64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({rows, cols});
  x.index_put_({torch::indexing::Slice(), 3}, 20.0 * torch::rand({rows}) - 10.0);
  x.index_put_({torch::indexing::Slice(), cols - 5}, 9.0);
  x[1].zero_();
  return x;
}

TEST(Quantize, Int8LinearIsLlmInt8sDecomposition) {
  if (!cpu_int8_gemm_available()) GTEST_SKIP() << "this LibTorch has no exact CPU int8 GEMM (quantized::linear_dynamic)";
  auto q = quantize_matrix(sample_weight(96, 256, 11), QuantFormat::kInt8);
  const auto values = q.data.clone();
  const auto dense = q.dequantize();
  use_int8_gemm(q);
  EXPECT_TRUE(torch::equal(q.data, values));  // held once: the packed copy is the product's own
  EXPECT_EQ(q.bytes(), 96 * 256 + 4 * 96);
  const auto x = sample_activations(40, 256, 12);
  for (double threshold : {6.0, 0.0, 1.5}) {
    const auto got = int8_linear(x, q, threshold);
    EXPECT_LT(relative_error(got, int8_linear_reference(x, values, q.scale, threshold)).item<double>(), 2e-6)
        << "threshold " << threshold;
  }
  // Outliers taken out keep the error of the quantized product small; without them, each row's
  // scale is set by its outlier and the other features lose their bits.
  const auto exact = torch::matmul(x, dense.t());
  const double with = relative_error(int8_linear(x, q, 6.0), exact).item<double>();
  const double without = relative_error(int8_linear(x, q, 0.0), exact).item<double>();
  EXPECT_LT(with, 0.03);  // 7-bit activations: about 1.7% of the largest output here
  EXPECT_GT(without, 2 * with);
  // Any leading shape, any float dtype in and out.
  const auto y3 = int8_linear(x.reshape({4, 10, 256}).to(torch::kBFloat16), q, 6.0);
  EXPECT_EQ(y3.sizes(), (std::vector<int64_t>{4, 10, 96}));
  EXPECT_EQ(y3.scalar_type(), torch::kBFloat16);
}

// A token's result never depends on the rest of its batch (data parallelism computes what one
// process computes), and a row-parallel split with its absmax all-reduced sums to the whole.
TEST(Quantize, Int8LinearSplitsOverTokensAndOverColumnsAsTheWholeComputes) {
  if (!cpu_int8_gemm_available()) GTEST_SKIP() << "this LibTorch has no exact CPU int8 GEMM (quantized::linear_dynamic)";
  const auto whole = quantize_matrix(sample_weight(64, 256, 13), QuantFormat::kInt8);
  auto marked = whole;
  use_int8_gemm(marked);
  const auto x = sample_activations(24, 256, 14);
  const auto y = int8_linear(x, marked, 6.0);
  const auto halves = torch::cat({int8_linear(x.slice(0, 0, 7), marked, 6.0), int8_linear(x.slice(0, 7), marked, 6.0)});
  EXPECT_TRUE(torch::equal(halves, y));
  QuantizedMatrix left = slice_quantized(whole, 1, 0, 128), right = slice_quantized(whole, 1, 128, 128);
  use_int8_gemm(left);
  use_int8_gemm(right);
  const auto x_left = x.slice(1, 0, 128), x_right = x.slice(1, 128);
  // What the tensor-parallel plugin's all-reduce(max) at WEFT_COMM_ROW_ABSMAX leaves.
  const auto inlier_absmax = [](const torch::Tensor& part) {
    return std::get<0>(part.masked_fill(part.abs() >= 6.0, 0.0).abs().max(1));
  };
  const auto global = torch::maximum(inlier_absmax(x_left), inlier_absmax(x_right));
  const RowAbsmaxSync sync = [&](torch::Tensor& absmax) { absmax = torch::maximum(absmax, global); };
  const auto split = int8_linear(x_left, left, 6.0, sync) + int8_linear(x_right, right, 6.0, sync);
  EXPECT_LT(relative_error(split, y).item<double>(), 1e-6);
  // Without the all-reduce, each half quantizes on its own scale: a visibly different product.
  const auto unsynced = int8_linear(x_left, left, 6.0) + int8_linear(x_right, right, 6.0);
  EXPECT_GT(relative_error(unsynced, y).item<double>(), 1e-4);
}

TEST(Quantize, Int8GemmLinearDifferentiatesTheDequantizedProduct) {
  if (!cpu_int8_gemm_available()) GTEST_SKIP() << "this LibTorch has no exact CPU int8 GEMM (quantized::linear_dynamic)";
  auto q = quantize_matrix(sample_weight(48, 64, 3), QuantFormat::kInt8);
  const auto dense = q.dequantize();
  use_int8_gemm(q);
  torch::manual_seed(4);
  auto x = torch::randn({2, 5, 64}, torch::requires_grad());
  Int8LinearOptions options;
  options.threshold = 1.0;
  auto y = quantized_linear(x, q, &options);
  EXPECT_TRUE(torch::allclose(y, int8_linear(x.detach(), q, 1.0)));
  const auto g = torch::randn_like(y);
  y.backward(g);
  EXPECT_TRUE(torch::allclose(x.grad(), torch::matmul(g, dense), 1e-5, 1e-6));
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
  const auto logits = quantized->forward(tokens), want = reference->forward(tokens);
  if (format == QuantFormat::kInt8 && cpu_int8_gemm_available()) {
    // The int8 GEMM also rounds the activations (7 bits per token): close to, not equal to, the
    // dequantized weights' function (int8_linear's own test checks its arithmetic exactly).
    for (auto& item : quantized->named_modules("", false)) {
      if (auto* linear = item.value()->as<LinearImpl>(); linear && linear->quantized()) {
        EXPECT_TRUE(linear->quantized_weight().int8_gemm) << item.key();
      }
    }
    const double error = ((logits - want).abs().max() / want.abs().max()).item<double>();
    EXPECT_LT(error, 0.05) << (from_file ? " loaded" : " initialised");
    EXPECT_GT(error, 0.0);
  } else {
    EXPECT_TRUE(torch::allclose(logits, want, 1e-4, 1e-5)) << quant_format_name(format) << (from_file ? " loaded" : " initialised");
  }
}

TEST(Quantize, ModelQuantizedAtInitComputesItsDequantizedWeightsFunction) {
  expect_quantized_model_matches_dequantized(QuantFormat::kInt8, false);
  expect_quantized_model_matches_dequantized(QuantFormat::kNf4, false);
}

TEST(Quantize, ModelQuantizedAsItLoadsComputesItsDequantizedWeightsFunction) {
  expect_quantized_model_matches_dequantized(QuantFormat::kInt8, true);
  expect_quantized_model_matches_dequantized(QuantFormat::kNf4, true);
}

// Activation checkpointing recomputes each block in backward: over an int8 base (in the CPU's int8
// GEMM where there is one) and an nf4 base, the loss and every adapter gradient are the
// non-checkpointed run's.
TEST(Quantize, ActivationCheckpointingGivesTheSameAdapterGradientsOverEachFormat) {
  const auto config = preset_config("tiny");
  for (const QuantFormat format : {QuantFormat::kInt8, QuantFormat::kNf4}) {
    std::map<std::string, torch::Tensor> grads[2];
    double losses[2] = {0, 0};
    for (const bool checkpointing : {false, true}) {
      ModelOptions options;
      options.quantize = format;
      options.activation_checkpointing = checkpointing;
      LlamaForCausalLM model(config, options);
      init_weights(*model, 5, 0.05);
      LoraConfig lora;
      lora.spec.r = 4;
      lora.target_modules = lora_targetable_modules();
      apply_lora(*model, lora, 1);
      {
        torch::NoGradGuard no_grad;
        auto generator = at::make_generator<at::CPUGeneratorImpl>(3);
        for (auto& [name, p] : trainable_parameters(*model)) p.normal_(0.0, 0.05, generator);
      }
      model->train();
      auto generator = at::make_generator<at::CPUGeneratorImpl>(8);
      const auto tokens = torch::randint(0, config.vocab_size, {2, 16}, generator, torch::kLong);
      auto loss = model->loss(model->forward(tokens.slice(1, 0, -1)), tokens.slice(1, 1));
      loss.backward();
      losses[checkpointing] = loss.item<double>();
      for (auto& [name, p] : trainable_parameters(*model)) grads[checkpointing][name] = p.grad().clone();
    }
    EXPECT_EQ(losses[0], losses[1]) << quant_format_name(format);
    ASSERT_EQ(grads[0].size(), grads[1].size());
    for (const auto& [name, g] : grads[0]) {
      EXPECT_TRUE(torch::allclose(grads[1].at(name), g, 1e-5, 1e-7)) << quant_format_name(format) << " " << name;
    }
  }
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

// model.frozen_dtype = "bf16": the base's matrices stored in bf16 compute what their values in fp32
// compute (each product casts its layer), with LoRA over them, bit for bit.
TEST(Quantize, Bf16FrozenBaseComputesWhatTheSameValuesInFp32Compute) {
  const auto config = preset_config("tiny");
  LlamaForCausalLM source(config);
  init_weights(*source, 5, 0.05);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : source->parameters()) p.copy_(p.to(torch::kBFloat16).to(torch::kFloat32));  // bf16's values
  }
  const auto dir = testing::fresh_dir("weft_test_quantize", "bf16_frozen");
  save_pretrained(*source, dir);
  LlamaForCausalLM fp32(config), bf16(config);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : bf16->parameters()) {
      if (p.dim() >= 2) p.set_data(torch::empty(p.sizes(), p.options().dtype(torch::kBFloat16)));
    }
  }
  load_weights(*fp32, dir);
  load_weights(*bf16, dir);
  int64_t bf16_bytes = 0;
  for (auto& p : bf16->parameters()) {
    if (p.scalar_type() == torch::kBFloat16) bf16_bytes += p.numel() * 2;
  }
  EXPECT_GT(bf16_bytes, 0);
  LoraConfig lora;
  lora.spec.r = 4;
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  apply_lora(*fp32, lora, 1);
  apply_lora(*bf16, lora, 1);
  torch::manual_seed(8);
  const auto tokens = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
  const auto as_map = [](LlamaForCausalLM& m) {
    std::map<std::string, torch::Tensor> out;
    for (auto& [name, p] : trainable_parameters(*m)) out[name] = p;
    return out;
  };
  auto b = as_map(bf16);
  ASSERT_EQ(b.size(), as_map(fp32).size());
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : as_map(fp32)) b.at(name).copy_(p.normal_(0.0, 0.05));
  }
  auto loss32 = fp32->loss(fp32->forward(tokens.slice(1, 0, -1)), tokens.slice(1, 1));
  auto loss16 = bf16->loss(bf16->forward(tokens.slice(1, 0, -1)), tokens.slice(1, 1));
  EXPECT_TRUE(torch::equal(loss32, loss16));
  loss32.backward();
  loss16.backward();
  for (auto& [name, p] : as_map(fp32)) {
    EXPECT_EQ(b.at(name).scalar_type(), torch::kFloat32) << name;  // adapters stay fp32
    EXPECT_TRUE(torch::equal(p.grad(), b.at(name).grad())) << name;
  }
}

// The product behind a bf16-stored frozen layer or head: cast in blocks of rows, forward and backward.
TEST(Quantize, FrozenCastLinearEqualsTheCastWeightsProductInBlocks) {
  torch::manual_seed(21);
  const auto w = torch::randn({50, 24}).to(torch::kBFloat16);
  auto x = torch::randn({3, 4, 24}, torch::requires_grad());
  auto x_ref = x.detach().clone().requires_grad_(true);
  auto y = frozen_cast_linear(x, w, torch::kFloat32, /*chunk_rows=*/7);  // 8 blocks, the last of 1 row
  auto y_ref = torch::nn::functional::linear(x_ref, w.to(torch::kFloat32));
  EXPECT_EQ(y.sizes(), y_ref.sizes());
  EXPECT_LT((y - y_ref).abs().max().item<double>(), 1e-5);
  const auto g = torch::randn_like(y);
  y.backward(g);
  y_ref.backward(g);
  EXPECT_TRUE(torch::allclose(x.grad(), x_ref.grad(), 1e-5, 1e-6));
  auto trained = torch::randn({5, 24}, torch::requires_grad());
  EXPECT_THROW(frozen_cast_linear(x, trained, torch::kFloat32), Error);
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
  // model.frozen_dtype = bf16: the frozen matrices at 2 bytes (the block's and the embedding's);
  // quantized ones as they are.
  const auto bf16 = [&](QuantFormat format) {
    return estimate_stage_memory(config, {}, lora, torch::kFloat32, 512, true, false, format, torch::kBFloat16);
  };
  EXPECT_EQ(bf16(QuantFormat::kNone)[1].parameter_bytes - rest, 2 * block_weights);
  EXPECT_EQ(bf16(QuantFormat::kNone)[0].parameter_bytes, 2 * config.vocab_size * config.hidden_size);
  EXPECT_EQ(bf16(QuantFormat::kInt8)[1].parameter_bytes, stage_bytes(QuantFormat::kInt8));
}

}  // namespace
}  // namespace weft
