// trainer --nproc N: runs N local ranks of this same command (TCPStore on 127.0.0.1 and a free
// port, torchrun's environment variables), and supervises them: if any rank fails, the others are
// stopped and the launcher exits non-zero naming the rank and its exit status. The ranks run in
// process groups of their own: SIGINT and SIGTERM to the launcher, or to its process group (a
// terminal's Ctrl-C, `timeout`, a scheduler), reach each rank once, passed on by the launcher; they
// stop after the same step, rank 0 saves a checkpoint, and the launcher exits 128 + the signal.
#pragma once

namespace weft {

// In the launcher: its exit status once every rank ended. In a rank: rank_process = true, and the
// caller goes on to run the command as that rank (the ranks are forks of the launcher, with
// torchrun's variables RANK, WORLD_SIZE, MASTER_ADDR, ... set in their environment).
struct LaunchResult {
  bool rank_process = false;
  int exit_code = 0;
};
// argv: the full command line, including --nproc (the ranks' when they must execute the trainer
// afresh: when this process already has threads, which a fork would copy the locks of).
LaunchResult launch_local_ranks(int nproc, int argc, char** argv);

}  // namespace weft
