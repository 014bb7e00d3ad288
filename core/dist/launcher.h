// trainer --nproc N: runs N local ranks of this same command (TCPStore on 127.0.0.1 and a free
// port, torchrun's environment variables), and supervises them: if any rank fails, the others are
// stopped and the launcher exits non-zero naming the rank and its exit status. The ranks run in
// process groups of their own: SIGINT and SIGTERM to the launcher, or to its process group (a
// terminal's Ctrl-C, `timeout`, a scheduler), reach each rank once, passed on by the launcher; they
// stop after the same step, rank 0 saves a checkpoint, and the launcher exits 128 + the signal.
//
// Across machines, as torchrun's static rendezvous: trainer --nproc N --nnodes M --node-rank R
// --master-addr HOST [--master-port P] on each of M nodes. Node 0's launcher hosts the store at
// HOST:P (P: 29500 by default), the others' launchers and every rank connect to it; node R's ranks
// are R x N ... R x N + N - 1. Each launcher supervises its own node's ranks; a rank lost on another
// node reaches them as a collective that fails or times out (train.collective_timeout_s).
#pragma once

#include <string>

namespace weft {

// In the launcher: its exit status once every rank ended. In a rank: rank_process = true, and the
// caller goes on to run the command as that rank (the ranks are forks of the launcher, with
// torchrun's variables RANK, WORLD_SIZE, MASTER_ADDR, ... set in their environment).
struct LaunchResult {
  bool rank_process = false;
  int exit_code = 0;
};
struct LaunchPlan {
  int nproc = 1;  // ranks on this node
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // nnodes > 1: node 0's address, where its launcher hosts the store
  int master_port = 29500;
};
// argv: the full command line, including --nproc (the ranks' when they must execute the trainer
// afresh: when this process already has threads, which a fork would copy the locks of).
LaunchResult launch_local_ranks(const LaunchPlan& plan, int argc, char** argv);
// The launcher's flags that a rank's command line leaves out (--nproc, --nnodes, ...), each taking
// a value.
bool is_launcher_flag(const std::string& arg);

}  // namespace weft
