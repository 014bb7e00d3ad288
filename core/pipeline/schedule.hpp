// schedule.hpp - pipeline schedules as data.
//
// A schedule is, for each pipeline stage (one rank of the pipeline), the ordered list of actions
// that rank performs in one training step over M micro-batches. A plugin gives each stage's
// compute actions (weft_schedule; gpipe.so's generators are plugins/gpipe/schedules.hpp), the host
// adds the transfers (and the reductions and gathers a composition needs), the verifier
// (verify.hpp) checks it before it runs, and the executor (executor.hpp) runs it action by action.
//
// Conventions:
//  - Pipeline stage p receives activations from p - 1 and gradients from p + 1.
//  - Virtual stages (interleaved schedules): with `chunks` = v > 1, the model is cut into S x v
//    virtual stages and stage (rank) p holds chunks c = 0..v-1, virtual stage c x S + p. Virtual
//    stage u receives activations from u - 1 and gradients from u + 1, wherever those live (the
//    last stage's chunk c sends to stage 0's chunk c + 1). Actions name their chunk; with v = 1
//    every chunk is 0 and the rule above is the plain one.
//  - RECV_* actions post an asynchronous receive; the matching FORWARD/BACKWARD waits for it.
//    Because receives are posted ahead (the executor posts every receive as early as it may),
//    the position of a RECV in the list is where it is posted, not where it completes.
//  - SEND_* actions start an asynchronous send; the executor waits for sends before the
//    optimizer step (and before reusing a buffer), never in between.
//  - Every stage ends with OPTIMIZER_STEP (the flush): the synchronous schedules here update the
//    weights once per step, after every micro-batch's backward.
#ifndef WEFT_CORE_PIPELINE_SCHEDULE_HPP
#define WEFT_CORE_PIPELINE_SCHEDULE_HPP

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <weft/plugin.h>

namespace weft {
namespace pipeline {

enum class ActionKind {
  kRecvActivation,  // from stage - 1: the input of FORWARD(micro_batch)
  kForward,         // run this stage's layers on micro_batch (the loss too on the last stage)
  kSendActivation,  // to stage + 1: the output of FORWARD(micro_batch)
  kRecvGradient,    // from stage + 1: the gradient of this stage's output for micro_batch
  kBackward,        // back-propagate micro_batch through this stage's layers
  kSendGradient,    // to stage - 1: the gradient of this stage's input for micro_batch
  kOptimizerStep,   // end of the step (gradients complete on this stage)
  // The weight-gradient half of a split backward (Schedule::split_backward, zero-bubble
  // schedules): the linear weights' gradients of micro_batch, deferred by its kBackward, which
  // then computes the input gradients only (ZB's B and W passes).
  kBackwardWeight,
  // Start the reduction of chunk's gradients over the data-parallel replicas (asynchronous: it
  // overlaps what follows and is waited for at kOptimizerStep). Placed after the action that makes
  // the chunk's gradients final on this stage (lower_reductions); micro_batch -1.
  kReduce,
  // Gather the chunk's flat-sharded parameters whole before its first compute of the step, and
  // release them (back to this rank's ranges) after its last backward and its kReduce: FSDP's
  // unshard/reshard around a pipeline stage (lower_gathers); micro_batch -1.
  kGather,
  kRelease,
};

struct Action {
  ActionKind kind;
  int32_t micro_batch;  // -1 for kOptimizerStep, kReduce, kGather and kRelease
  int32_t chunk = 0;    // which of the stage's virtual stages (0 unless Schedule::chunks > 1)
  bool operator==(const Action& other) const {
    return kind == other.kind && micro_batch == other.micro_batch && chunk == other.chunk;
  }
};

// One step of a pipeline with `stages` stages and `micro_batches` micro-batches.
struct Schedule {
  std::string name;                       // e.g. "gpipe", "1f1b"
  int32_t stages = 0;
  int32_t micro_batches = 0;
  int32_t chunks = 1;  // virtual stages per stage (interleaved schedules); see the conventions
  // Which virtual stage each chunk is: chunk_stage[p * chunks + c] for chunk c of stage p, a
  // permutation of [0, stages x chunks). Empty: the loop order, c x stages + p (Megatron's
  // interleaving); ZB-V's V shape puts chunk 1 of stage p at 2 S - 1 - p. Neighbouring virtual
  // stages may live on one stage (the V's bottom): their transfers stay on that rank.
  std::vector<int32_t> chunk_stage;
  bool trains = true;  // false: forward only (evaluation): no backward, no optimizer step
  // The most micro-batches whose forward has run but whose backward has not, on any stage, that
  // the schedule promises (GPipe: M; 1F1B: min(stages, M)). The verifier enforces it.
  int32_t max_in_flight = 0;
  // Split backward (zero-bubble schedules): every kBackward is followed, later, by the
  // micro-batch's kBackwardWeight; at most max_pending_weights of them wait on a stage (each
  // keeps its layers' inputs and output gradients). The verifier enforces both.
  bool split_backward = false;
  int32_t max_pending_weights = 0;
  std::vector<std::vector<Action>> actions;  // [stage] -> that stage's actions in order
};

// Forward-only (evaluation): every stage forwards every micro-batch in order, chunk by chunk in
// the order of their virtual stages (all micro-batches of the lowest first); no backward.
Schedule forward_only_schedule(int32_t stages, int32_t micro_batches, int32_t chunks = 1,
                               std::vector<int32_t> chunk_stage = {});

// The virtual stage of chunk `chunk` on stage `stage` (see Schedule::chunk_stage).
int32_t virtual_stage(const Schedule& schedule, int32_t stage, int32_t chunk);
// Where virtual stage `u` lives: (stage, chunk), or (-1, -1) outside [0, stages x chunks).
std::pair<int32_t, int32_t> locate(const Schedule& schedule, int32_t u);
// "" when `chunk_stage` is empty or a permutation of [0, stages x chunks) with stages x chunks
// entries; otherwise the problem, in one line.
std::string check_chunk_map(int32_t stages, int32_t chunks, const std::vector<int32_t>& chunk_stage);
// Completes a schedule whose lists hold compute actions only (kForward, kBackward,
// kBackwardWeight, kOptimizerStep) with the transfers the placement implies: each send right
// after the compute that made its data, each receive one compute action before the compute that
// consumes it, or earlier where needed so that between two stages the receives are posted in the
// order the sends start. Throws std::invalid_argument for a transfer in the lists.
void add_transfers(Schedule& schedule);

// Adds one kReduce(chunk) per chunk of every stage after the action that makes the chunk's
// gradients final (its last kBackward, or with a split backward its last kBackwardWeight) and the
// sends right after it, as PyTorch DDP starts a bucket's all-reduce once its gradients are ready. Training schedules only;
// throws std::invalid_argument for a schedule that already has kReduce actions.
void lower_reductions(Schedule& schedule);

// Adds kGather(chunk) right before the chunk's first compute and kRelease(chunk) after its last
// compute (after its kReduce where there is one), for each chunk of every stage; forward-only
// schedules too. Throws std::invalid_argument for a schedule that already has them.
void lower_gathers(Schedule& schedule);

// A training schedule of the stages' compute actions as a plugin's weft_schedule gives them
// (weft/plugin.h: FORWARD, BACKWARD or a split backward's BACKWARD_INPUT and BACKWARD_WEIGHT,
// OPTIMIZER_STEP; lists[p] is stage p's), with the transfers added (add_transfers). The plugin
// promises no bound: max_in_flight and max_pending_weights are every micro-batch of every chunk,
// and the verifier measures the peaks. Throws std::invalid_argument for another kind of action,
// whole and split backwards mixed, a list per stage missing, or what add_transfers refuses.
Schedule schedule_from_actions(std::string name, int32_t stages, int32_t micro_batches, int32_t chunks,
                               std::vector<int32_t> chunk_stage, const std::vector<std::vector<weft_action>>& lists);

// "F3", "B0", "W0" (weight gradients), "R" (reduce; "R.1" chunk 1), "G" / "X" (gather, release), "rA2" (receive activation), "sA2", "rG1", "sG1", "step"; a chunk other than 0 is
// appended: "F3.1" (micro-batch 3 on chunk 1).
std::string to_string(const Action& action);
// One line per stage: "stage 0: F0 sA0 F1 sA1 ... step".
std::string to_string(const Schedule& schedule);

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_SCHEDULE_HPP
