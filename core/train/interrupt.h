// Graceful interruption: SIGINT (Ctrl-C) and SIGTERM (Slurm preemption, `kill`) ask the training
// loop to stop after the current step, save a checkpoint and exit; a second SIGINT kills at once.
#pragma once

namespace weft {

// Installs the handlers (idempotent). Call once before training.
void install_interrupt_handlers();
// The signal number that asked to stop, or 0.
int interrupt_signal();
// Clears a pending request (tests).
void clear_interrupt();

}  // namespace weft
