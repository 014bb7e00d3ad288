// RMSNorm, RoPE (incl. Llama 3 scaling), attention masking and grouped-query attention.
#include <cmath>
#include <cstdio>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/model/layers.h"
#include "core/util/error.h"

namespace weft {
namespace {

ModelConfig small_config() {
  auto c = preset_config("tiny");
  return c;
}

TEST(RMSNorm, MatchesHandComputedValues) {
  RMSNorm norm(4, 1e-6);
  auto x = torch::tensor({1.0f, 2.0f, 3.0f, 4.0f}).view({1, 4});
  // mean of squares = (1+4+9+16)/4 = 7.5
  const double rms = std::sqrt(7.5 + 1e-6);
  auto y = norm(x);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[0][i].item<float>(), (i + 1) / rms, 1e-6);
  {
    torch::NoGradGuard g;
    norm->weight.copy_(torch::tensor({2.0f, 1.0f, 0.5f, 0.0f}));
  }
  y = norm(x);
  EXPECT_NEAR(y[0][0].item<float>(), 2.0 / rms, 1e-6);
  EXPECT_NEAR(y[0][2].item<float>(), 1.5 / rms, 1e-6);
  EXPECT_EQ(y[0][3].item<float>(), 0.0f);
}

TEST(RMSNorm, ComputesInFp32AndReturnsInputDtype) {
  RMSNorm norm(8, 1e-5);
  auto x = torch::randn({2, 8}).to(torch::kBFloat16);
  auto y = norm(x);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  auto expected = norm(x.to(torch::kFloat32));
  EXPECT_TRUE(torch::allclose(y.to(torch::kFloat32), expected, 1e-2, 1e-2));
}

TEST(Rope, PositionZeroIsIdentityAndRotationIsClosedForm) {
  ModelConfig c = small_config();
  RotaryEmbedding rope(c);
  const int64_t d = c.head_dim;  // 16
  auto x = torch::randn({1, 1, 3, d});
  auto [cos, sin] = rope.tables(0, 3);
  auto y = apply_rotary(x, cos, sin);
  EXPECT_TRUE(torch::allclose(y[0][0][0], x[0][0][0], 0, 1e-6));
  // Position p rotates the pair (x_i, x_{i+d/2}) by angle p * theta^(-2i/d).
  for (int64_t p = 1; p < 3; ++p) {
    for (int64_t i = 0; i < d / 2; ++i) {
      const double angle = p * std::pow(c.rope_theta, -2.0 * i / d);
      const double a = x[0][0][p][i].item<double>(), b = x[0][0][p][i + d / 2].item<double>();
      EXPECT_NEAR(y[0][0][p][i].item<double>(), a * std::cos(angle) - b * std::sin(angle), 1e-5);
      EXPECT_NEAR(y[0][0][p][i + d / 2].item<double>(), b * std::cos(angle) + a * std::sin(angle), 1e-5);
    }
  }
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  RotaryEmbedding rope(small_config());
  auto q = torch::randn({1, 1, 1, 16});
  auto k = torch::randn({1, 1, 1, 16});
  auto score = [&](int64_t m, int64_t n) {
    auto [cq, sq] = rope.tables(m, 1);
    auto [ck, sk] = rope.tables(n, 1);
    return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum().item<double>();
  };
  EXPECT_NEAR(score(5, 2), score(13, 10), 1e-4);
  EXPECT_NEAR(score(7, 7), score(0, 0), 1e-4);
}

TEST(Rope, Llama3ScalingOfFrequencies) {
  ModelConfig c = preset_config("llama-3.2-1b");  // head_dim 64, theta 5e5, factor 32, 1/4, 8192
  RotaryEmbedding rope(c);
  auto inv = rope.inv_freq();
  ASSERT_EQ(inv.size(0), 32);
  // Highest frequency: wavelength 2*pi < 8192/4 -> unchanged.
  EXPECT_NEAR(inv[0].item<double>(), 1.0, 1e-7);
  // Lowest frequency: wavelength > 8192 -> divided by 32.
  const double lowest = std::pow(500000.0, -62.0 / 64.0);
  EXPECT_NEAR(inv[31].item<double>() / (lowest / 32.0), 1.0, 1e-5);
  // A frequency in the blend band (2048 <= wavelength <= 8192): index 13, worked by hand:
  // f = 5e5^(-26/64) = 0.0049144; wavelen = 1278.5 < 2048 -> unchanged.
  EXPECT_NEAR(inv[13].item<double>() / std::pow(500000.0, -26.0 / 64.0), 1.0, 1e-5);
  // index 16: f = 5e5^(-0.5) = 1.41421e-3, wavelen = 4442.9 in the band;
  // smooth = (8192/4442.9 - 1) / (4 - 1) = 0.28127; f' = (1-s) f/32 + s f.
  const double f = std::pow(500000.0, -0.5);
  const double wavelen = 2 * M_PI / f;
  const double s = (8192.0 / wavelen - 1.0) / 3.0;
  EXPECT_NEAR(s, 0.28127, 1e-4);
  EXPECT_NEAR(inv[16].item<double>() / ((1 - s) * f / 32 + s * f), 1.0, 1e-5);
}

// Reference attention with explicit loops over heads and an explicit mask.
torch::Tensor naive_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t heads = q.size(1), kv = k.size(1), seq = q.size(2), dim = q.size(3);
  auto out = torch::zeros_like(q);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / (heads / kv);
    for (int64_t t = 0; t < seq; ++t) {
      auto scores = torch::matmul(k[0][g].narrow(0, 0, t + 1), q[0][h][t]) / std::sqrt(double(dim));
      auto p = scores.softmax(0);
      out[0][h][t] = torch::matmul(p, v[0][g].narrow(0, 0, t + 1));
    }
  }
  return out;
}

TEST(Attention, MatchesTheNaiveReferenceWithGroupedAndFullHeads) {
  for (const int64_t kv_heads : {2, 6}) {
    SCOPED_TRACE("kv heads " + std::to_string(kv_heads));
    auto q = torch::randn({1, 6, 5, 8});
    auto k = torch::randn({1, kv_heads, 5, 8});
    auto v = torch::randn({1, kv_heads, 5, 8});
    EXPECT_TRUE(torch::allclose(causal_attention(q, k, v), naive_attention(q, k, v), 1e-5, 1e-5));
  }
}

TEST(Attention, GradientsMatchTheNaiveReference) {
  torch::manual_seed(3);
  const auto q0 = torch::randn({1, 6, 7, 8}), k0 = torch::randn({1, 2, 7, 8}), v0 = torch::randn({1, 2, 7, 8});
  const auto upstream = torch::randn({1, 6, 7, 8});
  std::vector<torch::Tensor> grads[2];
  for (int reference = 0; reference < 2; ++reference) {
    auto q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    auto out = reference ? naive_attention(q, k, v) : causal_attention(q, k, v);
    (out * upstream).sum().backward();
    grads[reference] = {q.grad(), k.grad(), v.grad()};
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(torch::allclose(grads[0][i], grads[1][i], 1e-5, 1e-5)) << "gradient of " << "qkv"[i];
  }
}

// bf16 inputs stay within bf16's rounding of the fp32 result, values and (in training, where the
// CPU's backward runs in fp32) gradients: bf16 in and out, and the forward the same as without grad.
TEST(Attention, Bf16StaysNearTheFp32Result) {
  torch::manual_seed(4);
  auto q = torch::randn({2, 4, 33, 16}), k = torch::randn({2, 2, 33, 16}), v = torch::randn({2, 2, 33, 16});
  const auto upstream = torch::randn({2, 4, 33, 16});
  std::vector<torch::Tensor> grads[2];
  torch::Tensor outs[2];
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    const auto dtype = bf16 ? torch::kBFloat16 : torch::kFloat32;
    const auto leaf = [&](const torch::Tensor& t) { return t.to(dtype).clone().requires_grad_(); };
    auto qi = leaf(q), ki = leaf(k), vi = leaf(v);
    outs[bf16] = causal_attention(qi, ki, vi);
    (outs[bf16] * upstream.to(dtype)).sum().backward();
    grads[bf16] = {qi.grad(), ki.grad(), vi.grad()};
  }
  EXPECT_EQ(outs[1].scalar_type(), torch::kBFloat16);
  EXPECT_LT((outs[1].to(torch::kFloat32) - outs[0]).abs().max().item<double>(), 0.05);
  {
    torch::NoGradGuard no_grad;
    const auto plain = causal_attention(q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16));
    EXPECT_TRUE(torch::equal(plain, outs[1].detach()));
  }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(grads[1][i].scalar_type(), torch::kBFloat16);
    const double scale = grads[0][i].abs().max().item<double>();
    EXPECT_LT((grads[1][i].to(torch::kFloat32) - grads[0][i]).abs().max().item<double>(), 0.02 * scale)
        << "gradient of " << "qkv"[i];
  }
}

// fp32 and bf16 on the CPU up to 1024 tokens (math_attention_applies): GEMMs over blocks of
// queries that skip the masked blocks, in chunks of sequence groups. Values and gradients against
// fp64 attention: fp32 within 1e-5 and bf16 within its rounding, neither further from it than
// LibTorch's flash kernels of the same dtype. Shapes: 3 query heads per kv head at 1024 tokens
// (blocks of 128 positions); 12 per kv head (fp32: two chunks of groups); one (no grouping) at 300
// tokens (a last block of 44 positions); 5 tokens (one block shorter than 64). No-grad forward
// equals the training forward.
TEST(Attention, GemmPathStaysAsNearExactAsTheFlashKernels) {
  struct Shape {
    int64_t b, h, kvh, t, d;
  };
  // Up to 256 tokens the training forward keeps P for the backward (4 blocks of 64 at 256, a partial
  // last one at 200); past that the backward recomputes it.
  EXPECT_EQ(math_attention_kept_values(256), 64 * 64 * (1 + 2 + 3 + 4));
  EXPECT_EQ(math_attention_kept_values(200), 64 * (64 + 128 + 192) + 8 * 200);
  EXPECT_EQ(math_attention_kept_values(5), 25);
  EXPECT_EQ(math_attention_kept_values(300), 0);
  for (const auto& sh : {Shape{4, 6, 2, 1024, 32}, Shape{6, 12, 1, 1024, 16}, Shape{2, 4, 4, 300, 16},
                         Shape{3, 6, 2, 256, 32}, Shape{2, 3, 3, 200, 16}, Shape{3, 2, 1, 5, 8}}) {
    SCOPED_TRACE(fmt::format("{} x {} heads over {} kv heads, {} tokens", sh.b, sh.h, sh.kvh, sh.t));
    EXPECT_EQ(math_attention_keeps_probabilities(sh.t), sh.t <= 256);
    torch::manual_seed(sh.t + sh.h);
    const auto q = torch::randn({sh.b, sh.h, sh.t, sh.d}), k = torch::randn({sh.b, sh.kvh, sh.t, sh.d}),
               v = torch::randn({sh.b, sh.kvh, sh.t, sh.d});
    const auto upstream = torch::randn({sh.b, sh.h, sh.t, sh.d});
    const auto run = [&](torch::Dtype dtype, bool flash, int64_t row) {
      const auto leaf = [&](const torch::Tensor& x) { return x.narrow(0, row, 1).to(dtype).clone().requires_grad_(); };
      auto qi = leaf(q), ki = leaf(k), vi = leaf(v);
      const auto out = flash ? at::scaled_dot_product_attention(qi, ki, vi, {}, 0.0, true, std::nullopt, true)
                             : causal_attention(qi, ki, vi);
      (out * upstream.narrow(0, row, 1).to(dtype)).sum().backward();
      return std::vector<torch::Tensor>{out.detach().to(torch::kFloat64), qi.grad().to(torch::kFloat64),
                                        ki.grad().to(torch::kFloat64), vi.grad().to(torch::kFloat64)};
    };
    const auto whole = [&](torch::Dtype dtype, bool flash) {  // one sequence at a time: fp64's T^2 stays small
      if (dtype != torch::kFloat64) {
        const auto leaf = [&](const torch::Tensor& x) { return x.to(dtype).clone().requires_grad_(); };
        auto qi = leaf(q), ki = leaf(k), vi = leaf(v);
        const auto out = flash ? at::scaled_dot_product_attention(qi, ki, vi, {}, 0.0, true, std::nullopt, true)
                               : causal_attention(qi, ki, vi);
        (out * upstream.to(dtype)).sum().backward();
        return std::vector<torch::Tensor>{out.detach().to(torch::kFloat64), qi.grad().to(torch::kFloat64),
                                          ki.grad().to(torch::kFloat64), vi.grad().to(torch::kFloat64)};
      }
      std::vector<std::vector<torch::Tensor>> rows;
      for (int64_t row = 0; row < sh.b; ++row) rows.push_back(run(dtype, flash, row));
      std::vector<torch::Tensor> all;
      for (size_t i = 0; i < 4; ++i) {
        std::vector<torch::Tensor> parts;
        for (const auto& r : rows) parts.push_back(r[i]);
        all.push_back(torch::cat(parts, 0));
      }
      return all;
    };
    const auto exact = whole(torch::kFloat64, true);
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      EXPECT_TRUE(math_attention_applies(q.to(dtype), k.to(dtype), v.to(dtype)));
      const auto gemm = whole(dtype, false), flash = whole(dtype, true);
      for (size_t i = 0; i < exact.size(); ++i) {
        const double scale = exact[i].abs().max().item<double>();
        const double e_gemm = (gemm[i] - exact[i]).abs().max().item<double>() / scale;
        const double e_flash = (flash[i] - exact[i]).abs().max().item<double>() / scale;
        const char* what[] = {"output", "dq", "dk", "dv"};
        const bool fp32 = dtype == torch::kFloat32;
        EXPECT_LT(e_gemm, fp32 ? 1e-5 : 0.02) << what[i];
        EXPECT_LT(e_gemm, 2.0 * e_flash + (fp32 ? 1e-6 : 4e-3))
            << what[i] << ": " << e_gemm << " against the flash kernels' " << e_flash;
        std::printf("%s %s: relative error %.2e (flash %.2e)\n", c10::toString(dtype), what[i], e_gemm, e_flash);
      }
      torch::NoGradGuard no_grad;
      const auto plain = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype));
      EXPECT_TRUE(torch::equal(plain.to(torch::kFloat64), gemm[0]));
    }
  }
  const auto q = torch::zeros({1, 6, 8, 32});
  EXPECT_FALSE(math_attention_applies(q.to(torch::kFloat64), q.narrow(1, 0, 2).to(torch::kFloat64),
                                      q.narrow(1, 0, 2).to(torch::kFloat64)));
  const auto longer = torch::zeros({1, 6, 1025, 32}, torch::kBFloat16);
  EXPECT_FALSE(math_attention_applies(longer, longer.narrow(1, 0, 2), longer.narrow(1, 0, 2)));
}

TEST(Attention, FirstPositionAttendsOnlyToItself) {
  auto q = torch::randn({2, 4, 3, 8});
  auto k = torch::randn({2, 4, 3, 8});
  auto v = torch::randn({2, 4, 3, 8});
  auto out = causal_attention(q, k, v);
  EXPECT_TRUE(torch::allclose(out.select(2, 0), v.select(2, 0), 1e-6, 1e-6));
}


TEST(Attention, CausalMaskHidesTheFuture) {
  ModelConfig c = small_config();
  Attention attn(c);
  for (auto& p : attn->parameters()) {
    torch::NoGradGuard g;
    p.normal_(0, 0.2);
  }
  RotaryEmbedding rope(c);
  auto x = torch::randn({1, 6, c.hidden_size});
  auto y = attn->forward(x, rope);
  auto x2 = x.clone();
  x2.narrow(1, 4, 2).normal_();  // change positions 4 and 5
  auto y2 = attn->forward(x2, rope);
  EXPECT_TRUE(torch::allclose(y.narrow(1, 0, 4), y2.narrow(1, 0, 4), 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(y.narrow(1, 4, 2), y2.narrow(1, 4, 2), 1e-3, 1e-3));
}

TEST(Attention, GqaProjectionShapes) {
  ModelConfig c = small_config();  // hidden 64, 4 heads, 2 kv heads, head_dim 16
  Attention attn(c);
  EXPECT_EQ(attn->q_proj->weight.sizes(), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(attn->k_proj->weight.sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(attn->v_proj->weight.sizes(), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(attn->o_proj->weight.sizes(), (std::vector<int64_t>{64, 64}));
  for (auto& p : attn->parameters()) {
    torch::NoGradGuard g;
    p.normal_(0, 0.1);
  }
  RotaryEmbedding rope(c);
  EXPECT_EQ(attn->forward(torch::randn({3, 7, 64}), rope).sizes(), (std::vector<int64_t>{3, 7, 64}));
}

TEST(Mlp, IsSwiGlu) {
  ModelConfig c = small_config();
  Mlp mlp(c);
  for (auto& p : mlp->parameters()) {
    torch::NoGradGuard g;
    p.normal_(0, 0.1);
  }
  auto x = torch::randn({2, c.hidden_size});
  auto gate = torch::matmul(x, mlp->gate_proj->weight.t());
  auto up = torch::matmul(x, mlp->up_proj->weight.t());
  auto expected = torch::matmul(gate * torch::sigmoid(gate) * up, mlp->down_proj->weight.t());
  EXPECT_TRUE(torch::allclose(mlp(x), expected, 1e-5, 1e-5));
}

}  // namespace
}  // namespace weft
