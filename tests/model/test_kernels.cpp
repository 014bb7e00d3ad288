// The fused kernels (RMSNorm, SwiGLU, q/k/v split with RoPE, the loss on CUDA), fused linear layers
// and the rope table cache against the plain ATen formulations they replace, values and gradients.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <fstream>
#include <mutex>
#include <set>
#include <string>

#include "core/model/kernels.h"
#include "core/model/weight_grad.h"
#include "core/model/layers.h"
#include "core/model/linear.h"
#include "core/model/linear_cross_entropy.h"
#include "core/util/error.h"

namespace weft {
namespace {

// Gradients of sum(f(inputs) * probe) with respect to `inputs`.
template <typename F>
std::vector<torch::Tensor> grads_of(F f, std::vector<torch::Tensor> inputs, const torch::Tensor& probe) {
  for (auto& t : inputs) t = t.detach().clone().requires_grad_(true);
  (f(inputs).to(torch::kFloat32) * probe).sum().backward();
  std::vector<torch::Tensor> out;
  for (auto& t : inputs) out.push_back(t.grad());
  return out;
}

TEST(FusedKernels, RmsNormMatchesComposedOpsWithGradients) {
  torch::manual_seed(3);
  const auto x = torch::randn({3, 5, 24});
  const auto w = torch::rand({24}) + 0.5;
  const auto probe = torch::randn({3, 5, 24});
  auto reference = [](std::vector<torch::Tensor> in) {
    return in[0] * torch::rsqrt(in[0].pow(2).mean(-1, true) + 1e-5) * in[1];
  };
  auto fused = [](std::vector<torch::Tensor> in) { return fused_rms_norm(in[0], in[1], 1e-5, torch::kFloat32); };
  EXPECT_TRUE(torch::allclose(fused({x, w}), reference({x, w}), 1e-5, 1e-6));
  const auto ga = grads_of(fused, {x, w}, probe), gb = grads_of(reference, {x, w}, probe);
  EXPECT_TRUE(torch::allclose(ga[0], gb[0], 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(ga[1], gb[1], 1e-4, 1e-5));
  // bf16 output: the fp32 result rounded once (within one bf16 ulp of the rounded reference).
  const auto y16 = fused_rms_norm(x, w, 1e-5, torch::kBFloat16);
  EXPECT_EQ(y16.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(y16.to(torch::kFloat32), reference({x, w}), 8e-3, 1e-6));
}

TEST(FusedKernels, SwigluMatchesSiluTimesUpWithGradients) {
  torch::manual_seed(4);
  const auto gate_up = torch::randn({4, 7, 2 * 33}) * 4;  // wide range exercises exp's tails
  const auto probe = torch::randn({4, 7, 33});
  auto reference = [](std::vector<torch::Tensor> in) {
    return torch::silu(in[0].narrow(-1, 0, 33)) * in[0].narrow(-1, 33, 33);
  };
  auto fused = [](std::vector<torch::Tensor> in) { return fused_swiglu(in[0]); };
  EXPECT_TRUE(torch::allclose(fused({gate_up}), reference({gate_up}), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(grads_of(fused, {gate_up}, probe)[0], grads_of(reference, {gate_up}, probe)[0],
                              1e-5, 1e-5));
  // Saturated inputs stay finite: silu(-100) = 0, silu(100) = 100, on the 16-lane path and the
  // lane-by-lane rest (17 gates).
  const auto gates = torch::tensor({-100.0f, 100.0f}).repeat({9}).narrow(0, 0, 17);
  const auto extreme = torch::cat({gates, torch::ones({17})}).view({1, 34}).requires_grad_(true);
  const auto saturated = fused_swiglu(extreme);
  EXPECT_TRUE(torch::allclose(saturated, (gates > 0).to(torch::kFloat32).mul(100.0f).view({1, 17}), 0, 1e-4));
  saturated.sum().backward();
  EXPECT_TRUE(torch::isfinite(extreme.grad()).all().item<bool>());
  EXPECT_TRUE(torch::allclose(extreme.grad().narrow(1, 17, 17), saturated.detach(), 0, 1e-4));  // d/du = silu(g)
  const auto bf = fused_swiglu(gate_up.to(torch::kBFloat16));
  EXPECT_EQ(bf.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(bf.to(torch::kFloat32), reference({gate_up}), 2e-2, 2e-2));
}

TEST(FusedKernels, SplitQkvWithRopeMatchesTransposeAndApplyRotary) {
  torch::manual_seed(5);
  auto config = preset_config("tiny");  // 4 heads, 2 kv heads, head_dim 16
  RotaryEmbedding rope(config);
  const int64_t b = 2, t = 6, h = 4, kvh = 2, d = config.head_dim;
  const auto qkv = torch::randn({b, t, (h + 2 * kvh) * d});
  const auto [cos, sin] = rope.tables(0, t);
  auto reference = [&](std::vector<torch::Tensor> in) {
    auto heads = [&](int64_t first, int64_t n) {
      return in[0].narrow(-1, first * d, n * d).view({b, t, n, d}).transpose(1, 2);
    };
    return torch::cat({apply_rotary(heads(0, h), cos, sin).flatten(),
                       apply_rotary(heads(h, kvh), cos, sin).flatten(), heads(h + kvh, kvh).flatten()});
  };
  auto fused = [&](std::vector<torch::Tensor> in) {
    auto [q, k, v] = split_qkv_with_rope(in[0], h, kvh, cos, sin);
    EXPECT_EQ(q.sizes(), (std::vector<int64_t>{b, h, t, d}));
    EXPECT_EQ(k.sizes(), (std::vector<int64_t>{b, kvh, t, d}));
    return torch::cat({q.flatten(), k.flatten(), v.flatten()});
  };
  EXPECT_TRUE(torch::allclose(fused({qkv}), reference({qkv}), 1e-6, 1e-6));
  const auto probe = torch::randn({qkv.numel()});
  EXPECT_TRUE(torch::allclose(grads_of(fused, {qkv}, probe)[0], grads_of(reference, {qkv}, probe)[0], 1e-5, 1e-6));
}

// The ATen formulations (the path on CUDA and for fp16) against the fused CPU kernels, values and
// gradients, and the dispatch: an fp16 tensor takes the ATen path and keeps its dtype.
TEST(FusedKernels, TheAtenPathEqualsTheFusedKernelsItStandsInFor) {
  torch::manual_seed(6);
  auto config = preset_config("tiny");
  RotaryEmbedding rope(config);
  const int64_t h = 4, kvh = 2, d = config.head_dim;
  const auto x = torch::randn({2, 6, 24}), w = torch::rand({24}) + 0.5, probe = torch::randn({2, 6, 24});
  auto norm_fused = [&](std::vector<torch::Tensor> in) { return fused_rms_norm(in[0], in[1], 1e-5, torch::kFloat32); };
  auto norm_aten = [&](std::vector<torch::Tensor> in) { return aten_rms_norm(in[0], in[1], 1e-5, torch::kFloat32); };
  EXPECT_TRUE(torch::allclose(norm_aten({x, w}), norm_fused({x, w}), 1e-5, 1e-6));
  const auto gn_a = grads_of(norm_aten, {x, w}, probe), gn_f = grads_of(norm_fused, {x, w}, probe);
  EXPECT_TRUE(torch::allclose(gn_a[0], gn_f[0], 1e-4, 1e-5));
  EXPECT_TRUE(torch::allclose(gn_a[1], gn_f[1], 1e-4, 1e-5));

  const auto gate_up = torch::randn({2, 6, 2 * 20}) * 3, probe_mlp = torch::randn({2, 6, 20});
  auto mlp_fused = [](std::vector<torch::Tensor> in) { return fused_swiglu(in[0]); };
  auto mlp_aten = [](std::vector<torch::Tensor> in) { return aten_swiglu(in[0]); };
  EXPECT_TRUE(torch::allclose(mlp_aten({gate_up}), mlp_fused({gate_up}), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(grads_of(mlp_aten, {gate_up}, probe_mlp)[0], grads_of(mlp_fused, {gate_up}, probe_mlp)[0],
                              1e-5, 1e-5));

  const auto qkv = torch::randn({2, 6, (h + 2 * kvh) * d});
  const auto [cos, sin] = rope.tables(0, 6);
  auto qkv_of = [&](bool aten) {
    return [&, aten](std::vector<torch::Tensor> in) {
      auto [q, k, v] = aten ? aten_split_qkv_with_rope(in[0], h, kvh, cos, sin) : split_qkv_with_rope(in[0], h, kvh, cos, sin);
      return torch::cat({q.flatten(), k.flatten(), v.flatten()});
    };
  };
  EXPECT_TRUE(torch::allclose(qkv_of(true)({qkv}), qkv_of(false)({qkv}), 1e-6, 1e-6));
  const auto probe_qkv = torch::randn({qkv.numel()});
  EXPECT_TRUE(torch::allclose(grads_of(qkv_of(true), {qkv}, probe_qkv)[0], grads_of(qkv_of(false), {qkv}, probe_qkv)[0],
                              1e-5, 1e-6));
  // A table per row (packed rows: each row's positions), [B, T, D]: row 0 at positions 0..5, row 1
  // at 0, 1, 0, 1, 2, 3.
  const auto [whole_cos, whole_sin] = rope.tables(0, 6);
  const auto rows = torch::tensor(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 0, 1, 0, 1, 2, 3});
  const auto row_cos = whole_cos.index_select(0, rows).view({2, 6, -1}), row_sin = whole_sin.index_select(0, rows).view({2, 6, -1});
  auto per_row = [&](bool aten) {
    return [&, aten](std::vector<torch::Tensor> in) {
      auto [q, k, v] = aten ? aten_split_qkv_with_rope(in[0], h, kvh, row_cos, row_sin)
                            : split_qkv_with_rope(in[0], h, kvh, row_cos, row_sin);
      return torch::cat({q.flatten(), k.flatten(), v.flatten()});
    };
  };
  EXPECT_TRUE(torch::allclose(per_row(true)({qkv}), per_row(false)({qkv}), 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(grads_of(per_row(true), {qkv}, probe_qkv)[0], grads_of(per_row(false), {qkv}, probe_qkv)[0],
                              1e-5, 1e-6));
  // Row 0's table is the shared one: its q equals the [T, D] table's; row 1's differs from it.
  const auto q_rows = std::get<0>(split_qkv_with_rope(qkv, h, kvh, row_cos, row_sin));
  const auto q_shared = std::get<0>(split_qkv_with_rope(qkv, h, kvh, cos, sin));
  EXPECT_TRUE(torch::allclose(q_rows[0], q_shared[0], 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(q_rows[1], q_shared[1], 1e-3, 1e-3));

  // fp16 (CUDA's other half-precision) is not a dtype of the fused kernels: ATen's path runs.
  const auto y16 = fused_rms_norm(x.to(torch::kHalf), w, 1e-5, torch::kHalf);
  EXPECT_EQ(y16.scalar_type(), torch::kHalf);
  EXPECT_TRUE(torch::allclose(y16.to(torch::kFloat32), norm_fused({x, w}), 2e-3, 2e-3));
  EXPECT_EQ(fused_swiglu(gate_up.to(torch::kHalf)).scalar_type(), torch::kHalf);
}

// LoRA's dropout: each element kept with probability 1 - p and scaled by 1 / (1 - p), the backward
// through the same mask (drawn again, not stored), the mask a function of the generator's state, and
// neither neighbouring elements' nor successive calls' masks related.
TEST(FusedKernels, DropoutKeepsOneMinusPScaledAndBackwardUsesTheSameMask) {
  torch::manual_seed(3);
  const auto x = torch::rand({1000, 1000}) + 0.1;  // no zeros
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto xi = x.to(dtype).clone().requires_grad_(true);
    const auto y = fused_dropout(xi, 0.1);
    EXPECT_EQ(y.scalar_type(), dtype);
    const auto kept = y != 0;
    const double fraction = kept.to(torch::kFloat64).mean().item<double>();
    EXPECT_NEAR(fraction, 0.9, 0.002) << dtype;  // 6 standard deviations of a million draws
    const auto scaled = (xi.detach().to(torch::kFloat32) / 0.9).masked_fill(kept.logical_not(), 0);
    EXPECT_TRUE(torch::allclose(y.to(torch::kFloat32), scaled, dtype == torch::kFloat32 ? 1e-6 : 1e-2, 0)) << dtype;
    y.backward(torch::ones_like(y));
    EXPECT_TRUE(torch::equal(xi.grad() != 0, kept)) << dtype;
    EXPECT_TRUE(torch::allclose(xi.grad().to(torch::kFloat32).masked_select(kept),
                                torch::full({kept.sum().item<int64_t>()}, 1.0 / 0.9), 1e-2, 0)) << dtype;
  }
  torch::manual_seed(5);
  const auto a = fused_dropout(x, 0.5) != 0;
  torch::manual_seed(5);
  const auto b = fused_dropout(x, 0.5) != 0;
  const auto c = fused_dropout(x, 0.5) != 0;
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_NEAR((a == c).to(torch::kFloat64).mean().item<double>(), 0.5, 0.003);
  const auto flat = a.flatten();
  EXPECT_NEAR((flat.narrow(0, 0, flat.numel() - 1) == flat.narrow(0, 1, flat.numel() - 1)).to(torch::kFloat64).mean().item<double>(),
              0.5, 0.003);
  EXPECT_TRUE(fused_dropout(x, 0.0).is_same(x));
  EXPECT_THROW(fused_dropout(x, 1.0), Error);
  // The mask alone, as its dropped elements' indices: ascending, each once, where seeded_dropout
  // drops (x has no zeros), over several of the mask's blocks of 2^16 and a partial last one.
  const auto odd = x.narrow(1, 0, 999).contiguous();
  const auto dropped = dropout_mask_indices(999000, 0.2, 1234);
  ASSERT_EQ(dropped.scalar_type(), torch::kInt32);
  EXPECT_NEAR(static_cast<double>(dropped.numel()) / 999000, 0.2, 0.0024);  // 6 standard deviations
  const auto as64 = dropped.to(torch::kInt64);
  EXPECT_TRUE((as64.narrow(0, 1, as64.numel() - 1) > as64.narrow(0, 0, as64.numel() - 1)).all().item<bool>());
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto zeros = (seeded_dropout(odd.to(dtype), 0.2, 1234) == 0).flatten().nonzero().flatten();
    EXPECT_TRUE(torch::equal(zeros, as64)) << dtype;
  }
  // The stream itself, pinned (a change would silently change every seeded run's masks): the count
  // and the indices' sum of this mask.
  EXPECT_EQ(dropped.numel(), int64_t{199975});
  EXPECT_EQ(as64.sum().item<int64_t>(), int64_t{99940932889});
  // The same mask after drawing a larger one and a smaller one (the blocks' buffers are the calling
  // thread's, kept from call to call), at 2, 4 and 1 threads.
  const int threads = at::get_num_threads();
  for (const int n : {2, 4, 1}) {
    at::set_num_threads(n);
    const auto larger = dropout_mask_indices(1999000, 0.2, 77);
    EXPECT_TRUE(torch::equal(dropout_mask_indices(999000, 0.2, 1234), dropped)) << n << " threads";
    const auto smaller = dropout_mask_indices(70000, 0.2, 78);
    EXPECT_TRUE(torch::equal(dropout_mask_indices(1999000, 0.2, 77), larger)) << n << " threads";
    at::set_num_threads(1);
    EXPECT_TRUE(torch::equal(dropout_mask_indices(70000, 0.2, 78), smaller)) << n << " threads";
    EXPECT_TRUE(torch::equal(dropout_mask_indices(1999000, 0.2, 77), larger)) << n << " threads";
  }
  at::set_num_threads(threads);
  EXPECT_THROW(dropout_mask_indices(10, 1.0, 1), Error);
  EXPECT_THROW(dropout_mask_indices(10, 0.0, 1), Error);
}

// weft's CPU kernels split their loops with at::parallel_for, which compiles to OpenMP only in files
// built with it (cmake/libtorch.cmake): a loop of this file, built as kernels.cpp is, runs on as
// many of LibTorch's threads as at::set_num_threads gives it, and the process holds one OpenMP
// runtime (LibTorch's), so that setting reaches weft's loops.
TEST(FusedKernels, WeftsLoopsRunOnLibTorchsThreads) {
  const int threads = at::get_num_threads();
  for (const int n : {1, 2, 3}) {
    at::set_num_threads(n);
    std::mutex m;
    std::set<int> seen;
    at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
      std::lock_guard<std::mutex> lock(m);
      seen.insert(at::get_thread_num());
    });
    EXPECT_EQ(seen.size(), static_cast<size_t>(n)) << n << " threads";
  }
  at::set_num_threads(threads);
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> gomp;
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash != std::string::npos && line.find("libgomp") != std::string::npos) gomp.insert(line.substr(slash));
  }
  EXPECT_LE(gomp.size(), size_t{1}) << "two OpenMP runtimes: " << *gomp.begin() << ", " << *gomp.rbegin();
}

// Each CPU kernel's loops split rows (or fixed blocks summed in order) among threads: one thread and
// two give the same bits, forward and backward, fp32 and bf16, on shapes that split.
TEST(FusedKernels, EachCpuKernelGivesTheSameBitsOnOneThreadAndOnTwo) {
  torch::manual_seed(21);
  auto config = preset_config("tiny");
  RotaryEmbedding rope(config);
  const int64_t b = 2, t = 128, h = 4, kvh = 2, d = config.head_dim;
  const auto [cos, sin] = rope.tables(0, t);
  const auto x = torch::randn({512, 96}), w = torch::rand({96}) + 0.5, gate_up = torch::randn({512, 2 * 80}) * 3;
  const auto qkv = torch::randn({b, t, (h + 2 * kvh) * d});
  const auto scores = torch::randn({6, 64, 96}), dp = torch::randn({6, 64, 96});
  const auto logits = torch::randn({96, 1000}) * 3, targets = torch::randint(0, 1000, {96});
  const auto big = torch::randn({300000}), small = torch::randn({300000}).to(torch::kBFloat16);
  const auto run = [&](torch::Dtype dtype) {
    std::vector<torch::Tensor> out;
    const auto push_grads = [&](auto f, std::vector<torch::Tensor> in, const torch::Tensor& probe) {
      for (auto& g : grads_of(f, std::move(in), probe)) out.push_back(g);
    };
    out.push_back(fused_rms_norm(x.to(dtype), w, 1e-5, dtype));
    push_grads([&](std::vector<torch::Tensor> in) { return fused_rms_norm(in[0], in[1], 1e-5, dtype); },
               {x.to(dtype), w}, torch::randn({512, 96}));
    out.push_back(fused_swiglu(gate_up.to(dtype)));
    push_grads([](std::vector<torch::Tensor> in) { return fused_swiglu(in[0]); }, {gate_up.to(dtype)},
               torch::randn({512, 80}));
    push_grads([&](std::vector<torch::Tensor> in) {
      auto [q, k, v] = split_qkv_with_rope(in[0], h, kvh, cos, sin);
      return torch::cat({q.flatten(), k.flatten(), v.flatten()});
    }, {qkv.to(dtype)}, torch::randn({qkv.numel()}));
    auto p = scores.to(dtype).clone();  // (in place: the fp32 case's .to() would be the input itself)
    causal_softmax_rows_(p, 0.125, 2, 32);
    auto g = dp.to(dtype).clone();
    causal_softmax_backward_rows_(p, g, 0.125, 2, 32);
    out.push_back(p);
    out.push_back(g);
    auto l = logits.to(dtype).clone();
    out.push_back(cross_entropy_rows(l, targets, -100, 0.5));
    out.push_back(l);
    out.push_back(squared_sum_fp64(big.to(dtype)));
    return out;
  };
  const int threads = at::get_num_threads();
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    at::set_num_threads(1);
    torch::manual_seed(22);
    const auto one = run(dtype);
    at::set_num_threads(2);
    torch::manual_seed(22);
    const auto two = run(dtype);
    ASSERT_EQ(one.size(), two.size());
    for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << dtype << " output " << i;
  }
  // The fp32 residual stream's adds of a bf16 branch.
  auto sum1 = big.clone(), sum2 = big.clone();
  at::set_num_threads(1);
  add_into_fp32_(sum1, small);
  const auto added1 = add_widened(big, small);
  at::set_num_threads(2);
  add_into_fp32_(sum2, small);
  EXPECT_TRUE(torch::equal(sum1, sum2));
  EXPECT_TRUE(torch::equal(add_widened(big, small), added1));
  at::set_num_threads(threads);
}

// LoRA's dropout by the mask's complement (lora_linear), for three adapters that share x in one
// call: against the dense products of x less each adapter's kept elements, in fp32 and bf16, for
// ranks on the kernels' vector path (16, 32) and off it (5), on u and v that are column slices of
// one wider matrix (as lora_linear's), over more rows than one of backward's blocks of 512; x A^T
// less the dropped terms, scaled by 1 / (1 - p), is seeded_dropout(x) A^T; each sum in a fixed
// order, so two threads give the bits one gives, and an adapter's A gradient is the same alone or
// in the group; more adapters than one pass takes (16) give each one's own result.
TEST(FusedKernels, DroppedProductsAreTheMaskComplementsTerms) {
  torch::manual_seed(12);
  const int64_t rows = 600, cols = 45;
  const std::vector<int64_t> ranks{16, 5, 32};
  const std::vector<double> ps{0.3, 0.2, 0.5};
  const auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
  std::vector<torch::Tensor> masks, kept, ats;
  for (size_t k = 0; k < ranks.size(); ++k) {
    masks.push_back(dropout_mask_indices(rows * cols, ps[k], 99 + k));
    auto keep = torch::ones({rows * cols}, torch::kBool);
    keep.index_fill_(0, masks.back().to(torch::kInt64), false);
    kept.push_back(keep.view({rows, cols}));
    ats.push_back(torch::randn({cols, ranks[k]}));
  }
  const int64_t width = 16 + 5 + 32;
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const bool fp32 = dtype == torch::kFloat32;
    const double tol = fp32 ? 1e-5 : 1e-2, tol_abs = fp32 ? 1e-5 : 3e-2;
    const auto x = torch::randn({rows, cols}).to(dtype);
    // Forward: u = x A^T becomes D(x) A^T in place; the wide matrix's other columns untouched.
    const auto wide_u = torch::randn({rows, width + 2}).to(dtype);
    std::vector<DroppedAdapter> group;
    for (int64_t k = 0, column = 1; k < 3; column += ranks[k], ++k) {
      wide_u.narrow(1, column, ranks[k]).copy_(f64(x).mm(f64(ats[k])));
      group.push_back({masks[k], ats[k], wide_u.narrow(1, column, ranks[k]), dropout_scale(ps[k]), {}});
    }
    const auto u_before = wide_u.clone();
    subtract_dropped_products_(x, group);
    for (int64_t k = 0, column = 1; k < 3; column += ranks[k], ++k) {
      SCOPED_TRACE("adapter " + std::to_string(k));
      EXPECT_TRUE(seeded_dropout_applies(x) && torch::equal((seeded_dropout(x, ps[k], 99 + k) != 0) | (x == 0), kept[k]));
      const auto only_dropped = f64(x).masked_fill(kept[k], 0);
      const auto expected = (f64(u_before.narrow(1, column, ranks[k])) - only_dropped.mm(f64(ats[k]))) * dropout_scale(ps[k]);
      EXPECT_TRUE(torch::allclose(f64(group[k].rows), expected, tol, tol_abs));
      if (fp32) {
        const auto dropped_x = f64(seeded_dropout(x, ps[k], 99 + k));  // x * scale, unrounded in fp32
        EXPECT_TRUE(torch::allclose(f64(group[k].rows), dropped_x.mm(f64(ats[k])), 1e-4, 1e-4));
      }
    }
    EXPECT_TRUE(torch::equal(wide_u.narrow(1, 0, 1), u_before.narrow(1, 0, 1)));
    EXPECT_TRUE(torch::equal(wide_u.narrow(1, width + 1, 1), u_before.narrow(1, width + 1, 1)));
    // Backward: x's gradient less each v A at its dropped elements only, each A's less v^T x_dropped.
    const auto wide_v = torch::randn({rows, width + 2}).to(dtype);
    const auto g0 = torch::randn({rows, cols}).to(dtype);
    std::vector<torch::Tensor> ga0;
    auto expected_g = f64(g0);
    auto kept_by_all = torch::ones({rows, cols}, torch::kBool);
    group.clear();
    for (int64_t k = 0, column = 1; k < 3; column += ranks[k], ++k) {
      ga0.push_back(torch::randn({ranks[k], cols}));
      const auto v = wide_v.narrow(1, column, ranks[k]);
      group.push_back({masks[k], ats[k], v, 1.0f, ga0[k].clone()});
      expected_g -= f64(v).mm(f64(ats[k]).t()).masked_fill(kept[k], 0);
      kept_by_all &= kept[k];
    }
    auto g = g0.clone();
    dropped_backward_(g, x, group);
    EXPECT_TRUE(torch::allclose(f64(g), expected_g, tol, tol_abs));
    EXPECT_TRUE(torch::equal(f64(g).masked_select(kept_by_all), f64(g0).masked_select(kept_by_all)));
    for (int64_t k = 0; k < 3; ++k) {
      SCOPED_TRACE("adapter " + std::to_string(k));
      const auto only_dropped = f64(x).masked_fill(kept[k], 0);
      EXPECT_TRUE(torch::allclose(f64(group[k].grad_a), f64(ga0[k]) - only_dropped.t().mm(f64(group[k].rows)).t(), 1e-4, 1e-4));
      torch::Tensor none;
      std::vector<DroppedAdapter> alone{{masks[k], ats[k], group[k].rows, 1.0f, ga0[k].clone()}};
      dropped_backward_(none, x, alone);  // no x gradient wanted, one adapter: A's the same bits
      EXPECT_TRUE(torch::equal(alone[0].grad_a, group[k].grad_a));
    }
    // Two threads: the same bits.
    const int threads = at::get_num_threads();
    at::set_num_threads(2);
    const auto wide_u2 = u_before.clone();
    std::vector<DroppedAdapter> group2;
    for (int64_t k = 0, column = 1; k < 3; column += ranks[k], ++k) {
      group2.push_back({masks[k], ats[k], wide_u2.narrow(1, column, ranks[k]), dropout_scale(ps[k]), {}});
    }
    subtract_dropped_products_(x, group2);
    auto g2 = g0.clone();
    for (int64_t k = 0; k < 3; ++k) group2[k] = {masks[k], ats[k], group[k].rows, 1.0f, ga0[k].clone()};
    dropped_backward_(g2, x, group2);
    at::set_num_threads(threads);
    EXPECT_TRUE(torch::equal(wide_u2, wide_u) && torch::equal(g2, g));
    for (int64_t k = 0; k < 3; ++k) EXPECT_TRUE(torch::equal(group2[k].grad_a, group[k].grad_a)) << k;
    // Forward's copy of x's dropped elements (`values`): x's elements at the mask, in its order;
    // backward reading it instead of x: the same bits.
    const auto wide_u3 = u_before.clone();
    std::vector<DroppedAdapter> group3;
    for (int64_t k = 0, column = 1; k < 3; column += ranks[k], ++k) {
      group3.push_back({masks[k], ats[k], wide_u3.narrow(1, column, ranks[k]), dropout_scale(ps[k]), {},
                        torch::full({masks[k].numel()}, 7.0, x.options())});
    }
    subtract_dropped_products_(x, group3);
    EXPECT_TRUE(torch::equal(wide_u3, wide_u));
    auto g3 = g0.clone();
    for (int64_t k = 0; k < 3; ++k) {
      EXPECT_TRUE(torch::equal(group3[k].values, x.flatten().index_select(0, masks[k].to(torch::kInt64)))) << k;
      group3[k] = {masks[k], ats[k], group[k].rows, 1.0f, ga0[k].clone(), group3[k].values};
    }
    dropped_backward_(g3, x, group3);
    EXPECT_TRUE(torch::equal(g3, g));
    for (int64_t k = 0; k < 3; ++k) EXPECT_TRUE(torch::equal(group3[k].grad_a, group[k].grad_a)) << k;
    // ... and reads them: x with every dropped element zeroed, the values kept, the same bits.
    const auto x_zeroed = x.masked_fill(kept_by_all.logical_not(), 0);
    auto g4 = g0.clone();
    for (int64_t k = 0; k < 3; ++k) group3[k].grad_a = ga0[k].clone();
    dropped_backward_(g4, x_zeroed, group3);
    EXPECT_TRUE(torch::equal(g4, g));
    for (int64_t k = 0; k < 3; ++k) EXPECT_TRUE(torch::equal(group3[k].grad_a, group[k].grad_a)) << k;
    // An adapter's A^T in fp32.
    const auto a_k = ats[2].t().contiguous().to(dtype);
    EXPECT_TRUE(torch::equal(transposed_fp32(a_k), a_k.to(torch::kFloat32).t()));
  }
  // 17 adapters (two passes): each one's u as when alone.
  const auto x = torch::randn({rows, cols});
  const auto at = torch::randn({cols, 16});
  const auto u0 = torch::randn({rows, 16});
  std::vector<DroppedAdapter> many;
  for (int k = 0; k < 17; ++k) many.push_back({dropout_mask_indices(rows * cols, 0.1, 500 + k), at, u0.clone(), 1.1f, {}});
  subtract_dropped_products_(x, many);
  for (int k = 0; k < 17; ++k) {
    std::vector<DroppedAdapter> one{{many[k].dropped, at, u0.clone(), 1.1f, {}}};
    subtract_dropped_products_(x, one);
    EXPECT_TRUE(torch::equal(one[0].rows, many[k].rows)) << k;
  }
  // Bad operands: one clear error each.
  const auto u = torch::randn({rows, 5}), at5 = torch::randn({cols, 5});
  const auto bits = dropout_mask_indices(rows * cols, 0.2, 1);
  const auto fails = [&](DroppedAdapter a, bool backward) {
    std::vector<DroppedAdapter> one{std::move(a)};
    auto g = torch::randn({rows, cols});
    EXPECT_THROW(backward ? dropped_backward_(g, x, one) : subtract_dropped_products_(x, one), Error);
  };
  fails({dropout_mask_indices(rows * cols + 400, 0.2, 1), at5, u, 1.0f, {}}, false);  // a larger tensor's mask
  fails({bits, at5.narrow(0, 0, cols - 1).contiguous(), u, 1.0f, {}}, false);         // A^T of other rows
  fails({bits, at5, u.to(torch::kBFloat16), 1.0f, {}}, false);                        // not x's dtype
  fails({bits, at5, torch::randn({5, rows}).t(), 1.0f, torch::zeros({5, cols})}, true);  // v's columns strided
  fails({bits, at5, u, 1.0f, torch::zeros({cols, 5}).t()}, true);                      // A's gradient transposed
  fails({bits, at5, u, 1.0f, {}}, true);                                              // no A gradient
  fails({bits, at5, u, 1.0f, {}, torch::zeros({bits.numel() + 1})}, false);            // values not the mask's count
  fails({bits, at5, u, 1.0f, torch::zeros({5, cols}), torch::zeros({bits.numel()}, torch::kBFloat16)}, true);  // x's dtype
  const auto a_t = torch::randn({5, cols}, torch::kFloat64).t();  // another dtype, strided: cast and copied
  EXPECT_TRUE(torch::equal(transposed_fp32(a_t), a_t.to(torch::kFloat32).t()));
  EXPECT_THROW(transposed_fp32(torch::randn({5})), Error);  // not a matrix
}

// The CUDA backend (core/model/cuda) against the ATen formulations on the same GPU, values and
// gradients, in fp32 and bf16, at shapes that are no multiple of a block (rows of 2050 for the
// RMSNorm and loss, a 128k vocabulary). Needs a GPU: tools/gpu/kit.sh runs it (test_model).
TEST(FusedKernels, OnCudaEachKernelEqualsItsAtenFormulation) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here; tools/gpu/kit.sh runs this on a GPU";
  torch::manual_seed(7);
  const torch::Device gpu(torch::kCUDA, 0);
  const auto close = [](const torch::Tensor& a, const torch::Tensor& b, double rtol, double atol) {
    return torch::allclose(a.to(torch::kCPU, torch::kFloat32), b.to(torch::kCPU, torch::kFloat32), rtol, atol);
  };
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const bool bf16 = dtype == torch::kBFloat16;
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    // RMSNorm: the residual stream (fp32) in, the compute dtype out; and bf16 in.
    const auto x = torch::randn({5, 410, 2048}, gpu), w = (torch::rand({2048}) + 0.5).to(gpu);
    const auto probe = torch::randn({5, 410, 2048}, gpu);
    for (const auto& in : {x, x.to(dtype)}) {
      auto fused = [&](std::vector<torch::Tensor> t) { return fused_rms_norm(t[0], t[1], 1e-5, dtype); };
      auto aten = [&](std::vector<torch::Tensor> t) { return aten_rms_norm(t[0], t[1], 1e-5, dtype); };
      EXPECT_TRUE(close(fused({in, w}), aten({in, w}), bf16 ? 1e-2 : 1e-5, 1e-5));
      const auto gf = grads_of(fused, {in, w}, probe), ga = grads_of(aten, {in, w}, probe);
      EXPECT_TRUE(close(gf[0], ga[0], bf16 ? 2e-2 : 1e-4, bf16 ? 1e-2 : 1e-5));
      EXPECT_TRUE(close(gf[1], ga[1], bf16 ? 2e-2 : 1e-3, bf16 ? 1e-1 : 1e-3));
    }
    // SwiGLU.
    const auto gate_up = (torch::randn({3, 70, 2 * 1000}, gpu) * 3).to(dtype), probe_mlp = torch::randn({3, 70, 1000}, gpu);
    auto mlp_fused = [](std::vector<torch::Tensor> t) { return fused_swiglu(t[0]); };
    auto mlp_aten = [](std::vector<torch::Tensor> t) { return aten_swiglu(t[0]); };
    EXPECT_TRUE(close(mlp_fused({gate_up}), mlp_aten({gate_up}), bf16 ? 1e-2 : 1e-5, 1e-5));
    EXPECT_TRUE(close(grads_of(mlp_fused, {gate_up}, probe_mlp)[0], grads_of(mlp_aten, {gate_up}, probe_mlp)[0],
                      bf16 ? 2e-2 : 1e-5, bf16 ? 2e-2 : 1e-5));
    // q/k/v split with RoPE (the llama-3.2-1b heads: 32 of 64, 8 kv heads).
    auto config = preset_config("tiny");
    config.head_dim = 64;
    RotaryEmbedding rope(config);
    const int64_t h = 32, kvh = 8, d = 64, t = 100;
    const auto [cos, sin] = rope.tables(0, t, gpu);
    const auto qkv = torch::randn({2, t, (h + 2 * kvh) * d}, gpu).to(dtype), probe_qkv = torch::randn({qkv.numel()}, gpu);
    auto qkv_of = [&](bool use_aten) {
      return [&, use_aten](std::vector<torch::Tensor> in) {
        auto [q, k, v] = use_aten ? aten_split_qkv_with_rope(in[0], h, kvh, cos, sin) : split_qkv_with_rope(in[0], h, kvh, cos, sin);
        return torch::cat({q.flatten(), k.flatten(), v.flatten()});
      };
    };
    EXPECT_TRUE(close(qkv_of(false)({qkv}), qkv_of(true)({qkv}), bf16 ? 1e-2 : 1e-6, 1e-6));
    EXPECT_TRUE(close(grads_of(qkv_of(false), {qkv}, probe_qkv)[0], grads_of(qkv_of(true), {qkv}, probe_qkv)[0],
                      bf16 ? 1e-2 : 1e-5, bf16 ? 1e-2 : 1e-6));
    // The loss over a 128k vocabulary, two targets ignored (-100).
    const auto logits = (torch::randn({2050, 128256}, gpu) * 2).to(dtype);
    auto targets = torch::randint(0, 128256, {2050}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
    targets.index_put_({torch::tensor({3, 2000})}, -100);
    auto loss_fused = [&](std::vector<torch::Tensor> in) { return cross_entropy_sum_of(in[0], targets); };
    auto loss_aten = [&](std::vector<torch::Tensor> in) {
      return torch::nn::functional::cross_entropy(in[0].to(torch::kFloat32), targets,
                                                  torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    };
    EXPECT_TRUE(close(loss_fused({logits}), loss_aten({logits}), 1e-5, 1e-3));
    const auto one = torch::full({}, 0.5, gpu);
    const auto gl_f = grads_of(loss_fused, {logits}, one)[0], gl_a = grads_of(loss_aten, {logits}, one)[0];
    EXPECT_EQ(gl_f.scalar_type(), dtype);
    EXPECT_TRUE(close(gl_f, gl_a, bf16 ? 1e-2 : 1e-5, 1e-7));
    EXPECT_EQ(gl_f[3].abs().sum().item<float>(), 0.0f);
    // cross_entropy_rows (the chunked head's loss): the same per-row losses, and the gradient of
    // 0.5 * their sum written over the logits in place; an ignore_index inside the vocabulary too.
    auto rows = logits.clone();
    const auto row_losses = cross_entropy_rows(rows, targets, -100, 0.5);
    EXPECT_TRUE(close(row_losses.sum(), loss_aten({logits}), 1e-5, 1e-3));
    EXPECT_EQ(row_losses[2000].item<float>(), 0.0f);
    EXPECT_TRUE(close(rows, gl_a, bf16 ? 1e-2 : 1e-5, 1e-7));
    auto seven = targets.masked_fill(targets == -100, 7);
    auto copy = logits.clone();
    const auto ignored_seven = cross_entropy_rows(copy, seven, 7, std::nullopt);
    EXPECT_TRUE(torch::equal(copy, logits));  // no gradient asked: untouched
    EXPECT_TRUE(close(ignored_seven, row_losses.masked_fill(seven == 7, 0), 0, 0));
  }
  // A trainable fp32 weight computing in bf16 (fused_linear, deferrable_linear): dW from cuBLAS's
  // fp32-output GEMM equals the fp64 product of the same bf16 factors to the tensor cores' fp32
  // accumulation error (entries ~45 summed over 2,048 products: a few 1e-4, up to ~1e-3), well
  // inside what a bf16 output would have lost (its rounding alone moves entries by up to ~0.1).
  const auto w = (torch::randn({96, 2048}, gpu) * 0.02).requires_grad_(true);
  const auto xin = torch::randn({4, 512, 2048}, gpu).to(torch::kBFloat16);
  const auto dy = torch::randn({4, 512, 96}, gpu).to(torch::kBFloat16);
  ASSERT_TRUE(wide_weight_grad_applies(w, torch::kBFloat16));
  deferrable_linear(xin, {w}, torch::kBFloat16, /*defer=*/false).backward(dy);
  const auto expected = torch::mm(dy.reshape({-1, 96}).t().to(torch::kFloat64), xin.reshape({-1, 2048}).to(torch::kFloat64));
  EXPECT_EQ(w.grad().scalar_type(), torch::kFloat32);
  const double error = (w.grad().to(torch::kCPU, torch::kFloat64) - expected.cpu()).abs().max().item<double>();
  const double bf16_rounding =
      (expected.to(torch::kBFloat16).to(torch::kFloat64) - expected).abs().max().item<double>();
  EXPECT_LT(error, 1e-2) << "bf16 rounding alone: " << bf16_rounding;
  EXPECT_GT(bf16_rounding, 5e-2);  // so the bound above tells an fp32 output from a bf16 one
}

// add_into_fp32_: fp32 += bf16 widened, the same bits as ATen's add of an fp32 copy, over a length
// that is no multiple of the vector width; other dtypes and layouts fall back to add_.
TEST(FusedKernels, AddIntoFp32IsAtensAddOfTheWidenedCopy) {
  torch::manual_seed(11);
  auto sum = torch::randn({1000003});
  const auto x = (torch::randn({1000003}) * 1e-3).to(torch::kBFloat16);
  const auto expected = sum + x.to(torch::kFloat32);
  add_into_fp32_(sum, x);
  EXPECT_TRUE(torch::equal(sum, expected));
  auto strided = torch::zeros({8, 6}).t();
  add_into_fp32_(strided, torch::ones({6, 8}, torch::kBFloat16));
  EXPECT_EQ(strided.sum().item<float>(), 48.0f);
}

// add_widened (the fp32 residual stream's adds): fp32 + bf16 in one pass, the same bits as ATen's
// add of mixed dtypes, and its gradients as ATen's (x's passed through, a's cast to bf16); other
// dtypes and layouts fall back to x + a.
TEST(FusedKernels, AddWidenedIsAtensMixedAddAndItsGradients) {
  torch::manual_seed(13);
  const auto x0 = torch::randn({3, 1000003 / 3 + 1});
  const auto a0 = (torch::randn(x0.sizes()) * 1e-3).to(torch::kBFloat16);
  const auto probe = torch::randn(x0.sizes());
  const auto run = [&](bool fused) {
    auto x = x0.clone().requires_grad_(true);
    auto a = a0.clone().requires_grad_(true);
    const auto y = fused ? add_widened(x, a) : x + a;
    (y * probe).sum().backward();
    return std::vector<torch::Tensor>{y.detach(), x.grad(), a.grad()};
  };
  const auto expected = run(false), got = run(true);
  EXPECT_EQ(got[0].scalar_type(), torch::kFloat32);
  EXPECT_EQ(got[2].scalar_type(), torch::kBFloat16);
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(torch::equal(got[i], expected[i])) << i;
  const auto strided = torch::zeros({8, 6}).t();
  EXPECT_TRUE(torch::equal(add_widened(strided, torch::ones({6, 8}, torch::kBFloat16)), torch::ones({6, 8})));
  EXPECT_TRUE(torch::equal(add_widened(torch::ones({4}, torch::kBFloat16), torch::ones({4}, torch::kBFloat16)),
                           torch::full({4}, 2.0, torch::kBFloat16)));
}

// A trainable fp32 weight computing in bf16 on the CPU (deferrable_linear, which fused_linear and
// Linear use for it): each weight is cast into its rows of the product's operand, and dW is added
// straight into the weight's existing gradient, which autograd's accumulator then adopts (the same
// storage, its post-accumulation hooks once per backward). Over two backwards (the first into no
// gradient, the second into the first's), the gradients and the output equal plain autograd's
// (cast, concatenate, product, cast back, accumulate) bit for bit.
TEST(FusedKernels, MasterWeightGradientsOnTheCpuEqualAutogradsCastAndSumBitForBit) {
  torch::manual_seed(12);
  const auto make = [](int64_t rows) { return (torch::randn({rows, 48}) * 0.05).requires_grad_(true); };
  std::vector<torch::Tensor> ours = {make(40), make(16), make(16)}, plain;
  for (const auto& w : ours) plain.push_back(w.detach().clone().requires_grad_(true));
  ASSERT_TRUE(master_weight_grad_applies(ours[0], torch::kBFloat16));
  EXPECT_FALSE(master_weight_grad_applies(ours[0], torch::kFloat32));
  EXPECT_FALSE(master_weight_grad_applies(ours[0].detach(), torch::kBFloat16));
  int hooks = 0;
  auto accumulator = torch::autograd::impl::grad_accumulator(ours[1]);
  accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [&hooks](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        ++hooks;
        return outputs;
      }));
  const void* storage = nullptr;
  for (int pass = 0; pass < 2; ++pass) {
    const auto x = torch::randn({3, 7, 48}).to(torch::kBFloat16).requires_grad_(true);
    const auto x_plain = x.detach().clone().requires_grad_(true);
    const auto dy = torch::randn({3, 7, 72}).to(torch::kBFloat16);
    const auto y = deferrable_linear(x, ours, torch::kBFloat16, /*defer=*/false);
    std::vector<torch::Tensor> cast;
    for (const auto& w : plain) cast.push_back(w.to(torch::kBFloat16));
    const auto y_plain = torch::nn::functional::linear(x_plain, torch::cat(cast));
    ASSERT_TRUE(torch::equal(y, y_plain));
    y.backward(dy);
    y_plain.backward(dy);
    EXPECT_TRUE(torch::equal(x.grad(), x_plain.grad()));
    for (size_t i = 0; i < ours.size(); ++i) {
      ASSERT_EQ(ours[i].grad().scalar_type(), torch::kFloat32);
      EXPECT_TRUE(torch::equal(ours[i].grad(), plain[i].grad())) << "weight " << i << ", backward " << pass;
    }
    if (pass == 0) storage = ours[1].grad().data_ptr();
  }
  EXPECT_EQ(ours[1].grad().data_ptr(), storage) << "the second backward's sum is the first's gradient, adopted";
  EXPECT_EQ(hooks, 2);
}

// The LM head and its cross-entropy in row chunks (Liger's fused linear + cross-entropy) against
// cross_entropy_rows (and cross_entropy_sum_of, which runs it on the CPU) against ATen's
// cross_entropy over an fp32 copy: each row's loss and, in place, the scaled gradient of their sum, in fp32 and bf16, over a vocabulary that is no multiple
// of the kernel's 16 lanes, with an ignored row, a row whose target holds its maximum, and large
// logits (exp's range reduction). A NaN or +inf logit gives its row a NaN loss; a target outside
// the vocabulary is refused before anything is written.
TEST(FusedKernels, CrossEntropyRowsEqualAtenCrossEntropyAndItsGradient) {
  torch::manual_seed(5);
  const int64_t rows = 9, vocab = 1037;
  auto base = torch::randn({rows, vocab}) * 4.0;
  base[3] *= 20.0;  // logits in the hundreds
  auto targets = torch::randint(0, vocab, {rows}, torch::kLong);
  targets[2] = -100;
  targets[4] = base[4].argmax().item<int64_t>();
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto logits = base.to(dtype);
    auto ref_in = logits.to(torch::kFloat32).clone().requires_grad_(true);
    const auto ref = torch::nn::functional::cross_entropy(
        ref_in, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone).ignore_index(-100));
    (ref.sum() * 0.25).backward();
    auto values = logits.clone();
    const auto loss = cross_entropy_rows(values, targets, -100, std::nullopt);
    EXPECT_TRUE(torch::equal(values, logits)) << "no gradient asked: the logits are left as they were";
    EXPECT_TRUE(torch::allclose(loss, ref.detach(), 1e-6, 2e-5)) << (loss - ref).abs().max();
    EXPECT_EQ(loss[2].item<float>(), 0.0f);
    auto grad = logits.clone();
    EXPECT_TRUE(torch::allclose(cross_entropy_rows(grad, targets, -100, 0.25), loss));
    EXPECT_EQ(grad.scalar_type(), dtype);
    const auto expected = ref_in.grad().to(dtype).to(torch::kFloat32);
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 8e-3;  // bf16: one rounding of the gradient
    EXPECT_TRUE(torch::allclose(grad.to(torch::kFloat32), expected, tol, 1e-8))
        << (grad.to(torch::kFloat32) - expected).abs().max();
    EXPECT_EQ(grad[2].abs().sum().item<double>(), 0.0);
    // cross_entropy_sum_of on the CPU runs it forward and backward: ATen's sum and gradient.
    auto in = logits.clone().requires_grad_(true);
    const auto sum = cross_entropy_sum_of(in, targets);
    (sum * 0.25).backward();
    EXPECT_NEAR(sum.item<double>(), ref.sum().item<double>(), 1e-5 * ref.sum().item<double>());
    EXPECT_EQ(in.grad().scalar_type(), dtype);
    EXPECT_TRUE(torch::allclose(in.grad().to(torch::kFloat32), expected, tol, 1e-8));
  }
  // Over a real vocabulary's width the kernel is no further from fp64 than ATen's fp32 is.
  {
    auto wide = torch::randn({16, 49152}) * 2.0;
    const auto t = torch::randint(0, 49152, {16}, torch::kLong);
    auto r64 = wide.to(torch::kFloat64).requires_grad_();
    const auto opts = torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone);
    const auto l64 = torch::nn::functional::cross_entropy(r64, t, opts);
    l64.sum().backward();
    auto r32 = wide.clone().requires_grad_();
    const auto l32 = torch::nn::functional::cross_entropy(r32, t, opts);
    l32.sum().backward();
    auto grad = wide.clone();
    const auto loss = cross_entropy_rows(grad, t, -100, 1.0);
    const auto err = [&](const torch::Tensor& a, const torch::Tensor& b) {
      return (a.to(torch::kFloat64) - b).abs().max().item<double>();
    };
    EXPECT_LE(err(loss, l64.detach()), 1.5 * err(l32.detach(), l64.detach()));
    EXPECT_LE(err(grad, r64.grad()), 1.5 * err(r32.grad(), r64.grad()));
  }
  auto bad = torch::randn({3, 40});
  bad[0][7] = std::numeric_limits<float>::quiet_NaN();
  bad[1][9] = std::numeric_limits<float>::infinity();
  const auto loss = cross_entropy_rows(bad, torch::tensor({1, 2, 3}), -100, 1.0);
  EXPECT_TRUE(std::isnan(loss[0].item<float>()));
  EXPECT_TRUE(std::isnan(loss[1].item<float>()));
  EXPECT_TRUE(std::isfinite(loss[2].item<float>()));
  auto untouched = torch::randn({2, 40});
  const auto before = untouched.clone();
  EXPECT_THROW(cross_entropy_rows(untouched, torch::tensor({1, 40}), -100, 1.0), Error);
  EXPECT_TRUE(torch::equal(untouched, before));
  EXPECT_THROW(cross_entropy_rows(untouched, torch::tensor({1}), -100, 1.0), Error);
}

// linear then cross_entropy(reduction sum): the loss, each row's loss, and the gradients of h and
// of a trained head, with rows ignored, a last chunk shorter than the others, a scaled loss, under
// no_grad, and in bf16 (the product rounded to bf16 as the head's linear rounds it).
TEST(FusedKernels, SquaredSumFp64EqualsTheWidenedSumOfSquares) {
  torch::manual_seed(0);
  // Sizes around the kernel's 16 lanes and 65,536-element blocks, and past ATen's 4M-element chunks.
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{17}, int64_t{65536}, int64_t{65536 * 3 + 7},
                          kSquaredSumChunk + 5}) {
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      const auto t = (torch::randn({n}) * 3).to(dtype);
      const double expected = t.to(torch::kDouble).pow(2).sum().item<double>();
      const auto got = squared_sum_fp64(t);
      EXPECT_EQ(got.scalar_type(), torch::kDouble);
      EXPECT_EQ(got.dim(), 0);
      EXPECT_NEAR(got.item<double>(), expected, 1e-12 * expected) << n << " " << dtype;
    }
  }
  // Beyond fp32's range the squares are still finite in fp64, as the widened sum's.
  const auto big = torch::full({40}, 3e30f);
  const double widened = big.to(torch::kDouble).pow(2).sum().item<double>();
  EXPECT_GT(widened, 3.5e62);
  EXPECT_NEAR(squared_sum_fp64(big).item<double>(), widened, 1e-12 * widened);
  // A transposed view and an fp16 tensor take ATen's path, to the same value.
  const auto m = torch::randn({300, 70});
  EXPECT_NEAR(squared_sum_fp64(m.t()).item<double>(), m.to(torch::kDouble).pow(2).sum().item<double>(), 1e-9);
  const auto h = torch::randn({1000}).to(torch::kHalf);
  EXPECT_NEAR(squared_sum_fp64(h).item<double>(), h.to(torch::kDouble).pow(2).sum().item<double>(), 1e-9);
  // NaN and infinity reach the sum, as gradient clipping needs to see them.
  auto nan = torch::ones({100});
  nan[37] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(squared_sum_fp64(nan).item<double>()));
  auto inf = torch::ones({100}).to(torch::kBFloat16);
  inf[99] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(squared_sum_fp64(inf).item<double>()));
  // At one thread and at two: the same bits.
  const auto x = torch::randn({65536 * 5 + 3});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const double one = squared_sum_fp64(x).item<double>();
  at::set_num_threads(2);
  const double two = squared_sum_fp64(x).item<double>();
  at::set_num_threads(threads);
  EXPECT_EQ(one, two);
}

TEST(FusedKernels, ChunkedLinearCrossEntropyEqualsLinearThenCrossEntropy) {
  torch::manual_seed(11);
  const int64_t rows = 37, hidden = 24, vocab = 101;
  const auto h0 = torch::randn({rows, hidden});
  const auto w0 = torch::randn({vocab, hidden}) * 0.3;
  auto targets = torch::randint(0, vocab, {rows}, torch::kLong);
  targets.index_put_({torch::tensor({0, 5, 36})}, -100);
  const auto reference = [&](torch::Dtype dtype) {
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const auto logits = torch::nn::functional::linear(h.to(dtype), w.to(dtype)).to(torch::kFloat32);
    const auto per_row = torch::nn::functional::cross_entropy(
        logits, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone).ignore_index(-100));
    const auto loss = per_row.sum();
    (loss * 3.0).backward();
    return std::tuple{loss.detach(), per_row.detach(), h.grad(), w.grad()};
  };
  for (const int64_t chunk : {int64_t{8}, int64_t{0}}) {  // 5 chunks (the last of 5 rows), or one
    const auto [loss, per_row, grad_h, grad_w] = reference(torch::kFloat32);
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    torch::Tensor rows_out;
    const auto fused = linear_cross_entropy_sum(h, w, targets, torch::kFloat32, -100, nullptr, chunk);
    (fused * 3.0).backward();
    EXPECT_EQ(fused.scalar_type(), torch::kFloat32);
    EXPECT_NEAR(fused.item<double>(), loss.item<double>(), 1e-5 * loss.item<double>()) << chunk;
    EXPECT_TRUE(torch::allclose(h.grad(), grad_h, 1e-5, 1e-6)) << chunk;
    EXPECT_TRUE(torch::allclose(w.grad(), grad_w, 1e-5, 1e-6)) << chunk;
    EXPECT_EQ(h.grad().select(0, 5).abs().sum().item<double>(), 0.0);  // an ignored row: no gradient
    {
      torch::NoGradGuard no_grad;
      const auto value = linear_cross_entropy_sum(h0, w0, targets, torch::kFloat32, -100, &rows_out, chunk);
      EXPECT_NEAR(value.item<double>(), loss.item<double>(), 1e-5 * loss.item<double>());
      EXPECT_TRUE(torch::allclose(rows_out, per_row, 1e-5, 1e-6));
      EXPECT_EQ(rows_out[36].item<double>(), 0.0);
    }
  }
  {  // a frozen head: h's gradient alone
    auto h = h0.clone().requires_grad_(true);
    linear_cross_entropy_sum(h, w0, targets, torch::kFloat32, -100, nullptr, 8).backward();
    const auto [loss, per_row, grad_h, grad_w] = reference(torch::kFloat32);
    EXPECT_TRUE(torch::allclose(h.grad() * 3.0, grad_h, 1e-5, 1e-6));
  }
  {  // bf16 compute: within bf16 rounding of the bf16 reference
    const auto [loss, per_row, grad_h, grad_w] = reference(torch::kBFloat16);
    auto h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const auto fused = linear_cross_entropy_sum(h, w, targets, torch::kBFloat16, -100, nullptr, 8);
    (fused * 3.0).backward();
    EXPECT_NEAR(fused.item<double>(), loss.item<double>(), 1e-3 * loss.item<double>());
    EXPECT_TRUE(torch::allclose(h.grad(), grad_h, 2e-2, 2e-2));
    EXPECT_EQ(w.grad().scalar_type(), torch::kFloat32);
    EXPECT_TRUE(torch::allclose(w.grad(), grad_w, 2e-2, 2e-2));
  }
  EXPECT_THROW(linear_cross_entropy_sum(h0, w0.narrow(1, 0, 8), targets, torch::kFloat32, -100), Error);
  EXPECT_THROW(linear_cross_entropy_sum(h0, w0, targets.narrow(0, 0, 5), torch::kFloat32, -100), Error);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(128256), 512);  // 256 MiB of fp32 logits per chunk
  EXPECT_EQ(linear_cross_entropy_chunk_rows(49152), 1360);
}

// Appends each layer's LoRA A and B gradients to `out` and clears them.
void take_adapter_grads(const std::vector<LinearImpl*>& layers, std::vector<torch::Tensor>& out) {
  for (auto* layer : layers) {
    auto* lora = layer->adapter_as<LoraAdapter>();
    for (auto* factor : {&lora->A->weight, &lora->B->weight}) {
      out.push_back(factor->grad().clone());
      factor->mutable_grad() = torch::Tensor();
    }
  }
}

// lora_linear (frozen bases, plain LoRA adapters: one node for a group of layers reading the same
// x) against each layer's x W^T + s (x A^T) B^T composed of ATen ops: the output, and the
// gradients of x and of every A and B, for a group of three (the middle one without an adapter)
// and one layer alone (LinearImpl::forward), in fp32 and bf16; where it does not apply (dropout in
// training, an AdaLoRA adapter, a trained base) the layers take the composed path.
TEST(FusedKernels, LoraLinearEqualsEachLayersProductsComposed) {
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    torch::manual_seed(8);
    Linear q(16, 5), k(16, 3), v(16, 4);
    for (auto* layer : {q.get(), k.get(), v.get()}) {
      torch::nn::init::normal_(layer->weight);
      layer->set_compute_dtype(dtype);
    }
    q->add_lora(LoraSpec{2, 4.0, 0.0}, 1);
    v->add_lora(LoraSpec{3, 6.0, 0.0}, 2);
    k->weight.set_requires_grad(false);
    {
      torch::NoGradGuard no_grad;
      q->adapter_as<LoraAdapter>()->B->weight.normal_();
      v->adapter_as<LoraAdapter>()->B->weight.normal_();
    }
    const std::vector<LinearImpl*> group{q.get(), k.get(), v.get()};
    ASSERT_TRUE(lora_linear_applies(group));
    const auto x0 = torch::randn({2, 4, 16});
    const auto probe = torch::randn({2, 4, 12});
    const auto composed = [&](const torch::Tensor& x) {
      std::vector<torch::Tensor> parts;
      for (auto* layer : group) {
        const auto xd = x.to(dtype);
        auto y = torch::nn::functional::linear(xd, layer->weight.to(dtype));
        if (auto* lora = layer->adapter_as<LoraAdapter>()) {
          y = y + torch::nn::functional::linear(torch::nn::functional::linear(xd, lora->A->weight.to(dtype)),
                                                lora->B->weight.to(dtype)) * lora->scale();
        }
        parts.push_back(y);
      }
      return torch::cat(parts, -1);
    };
    const auto run = [&](bool fused) {
      auto x = x0.clone().requires_grad_(true);
      const auto y = fused ? lora_linear(x, group) : composed(x);
      (y.to(torch::kFloat32) * probe).sum().backward();
      std::vector<torch::Tensor> out{y.detach().to(torch::kFloat32), x.grad()};
      take_adapter_grads({q.get(), v.get()}, out);
      return out;
    };
    const auto expected = run(false), got = run(true);
    const double tolerance = dtype == torch::kFloat32 ? 1e-5 : 3e-2;
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), expected[i].scalar_type()) << i;
      EXPECT_TRUE(torch::allclose(got[i], expected[i], tolerance, tolerance)) << i << " " << c10::toString(dtype);
    }
    // One layer through its own forward equals the composed products too.
    EXPECT_TRUE(torch::allclose(v(x0).to(torch::kFloat32), composed(x0).narrow(-1, 8, 4).to(torch::kFloat32),
                                tolerance, tolerance));
  }
  Linear trained(8, 4), ada(8, 4);
  trained->add_lora(LoraSpec{2, 4.0, 0.0}, 1);
  trained->weight.set_requires_grad(true);
  ada->add_adalora(LoraSpec{2, 4.0, 0.0}, 1);
  EXPECT_FALSE(lora_linear_applies({trained.get()}));
  EXPECT_FALSE(lora_linear_applies({ada.get()}));
}

// LoRA dropout inside lora_linear: the same masks as each adapter's fused_dropout from the same
// generator state (the seeds drawn in layer order), so the same output and the same gradients of
// x, A and B; the masks are drawn again in backward, and evaluation drops nothing.
TEST(FusedKernels, LoraLinearDropsOutAsEachAdaptersDropout) {
  // 16: the complement kernels' one-register path; alone: one adapter
  for (const auto& [rank, alone] : std::vector<std::pair<int64_t, bool>>{{3, false}, {16, false}, {16, true}}) {
    SCOPED_TRACE("rank " + std::to_string(rank) + (alone ? ", one layer" : ", two layers"));
    torch::manual_seed(9);
    Linear q(16, 6), v(16, 5);
    for (auto* layer : {q.get(), v.get()}) {
      torch::nn::init::normal_(layer->weight);
      layer->add_lora(LoraSpec{rank, 6.0, 0.25}, 3);
      torch::NoGradGuard no_grad;
      layer->adapter_as<LoraAdapter>()->B->weight.normal_();
    }
    const auto group = alone ? std::vector<LinearImpl*>{q.get()} : std::vector<LinearImpl*>{q.get(), v.get()};
    ASSERT_TRUE(lora_linear_applies(group));
    const auto x0 = torch::randn({3, 5, 16});
    const auto probe = torch::randn({3, 5, alone ? 6 : 11});
    const auto run = [&](bool fused) {
      torch::manual_seed(21);  // the dropout seeds' generator
      auto x = x0.clone().requires_grad_(true);
      torch::Tensor y;
      if (fused) {
        y = lora_linear(x, group);
      } else {
        std::vector<torch::Tensor> parts;
        for (auto* layer : group) {
          auto* lora = layer->adapter_as<LoraAdapter>();
          const auto dropped = fused_dropout(x, 0.25);
          parts.push_back(torch::nn::functional::linear(x, layer->weight) +
                          torch::nn::functional::linear(torch::nn::functional::linear(dropped, lora->A->weight),
                                                        lora->B->weight) *
                              lora->scale());
        }
        y = torch::cat(parts, -1);
      }
      (y * probe).sum().backward();
      std::vector<torch::Tensor> out{y.detach(), x.grad()};
      take_adapter_grads(group, out);
      return out;
    };
    const auto expected = run(false), got = run(true);
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_TRUE(torch::allclose(got[i], expected[i], 1e-5, 1e-5)) << i;
    q->eval();
    v->eval();
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> parts;
    for (auto* layer : group) {
      auto* lora = layer->adapter_as<LoraAdapter>();
      parts.push_back(torch::nn::functional::linear(x0, layer->weight) +
                      torch::nn::functional::linear(torch::nn::functional::linear(x0, lora->A->weight), lora->B->weight) *
                          lora->scale());
    }
    const auto kept = lora_linear(x0, group);
    EXPECT_TRUE(torch::allclose(kept, torch::cat(parts, -1), 1e-5, 1e-5));  // nothing dropped
    EXPECT_FALSE(torch::allclose(kept, expected[0], 1e-3, 1e-3));            // training dropped some
  }
}

// x's gradient through dropped-out adapters in one pass on AMX (add_kept_products_): each adapter's
// v A over A rounded to bf16, 0 where its mask drops the element, added in fp32 and rounded once;
// four adapters (two passes: three, then one), ranks 16 and 32, rows not a multiple of 16 (the
// last 6 without tiles). Where it does not apply (fp32, a width not a multiple of 16) it returns
// false and changes nothing; on a CPU without AMX-BF16 it never applies.
TEST(FusedKernels, KeptProductsAreEachAdaptersMaskedProductOnAmx) {
  torch::manual_seed(13);
  const int64_t rows = 150, cols = 144;
  const std::vector<int64_t> ranks{16, 32, 16, 16};
  const std::vector<double> ps{0.3, 0.2, 0.5, 0.1};
  const int64_t width = 16 + 32 + 16 + 16;
  const auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
  const auto wide_v = torch::randn({rows, width + 2}).to(torch::kBFloat16);
  const auto g0 = torch::randn({rows, cols}).to(torch::kBFloat16);
  std::vector<DroppedAdapter> group;
  auto expected = f64(g0);
  torch::Tensor first_pass;
  for (int64_t k = 0, column = 1; k < 4; column += ranks[k], ++k) {
    const auto mask = dropout_mask_indices(rows * cols, ps[k], 40 + k);
    auto keep = torch::ones({rows * cols}, torch::kBool);
    keep.index_fill_(0, mask.to(torch::kInt64), false);
    const auto at = torch::randn({cols, ranks[k]});
    const auto v = wide_v.narrow(1, column, ranks[k]);
    group.push_back({mask, at, v, 1.0f, torch::zeros({ranks[k], cols}), {}});
    expected += (f64(v).mm(f64(at.to(torch::kBFloat16)).t())).masked_fill(~keep.view({rows, cols}), 0);
    if (k == 2) first_pass = expected.clone();
  }
  // Where it does not apply: nothing changes.
  auto fp32 = g0.to(torch::kFloat32);
  EXPECT_FALSE(add_kept_products_(fp32, group));
  EXPECT_TRUE(torch::equal(fp32, g0.to(torch::kFloat32)));
  auto narrow_g = g0.narrow(1, 0, 40).contiguous();
  const auto narrow_before = narrow_g.clone();
  std::vector<DroppedAdapter> narrow_group{{group[0].dropped, group[0].at.narrow(0, 0, 40).contiguous(), group[0].rows, 1.0f, {}, {}}};
  EXPECT_FALSE(add_kept_products_(narrow_g, narrow_group));
  EXPECT_TRUE(torch::equal(narrow_g, narrow_before));
  auto g = g0.clone();
  if (!add_kept_products_(g, group)) {
    EXPECT_TRUE(torch::equal(g, g0));
    GTEST_SKIP() << "add_kept_products_ needs AMX-BF16 and AVX512_BF16, which this CPU lacks (or the kernel "
                    "refused the process the tiles); the dense product and dropped_backward_ serve here";
  }
  // Each pass's sum in fp32, rounded once into bf16: within a rounding of the first three adapters'
  // exact sum and one of all four (2^-8 relative each), plus the fp32 sums' own error.
  const auto err = (f64(g) - expected).abs();
  EXPECT_TRUE((err <= (first_pass.abs() + expected.abs()) * (1.0 / 256) + 1e-3).all().item<bool>())
      << err.max().item<double>();
  // The dense products corrected by dropped_backward_ (the path elsewhere) agree to bf16's rounding:
  // they round each dropped term into the sum before taking it out again, so their error is a few
  // roundings of the products (up to ~35 here: 2^-8 of it ~0.14) even where the result is small.
  auto g_dense = g0.clone();
  for (size_t k = 0; k < group.size(); ++k) g_dense.add_(group[k].rows.mm(group[k].at.t().to(torch::kBFloat16)));
  dropped_backward_(g_dense, g0, group);
  EXPECT_TRUE(torch::allclose(f64(g_dense), expected, 2e-2, 0.4)) << (f64(g_dense) - expected).abs().max().item<double>();
  EXPECT_FALSE(torch::allclose(f64(g0), expected, 2e-2, 0.4));  // the products are not negligible
  // A's gradients (kept_weight_grads_): v^T D(x) in fp32, x's dropped elements zero; 150 rows are
  // four blocks of 32 and 22 rows of the fifth (the rest zeros), 144 columns nine tiles.
  const auto x = torch::randn({rows, cols}).to(torch::kBFloat16);
  auto weights = group;
  ASSERT_TRUE(kept_weight_grads_(x, weights));
  for (size_t k = 0; k < weights.size(); ++k) {
    auto keep = torch::ones({rows * cols}, torch::kBool);
    keep.index_fill_(0, group[k].dropped.to(torch::kInt64), false);
    const auto expected_a = f64(group[k].rows).t().mm(f64(x).masked_fill(~keep.view({rows, cols}), 0));
    EXPECT_TRUE(weights[k].grad_a.scalar_type() == torch::kFloat32 &&
                torch::allclose(f64(weights[k].grad_a), expected_a, 1e-5, 1e-4)) << k;
  }
  // Two threads: the same bits.
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  auto g2 = g0.clone();
  EXPECT_TRUE(add_kept_products_(g2, group));
  auto weights2 = group;
  EXPECT_TRUE(kept_weight_grads_(x, weights2));
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(g2, g));
  for (size_t k = 0; k < weights.size(); ++k) EXPECT_TRUE(torch::equal(weights2[k].grad_a, weights[k].grad_a)) << k;
}

// The same group through its dropout in bf16 as in fp32 (which the test above holds to ATen's
// composition), to bf16's rounding: the masks are the same (the same seeds), and in bf16 x's
// gradient goes through add_kept_products_ where the CPU has AMX (width 32, rank 16; 21 rows: one
// block of tiles and 5 rows without), through the dense product and its correction elsewhere.
TEST(FusedKernels, LoraLinearDropsOutInBf16AsInFp32) {
  torch::manual_seed(10);
  Linear q(32, 24), v(32, 16);
  for (auto* layer : {q.get(), v.get()}) {
    torch::nn::init::normal_(layer->weight);
    layer->add_lora(LoraSpec{16, 32.0, 0.1}, 7);
    torch::NoGradGuard no_grad;
    layer->adapter_as<LoraAdapter>()->B->weight.normal_();
  }
  const std::vector<LinearImpl*> group{q.get(), v.get()};
  const auto x0 = torch::randn({3, 7, 32}).to(torch::kBFloat16).to(torch::kFloat32);
  const auto probe = torch::randn({3, 7, 40}).to(torch::kBFloat16).to(torch::kFloat32);
  const auto run = [&](torch::Dtype dtype) {
    for (auto* layer : group) layer->set_compute_dtype(dtype);
    for (auto* layer : group) layer->zero_grad();
    torch::manual_seed(21);
    auto x = x0.clone().requires_grad_(true);
    const auto y = lora_linear(x, group);
    (y.to(torch::kFloat32) * probe).sum().backward();
    std::vector<torch::Tensor> out{y.detach().to(torch::kFloat32), x.grad()};
    take_adapter_grads(group, out);
    return out;
  };
  const auto fp32 = run(torch::kFloat32), bf16 = run(torch::kBFloat16);
  ASSERT_EQ(fp32.size(), bf16.size());
  for (size_t i = 0; i < fp32.size(); ++i) {
    const double scale = fp32[i].abs().max().item<double>();
    EXPECT_TRUE(torch::allclose(bf16[i].to(torch::kFloat32), fp32[i], 3e-2, 3e-2 * scale)) << i;
  }
}

// Attention's causal softmax rows (the GEMM attention's blocks): against ATen's softmax over the
// masked, scaled scores and its backward, in fp32 and bf16, for widths that are whole vectors of 16
// (the masked last block) and ones that are not (lanes one by one), with two query heads' rows per
// position (position-major) and blocks that start at position 0 or further in (first > 0: the
// block's rows see every key of the earlier blocks).
TEST(FusedKernels, CausalSoftmaxRowsEqualAtensMaskedSoftmaxAndItsGradient) {
  for (const int64_t t : {16, 37, 64}) {
    for (const int64_t first : {int64_t{0}, int64_t{11}}) {
      for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
        SCOPED_TRACE("block of " + std::to_string(t) + " positions from " + std::to_string(first) + " " +
                     c10::toString(dtype));
        torch::manual_seed(t + first);
        const int64_t group = 2, width = first + t;
        const auto scores = (torch::randn({3, group * t, width}) * 4).to(dtype);
        const auto upstream = torch::randn({3, group * t, width}).to(dtype);
        const double scale = 0.3;
        // row r is the query at position first + r / group and sees keys <= it
        const auto position = torch::arange(group * t).floor_divide(group) + first;
        const auto mask = torch::arange(width).unsqueeze(0) <= position.unsqueeze(1);
        auto s = scores.to(torch::kFloat32).clone().requires_grad_(true);
        const auto expected = (s * scale).masked_fill(mask.logical_not(), -INFINITY).softmax(-1);
        (expected * upstream.to(torch::kFloat32)).sum().backward();
        auto p = scores.clone();
        causal_softmax_rows_(p, scale, group, first);
        auto dp = upstream.clone();
        causal_softmax_backward_rows_(p, dp, scale, group, first);
        const double tol = dtype == torch::kFloat32 ? 1e-5 : 1e-2;
        EXPECT_TRUE(torch::allclose(p.to(torch::kFloat32), expected.detach(), tol, tol));
        EXPECT_TRUE(torch::allclose(dp.to(torch::kFloat32), s.grad(), tol, tol));
        EXPECT_EQ(p.masked_select(mask.logical_not()).abs().sum().item<double>(), 0.0);  // nothing past the query
        EXPECT_EQ(dp.masked_select(mask.logical_not()).abs().sum().item<double>(), 0.0);
      }
    }
  }
  auto odd = torch::zeros({2, 5, 4});  // 5 rows are not whole positions of 2 heads
  EXPECT_THROW(causal_softmax_rows_(odd, 1.0, 2, 0), Error);
  auto narrow = torch::zeros({2, 4, 4});  // positions 2..5 need 6 keys
  EXPECT_THROW(causal_softmax_rows_(narrow, 1.0, 1, 2), Error);
  auto empty = torch::zeros({2, 0, 0});
  causal_softmax_rows_(empty, 1.0);  // nothing to do, and no division by the width
  causal_softmax_backward_rows_(empty, empty, 1.0);
}

// CastCache (model.cache_frozen_casts): which weights it keeps, that it stacks a group's parts in
// the compute dtype as torch::cat of their casts, hands back the same copy while they are unchanged,
// and makes it again after an in-place write or new storage.
TEST(FusedKernels, CastCacheKeepsAStackedCastUntilAPartChanges) {
  torch::manual_seed(4);
  auto q = torch::randn({5, 8}), k = torch::randn({3, 8});
  EXPECT_TRUE(CastCache::applies({q}, torch::kBFloat16));
  EXPECT_TRUE(CastCache::applies({q, k}, torch::kFloat32));              // stacked: a concatenation kept
  EXPECT_FALSE(CastCache::applies({q}, torch::kFloat32));                // already the weight itself
  EXPECT_FALSE(CastCache::applies({q.to(torch::kBFloat16)}, torch::kFloat32));  // wider than stored
  EXPECT_FALSE(CastCache::applies({q, torch::randn({3, 4})}, torch::kBFloat16));
  EXPECT_FALSE(CastCache::applies({q.clone().requires_grad_(true)}, torch::kBFloat16));  // trained
  CastCache cache;
  const auto first = cache.get({q, k}, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(first, torch::cat({q.to(torch::kBFloat16), k.to(torch::kBFloat16)})));
  EXPECT_TRUE(cache.get({q, k}, torch::kBFloat16).is_same(first));
  k.mul_(2);  // an in-place write
  const auto second = cache.get({q, k}, torch::kBFloat16);
  EXPECT_FALSE(second.is_same(first));
  EXPECT_TRUE(torch::equal(second, torch::cat({q.to(torch::kBFloat16), k.to(torch::kBFloat16)})));
  q.set_data(torch::randn({5, 8}));  // new storage in the same tensor
  EXPECT_TRUE(torch::equal(cache.get({q, k}, torch::kBFloat16).narrow(0, 0, 5), q.to(torch::kBFloat16)));
  EXPECT_FALSE(cache.get({k, q}, torch::kBFloat16).is_same(cache.get({q, k}, torch::kBFloat16)));  // another group
  cache.clear();
  EXPECT_FALSE(cache.holds());
  EXPECT_THROW(cache.get({q}, torch::kFloat32), Error);
}

TEST(FusedKernels, FusedLinearEqualsSeparateLayersWithAndWithoutLora) {
  torch::manual_seed(6);
  Linear a(8, 5), b(8, 3);
  torch::nn::init::normal_(a->weight);
  torch::nn::init::normal_(b->weight);
  const auto x = torch::randn({2, 4, 8});
  const auto separate = torch::cat({a(x), b(x)}, -1);
  EXPECT_TRUE(torch::allclose(fused_linear(x, {a.get(), b.get()}), separate, 1e-5, 1e-5));
  b->add_lora(LoraSpec{2, 4.0, 0.0}, 7);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : b->parameters()) p.add_(0.1);  // make the adapter term non-zero
  }
  const auto with_lora = torch::cat({a(x), b(x)}, -1);
  EXPECT_FALSE(torch::allclose(with_lora, separate, 1e-3, 1e-3));
  EXPECT_TRUE(torch::allclose(fused_linear(x, {a.get(), b.get()}), with_lora, 1e-5, 1e-5));
}

TEST(Rope, CachedTablesEqualFreshOnesForEachRange) {
  auto config = preset_config("tiny");
  RotaryEmbedding rope(config);
  const auto first = rope.tables(0, 8);
  const auto other = rope.tables(3, 5);  // replaces the cached range
  const auto again = rope.tables(0, 8);
  RotaryEmbedding fresh(config);
  EXPECT_TRUE(torch::equal(again.first, fresh.tables(0, 8).first));
  EXPECT_TRUE(torch::equal(again.second, first.second));
  EXPECT_TRUE(torch::equal(other.first, RotaryEmbedding(config).tables(3, 5).first));
  EXPECT_TRUE(torch::equal(other.second, first.second.narrow(0, 3, 5)));
}

}  // namespace
}  // namespace weft
