#include "core/train/optimizer.h"

#include <cmath>

#include <map>

#include <torch/torch.h>

#include "core/model/kernels.h"
#include "core/util/error.h"

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

const torch::optim::AdamWParamState* adamw_state(torch::optim::AdamW& optimizer, const torch::Tensor& tensor) {
  auto& states = optimizer.state();
  const auto it = states.find(tensor.unsafeGetTensorImpl());
  return it == states.end() ? nullptr : static_cast<const torch::optim::AdamWParamState*>(it->second.get());
}

void set_adamw_state(torch::optim::AdamW& optimizer, const torch::Tensor& tensor, int64_t step, torch::Tensor exp_avg,
                     torch::Tensor exp_avg_sq) {
  auto state = std::make_unique<torch::optim::AdamWParamState>();
  state->step(step);
  state->exp_avg(std::move(exp_avg));
  state->exp_avg_sq(std::move(exp_avg_sq));
  optimizer.state()[tensor.unsafeGetTensorImpl()] = std::move(state);
}

void materialize_adamw_state(torch::optim::AdamW& optimizer) {
  torch::NoGradGuard no_grad;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (adamw_state(optimizer, p) != nullptr) continue;
      set_adamw_state(optimizer, p, 0, torch::zeros_like(p, torch::MemoryFormat::Preserve),
                      torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
  }
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

namespace {

// Whether every tensor of `group` with a gradient can take the fused kernel: fp32, dense, on CUDA
// or the CPU.
bool fusable(const torch::optim::OptimizerParamGroup& group) {
  bool any = false;
  for (const auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    const bool device_ok = p.is_cuda() || p.is_cpu();
    if (!device_ok || p.scalar_type() != torch::kFloat32 || p.grad().scalar_type() != torch::kFloat32 ||
        p.is_sparse() || p.grad().is_sparse()) {
      return false;
    }
    any = true;
  }
  return any;
}

// One group's step through aten::_fused_adamw_, on the optimizer's own state (step counts,
// moments), so checkpoints and optimizer_state_bytes see what the unfused step would have left.
void fused_group_step(torch::optim::AdamW& optimizer, torch::optim::OptimizerParamGroup& group) {
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
  std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  std::map<int64_t, torch::Tensor> step_tensors;  // one per distinct step count (usually one)
  for (const auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    auto& slot = optimizer.state()[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(0);
      state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      state->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      slot = std::move(state);
    }
    auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
    state.step(state.step() + 1);
    auto& step = step_tensors[state.step()];
    if (!step.defined()) step = torch::full({}, static_cast<double>(state.step()), p.options());
    params.push_back(p);
    grads.push_back(p.grad());
    exp_avgs.push_back(state.exp_avg());
    exp_avg_sqs.push_back(state.exp_avg_sq());
    steps.push_back(step);
  }
  const auto [beta1, beta2] = o.betas();
  // `steps` holds each tensor's step count after this step: the kernel reads it, as torch.optim
  // increments it first.
  at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, o.lr(), beta1, beta2,
                    o.weight_decay(), o.eps(), /*amsgrad=*/false, /*maximize=*/false);
}

}  // namespace

void adamw_step(torch::optim::AdamW& optimizer, AdamWKernel kernel) {
  torch::NoGradGuard no_grad;
  bool all_fusable = kernel != AdamWKernel::kUnfused;
  for (const auto& group : optimizer.param_groups()) {
    WEFT_CHECK(!static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad(),
               "adamw_step: amsgrad is not used by weft");
    all_fusable = all_fusable && fusable(group);
  }
  WEFT_CHECK(all_fusable || kernel != AdamWKernel::kFused,
             "adamw_step: no fused AdamW kernel for these tensors (fp32 and dense, on CUDA or the CPU)");
  if (!all_fusable) {
    optimizer.step();
    return;
  }
  for (auto& group : optimizer.param_groups()) fused_group_step(optimizer, group);
}

double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm,
                      const std::function<double(double)>& globalize, double grad_scale) {
  torch::NoGradGuard no_grad;
  // Sums of squares in fp64, one reduction and one host sync for all tensors.
  // On CUDA, one multi-tensor kernel computes every norm (fp32 accumulation per tensor).
  std::vector<torch::Tensor> grads, squares;
  bool cuda = !params.empty();
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    cuda = cuda && p.grad().is_cuda();
  }
  if (cuda && !grads.empty()) {
    for (const auto& n : at::_foreach_norm(grads, 2)) squares.push_back(n.to(torch::kFloat64).pow(2));
  } else {
    for (const auto& g : grads) squares.push_back(squared_sum_fp64(g));  // bounded fp64 copies
  }
  double sum_sq = squares.empty() ? 0.0 : torch::stack(squares).sum().item<double>();
  if (globalize) sum_sq = globalize(sum_sq);  // collective: every process calls it
  const double norm = std::sqrt(std::max(sum_sq, 0.0)) / grad_scale;  // NaN stays NaN
  if (grads.empty() || !std::isfinite(norm)) return norm;
  double factor = 1.0 / grad_scale;
  if (max_norm > 0 && norm > max_norm) factor *= max_norm / (norm + 1e-6);
  if (factor != 1.0) {
    if (cuda) {
      at::_foreach_mul_(grads, factor);
    } else {
      for (auto& g : grads) g.mul_(factor);
    }
  }
  return norm;
}

void zero_gradients(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> cuda_grads;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    if (p.grad().is_cuda()) {
      cuda_grads.push_back(p.grad());
    } else {
      p.grad().zero_();
    }
  }
  if (!cuda_grads.empty()) at::_foreach_zero_(cuda_grads);
}

}  // namespace weft
