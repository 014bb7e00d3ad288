// verify.hpp - checks a pipeline schedule before it runs, by simulating it.
//
// The verifier proves, for one concrete (stages, micro-batches) schedule:
//  1. Shape: one action list per stage; transfers only towards stages that exist.
//  2. Completeness: on every stage every micro-batch is forwarded exactly once and (when the
//     schedule trains) back-propagated exactly once, after its forward; the optimizer step is
//     the last action, once; a chunk's kReduce, where there is one, comes after every backward
//     (and weight pass) of that chunk; a chunk's kGather and kRelease, where there are, enclose
//     every compute of that chunk, the release after its kReduce.
//  3. Matching: every send has exactly one matching receive on the neighbouring stage (same
//     kind, same micro-batch) and vice versa; each receive is posted before the compute that
//     consumes it, and each send follows the compute that produces its data; between two stages
//     each direction's transfers are started by the sender in the order the receiver posts them
//     (NCCL's send/recv match by order, not by tag).
//  4. Progress: a dataflow simulation where sends never block and a compute waits for the data
//     of its receive runs every stage to its end (no rank waits forever); a stall is reported
//     with what each stuck stage waits for.
//  5. Memory: the number of micro-batches forwarded but not yet back-propagated on a stage never
//     exceeds Schedule::max_in_flight (counted per chunk with virtual stages); with a split
//     backward every B has one W after it and at most Schedule::max_pending_weights wait.
// With virtual stages (Schedule::chunks > 1) every check is per chunk and transfers go to the
// neighbouring virtual stage; a chunk's compute costs 1 / chunks of the stage's.
// The same simulation, with per-action costs, yields the schedule's makespan and bubble.
#ifndef WEFT_CORE_PIPELINE_VERIFY_HPP
#define WEFT_CORE_PIPELINE_VERIFY_HPP

#include <cstdint>
#include <string>
#include <vector>

#include "schedule.hpp"

namespace weft {
namespace pipeline {

// Simulated durations (arbitrary units). The default is the textbook model: backward = 2x
// forward, free transfers.
struct CostModel {
  double forward = 1.0;
  double backward = 2.0;
  double weight = 1.0;     // the part of backward that is the weights' gradients (W of a split backward)
  double transfer = 0.0;  // latency from a send to the data being usable by the receiver
};

struct Verification {
  bool ok = false;
  std::string error;                    // the first problem found (empty when ok)
  std::vector<int32_t> peak_in_flight;  // per stage
  std::vector<int32_t> peak_pending_weights;  // per stage: the most B passes waiting for their W
  double makespan = 0.0;                // simulated time of the whole step
  // Idle share of the stages over the makespan: 1 - sum(busy) / (stages * makespan).
  double bubble = 0.0;
};

Verification verify(const Schedule& schedule, const CostModel& costs = {});

// GPipe's bubble for uniform stages and free transfers: (S - 1) / (M + S - 1).
double gpipe_bubble_formula(int32_t stages, int32_t micro_batches);
// Interleaved 1F1B's with `chunks` virtual stages per stage: (S - 1) / (v M + S - 1) (the
// chunks' work is 1 / v of a stage's, so the fill and drain shrink by v).
double interleaved_bubble_formula(int32_t stages, int32_t micro_batches, int32_t chunks);
// ZB-H1's with B = W = F (M >= S): (S - 1) / (3 M + S - 1), its fill and drain (S - 1)(F + B - W)
// over 1F1B's (S - 1)(F + B + W).
double zero_bubble_h1_bubble_formula(int32_t stages, int32_t micro_batches);

}  // namespace pipeline
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_VERIFY_HPP
