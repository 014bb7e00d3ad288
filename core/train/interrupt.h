// Graceful interruption: SIGINT (Ctrl-C) and SIGTERM (Slurm preemption, `kill`) ask the training
// loop to stop after the current step, save a checkpoint and exit; a second SIGINT kills at once.
#pragma once

namespace weft {

// Installs the handlers (idempotent). Call when training starts: until then SIGINT and SIGTERM
// keep their default action and end the process at once (a rank waiting at the rendezvous has
// nothing to save and must not wait out the timeout).
void install_interrupt_handlers();
// The signal number that asked to stop, or 0.
int interrupt_signal();
// Clears a pending request (tests).
void clear_interrupt();

}  // namespace weft
