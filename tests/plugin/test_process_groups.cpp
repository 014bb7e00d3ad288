// The host's process groups: the TCPStore rendezvous with and without libuv, the Gloo world, and
// the NCCL backend's presence in the build and its refusals.
#include <cstdlib>
#include <future>
#include <string>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "core/plugin/process_groups.h"
#include "core/plugin/rendezvous.h"
#include "core/util/error.h"
#include "test_paths.h"

namespace weft {
namespace {

// Two ranks (threads) join one world through join_world's TCPStore and all-gather their ranks.
void two_ranks_rendezvous(int port) {
  auto join = [port](int rank) {
    DistributedEnv e;
    e.source = "torchrun";
    e.rank = rank;
    e.world = 2;
    e.master_addr = "127.0.0.1";
    e.master_port = port;
    auto communicator = join_world(e, std::chrono::seconds(60));
    return communicator->all_gather(10.0 + rank);
  };
  auto r1 = std::async(std::launch::async, join, 1);
  const auto gathered0 = join(0);
  const auto gathered1 = r1.get();
  EXPECT_EQ(gathered0, (std::vector<double>{10.0, 11.0}));
  EXPECT_EQ(gathered1, (std::vector<double>{10.0, 11.0}));
}

// The store's server is libuv's where LibTorch has it (the wheel) and the classic one otherwise;
// USE_LIBUV=0 (torchrun's switch) asks for the classic one. Both rendezvous.
TEST(Rendezvous, TwoRanksJoinWithTheDefaultStoreAndWithUseLibuvOff) {
  ::unsetenv("USE_LIBUV");
  two_ranks_rendezvous(free_local_port());
  ::setenv("USE_LIBUV", "0", 1);
  two_ranks_rendezvous(free_local_port());
  ::unsetenv("USE_LIBUV");
}

// CMake's finding (WEFT_TORCH_NCCL: LibTorch's torch_cuda carries USE_C10D_NCCL) and the code's
// (compiled with USE_C10D_NCCL) agree: against PyTorch's CUDA wheel the NCCL path is compiled
// and linked, against Debian's 1.13 it is not.
TEST(ProcessGroups, TheNcclPathIsCompiledExactlyWhereLibTorchHasIt) {
  EXPECT_EQ(Communicator::nccl_compiled(), WEFT_TEST_TORCH_NCCL);
}

TEST(ProcessGroups, NcclIsRefusedWithOneClearErrorWhereItCannotRun) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  if (!Communicator::nccl_compiled()) {
    try {
      Communicator(store, 0, 1, std::chrono::seconds(5), "nccl");
      ADD_FAILURE() << "nccl accepted by a build without it";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not in this build"), std::string::npos) << e.what();
    }
  } else if (torch::cuda::device_count() == 0) {
    try {
      Communicator(store, 0, 1, std::chrono::seconds(5), "nccl");
      ADD_FAILURE() << "nccl accepted without a CUDA device";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("needs a CUDA device"), std::string::npos) << e.what();
    }
  } else {  // a GPU machine: a one-rank NCCL world all-reduces a CUDA tensor
    Communicator communicator(store, 0, 1, std::chrono::seconds(60), "nccl");
    std::vector<at::Tensor> tensors{torch::ones({4}, torch::kCUDA)};
    communicator.world().backend->allreduce(tensors)->wait();
    EXPECT_TRUE(torch::equal(tensors[0].cpu(), torch::ones({4})));
  }
  EXPECT_THROW(Communicator(store, 0, 1, std::chrono::seconds(5), "mpi"), Error);
}

}  // namespace
}  // namespace weft
