#include "core/model/weight_grad.h"

#include <atomic>
#include <utility>

#include <torch/torch.h>

#include "core/model/gemm.h"
#include "core/model/kernels.h"
#include "core/util/error.h"

namespace weft {
namespace {

// The scope's queue; read on whichever thread autograd runs a layer's backward on.
std::atomic<WeightGradQueue*> active_queue{nullptr};

// dW added into the weight's fp32 gradient where one is there (gradients stay defined between
// steps, zeroed: zero_gradients), in one mixed-dtype pass instead of a cast to fp32 and autograd's
// accumulator adding that; the sum goes back to the accumulator with the weight's gradient unset, and
// the accumulator adopts it (the same storage), so its post-accumulation hooks run as before.
// Elsewhere (no gradient yet, or a shape or dtype the gradient does not have) dW cast.
torch::Tensor into_master_gradient(const torch::Tensor& w, const torch::Tensor& dw) {
  const auto& sum = w.grad();
  if (!torch::GradMode::is_enabled() && sum.defined() && sum.scalar_type() == w.scalar_type() &&
      sum.device() == dw.device() && sum.sizes() == dw.sizes() && sum.is_contiguous() && !sum.is_sparse()) {
    auto adopted = sum;
    w.mutable_grad() = torch::Tensor();
    add_into_fp32_(adopted, dw);
    return adopted;
  }
  return dw.to(w.scalar_type());
}

// dW_i = dY_i^T x for the rows of each weight (dY's columns are the weights' rows, in order; `rows`
// their counts, as the forward saw them), in the weight's own dtype. `into_gradients`: added into
// the weights' existing gradients (into_master_gradient) and returned for autograd to adopt.
std::vector<torch::Tensor> weight_grads(const torch::Tensor& x, const torch::Tensor& dy,
                                        const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& rows,
                                        bool into_gradients) {
  const auto x2 = x.reshape({-1, x.size(-1)});
  const auto dy2 = dy.reshape({-1, dy.size(-1)});
  // Where every weight is wider than dY and takes dW in dY's dtype (then added or cast), one product
  // for all of them, each weight's rows of it contiguous: narrow ones (k_proj's, v_proj's) ran ~10%
  // slower alone on an AMD Zen 4 core.
  // So too for fp32 weights whose products oneDNN takes (gemm.h), which takes no narrowed dY^T (those
  // would go to ATen): their gradients are then row blocks (views) of the one product.
  bool joint = weights.size() > 1;
  for (const auto& w : weights) {
    joint = joint && w.requires_grad() &&
            ((w.scalar_type() != dy2.scalar_type() && !wide_weight_grad_applies(w, dy2.scalar_type())) ||
             (w.scalar_type() == dy2.scalar_type() && onednn_takes(dy2.t(), x2)));
  }
  const auto all = joint ? gemm(dy2.t(), x2) : torch::Tensor();
  std::vector<torch::Tensor> grads;
  int64_t row = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    const auto dy_rows = dy2.narrow(1, row, rows[i]).t();
    const auto product = [&] { return joint ? all.narrow(0, row, rows[i]) : gemm(dy_rows, x2); };
    if (!w.requires_grad()) {
      grads.emplace_back();
    } else if (wide_weight_grad_applies(w, dy2.scalar_type())) {
      grads.push_back(at::mm(dy_rows, x2, w.scalar_type()));  // fp32 out (mm.dtype)
    } else if (into_gradients && w.scalar_type() != dy2.scalar_type()) {
      grads.push_back(into_master_gradient(w, product()));
    } else {
      grads.push_back(product().to(w.scalar_type()));
    }
    row += rows[i];
  }
  return grads;
}

class DeferrableLinear : public torch::autograd::Function<DeferrableLinear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, torch::TensorList weights,
                               torch::Dtype dtype, bool defer) {
    // Each weight cast into its rows of the product's operand (no concatenation after the casts).
    std::vector<int64_t> rows;
    int64_t total = 0;
    for (const auto& w : weights) {
      rows.push_back(w.size(0));
      total += w.size(0);
    }
    torch::Tensor w;
    if (weights.size() == 1) {
      w = weights[0].to(dtype);
    } else {
      w = torch::empty({total, weights[0].size(1)}, weights[0].options().dtype(dtype).requires_grad(false));
      int64_t row = 0;
      for (size_t i = 0; i < weights.size(); ++i) {
        w.narrow(0, row, rows[i]).copy_(weights[i]);
        row += rows[i];
      }
    }
    ctx->save_for_backward({x});
    ctx->saved_data["w"] = w;
    ctx->saved_data["weights"] = weights.vec();
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["defer"] = defer;
    const auto x2 = x.reshape({-1, x.size(-1)});
    if (!onednn_takes(x2, w.t())) return torch::nn::functional::linear(x, w);
    auto shape = x.sizes().vec();
    shape.back() = w.size(0);
    auto y = torch::empty(shape, x.options());  // the output itself, not a view of the product
    gemm_out(y.view({-1, w.size(0)}), x2, w.t());
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto x = ctx->get_saved_variables()[0];
    const auto w = ctx->saved_data["w"].toTensor();
    const auto weights = ctx->saved_data["weights"].toTensorVector();
    const auto rows = ctx->saved_data["rows"].toIntVector();
    const auto& dy = grad_outputs[0];
    torch::autograd::variable_list grads;
    if (!ctx->needs_input_grad(0)) {
      grads.emplace_back();
    } else if (const auto dy2 = dy.reshape({-1, dy.size(-1)}); onednn_takes(dy2, w)) {
      auto shape = dy.sizes().vec();
      shape.back() = w.size(1);
      grads.push_back(gemm(dy2, w).view(shape));
    } else {
      grads.push_back(torch::matmul(dy, w));
    }
    bool any = false;
    for (size_t i = 0; i < weights.size(); ++i) any = any || ctx->needs_input_grad(1 + i);
    WeightGradQueue* queue = ctx->saved_data["defer"].toBool() ? active_queue.load() : nullptr;
    if (any && queue != nullptr) {
      // W later: the same products, accumulated through autograd (views of the leaves), so the
      // parameters' post-accumulation hooks run as they would have in this backward.
      queue->push(
          [x, dy, weights, rows] {
            // The products outside autograd (the queue runs with gradients on), as in the backward:
            // their operands, which autograd tracks, would keep them off oneDNN (gemm.h) and record a graph.
            const auto computed = [&] {
              torch::NoGradGuard no_grad;
              return weight_grads(x, dy, weights, rows, /*into_gradients=*/false);
            }();
            std::vector<torch::Tensor> outputs, values;
            for (size_t i = 0; i < weights.size(); ++i) {
              if (!computed[i].defined()) continue;
              outputs.push_back(weights[i].view_as(weights[i]));
              values.push_back(computed[i]);
            }
            if (!outputs.empty()) torch::autograd::backward(outputs, values);
          },
          static_cast<int64_t>(x.numel() * x.element_size() + dy.numel() * dy.element_size()));
      for (size_t i = 0; i < weights.size(); ++i) grads.emplace_back();
    } else {
      const auto computed = any ? weight_grads(x, dy, weights, rows, /*into_gradients=*/true)
                                : std::vector<torch::Tensor>(weights.size());
      for (size_t i = 0; i < weights.size(); ++i) grads.push_back(ctx->needs_input_grad(1 + i) ? computed[i] : torch::Tensor());
    }
    grads.emplace_back();  // dtype
    grads.emplace_back();  // defer
    return grads;
  }
};

}  // namespace

void WeightGradQueue::push(std::function<void()> compute, int64_t bytes) {
  pending_.push_back(std::move(compute));
  bytes_ += bytes;
}

void WeightGradQueue::run() {
  auto pending = std::move(pending_);
  pending_.clear();
  bytes_ = 0;
  for (auto& compute : pending) {
    compute();
    compute = nullptr;  // frees the layer's input and output gradient as soon as it is used
  }
}

DeferWeightGradients::DeferWeightGradients(WeightGradQueue& queue) : previous_(active_queue.exchange(&queue)) {}

DeferWeightGradients::~DeferWeightGradients() { active_queue.store(previous_); }

torch::Tensor deferrable_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& weights, torch::Dtype dtype,
                                bool defer) {
  WEFT_CHECK(!weights.empty(), "deferrable_linear needs at least one weight");
  // As an ArrayRef, so that autograd counts each weight as an input (a std::vector would not be).
  return DeferrableLinear::apply(x.to(dtype), torch::TensorList(weights), dtype, defer);
}

bool master_weight_grad_applies(const torch::Tensor& weight, torch::Dtype dtype) {
  if (weight.requires_grad() && weight.scalar_type() == torch::kFloat32 && dtype == torch::kFloat32) {
    return onednn_multiplies(weight, dtype);
  }
  return weight.requires_grad() && weight.scalar_type() == torch::kFloat32 &&
         (dtype == torch::kBFloat16 || dtype == torch::kFloat16);
}

bool wide_weight_grad_applies(const torch::Tensor& weight, torch::Dtype dtype) {
  return weight.is_cuda() && weight.requires_grad() && weight.scalar_type() == torch::kFloat32 &&
         (dtype == torch::kBFloat16 || dtype == torch::kFloat16);
}

}  // namespace weft
