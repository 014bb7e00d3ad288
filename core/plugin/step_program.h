// A rank's training step as data (ABI 2, sdk/include/weft/plugin.h): the list of actions the host
// executes, built for the run, lowered from the plugins' layout and verified before compute, as
// PyTorch's pipelining runtime executes its _Action lists and FSDP2 unshards and reshards around a
// module.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace weft {

enum class StepKind {
  kForward,        // a chunk's forward of a micro-batch (on the last chunk, with the loss)
  kBackward,       // its backward
  kReduce,         // the chunk's gradients: started during its last backward, complete before kOptimizerStep
  kOptimizerStep,  // the host's optimizer: the step's last action
  kGather,         // the chunk's FLAT_SHARD parameters whole (waits for their all-gathers)
  kPrefetch,       // starts the chunk's all-gathers, so they run under the compute before its kGather
  kRelease,        // frees the chunk's whole parameters: each rank keeps its range
};

struct StepAction {
  StepKind kind = StepKind::kForward;
  int chunk = 0;
  int micro_batch = -1;  // kForward and kBackward only
  bool operator==(const StepAction& other) const {
    return kind == other.kind && chunk == other.chunk && micro_batch == other.micro_batch;
  }
};

using StepProgram = std::vector<StepAction>;

// What a program is checked against: `micro_batches` micro-batches through `chunks` chunks (chunk
// c+1 takes chunk c's output); chunks below `first_trained` have no backward (a frozen embedding);
// `sharded`: the chunks' parameters are FLAT_SHARD, whole only between a kGather and a kRelease.
struct ProgramShape {
  int micro_batches = 1;
  int chunks = 1;
  int first_trained = 0;
  bool sharded = false;
};

// The whole model as one chunk: F0 B0 F1 B1 ... F(M-1) B(M-1), then OPTIMIZER_STEP.
StepProgram one_chunk_program(int micro_batches);

// Parameters FLAT_SHARD without a pipeline (FSDP's full sharding): each model stage a chunk, gathered
// before its forward and released after it, then gathered again for its backward, micro-batch by
// micro-batch; the next chunk's all-gathers start (kPrefetch) before the current one computes. A
// chunk released and gathered again with nothing between (chunk 0 from one micro-batch's backward
// to the next one's forward) stays whole instead.
// The last chunk stays whole from its forward through its backward; with `tied` embeddings chunk 0
// stays whole through the step (the head uses it); with `keep_after_forward` every chunk stays
// whole from its forward to its backward. Chunks below `shape.first_trained` are released after the
// forward and not gathered for a backward.
StepProgram sharded_program(const ProgramShape& shape, bool tied, bool keep_after_forward);

// Inserts REDUCE(c), for every chunk c in `reduced`, right after the chunk's last BACKWARD: its
// gradients are final there, and the reduction (started during that backward) overlaps whatever
// follows. Throws weft::Error if a chunk in `reduced` has no BACKWARD.
StepProgram lower_reductions(const StepProgram& program, const std::set<int>& reduced);

// Checks the rules every executed list keeps: each chunk's forward of each micro-batch once, chunk
// by chunk in order; each backward (of chunks from shape.first_trained) once, after its forward and
// after the next chunk's backward of the same micro-batch; a REDUCE(c) at most once, after every
// BACKWARD of c (so none follows it); OPTIMIZER_STEP once, last, after every backward. Sharded, a
// chunk computes only while whole (between its GATHER and its RELEASE); a GATHER of a whole chunk,
// a PREFETCH of one whole or under way, a RELEASE of one not whole are errors, and nothing is whole
// or under way at OPTIMIZER_STEP. Throws weft::Error naming the first action (its index and
// describe()) that breaks one.
void verify_program(const StepProgram& program, const ProgramShape& shape);

// "F0.3" (chunk 0, micro-batch 3), "B0.3", "R0", "G2", "P2", "X2", "OPT".
std::string describe(const StepAction& action);
// The list as one line: "F0.0 B0.0 F0.1 B0.1 R0 OPT".
std::string describe(const StepProgram& program);

}  // namespace weft
