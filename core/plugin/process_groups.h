// Process groups for strategies: c10d's Gloo process group (or NCCL's, where LibTorch has it) over a
// rendezvous store (TCPStore for multi-process jobs, an in-memory HashStore for one process), plus
// sub-groups for meshes.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

#include "core/util/torch_compat.h"

namespace c10d {
class Store;
}  // namespace c10d

namespace weft {

struct ProcessGroup {
  c10::intrusive_ptr<compat::Backend> backend;      // c10d's Gloo or NCCL group; null on ranks outside
  std::vector<int32_t> world_ranks;                 // members, in group-rank order
  int32_t rank = -1;                                // this process's rank in the group, or -1
  int32_t size = 0;
  std::string name;                                 // "world", "group1", ...
};

class Communicator {
 public:
  // Joins the world group through `store` (rank, world size). Collective operations time out
  // after `timeout`. `backend`: "gloo" (CPU tensors), or "nccl" (CUDA tensors; only where LibTorch
  // was built with NCCL, see nccl_compiled(), and the process sees a CUDA device). Throws
  // weft::Error naming the problem otherwise.
  Communicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::chrono::milliseconds timeout,
               std::string backend = "gloo");
  // Whether this weft was compiled against a LibTorch with c10d's NCCL process group.
  static bool nccl_compiled();
  // A one-process world on an in-memory store.
  static std::unique_ptr<Communicator> single_process(std::chrono::milliseconds timeout);
  ~Communicator();

  ProcessGroup& world() { return *groups_.front(); }
  // Creates a sub-group from world ranks; collective over the world (every rank calls it with
  // the same list, in the same order). Ranks outside get a group with rank -1. The group lives
  // as long as the Communicator. Throws weft::Error on an invalid rank list.
  ProcessGroup& create_group(const std::vector<int32_t>& world_ranks);
  std::chrono::milliseconds timeout() const { return timeout_; }
  c10d::Store& store();  // the rendezvous store (for start-up key exchanges)
  // Every rank's `value`, in rank order. Collective over the world.
  std::vector<double> all_gather(double value);

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_size_;
  std::chrono::milliseconds timeout_;
  std::string backend_;
  std::vector<std::unique_ptr<ProcessGroup>> groups_;
};

}  // namespace weft
