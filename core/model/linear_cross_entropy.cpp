#include "core/model/linear_cross_entropy.h"

#include <algorithm>
#include <atomic>

#include "core/model/gemm.h"
#include "core/model/kernels.h"
#include "core/util/error.h"

namespace weft {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Pass {
  torch::Tensor loss;       // fp32 scalar
  torch::Tensor rows;       // [N] fp32, when asked
  torch::Tensor grad_h;     // [N, H] in h's dtype, when h requires a gradient
  torch::Tensor grad_w;     // [V, H] fp32, when the weight requires one
};

// On CUDA, products of bf16 or fp16 factors for an fp32 sum: cuBLAS writes (and accumulates)
// them in fp32 itself (mm.dtype, addmm.dtype), with no cast of a half-precision product after it.
bool wide_accumulation_applies(const torch::Tensor& factor) {
  return factor.is_cuda() && (factor.scalar_type() == torch::kBFloat16 || factor.scalar_type() == torch::kFloat16);
}

// sum += a b in fp32 from half-precision a, b: one GEMM accumulating into `sum` where this
// LibTorch's addmm.dtype takes an fp32 `self` (newer ones do), else an fp32-output product added.
void accumulate_wide(torch::Tensor& sum, const torch::Tensor& a, const torch::Tensor& b) {
  static std::atomic<bool> addmm_takes_fp32_self{true};
  if (addmm_takes_fp32_self.load()) {
    try {
      at::addmm_out(sum, sum, a, b, torch::kFloat32);
      return;
    } catch (const c10::Error&) {  // this LibTorch's addmm.dtype wants self in the factors' dtype
      addmm_takes_fp32_self.store(false);
    }
  }
  sum.add_(at::mm(a, b, torch::kFloat32));
}

// The chunked pass: the loss, and the gradients of a unit loss where asked.
Pass run_chunks(const torch::Tensor& h, const torch::Tensor& weight, const torch::Tensor& targets,
                torch::Dtype compute_dtype, int64_t ignore_index, bool want_rows, bool grad_h, bool grad_w,
                int64_t chunk_rows, double grad_hint) {
  torch::NoGradGuard no_grad;
  const int64_t n = h.size(0);
  const auto w = weight.to(compute_dtype).contiguous();
  const auto hc = h.to(compute_dtype).contiguous();
  const auto t = targets.to(h.device(), torch::kLong).contiguous();
  Pass out;
  auto total = torch::zeros({}, h.options().dtype(torch::kFloat64));
  if (want_rows) out.rows = torch::zeros({n}, h.options().dtype(torch::kFloat32));
  if (grad_h) out.grad_h = torch::empty({n, h.size(1)}, h.options());
  const int64_t step = chunk_rows > 0 ? chunk_rows : linear_cross_entropy_chunk_rows(weight.size(0));
  for (int64_t start = 0; start < n; start += step) {
    const int64_t rows = std::min(step, n - start);
    const auto x = hc.narrow(0, start, rows);
    const auto target = t.narrow(0, start, rows);
    auto logits = gemm(x, w.t());
    const bool want_grad = grad_h || grad_w;
    torch::Tensor dc;  // d loss / d logits (softmax - one-hot, 0 on ignored rows) times the hint, in the compute dtype
    if (cross_entropy_rows_applies(logits)) {
      // CPU and CUDA: one kernel per row reads the logits in their dtype and overwrites them with the gradient.
      const auto loss = cross_entropy_rows(logits, target, ignore_index,
                                           want_grad ? std::optional<double>(grad_hint) : std::nullopt);
      total += loss.sum(torch::kFloat64);
      if (want_rows) out.rows.narrow(0, start, rows).copy_(loss);
      if (!want_grad) continue;
      dc = logits;
    } else {
      if (logits.scalar_type() != torch::kFloat32) logits = logits.to(torch::kFloat32);
      // log-softmax and its gradient as ATen's log_softmax and nll_loss compute them (the same
      // roundings as the whole logits' loss), in place over the chunk's logits.
      auto logp = torch::log_softmax(logits, 1);
      logits = torch::Tensor();
      const auto valid = target != ignore_index;
      const auto safe = torch::where(valid, target, torch::zeros_like(target)).unsqueeze(1);
      const auto loss = torch::where(valid, -logp.gather(1, safe).squeeze(1), torch::zeros({}, logp.options()));
      total += loss.sum(torch::kFloat64);
      if (want_rows) out.rows.narrow(0, start, rows).copy_(loss);
      if (!want_grad) continue;
      auto& d = logp;
      d.exp_();
      d.scatter_add_(1, safe, -torch::ones_like(safe, d.options()));
      const auto ignored = (~valid).nonzero().reshape({-1});
      if (ignored.numel() > 0) d.index_fill_(0, ignored, 0.0f);
      if (grad_hint != 1.0) d.mul_(grad_hint);
      dc = d.to(compute_dtype);
    }
    if (grad_h) {
      auto slice = out.grad_h.narrow(0, start, rows);  // rows of a contiguous [N, H]: contiguous
      if (slice.scalar_type() == dc.scalar_type()) {
        gemm_out(slice, dc, w);
      } else {
        slice.copy_(torch::mm(dc, w));
      }
    }
    if (grad_w) {
      // The first chunk's product is the sum so far (no zeroed [V, H] to add it to).
      if (wide_accumulation_applies(dc)) {
        if (!out.grad_w.defined()) {
          out.grad_w = at::mm(dc.t(), x, torch::kFloat32);
        } else {
          accumulate_wide(out.grad_w, dc.t(), x);
        }
      } else {
        auto part = gemm(dc.t(), x);
        if (!out.grad_w.defined()) {
          out.grad_w = part.to(torch::kFloat32);
        } else {
          out.grad_w.add_(part.to(torch::kFloat32));
        }
      }
    }
  }
  if (grad_w && !out.grad_w.defined()) out.grad_w = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
  out.loss = total.to(torch::kFloat32);
  return out;
}

class LinearCrossEntropyFunction : public torch::autograd::Function<LinearCrossEntropyFunction> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& h, const torch::Tensor& weight,
                               const torch::Tensor& targets, int64_t compute_dtype, int64_t ignore_index,
                               int64_t chunk_rows, double grad_hint) {
    auto pass = run_chunks(h, weight, targets, static_cast<torch::Dtype>(compute_dtype), ignore_index,
                           /*want_rows=*/false, h.requires_grad(), weight.requires_grad(), chunk_rows, grad_hint);
    ctx->saved_data["hint"] = grad_hint;
    ctx->save_for_backward({pass.grad_h, pass.grad_w});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return pass.loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto g = grads[0] / ctx->saved_data["hint"].toDouble();  // exactly 1 where the hint was right
    // On the CPU, a gradient of exactly 1 (the hint was right) returns the saved ones as they are.
    const bool unit = g.device().is_cpu() && g.item<double>() == 1.0;
    torch::Tensor grad_h, grad_w;
    if (saved[0].defined()) grad_h = unit ? saved[0] : saved[0] * g.to(saved[0].scalar_type());
    if (saved[1].defined()) {
      grad_w = (unit ? saved[1] : saved[1] * g.to(torch::kFloat32))
                   .to(static_cast<torch::Dtype>(ctx->saved_data["weight_dtype"].toInt()));
    }
    return {grad_h, grad_w, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

int64_t linear_cross_entropy_chunk_rows(int64_t vocab) {
  constexpr int64_t kChunkElements = int64_t{1} << 26;  // 256 MiB of fp32 logits
  const int64_t rows = kChunkElements / std::max<int64_t>(vocab, 1);
  return std::max<int64_t>(16, rows / 16 * 16);
}

torch::Tensor linear_cross_entropy_sum(const torch::Tensor& h, const torch::Tensor& weight, const torch::Tensor& targets,
                                       torch::Dtype compute_dtype, int64_t ignore_index, torch::Tensor* row_losses,
                                       int64_t chunk_rows, double grad_hint) {
  WEFT_CHECK(h.dim() == 2 && weight.dim() == 2 && h.size(1) == weight.size(1),
             "linear_cross_entropy: hidden states [rows, {}] against a head of {} columns", h.size(-1),
             weight.size(-1));
  WEFT_CHECK(targets.numel() == h.size(0), "linear_cross_entropy: {} targets for {} rows", targets.numel(), h.size(0));
  const bool differentiable = torch::GradMode::is_enabled() && (h.requires_grad() || weight.requires_grad());
  if (!differentiable || row_losses != nullptr) {
    auto pass = run_chunks(h, weight, targets.reshape({-1}), compute_dtype, ignore_index, row_losses != nullptr,
                           false, false, chunk_rows, 1.0);
    if (row_losses != nullptr) *row_losses = pass.rows;
    if (!differentiable) return pass.loss;
  }
  return LinearCrossEntropyFunction::apply(h, weight, targets.reshape({-1}), static_cast<int64_t>(compute_dtype),
                                           ignore_index, chunk_rows, grad_hint);
}

}  // namespace weft
