// async_pipeline.hpp - PipeDream's original asynchronous 1F1B (Narayanan et al., SOSP 2019)
// with weight stashing: the host's pipeline step where a plugin's layout asks for it
// (weft_layout.pipeline_asynchronous; gpipe.so's and pipedream.so's mode = "async").
//
// Semantics. Every training step t is one minibatch (the host's whole batch; no pipeline
// micro-batches, no gradient accumulation) and ends with the host's optimizer step on every
// stage: there is no flush. Stage p of S forwards minibatch t in step t and back-propagates
// minibatch t - (S - 1 - p) in the same step, so the last stage forwards and back-propagates
// minibatch t at once while stage 0's backward lags S - 1 steps: every stage updates its
// weights once per step, with gradients of a minibatch whose forward used weights up to S - 1
// updates old. Weight stashing makes each minibatch's backward use exactly the weights its
// forward used on that stage: the forward runs without autograd history and stashes the stage's
// trainable weights and its input; the backward writes the stashed weights into the parameters,
// recomputes the stage's forward on the stashed input with autograd, back-propagates the
// received gradient, and writes the current weights back before the optimizer step applies the
// gradient to them. (PipeDream keeps each version's activations instead; recomputing trades one
// more forward for holding no activations across steps.) During the first S - 1 - p steps stage
// p has no backward yet: its gradients are zero for those steps. Minibatches still in flight
// when training stops are never back-propagated.
//
// Transfers: activations go forward within a step; the gradient stage p + 1 produces in step t
// is received by stage p in step t + 1, through a receive stage p posts at the end of step t.
// Tags live in their own range so they never meet the synchronous schedules' (evaluation).
#ifndef WEFT_CORE_PIPELINE_ASYNC_PIPELINE_HPP
#define WEFT_CORE_PIPELINE_ASYNC_PIPELINE_HPP

#include <cstdint>
#include <map>
#include <vector>

#include "core/plugin/step/step.hpp"

#include "executor.hpp"

namespace weft {
namespace pipeline {

class AsyncPipeline {
 public:
  AsyncPipeline(const weft::sdk::Host& host, weft::sdk::Group world, const weft::pipeline::Placement& placement);

  // Step `step` (the host's 0-based step counter must advance by one per call). Returns this
  // rank's contribution to the loss: the last stage's unscaled mean loss of minibatch `step`,
  // 0 elsewhere.
  double step(int64_t step, int64_t rows, int64_t stage_tokens);

  // Minibatches forwarded and not yet back-propagated on this stage (weight versions stashed).
  size_t stashed() const { return stash_.size(); }
  // The largest stash this stage has held (PipeDream: S - p versions on stage p).
  size_t peak_stashed() const { return peak_stashed_; }
  // Evidence that stashing works, from the last step's backward (0 when there was none):
  // how far the weights had moved since the minibatch's forward (the L2 norm of the difference
  // between the stashed and the current weights: what a backward without stashing would have
  // used instead), and how far the recomputed stage output is from the output the forward sent
  // (the difference of their sums of squares: 0 when the backward really ran with the forward's
  // weights on the forward's input).
  double last_weight_staleness() const { return last_staleness_; }
  double last_recompute_difference() const { return last_recompute_difference_; }

 private:
  struct InFlight {
    weft::sdk::Activation input;          // token ids (stage 0) or the received activation
    std::vector<weft::sdk::Buffer> weights;  // the trainable parameters at forward time (on the device)
    double output_squares = 0.0;             // of the output the forward sent
  };
  int64_t delay() const { return placement_.stages - 1 - placement_.stage; }
  int32_t peer(bool next) const;
  std::vector<weft::sdk::Buffer> read_weights() const;
  void write_weights(const std::vector<weft::sdk::Buffer>& weights) const;
  double distance(const std::vector<weft::sdk::Buffer>& a, const std::vector<weft::sdk::Buffer>& b) const;
  void post_gradient_receive(int64_t minibatch, int64_t rows, int64_t stage_tokens);
  void backward(int64_t minibatch, std::vector<weft::sdk::Work>& sends);

  weft::sdk::Host host_;
  weft::sdk::Group world_;
  weft::pipeline::Placement placement_;
  std::vector<int64_t> trainable_;  // host parameter indices
  std::map<int64_t, InFlight> stash_;
  size_t peak_stashed_ = 0;
  double last_staleness_ = 0.0, last_recompute_difference_ = 0.0;
  // The posted receive of the next backward's gradient.
  int64_t gradient_minibatch_ = -1;
  weft::sdk::Buffer gradient_buffer_;
  weft::sdk::Work gradient_work_;
  weft::sdk::Activation pending_input_grad_;  // kept until its send is waited for
};

// Tags of the asynchronous schedule: above every synchronous schedule's tag.
inline int32_t async_tag(int64_t minibatch, bool gradient) {
  return (1 << 24) + 2 * static_cast<int32_t>(minibatch % (1 << 22)) + (gradient ? 1 : 0);
}

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_ASYNC_PIPELINE_HPP
