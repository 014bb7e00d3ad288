#include "core/model/weight_grad.h"

#include <atomic>
#include <utility>

#include <torch/torch.h>

#include "core/util/error.h"

namespace weft {
namespace {

// The scope's queue; read on whichever thread autograd runs a layer's backward on.
std::atomic<WeightGradQueue*> active_queue{nullptr};

// dW_i = dY_i^T x for the rows of each weight (dY's columns are the weights' rows, in order),
// in the weight's own dtype.
std::vector<torch::Tensor> weight_grads(const torch::Tensor& x, const torch::Tensor& dy,
                                        const std::vector<torch::Tensor>& weights) {
  const auto x2 = x.reshape({-1, x.size(-1)});
  const auto dy2 = dy.reshape({-1, dy.size(-1)});
  std::vector<torch::Tensor> grads;
  int64_t row = 0;
  for (const auto& w : weights) {
    const int64_t rows = w.size(0);
    if (!w.requires_grad()) {
      grads.emplace_back();
    } else if (wide_weight_grad_applies(w, dy2.scalar_type())) {
      grads.push_back(at::mm(dy2.narrow(1, row, rows).t(), x2, w.scalar_type()));  // fp32 out (mm.dtype)
    } else {
      grads.push_back(dy2.narrow(1, row, rows).t().mm(x2).to(w.scalar_type()));
    }
    row += rows;
  }
  return grads;
}

class DeferrableLinear : public torch::autograd::Function<DeferrableLinear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, torch::TensorList weights,
                               torch::Dtype dtype, bool defer) {
    std::vector<torch::Tensor> cast;
    for (const auto& w : weights) cast.push_back(w.to(dtype));
    const auto w = cast.size() == 1 ? cast.front() : torch::cat(cast);
    ctx->save_for_backward({x});
    ctx->saved_data["w"] = w;
    ctx->saved_data["weights"] = weights.vec();
    ctx->saved_data["defer"] = defer;
    return torch::nn::functional::linear(x, w);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto x = ctx->get_saved_variables()[0];
    const auto w = ctx->saved_data["w"].toTensor();
    const auto weights = ctx->saved_data["weights"].toTensorVector();
    const auto& dy = grad_outputs[0];
    torch::autograd::variable_list grads;
    grads.push_back(ctx->needs_input_grad(0) ? torch::matmul(dy, w) : torch::Tensor());
    bool any = false;
    for (size_t i = 0; i < weights.size(); ++i) any = any || ctx->needs_input_grad(1 + i);
    WeightGradQueue* queue = ctx->saved_data["defer"].toBool() ? active_queue.load() : nullptr;
    if (any && queue != nullptr) {
      // W later: the same products, accumulated through autograd (views of the leaves), so the
      // parameters' post-accumulation hooks run as they would have in this backward.
      queue->push(
          [x, dy, weights] {
            const auto computed = weight_grads(x, dy, weights);
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
      const auto computed = any ? weight_grads(x, dy, weights) : std::vector<torch::Tensor>(weights.size());
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

bool wide_weight_grad_applies(const torch::Tensor& weight, torch::Dtype dtype) {
  return weight.is_cuda() && weight.requires_grad() && weight.scalar_type() == torch::kFloat32 &&
         (dtype == torch::kBFloat16 || dtype == torch::kFloat16);
}

}  // namespace weft
