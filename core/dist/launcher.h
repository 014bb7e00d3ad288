// trainer --nproc N: runs N local ranks of this same command (TCPStore on 127.0.0.1 and a free
// port, torchrun's environment variables), and supervises them: if any rank fails, the others are
// stopped and the launcher exits non-zero naming the rank and its exit status.
#pragma once

namespace weft {

// argv: the full command line, including --nproc (which is removed for the ranks).
int launch_local_ranks(int nproc, int argc, char** argv);

}  // namespace weft
