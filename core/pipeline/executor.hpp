// executor.hpp - runs a verified pipeline schedule on this rank through the host's services.
//
// This rank is pipeline stage `stage` of `stages`, holding model stages [first, last), or with
// virtual stages (Schedule::chunks = v > 1) one range per chunk: chunk c is virtual stage
// c x stages + stage (or Placement::chunk_stage's); virtual stage 0 takes the token ids, virtual stage stages x v - 1 runs the
// loss. For each action of its list (per micro-batch and chunk):
//  - a transfer between two chunks of this rank (neighbouring virtual stages on one rank) is
//    handed over in memory, not sent;
//  - RECV_ACTIVATION / RECV_GRADIENT post an asynchronous receive into a plugin-owned fp32
//    buffer [rows, stage_tokens, hidden] (hidden states and their gradients are fp32 in every
//    precision, see weft_model_info; stage_tokens < seq_len when the plan splits sequences);
//  - FORWARD takes the micro-batch's token ids (stage 0) or waits for its received activation
//    and makes it a leaf that requires grad, runs the stage's layers (and the loss, scaled by
//    1 / micro-batches, on the last stage) and keeps input and output for the backward;
//  - SEND_ACTIVATION / SEND_GRADIENT start an asynchronous send of the output / of the input's
//    gradient; the data stays alive until the send is waited for, at the end of the step;
//  - BACKWARD back-propagates from the scaled loss (last stage) or from the output with the
//    received gradient, then releases the micro-batch's activations (its autograd graph);
//  - with a split backward (zero-bubble schedules), BACKWARD is the host's backward_input and
//    BACKWARD_WEIGHT its backward_weight on the pass that BACKWARD kept;
//  - OPTIMIZER_STEP waits for every outstanding send (the flush).
// Pipeline micro-batch k of a step is the host's micro-batch k / splits, split k % splits, so
// gradient accumulation and pipeline micro-batches compose.
#ifndef WEFT_CORE_PIPELINE_EXECUTOR_HPP
#define WEFT_CORE_PIPELINE_EXECUTOR_HPP

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "core/plugin/step/step.hpp"

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
  // How stages and replicas lie on the world's ranks: replica-major (rank = replica x stages +
  // stage, the pipeline's own replicas) or stage-major (rank = stage x replicas + replica: a
  // device mesh's, pp outside dp, as weft/common.h's weft_mesh_dim orders them).
  bool stage_major = false;
  int32_t rank_of(int32_t of_stage, int32_t of_replica) const {
    return stage_major ? of_stage * replicas + of_replica : of_replica * stages + of_stage;
  }
  int64_t first_model_stage = 0;  // model stages [first, last) held by this rank (chunk 0's)
  int64_t last_model_stage = 0;
  // Virtual stages: chunk c holds model stages [chunk_stages[c].first, chunk_stages[c].second)
  // (one entry, equal to the range above, without them).
  std::vector<std::pair<int64_t, int64_t>> chunk_stages;
  int64_t hidden_size = 0;
  // Which virtual stage each chunk of each stage is (Schedule::chunk_stage: [p * chunks + c];
  // empty: the loop order c x stages + p).
  std::vector<int32_t> chunk_stage;
  int32_t chunks() const { return chunk_stages.empty() ? 1 : static_cast<int32_t>(chunk_stages.size()); }
  int32_t virtual_stages() const { return stages * chunks(); }
  int32_t virtual_stage(int32_t of_stage, int32_t chunk) const {
    if (chunk_stage.empty()) return chunk * stages + of_stage;
    return chunk_stage.at(static_cast<size_t>(of_stage) * static_cast<size_t>(chunks()) + static_cast<size_t>(chunk));
  }
  // The stage that holds virtual stage `u`.
  int32_t stage_of(int32_t u) const {
    if (chunk_stage.empty()) return u % stages;
    for (size_t i = 0; i < chunk_stage.size(); ++i) {
      if (chunk_stage[i] == u) return static_cast<int32_t>(i) / chunks();
    }
    return -1;
  }
  bool is_first() const { return stage_of(0) == stage; }                     // holds the embedding (virtual stage 0)
  bool is_last() const { return stage_of(virtual_stages() - 1) == stage; }  // holds the head (the last virtual stage)
  bool is_first_virtual(int32_t chunk) const { return virtual_stage(stage, chunk) == 0; }
  bool is_last_virtual(int32_t chunk) const { return virtual_stage(stage, chunk) == virtual_stages() - 1; }
};

// What one run of a schedule measured on this rank.
struct RunStats {
  double loss_sum = 0.0;        // last stage: sum over micro-batches of the unscaled mean loss
  double token_loss_sum = 0.0;  // last stage: sum of value * tokens
  int64_t tokens = 0;           // last stage: target tokens
  int32_t peak_in_flight = 0;   // micro-batches forwarded and not yet back-propagated (per chunk)
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
  // `rows` is this replica's rows per host micro-batch, `stage_tokens` the tokens per row of the
  // hidden states between stages (weft_step_info.stage_tokens: this rank's share of a split sequence).
  // Training schedules scale each loss by 1 / schedule.micro_batches; forward-only ones run
  // without autograd history.
  // The host's actions of a schedule with lowered reductions and gathers (kReduce, kGather,
  // kRelease), each called with its chunk; without a split backward, `final_backward` runs right
  // before (true) and after (false) each chunk's last backward, the one whose gradients its kReduce
  // reduces (a reducer can start buckets during it).
  struct ChunkHooks {
    std::function<void(int32_t chunk)> reduce, gather, release;
    std::function<void(int32_t chunk, bool before)> final_backward;
  };
  RunStats run(const Schedule& schedule, int32_t splits, int64_t rows, int64_t stage_tokens,
               const ChunkHooks& hooks = {});

 private:
  struct Slot;  // one micro-batch's handles and buffers on one chunk of this rank
  void receive(Slot& slot, bool gradient, const Action& action);
  void forward(Slot& slot, const Action& action, const Schedule& schedule, RunStats& stats);
  void backward(Slot& slot, const Action& action, RunStats& stats);
  void send(Slot& slot, bool gradient, const Action& action);
  // The world rank of the neighbouring virtual stage of `action`'s chunk in that direction.
  int32_t peer(const Action& action, bool to_next) const;
  weft::sdk::Activation take_local(int32_t tag, const Action& action);
  // The tag of a transfer between this rank's chunk `chunk` and its neighbour in that direction.
  int32_t tag(const Action& action, bool gradient, bool to_next) const;

  weft::sdk::Host host_;
  weft::sdk::Group world_;
  Placement placement_;
  bool recompute_;
  // Per run:
  std::vector<Slot>* slots_ = nullptr;
  std::vector<weft::sdk::Work>* pending_sends_ = nullptr;
  // Transfers between two chunks of this rank (a V-shaped placement's bottom), by tag: kept, not sent.
  std::map<int32_t, weft::sdk::Activation>* local_ = nullptr;
  int32_t splits_ = 1;
  int64_t rows_ = 0, stage_tokens_ = 0;
  bool train_ = true;
  bool split_backward_ = false;  // BACKWARD computes input gradients only; BACKWARD_WEIGHT the weights'
};

// The tag of a transfer across the edge from virtual stage `edge` to `edge` + 1 (of
// `virtual_stages`): micro-batch k's activation (even) or the gradient sent back across it (odd).
inline int32_t transfer_tag(int32_t micro_batch, int32_t edge, int32_t virtual_stages, bool gradient) {
  return 2 * (micro_batch * virtual_stages + edge) + (gradient ? 1 : 0);
}

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_EXECUTOR_HPP
