// Joining a multi-process job: the torchrun and Slurm environment conventions, c10d's TCPStore
// rendezvous, and the start-up check that every rank runs the same plugin build and config.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class Store;
}  // namespace c10d

namespace weft {

class Communicator;
struct GlooNetwork;

struct DistributedEnv {
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single";  // "single", "torchrun" (also trainer --nproc) or "slurm"
  // The rendezvous store is hosted by the launcher (torchrun's agent, trainer --nproc), not by
  // rank 0: every rank connects as a client (TORCHELASTIC_USE_AGENT_STORE=True).
  bool agent_store = false;
  // The job has ranks on more than one node: torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE, or
  // Slurm's SLURM_NNODES above 1.
  bool spans_nodes = false;
  // Ranks per node where every node has as many (torchrun's LOCAL_WORLD_SIZE; Slurm's tasks over
  // SLURM_NNODES when they divide evenly), numbered node by node as torchrun and Slurm's block
  // distribution number them; 0 where unknown.
  int local_world = 1;
};

// Reads the environment:
//  - torchrun / trainer --nproc: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
//    TORCHELASTIC_USE_AGENT_STORE;
//  - Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, with MASTER_ADDR (required when
//    SLURM_NTASKS > 1: e.g. the first host of SLURM_JOB_NODELIST) and MASTER_PORT (default 29500);
//  - neither: one process.
// Partial or invalid values are a weft::Error naming the variable.
DistributedEnv detect_distributed_env();

// Where this rank's Gloo connections listen (the address its peers connect to):
//  - GLOO_SOCKET_IFNAME=eth0[,eth1...] (PyTorch's convention): those interfaces;
//  - MASTER_ADDR a loopback address (one node: trainer --nproc, torchrun's default): 127.0.0.1;
//  - otherwise: this node's address on the route to MASTER_ADDR (the kernel's choice of source
//    address for it; nothing is sent), so that a node with several networks uses the one its
//    peers share with the rendezvous.
// A weft::Error names the problem: an interface that does not exist, a MASTER_ADDR that does not
// resolve or has no route, or a loopback MASTER_ADDR in a job that spans nodes.
GlooNetwork gloo_network(const DistributedEnv& env);

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice), for local jobs.
int free_local_port();

// Connects to the job's TCPStore (the launcher's, or rank 0 hosts it), waits until every rank has
// arrived, and builds the world process group (Gloo on gloo_network(env)). Each rank has `timeout` to reach the store and
// the whole world to arrive; past it, a weft::Error names the rendezvous address, where it came
// from, the ranks that never arrived and train.collective_timeout_s. `backend`: Communicator's
// ("nccl" adds NCCL groups for CUDA tensors; a one-process world always has Gloo only).
std::unique_ptr<Communicator> join_world(const DistributedEnv& env, std::chrono::milliseconds timeout,
                                         const std::string& backend = "gloo");

// A TCPStore server on `host`:`port` (0: a free port the kernel picks), as a launcher hosts it
// for its ranks; `port` is set to the port it listens on.
c10::intrusive_ptr<c10d::Store> host_store(const std::string& host, int& port, std::chrono::milliseconds timeout);
// A client of the TCPStore at `host`:`port`, waiting up to `timeout` for it to listen.
c10::intrusive_ptr<c10d::Store> connect_store(const std::string& host, int port, std::chrono::milliseconds timeout);

// Every rank publishes `fingerprint` (plugin name, version, ABI, config hash) through the store;
// each then compares all of them and throws weft::Error naming the first rank that differs.
void check_same_everywhere(Communicator& communicator, const std::string& what, const std::string& fingerprint);

}  // namespace weft
