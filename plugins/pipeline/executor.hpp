// executor.hpp - runs a verified pipeline schedule on this rank through the host's services.
//
// This rank is pipeline stage `stage` of `stages`, holding model stages [first, last). For each
// action of its list:
//  - RECV_ACTIVATION / RECV_GRADIENT post an asynchronous receive into a plugin-owned fp32
//    buffer [rows, seq_len, hidden] (hidden states and their gradients are fp32 in every
//    precision, see weft_model_info);
//  - FORWARD takes the micro-batch's token ids (stage 0) or waits for its received activation
//    and makes it a leaf that requires grad, runs the stage's layers (and the loss, scaled by
//    1 / micro-batches, on the last stage) and keeps input and output for the backward;
//  - SEND_ACTIVATION / SEND_GRADIENT start an asynchronous send of the output / of the input's
//    gradient; the data stays alive until the send is waited for, at the end of the step;
//  - BACKWARD back-propagates from the scaled loss (last stage) or from the output with the
//    received gradient, then releases the micro-batch's activations (its autograd graph);
//  - OPTIMIZER_STEP waits for every outstanding send (the flush).
// Pipeline micro-batch k of a step is the host's micro-batch k / splits, split k % splits, so
// gradient accumulation and pipeline micro-batches compose.
#ifndef WEFT_PLUGINS_PIPELINE_EXECUTOR_HPP
#define WEFT_PLUGINS_PIPELINE_EXECUTOR_HPP

#include <cstdint>
#include <vector>

#include <weft/strategy.hpp>

#include "schedule.hpp"

namespace weft {
namespace pipeline {

// Where this rank sits. World rank = replica * stages + stage (a pipeline's ranks are
// consecutive).
struct Placement {
  int32_t stages = 1;
  int32_t stage = 0;
  int32_t replicas = 1;
  int32_t replica = 0;
  int64_t first_model_stage = 0;  // model stages [first, last) held by this rank
  int64_t last_model_stage = 0;
  int64_t hidden_size = 0;
  bool is_first() const { return stage == 0; }
  bool is_last() const { return stage == stages - 1; }
};

// What one run of a schedule measured on this rank.
struct RunStats {
  double loss_sum = 0.0;        // last stage: sum over micro-batches of the unscaled mean loss
  double token_loss_sum = 0.0;  // last stage: sum of value * tokens
  int64_t tokens = 0;           // last stage: target tokens
  int32_t peak_in_flight = 0;   // micro-batches forwarded and not yet back-propagated
  double compute_seconds = 0.0; // inside FORWARD / BACKWARD
  double wall_seconds = 0.0;    // from the first action to the end of the flush
};

class Executor {
 public:
  // `world` carries the point-to-point transfers; `recompute`: forward with
  // WEFT_FORWARD_RECOMPUTE (the host re-materialises each block's activations in backward).
  Executor(const weft::sdk::Host& host, weft::sdk::Group world, const Placement& placement, bool recompute);

  // Runs `schedule` (verified beforehand) for one step whose host micro-batches are each split
  // into `splits` pipeline micro-batches (schedule.micro_batches = host micro-batches x splits).
  // `rows` is this replica's rows per host micro-batch, `seq_len` the sequence length.
  // Training schedules scale each loss by 1 / schedule.micro_batches; forward-only ones run
  // without autograd history.
  RunStats run(const Schedule& schedule, int32_t splits, int64_t rows, int64_t seq_len);

 private:
  struct Slot;  // one micro-batch's handles and buffers on this rank
  void receive(Slot& slot, bool gradient, int32_t micro_batch);
  void forward(Slot& slot, int32_t micro_batch, const Schedule& schedule, RunStats& stats);
  void backward(Slot& slot, int32_t micro_batch, RunStats& stats);
  void send(Slot& slot, bool gradient, int32_t micro_batch);
  int32_t peer(bool to_next) const;

  weft::sdk::Host host_;
  weft::sdk::Group world_;
  Placement placement_;
  bool recompute_;
  // Per run:
  std::vector<Slot>* slots_ = nullptr;
  std::vector<weft::sdk::Work>* pending_sends_ = nullptr;
  int32_t splits_ = 1;
  int64_t rows_ = 0, seq_len_ = 0;
  bool train_ = true;
};

// The tag of a transfer: micro-batch k's activation (2k) or gradient (2k + 1).
inline int32_t transfer_tag(int32_t micro_batch, bool gradient) { return 2 * micro_batch + (gradient ? 1 : 0); }

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_PLUGINS_PIPELINE_EXECUTOR_HPP
