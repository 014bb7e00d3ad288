// AdamW over the trainable parameters: matrices decay, vectors (norm weights) do not.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <functional>
#include <vector>

#include <torch/optim/adamw.h>

#include "core/job/options.h"

namespace weft {

std::unique_ptr<torch::optim::AdamW> make_adamw(
    const std::vector<std::pair<std::string, torch::Tensor>>& trainable, const OptimOptions& options);

// A tensor the optimizer updates: a parameter, or the shard of one that this rank keeps under a
// plugin that shards the training state (its .grad() the shard's gradient). `decay`: weight
// decay applies (the whole parameter is a matrix).
struct OptimizedTensor {
  torch::Tensor tensor;
  bool decay = false;
};
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<OptimizedTensor>& tensors,
                                                const OptimOptions& options);

// AdamW's state of `tensor` (keyed by the tensor, as the optimizer steps it), or nullptr before
// its first step (the trainer makes every tensor's before the first: materialize_adamw_state).
const torch::optim::AdamWParamState* adamw_state(torch::optim::AdamW& optimizer, const torch::Tensor& tensor);
// Replaces the state of `tensor` with these step count and moments (shaped as the tensor).
void set_adamw_state(torch::optim::AdamW& optimizer, const torch::Tensor& tensor, int64_t step, torch::Tensor exp_avg,
                     torch::Tensor exp_avg_sq);

// Gives every tensor of `optimizer` that has no state yet the state its first step would create
// (step 0, zero moments), so that the moments are allocated with the rest of the training state
// before the first step rather than at its end: there they pushed the CPU allocator's kept
// blocks over its bound, and the second step's activations were allocated and touched afresh.
void materialize_adamw_state(torch::optim::AdamW& optimizer);

// Bytes of AdamW's state tensors (the moments of every tensor that has state).
int64_t optimizer_state_bytes(torch::optim::AdamW& optimizer);

// One AdamW step of `optimizer` (the update torch::optim::AdamW::step makes). When every tensor
// with a gradient is fp32 and dense, on a CUDA device or the CPU, the whole step is
// aten::_fused_adamw_, one multi-tensor kernel per parameter group that reads and writes each
// tensor once, instead of ~10 passes per tensor (on one core of an Intel Xeon, 135M parameters:
// 0.19 s against 0.60 s); the state it leaves (step counts, moments) is the optimizer's own, as
// the unfused step leaves it. `kernel`: kAuto as above; kFused throws weft::Error where a tensor
// is not fp32 and dense; kUnfused is torch::optim::AdamW::step (tests compare the two).
enum class AdamWKernel { kAuto, kFused, kUnfused };
void adamw_step(torch::optim::AdamW& optimizer, AdamWKernel kernel = AdamWKernel::kAuto);

// Sets the learning rate of every parameter group.
void set_learning_rate(torch::optim::AdamW& optimizer, double lr);

// Zeroes the gradients in place (keeping them defined). Optimizer::zero_grad() sets them to
// undefined, which would leave strategies without a gradient to reduce.
void zero_gradients(const std::vector<torch::Tensor>& params);

// Global L2 norm of the gradients of `params` (missing grads count as zero), divided by
// `grad_scale` (fp16's loss scale: the gradients hold scale x their values); if it is finite, the
// gradients are divided by grad_scale and, if max_norm > 0, scaled so that their norm is at most
// max_norm. Returns the unscaled norm before clipping (inf or NaN, gradients untouched, when some
// gradient is not finite). `globalize` (optional) turns this process's sum of squares into the
// sum over every process that holds a part of the model (a model-parallel plugin's
// global_grad_norm_sq).
double clip_grad_norm(const std::vector<torch::Tensor>& params, double max_norm,
                      const std::function<double(double)>& globalize = {}, double grad_scale = 1.0);

}  // namespace weft
