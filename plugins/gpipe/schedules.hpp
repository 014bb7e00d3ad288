// The schedules gpipe.so (and pipedream.so) return as data: for each rank of a pipeline, the
// compute actions of one training step in order, as weft_schedule gives them (weft/plugin.h):
// FORWARD, BACKWARD (or a split backward's BACKWARD_INPUT and BACKWARD_WEIGHT) and a final
// OPTIMIZER_STEP, each naming its chunk (virtual stage of the rank) and micro-batch. The host adds
// the sends and receives, verifies the lists and runs them. Chunk c of rank p is virtual stage
// c x stages + p (Megatron's interleaving). New schedules are new generators.
#ifndef WEFT_PLUGINS_GPIPE_SCHEDULES_HPP
#define WEFT_PLUGINS_GPIPE_SCHEDULES_HPP

#include <cstdint>
#include <string>
#include <vector>

#include <weft/plugin.h>

namespace gpipe {

using Actions = std::vector<weft_action>;  // one rank's step

// GPipe (fill-drain): all forwards, then all backwards in reverse micro-batch order.
std::vector<Actions> gpipe_schedule(int32_t stages, int32_t micro_batches);

// 1F1B with a flush (PipeDream-Flush / DAPPLE): stage p runs min(stages - p - 1, M) warm-up
// forwards, then alternates one forward and one backward, then drains the remaining backwards.
// Same gradients as GPipe; at most min(stages - p, M) micro-batches in flight on stage p.
std::vector<Actions> one_f_one_b_schedule(int32_t stages, int32_t micro_batches);

// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline): each stage holds
// `chunks` virtual stages; micro-batches go through the chunks in groups of S (forward k on stage p
// is chunk (k / S) mod v of micro-batch (k / (S v)) S + k mod S; backwards walk the chunks in
// reverse), after min(2 (S - p - 1) + (v - 1) S, M v) warm-up forwards (all of them when M = S),
// one forward and one backward alternate. The bubble shrinks by v against 1F1B's for the same M;
// stage 0 keeps up to 2 (S - 1) + (v - 1) S + 1 chunk activations. Needs M divisible by S.
std::vector<Actions> interleaved_one_f_one_b_schedule(int32_t stages, int32_t micro_batches, int32_t chunks);

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into
// B (input gradients, on the critical path) and W (weight gradients, deferred to fill the bubbles).
// The order is a list schedule of the textbook cost model (F = B = W, free transfers): a free
// stage runs a ready B first, else the next F while fewer than min(S - p, M) micro-batches are
// between F and B (1F1B's bound) and fewer than min(S, M) wait for their W, else its oldest W. Its
// simulated bubble is (S - 1) / (3 M + S - 1) for M >= S, a third of 1F1B's (S - 1) / (M + S - 1) in
// the same time units, at 1F1B's activations plus at most S micro-batches' weight-gradient inputs.
std::vector<Actions> zero_bubble_h1_schedule(int32_t stages, int32_t micro_batches);

// The schedule called `name` ("gpipe", "1f1b", "interleaved1f1b", "zbh1") with `chunks` virtual
// stages per stage (1 for all but interleaved1f1b); throws std::invalid_argument for another
// name, stages < 1, micro_batches < 1, chunks < 1, or chunks > 1 with a schedule of one chunk.
std::vector<Actions> make_schedule(const std::string& name, int32_t stages, int32_t micro_batches, int32_t chunks = 1);

}  // namespace gpipe

#endif  // WEFT_PLUGINS_GPIPE_SCHEDULES_HPP
