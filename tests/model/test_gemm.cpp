// The CPU's fp32 products through oneDNN (core/model/gemm.h) against ATen's and an fp64 reference:
// each layout the model hands it (x W^T, dY^T x, dY W, accumulated into the output), the products
// it leaves to ATen, and the setting's names.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "common/metrics.h"
#include "common/process.h"
#include "core/model/gemm.h"
#include "core/model/linear.h"
#include "core/model/linear_cross_entropy.h"
#include "core/model/weight_grad.h"
#include "core/util/error.h"

namespace {

using weft::CpuFp32Gemm;

// Restores ATen's products when a test ends (the choice is the process's).
struct AtenAfter {
  ~AtenAfter() { weft::set_cpu_fp32_gemm(CpuFp32Gemm::aten); }
};

double relative_error(const torch::Tensor& got, const torch::Tensor& want) {
  return (got.to(torch::kFloat64) - want).abs().max().item<double>() / want.abs().max().item<double>();
}

TEST(CpuGemm, OneDnnMultipliesEachLayoutTheModelUsesAsAtenDoes) {
  if (const auto why = weft::onednn_fp32_gemm_unavailable()) GTEST_SKIP() << "oneDNN takes no fp32 here: " << *why;
  AtenAfter restore;
  weft::set_cpu_fp32_gemm(CpuFp32Gemm::onednn);
  torch::manual_seed(3);
  const int64_t m = 200, k = 96, n = 136;
  const auto x = torch::randn({m, k}), w = torch::randn({n, k}), dy = torch::randn({m, n});
  struct Case {
    const char* what;
    torch::Tensor a, b;
  };
  for (const auto& c : {Case{"x W^T", x, w.t()}, Case{"dY^T x", dy.t(), x}, Case{"dY W", dy, w}}) {
    SCOPED_TRACE(c.what);
    ASSERT_TRUE(weft::cpu_gemm_routes(c.a, c.b)) << "oneDNN should take it";
    const auto want = torch::mm(c.a.to(torch::kFloat64), c.b.to(torch::kFloat64));
    const int64_t before = weft::onednn_fp32_products();
    const auto got = weft::gemm(c.a, c.b);
    EXPECT_EQ(weft::onednn_fp32_products(), before + 1);
    EXPECT_LT(relative_error(got, want), 1e-5);
    EXPECT_LT(relative_error(torch::mm(c.a, c.b), want), 1e-5);  // ATen's, as close
    // Into an output, then accumulated over what is there.
    auto out = torch::full({c.a.size(0), c.b.size(1)}, 7.0f);
    weft::gemm_out(out, c.a, c.b);
    EXPECT_LT(relative_error(out, want), 1e-5);
    weft::gemm_out(out, c.a, c.b, /*accumulate=*/true);
    EXPECT_LT(relative_error(out, 2 * want), 1e-5);
    EXPECT_EQ(weft::onednn_fp32_products(), before + 3);
  }
}

TEST(CpuGemm, ProductsOneDnnDoesNotTakeStayWithAtenAndAreRight) {
  if (const auto why = weft::onednn_fp32_gemm_unavailable()) GTEST_SKIP() << "oneDNN takes no fp32 here: " << *why;
  AtenAfter restore;
  weft::set_cpu_fp32_gemm(CpuFp32Gemm::onednn);
  torch::manual_seed(4);
  const auto x = torch::randn({128, 96}), w = torch::randn({160, 96});
  struct Case {
    const char* what;
    torch::Tensor a, b;
  };
  const auto tracked = w.clone().requires_grad_();
  for (const auto& c : {Case{"bf16", x.to(torch::kBFloat16), w.t().to(torch::kBFloat16)},
                        Case{"a narrowed column block", x.narrow(1, 8, 80), w.narrow(1, 8, 80).t()},
                        Case{"a rank-16 side", x, w.narrow(0, 0, 16).t()},
                        Case{"fp64", x.to(torch::kFloat64), w.t().to(torch::kFloat64)}}) {
    SCOPED_TRACE(c.what);
    EXPECT_FALSE(weft::cpu_gemm_routes(c.a, c.b));
    const int64_t before = weft::onednn_fp32_products();
    const auto got = weft::gemm(c.a, c.b);
    EXPECT_EQ(weft::onednn_fp32_products(), before);
    EXPECT_TRUE(torch::equal(got, torch::mm(c.a, c.b)));
  }
  // An operand autograd tracks: ATen's product, and its gradient flows.
  EXPECT_FALSE(weft::cpu_gemm_routes(x, tracked.t()));
  weft::gemm(x, tracked.t()).sum().backward();
  ASSERT_TRUE(tracked.grad().defined());
  EXPECT_TRUE(torch::allclose(tracked.grad(), x.sum(0).expand({160, 96}), 1e-5, 1e-4));
  // A non-contiguous output: ATen writes it.
  auto wide = torch::zeros({128, 320});
  auto half = wide.narrow(1, 0, 160);
  EXPECT_FALSE(weft::cpu_gemm_routes(x, w.t(), half));
  weft::gemm_out(half, x, w.t());
  EXPECT_TRUE(torch::allclose(half, torch::mm(x, w.t())));
  EXPECT_EQ(wide.narrow(1, 160, 160).abs().max().item<float>(), 0.0f);
}

TEST(CpuGemm, TheSettingNamesALibraryAndAutoFollowsTheCpu) {
  AtenAfter restore;
  EXPECT_EQ(weft::resolve_cpu_fp32_gemm("aten"), CpuFp32Gemm::aten);
  const auto why = weft::onednn_fp32_gemm_unavailable();
  if (why) {
    try {
      weft::resolve_cpu_fp32_gemm("onednn");
      ADD_FAILURE() << "onednn resolved where it is unavailable: " << *why;
    } catch (const weft::Error& e) {
      EXPECT_NE(std::string(e.what()).find(*why), std::string::npos) << e.what();
    }
  } else {
    EXPECT_EQ(weft::resolve_cpu_fp32_gemm("onednn"), CpuFp32Gemm::onednn);
  }
  try {
    weft::resolve_cpu_fp32_gemm("mkl");
    ADD_FAILURE() << "an unknown library resolved";
  } catch (const weft::Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.fp32_cpu_gemm = \"mkl\""), std::string::npos) << e.what();
  }
  // auto: oneDNN only on AMD's family 0x1A (Zen 5) and later with MKL as ATen's BLAS.
  const auto id = weft::cpu_id();
#if defined(__x86_64__)
  EXPECT_FALSE(id.vendor.empty());
  EXPECT_GE(id.family, 6);
#endif
  const bool zen5 = id.vendor == "AuthenticAMD" && id.family >= 0x1a && at::hasMKL() && !why;
  EXPECT_EQ(weft::resolve_cpu_fp32_gemm("auto"), zen5 ? CpuFp32Gemm::onednn : CpuFp32Gemm::aten);
  EXPECT_STREQ(weft::to_string(CpuFp32Gemm::onednn), "onednn");
  EXPECT_STREQ(weft::to_string(CpuFp32Gemm::aten), "aten");
}

// Values and gradients through each layer kind whose products oneDNN takes, against ATen's: LoRA's
// fused layers (frozen bases), full fine-tuning's fused trainable weights (deferrable_linear, dW as
// one product), a frozen layer without an adapter, a frozen weight by frozen_cast_linear, and the
// chunked head's loss; each takes products through oneDNN.
TEST(CpuGemm, EachLayersValuesAndGradientsThroughOneDnnEqualAtens) {
  if (const auto why = weft::onednn_fp32_gemm_unavailable()) GTEST_SKIP() << "oneDNN takes no fp32 here: " << *why;
  AtenAfter restore;
  torch::manual_seed(11);
  const int64_t in = 96;
  weft::Linear q(in, 80), k(in, 72), v(in, 64), mlp(in, 128);
  q->add_lora(weft::LoraSpec{4, 8.0, 0.0}, 1);
  v->add_lora(weft::LoraSpec{4, 8.0, 0.0}, 2);
  {
    torch::NoGradGuard no_grad;
    for (auto* layer : {q.get(), k.get(), v.get(), mlp.get()}) layer->weight.normal_(0.0, 0.1).set_requires_grad(false);
    q->adapter_as<weft::LoraAdapter>()->B->weight.normal_();
    v->adapter_as<weft::LoraAdapter>()->B->weight.normal_();
  }
  const std::vector<weft::LinearImpl*> group{q.get(), k.get(), v.get()};
  ASSERT_TRUE(weft::lora_linear_applies(group));
  std::vector<torch::Tensor> trained{torch::randn({80, in}), torch::randn({72, in}), torch::randn({64, in})};
  const auto x0 = torch::randn({2, 64, in}), head0 = torch::randn({256, in}) * 0.1;
  const auto targets = torch::randint(0, 256, {128});
  const auto frozen_head = torch::randn({192, in});

  // Every value and gradient of one pass, and how many products oneDNN took in it.
  const auto pass = [&](CpuFp32Gemm library) {
    weft::set_cpu_fp32_gemm(library);
    const int64_t before = weft::onednn_fp32_products();
    std::vector<torch::Tensor> out;
    const auto take = [&](const torch::Tensor& t) { out.push_back(t.detach().clone()); };
    auto x = x0.clone().requires_grad_(true);
    // LoRA's fused layers: output, x's gradient and the adapters'.
    for (auto* layer : {q.get(), v.get()}) {
      auto* lora = layer->adapter_as<weft::LoraAdapter>();
      for (auto* p : {&lora->A->weight, &lora->B->weight}) p->mutable_grad() = torch::Tensor();
    }
    auto y = weft::lora_linear(x, group);
    y.pow(2).sum().backward();
    take(y);
    take(x.grad());
    for (auto* layer : {q.get(), v.get()}) {
      auto* lora = layer->adapter_as<weft::LoraAdapter>();
      take(lora->A->weight.grad());
      take(lora->B->weight.grad());
    }
    // Trainable fused weights (full fine-tuning's q/k/v): output, x's and each weight's gradient.
    x.mutable_grad() = torch::Tensor();
    std::vector<torch::Tensor> weights;
    for (const auto& w : trained) weights.push_back(w.clone().requires_grad_(true));
    y = weft::deferrable_linear(x, weights, torch::kFloat32, /*defer=*/false);
    y.pow(2).sum().backward();
    take(y);
    take(x.grad());
    for (const auto& w : weights) take(w.grad());
    // A frozen layer without an adapter, and a frozen weight by frozen_cast_linear: x's gradient.
    x.mutable_grad() = torch::Tensor();
    y = mlp(x) + weft::frozen_cast_linear(x, frozen_head, torch::kFloat32).narrow(-1, 0, 128);
    y.pow(2).sum().backward();
    take(y);
    take(x.grad());
    // The chunked head's loss (two chunks of 64 rows): the loss, h's and the head's gradients.
    auto h = x0.reshape({128, in}).clone().requires_grad_(true);
    auto head = head0.clone().requires_grad_(true);
    const auto loss = weft::linear_cross_entropy_sum(h, head, targets, torch::kFloat32, -100, nullptr, 64);
    loss.backward();
    take(loss);
    take(h.grad());
    take(head.grad());
    return std::make_pair(out, weft::onednn_fp32_products() - before);
  };
  const auto [aten, aten_products] = pass(CpuFp32Gemm::aten);
  const auto [onednn, onednn_products] = pass(CpuFp32Gemm::onednn);
  EXPECT_EQ(aten_products, 0);
  // LoRA: 2 bases' products (forward, x's gradient); deferrable: 3 (y, x's gradient, the joint dW);
  // the frozen layer and frozen_cast_linear: 2 each; the head: 3 per chunk.
  EXPECT_GE(onednn_products, 2 + 3 + 4 + 6);
  ASSERT_EQ(aten.size(), onednn.size());
  for (size_t i = 0; i < aten.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(aten[i].defined() && onednn[i].defined());
    ASSERT_EQ(aten[i].sizes(), onednn[i].sizes());
    EXPECT_LT((onednn[i] - aten[i]).abs().max().item<double>(), 1e-5 * (1 + aten[i].abs().max().item<double>()));
  }
}

// A training run's products through oneDNN (LoRA's frozen bases and head, full fine-tuning's
// weights, forward and backward) against ATen's: the same losses up to rounding, and the summary says
// which library ran and how many products oneDNN took.
TEST(CpuGemm, TrainingThroughOneDnnMatchesAtenForLoraAndFullFineTuning) {
  if (const auto why = weft::onednn_fp32_gemm_unavailable()) GTEST_SKIP() << "oneDNN takes no fp32 here: " << *why;
  for (const std::string mode : {"lora", "full"}) {
    SCOPED_TRACE(mode);
    std::vector<double> losses[2];
    for (int onednn = 0; onednn < 2; ++onednn) {
      const std::string library = onednn ? "onednn" : "aten";
      const std::string dir = weft::testing::fresh_dir("gemm", mode + "_" + library);
      const auto outcome = weft::testing::run_trainer(
          "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/small-bench.toml --set data.path=" +
          std::string(WEFT_SOURCE_DIR) + "/data/austen/austen.jsonl --set data.cache_dir= --set train.out_dir=" + dir +
          " --set train.overwrite=true --set log.progress=off --set train.max_steps=3 --set train.batch_size=4 "
          "--set data.seq_len=64 --set eval.max_batches=1 --set train.mode=" + mode +
          " --set lora.target_modules='[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\",\"down_proj\"]'"
          " --set train.fp32_cpu_gemm=" + library);
      ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
      losses[onednn] = weft::testing::step_losses(dir + "/metrics.jsonl");
      const auto summary = weft::testing::last_record(dir + "/metrics.jsonl", "summary");
      ASSERT_FALSE(summary.is_null());
      EXPECT_EQ(summary["fp32_cpu_gemm"], library);
      // Per step 6 layers' products forward and backward and the head's: well over 50 through oneDNN.
      if (onednn) {
        EXPECT_GT(summary["onednn_fp32_products"].get<int64_t>(), 50) << summary.dump();
      } else {
        EXPECT_EQ(summary["onednn_fp32_products"].get<int64_t>(), 0) << summary.dump();
      }
    }
    ASSERT_EQ(losses[0].size(), 3u);
    ASSERT_EQ(losses[1].size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(losses[1][i], losses[0][i], 2e-5 * losses[0][i]) << "step " << i + 1;
  }
}

}  // namespace
