// trainer --nproc N: runs N local ranks of this same command (TCPStore on 127.0.0.1 and a free
// port, torchrun's environment variables), and supervises them: if any rank fails, the others are
// stopped and the launcher exits non-zero naming the rank and its exit status. The ranks run in
// process groups of their own: SIGINT and SIGTERM to the launcher, or to its process group (a
// terminal's Ctrl-C, `timeout`, a scheduler), reach each rank once, passed on by the launcher; they
// stop after the same step, rank 0 saves a checkpoint, and the launcher exits 128 + the signal.
#pragma once

namespace weft {

// argv: the full command line, including --nproc (which is removed for the ranks).
int launch_local_ranks(int nproc, int argc, char** argv);

}  // namespace weft
