// A rank's training step as data (ABI 2, sdk/include/weft/plugin.h): the list of actions the host
// executes, built for the run, lowered from the plugins' layout and verified before compute, as
// PyTorch's pipelining runtime executes its _Action lists.
#pragma once

#include <set>
#include <string>
#include <vector>

#include <weft/plugin.h>

namespace weft {

struct StepAction {
  weft_action_kind kind = WEFT_ACTION_FORWARD;
  int chunk = 0;
  int micro_batch = -1;  // FORWARD and BACKWARD only
  bool operator==(const StepAction& other) const {
    return kind == other.kind && chunk == other.chunk && micro_batch == other.micro_batch;
  }
};

using StepProgram = std::vector<StepAction>;

// The whole model as one chunk: F0 B0 F1 B1 ... F(M-1) B(M-1), then OPTIMIZER_STEP.
StepProgram one_chunk_program(int micro_batches);

// Inserts REDUCE(c), for every chunk c in `reduced`, right after the chunk's last BACKWARD: its
// gradients are final there, and the reduction (started during that backward) overlaps whatever
// follows. Throws weft::Error if a chunk in `reduced` has no BACKWARD.
StepProgram lower_reductions(const StepProgram& program, const std::set<int>& reduced);

// Checks the rules every executed list keeps, for `micro_batches` micro-batches of `chunks` chunks
// (chunk c+1 takes chunk c's output): each chunk's forward of each micro-batch once, chunk by chunk
// in order; each backward once, after its forward and after the next chunk's backward of the same
// micro-batch; a REDUCE(c) at most once, after every BACKWARD of c (so none follows it);
// OPTIMIZER_STEP once, last, after every backward. Throws weft::Error naming the first action (its index and describe()) that breaks
// one.
void verify_program(const StepProgram& program, int micro_batches, int chunks);

// "F0.3" (chunk 0, micro-batch 3), "B0.3", "R0", "OPT".
std::string describe(const StepAction& action);
// The list as one line: "F0.0 B0.0 F0.1 B0.1 R0 OPT".
std::string describe(const StepProgram& program);

}  // namespace weft
