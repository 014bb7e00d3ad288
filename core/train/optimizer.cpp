#include "core/train/optimizer.h"

#include <cmath>

#include <torch/torch.h>

namespace weft {

std::unique_ptr<torch::optim::AdamW> make_adamw(
    const std::vector<std::pair<std::string, torch::Tensor>>& trainable, const OptimOptions& o) {
  std::vector<OptimizedTensor> tensors;
  for (const auto& [name, param] : trainable) tensors.push_back({param, param.dim() >= 2});
  return make_adamw(tensors, o);
}

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<OptimizedTensor>& tensors, const OptimOptions& o) {
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& t : tensors) (t.decay ? decay : no_decay).push_back(t.tensor);
  auto options = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(weight_decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(decay, options(o.weight_decay));
  if (!no_decay.empty()) groups.emplace_back(no_decay, options(0.0));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(o.lr));
}

int64_t optimizer_state_bytes(torch::optim::AdamW& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    const auto& adamw = static_cast<const torch::optim::AdamWParamState&>(*state);
    for (const auto* t : {&adamw.exp_avg(), &adamw.exp_avg_sq(), &adamw.max_exp_avg_sq()}) {
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

void set_learning_rate(torch::optim::AdamW& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm,
                      const std::function<double(double)>& globalize, double grad_scale) {
  torch::NoGradGuard no_grad;
  // Sums of squares in fp64, one reduction and one host sync for all tensors.
  std::vector<torch::Tensor> grads, squares;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    squares.push_back(p.grad().to(torch::kFloat64).pow(2).sum());
  }
  double sum_sq = squares.empty() ? 0.0 : torch::stack(squares).sum().item<double>();
  if (globalize) sum_sq = globalize(sum_sq);  // collective: every process calls it
  const double norm = std::sqrt(std::max(sum_sq, 0.0)) / grad_scale;  // NaN stays NaN
  if (grads.empty() || !std::isfinite(norm)) return norm;
  double factor = 1.0 / grad_scale;
  if (max_norm > 0 && norm > max_norm) factor *= max_norm / (norm + 1e-6);
  if (factor != 1.0) {
    for (auto& g : grads) g.mul_(factor);
  }
  return norm;
}

void zero_gradients(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.grad().zero_();
  }
}

}  // namespace weft
