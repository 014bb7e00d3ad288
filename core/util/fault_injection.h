// Fault injection for the fault tests (ctest FaultInjection.*, tools/fault_injection.py): with the
// environment variable WEFT_FAULT_INJECT = "<rank>:<point>:<n>", the process whose RANK is <rank>
// (0 when RANK is unset) kills itself with SIGKILL the <n>-th time (from 1) it reaches <point>:
//   forward     a model stage's forward while training
//   backward    that stage's backward (a hook on its output)
//   collective  an operation issued on a process group (its peers are then inside it)
//   save        a checkpoint's files written, before it is published
//   eval        an evaluation batch
//   save_local  a rank's own state of LOCAL parameters written, before rank 0 publishes the checkpoint
// A kill -9 at a point that tests can name, as a real crash would come. Without the variable (every
// real run) a point costs one test of a flag read once.
#pragma once

namespace weft {

// Whether WEFT_FAULT_INJECT names a point for this process (read once; a malformed value is an
// error naming it).
bool fault_injection_armed();

// Counts a visit of `point`; SIGKILL when it is the armed one's n-th.
void fault_point(const char* point);

}  // namespace weft
