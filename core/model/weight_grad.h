// Weight gradients computed apart from the backward pass (zero-bubble pipeline schedules: ZB-H1's
// B and W passes, Qi et al. 2023).
//
// A backward pass run under a DeferWeightGradients scope computes every input gradient and every
// parameter gradient but those of the trainable linear weights of weft::Linear (and fused_linear):
// for each such layer it keeps the layer's input and output gradient in the scope's queue instead,
// and the queue's run() later computes dW = dY^T x for them and accumulates it into the weights'
// gradients through autograd (so post-accumulation hooks fire then). Everything else (norms, the
// embedding, LoRA adapters, a tied head) gets its gradient in the backward itself. Outside a scope
// the same layers compute every gradient in their backward, as plain autograd would.
#pragma once

#include <functional>
#include <vector>

#include <torch/types.h>

namespace weft {

// The deferred weight gradients of one backward pass. Not thread-safe; one scope at a time per
// process (the host runs one backward at a time).
class WeightGradQueue {
 public:
  // Computes and accumulates every deferred gradient, in the order they were deferred, then
  // empties the queue (the kept inputs and output gradients are freed).
  void run();
  size_t size() const { return pending_.size(); }
  bool empty() const { return pending_.empty(); }
  // Bytes the queue keeps alive (inputs and output gradients).
  int64_t bytes() const { return bytes_; }

  // For the layers: defers one layer's weight gradients.
  void push(std::function<void()> compute, int64_t bytes);

 private:
  std::vector<std::function<void()>> pending_;
  int64_t bytes_ = 0;
};

// While alive, backward passes defer trainable linear weights' gradients into `queue`.
class DeferWeightGradients {
 public:
  explicit DeferWeightGradients(WeightGradQueue& queue);
  ~DeferWeightGradients();
  DeferWeightGradients(const DeferWeightGradients&) = delete;
  DeferWeightGradients& operator=(const DeferWeightGradients&) = delete;

 private:
  WeightGradQueue* previous_;
};

// x [..., in] @ cat(weights, 0)^T in `dtype` (each weight [out_i, in], cast to `dtype`), with the
// weights' gradients deferred under a DeferWeightGradients scope where `defer` is set. The weights
// are the parameters themselves (leaves), so their gradients reach them in their own dtype: on CUDA,
// an fp32 weight computing in bf16 or fp16 takes dW from a GEMM with fp32 output (fp32
// accumulation, no bf16 rounding of dW and no cast kernel after it); elsewhere dW in `dtype`, added
// into the weight's existing fp32 gradient in one pass (add_into_fp32_) for autograd's accumulator
// to adopt, or cast where the weight has no gradient yet (the same bits as autograd's cast and sum).
torch::Tensor deferrable_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& weights, torch::Dtype dtype,
                                bool defer = true);

// Whether a trainable weight's product in `dtype` goes through deferrable_linear (an fp32 weight,
// bf16 or fp16 compute, any device): its cast goes straight into the product's operand (no
// concatenation of fused weights' casts), and dW reaches the fp32 gradient without autograd's cast:
// from an fp32-output GEMM (wide_weight_grad_applies), or added into the gradient there (one
// mixed-dtype pass instead of a cast and the accumulator's addition). Also an fp32 CPU weight computing
// in fp32 while oneDNN multiplies fp32 matrices on the CPU (gemm.h): autograd's own linear would take
// ATen's products, deferrable_linear takes the process's library for all three.
bool master_weight_grad_applies(const torch::Tensor& weight, torch::Dtype dtype);

// Whether a trainable weight's product in `dtype` takes its gradient from deferrable_linear's
// fp32-output GEMM (CUDA, an fp32 weight, bf16 or fp16 compute) rather than autograd's product in
// `dtype` and a cast back to fp32.
bool wide_weight_grad_applies(const torch::Tensor& weight, torch::Dtype dtype);

}  // namespace weft
