// The host's process groups: the TCPStore rendezvous with and without libuv, the Gloo world, and
// the NCCL backend's presence in the build and its refusals.
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/torch.h>

#include "core/dist/process_groups.h"
#include "core/dist/rendezvous.h"
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

// Where a rank's Gloo listens (gloo_network): GLOO_SOCKET_IFNAME's interfaces, loopback for a
// loopback MASTER_ADDR on one node, otherwise this node's address on the route to MASTER_ADDR;
// the misconfigurations that would leave ranks unable to reach each other are refused by name.
TEST(Rendezvous, GlooListensWhereThePeersCanReachIt) {
  auto env_at = [](const std::string& master, bool spans_nodes) {
    DistributedEnv e;
    e.source = "torchrun";
    e.world = 2;
    e.master_addr = master;
    e.spans_nodes = spans_nodes;
    return e;
  };
  auto error_of = [](const DistributedEnv& e) -> std::string {
    try {
      gloo_network(e);
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  ::unsetenv("GLOO_SOCKET_IFNAME");
  EXPECT_EQ(gloo_network(env_at("127.0.0.1", false)).address, "127.0.0.1");
  EXPECT_EQ(gloo_network(env_at("localhost", false)).address, "127.0.0.1");
  EXPECT_TRUE(gloo_network(env_at("127.0.0.1", false)).interfaces.empty());
  EXPECT_NE(error_of(env_at("127.0.0.1", true)).find("MASTER_ADDR '127.0.0.1' is a loopback address on this node, "
                                                     "but the job spans nodes"),
            std::string::npos);
  EXPECT_NE(error_of(env_at("no-such-host.invalid", false)).find("MASTER_ADDR 'no-such-host.invalid' does not resolve"),
            std::string::npos);
  // A non-loopback address of this machine (where it has one) routes to itself.
  ifaddrs* list = nullptr;
  ASSERT_EQ(::getifaddrs(&list), 0);
  std::string own;
  for (const ifaddrs* a = list; a && own.empty(); a = a->ifa_next) {
    if (a->ifa_addr && a->ifa_addr->sa_family == AF_INET && !(a->ifa_flags & IFF_LOOPBACK) && (a->ifa_flags & IFF_UP)) {
      char text[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
      own = text;
    }
  }
  ::freeifaddrs(list);
  if (!own.empty()) {
    EXPECT_EQ(gloo_network(env_at(own, true)).address, own);
  }

  ::setenv("GLOO_SOCKET_IFNAME", "lo", 1);
  const auto on_lo = gloo_network(env_at("10.1.2.3", false));
  EXPECT_EQ(on_lo.interfaces, std::vector<std::string>{"lo"});
  EXPECT_EQ(on_lo.describe(), "interface lo");
  EXPECT_NE(error_of(env_at("10.1.2.3", true)).find("names the loopback interface 'lo', but the job spans nodes"),
            std::string::npos);
  ::setenv("GLOO_SOCKET_IFNAME", "lo,weftnope0", 1);
  EXPECT_NE(error_of(env_at("127.0.0.1", false)).find("names 'weftnope0', which is not a network interface"),
            std::string::npos);
  ::unsetenv("GLOO_SOCKET_IFNAME");
}

// CMake's finding (WEFT_TORCH_NCCL: LibTorch's torch_cuda carries USE_C10D_NCCL) and the code's
// (compiled with USE_C10D_NCCL) agree: against PyTorch's CUDA wheel the NCCL path is compiled
// and linked, against a CPU-only LibTorch it is not.
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
  } else {  // a GPU machine (needs a GPU: the kit in tools/gpu runs it): a one-rank world all-reduces a
             // CUDA tensor over NCCL and a CPU tensor over Gloo
    Communicator communicator(store, 0, 1, std::chrono::seconds(60), "nccl");
    EXPECT_EQ(Communicator::route(communicator.world(), c10::Device(c10::kCUDA, 0)).name, "nccl");
    auto on_gpu = torch::ones({4}, torch::kCUDA), on_cpu = torch::ones({4});
    auto gpu_op = communicator.all_reduce(communicator.world(), on_gpu, c10d::ReduceOp::SUM);
    communicator.wait(gpu_op);
    auto cpu_op = communicator.all_reduce(communicator.world(), on_cpu, c10d::ReduceOp::SUM);
    communicator.wait(cpu_op);
    EXPECT_TRUE(torch::equal(on_gpu.cpu(), torch::ones({4})));
    EXPECT_TRUE(torch::equal(on_cpu, torch::ones({4})));
  }
  EXPECT_THROW(Communicator(store, 0, 1, std::chrono::seconds(5), "mpi"), Error);
}

// Every operation goes to the backend for its tensors' device: Gloo for CPU tensors; NCCL for CUDA
// tensors where the group has an NCCL backend; Gloo through a host copy where it has none. (On a
// machine without a GPU a second Gloo group stands in the NCCL slot: routing looks only at which
// slots a group has. The NCCL path itself needs a GPU: the test above, run by tools/gpu.)
TEST(ProcessGroups, EachOperationRoutesByItsTensorsDevice) {
  auto communicator = Communicator::single_process(std::chrono::seconds(5));
  ProcessGroup& world = communicator->world();
  const c10::Device cpu(c10::kCPU), gpu(c10::kCUDA, 0);
  Route route = Communicator::route(world, cpu);
  EXPECT_EQ(route.name, "gloo");
  EXPECT_EQ(route.backend, world.backend.get());
  EXPECT_FALSE(route.staged);
  route = Communicator::route(world, gpu);  // no NCCL group: Gloo, through host memory
  EXPECT_EQ(route.name, "gloo");
  EXPECT_EQ(route.backend, world.backend.get());
  EXPECT_TRUE(route.staged);
  auto stand_in = Communicator::single_process(std::chrono::seconds(5));
  world.nccl = stand_in->world().backend;
  route = Communicator::route(world, gpu);
  EXPECT_EQ(route.name, "nccl");
  EXPECT_EQ(route.backend, world.nccl.get());
  EXPECT_FALSE(route.staged);
  route = Communicator::route(world, cpu);
  EXPECT_EQ(route.name, "gloo");
  EXPECT_EQ(route.backend, world.backend.get());
  // And what each backend does with a dtype: NCCL reduces and moves bf16 and fp16 natively.
  EXPECT_TRUE(Communicator::reduces_natively("nccl", at::kBFloat16));
  EXPECT_FALSE(Communicator::reduces_natively("gloo", at::kBFloat16));
  EXPECT_FALSE(Communicator::reduces_natively("gloo", at::kHalf));
  world.nccl.reset();
  // The CPU path still reduces through the communicator (a one-rank sum is the tensor itself).
  auto values = torch::tensor({1.5f, -2.0f}).to(at::kBFloat16);
  auto operation = communicator->all_reduce(world, values, c10d::ReduceOp::SUM);
  communicator->wait(operation);
  EXPECT_TRUE(torch::equal(values.to(at::kFloat), torch::tensor({1.5f, -2.0f})));
}

// Runs `body(communicator)` on `world` ranks (threads) joined through join_world's TCPStore.
template <typename Body>
void on_ranks(int world, Body body, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const int port = free_local_port();
  // Every rank's communicator lives until every body has returned: rank 0's hosts the store, and
  // a rank still checking it after rank 0 left got "Connection reset by peer" (CI, under load).
  std::mutex mutex;
  std::condition_variable all_done;
  int finished = 0;
  auto join = [&](int rank) {
    DistributedEnv e;
    e.source = "torchrun";
    e.rank = rank;
    e.world = world;
    e.master_addr = "127.0.0.1";
    e.master_port = port;
    auto communicator = join_world(e, timeout);
    try {
      body(*communicator);
    } catch (...) {
      std::lock_guard lock(mutex);
      ++finished;
      all_done.notify_all();
      throw;
    }
    std::unique_lock lock(mutex);
    ++finished;
    all_done.notify_all();
    all_done.wait(lock, [&] { return finished == world; });
  };
  std::vector<std::future<void>> others;
  for (int r = 1; r < world; ++r) others.push_back(std::async(std::launch::async, join, r));
  join(0);
  for (auto& other : others) other.get();
}

// Gloo adds bf16 rank after rank in bf16. Communicator reduces bf16 in fp32 and moves it as raw
// bytes: 1 + 2^-8 + 2^-8 is exactly 1 + 2^-7 in
// fp32 (a bf16 number), where a bf16 running sum stays at 1.
TEST(ProcessGroups, Bf16IsReducedInFp32AndMovedAsBytes) {
  EXPECT_FALSE(Communicator::reduces_natively("gloo", torch::kBFloat16));
  EXPECT_FALSE(Communicator::moves_natively("gloo", torch::kBFloat16));
  EXPECT_TRUE(Communicator::reduces_natively("nccl", torch::kBFloat16));
  on_ranks(3, [](Communicator& c) {
    auto& world = c.world();
    const int rank = world.rank;
    const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16);
    auto run = [&](Operation operation) { c.wait(operation); };
    // all_reduce: exact fp32 sum, rounded once.
    auto sum = torch::full({3}, rank == 0 ? 1.0 : 1.0 / 256, bf16);
    run(c.all_reduce(world, sum, c10d::ReduceOp::SUM));
    EXPECT_TRUE(torch::equal(sum, torch::full({3}, 1.0 + 1.0 / 128, bf16))) << sum;
    auto top = torch::full({2}, 0.5 * rank, bf16);
    run(c.all_reduce(world, top, c10d::ReduceOp::MAX));
    EXPECT_TRUE(torch::equal(top, torch::full({2}, 1.0, bf16))) << top;
    // reduce_scatter: rank r keeps the r-th part of the sum.
    auto parts = torch::arange(6, torch::kFloat).to(torch::kBFloat16);
    auto mine = torch::empty({2}, bf16);
    run(c.reduce_scatter(world, mine, parts, c10d::ReduceOp::SUM));
    EXPECT_TRUE(torch::equal(mine, (3 * torch::arange(2 * rank, 2 * rank + 2, torch::kFloat)).to(torch::kBFloat16)));
    // ... of 2-D rows, and by the other operations (fp32: rank r sent (r + 1) x [0 .. 5]).
    const auto rows = (rank + 1) * torch::arange(12, torch::kFloat).view({6, 2});
    for (const auto& [op, factor] : {std::pair{c10d::ReduceOp::MAX, 3.0}, {c10d::ReduceOp::MIN, 1.0},
                                    {c10d::ReduceOp::AVG, 2.0}, {c10d::ReduceOp::PRODUCT, 6.0}}) {
      auto part = torch::empty({2, 2});
      run(c.reduce_scatter(world, part, rows, c10d::ReduceOp(op)));
      const auto base = torch::arange(4 * rank, 4 * rank + 4, torch::kFloat).view({2, 2});
      const auto expected = op == c10d::ReduceOp::PRODUCT ? base.pow(3) * factor : base * factor;
      EXPECT_TRUE(torch::equal(part, expected)) << part << " op " << static_cast<int>(op);
    }
    // broadcast, all_gather and all_to_all move bf16's bytes unchanged (values fp16 cannot hold).
    auto shared = rank == 1 ? torch::tensor({1e30, -3e-30, 7.0}).to(torch::kBFloat16) : torch::zeros({3}, bf16);
    run(c.broadcast(world, shared, 1));
    EXPECT_TRUE(torch::equal(shared, torch::tensor({1e30, -3e-30, 7.0}).to(torch::kBFloat16))) << shared;
    auto gathered = torch::empty({3, 2}, bf16);
    run(c.all_gather(world, gathered, torch::full({1, 2}, 1e20 * (rank + 1), bf16)));
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(torch::equal(gathered[r], torch::full({2}, 1e20 * (r + 1), bf16))) << gathered;
    }
    auto sent = torch::tensor({100.0 * rank, 100.0 * rank + 1, 100.0 * rank + 2}).to(torch::kBFloat16);
    auto received = torch::empty({3}, bf16);
    run(c.all_to_all(world, received, sent));
    EXPECT_TRUE(torch::equal(received, torch::tensor({0.0 + rank, 100.0 + rank, 200.0 + rank}).to(torch::kBFloat16)))
        << received;
  });
}

// A collective that times out names the ranks that never joined it, which the members that did
// join know from the store. The first member to time out closes its connections, so another member
// may see its collective fail rather than time out: that one names the absent rank too.
TEST(ProcessGroups, ATimedOutCollectiveNamesTheRanksThatNeverJoinedIt) {
  std::atomic<int> timed_out{0};
  on_ranks(
      3,
      [&timed_out](Communicator& c) {
        auto& world = c.world();
        const std::string record = ::testing::TempDir() + "/weft_flight_" + std::to_string(::getpid()) + "_rank" +
                                   std::to_string(world.rank) + ".json";
        c.set_flight_record_path(record);
        auto value = torch::ones({1});
        auto first = c.all_reduce(world, value, c10d::ReduceOp::SUM);
        c.wait(first);
        if (world.rank == 2) {  // stays away from the second collective
          std::this_thread::sleep_for(std::chrono::milliseconds(3500));
          return;
        }
        auto second = c.all_reduce(world, value, c10d::ReduceOp::SUM);
        try {
          c.wait(second);
          ADD_FAILURE() << "the all_reduce completed without rank 2";
        } catch (const CommError& e) {
          const std::string what = e.what();
          if (e.timed_out()) {
            ++timed_out;
            EXPECT_NE(what.find("all_reduce #2 on group world timed out after 2 s (train.collective_timeout_s): "
                                "rank 2 did not join it"),
                      std::string::npos)
                << what;
            EXPECT_TRUE(c.store().check({Communicator::fault_key(world.rank)}));
          } else {
            EXPECT_NE(what.find("all_reduce #2 on group world failed: "), std::string::npos) << what;
            EXPECT_NE(what.find("(rank 2 did not join it)"), std::string::npos) << what;
          }
          // The flight recorder: both all-reduces, the first completed, the second timed out (or
          // failed), in the file the message names.
          EXPECT_NE(what.find("this rank's last operations: " + record), std::string::npos) << what;
          const auto records = c.flight_records();
          ASSERT_EQ(records.size(), 2u);
          EXPECT_EQ(records[0].operation, "all_reduce");
          EXPECT_EQ(records[0].sequence, 1);
          EXPECT_EQ(records[0].state, "completed");
          EXPECT_EQ(records[1].sequence, 2);
          EXPECT_EQ(records[1].group, "world");
          EXPECT_EQ(records[1].bytes, 4);
          EXPECT_EQ(records[1].state, e.timed_out() ? "timed out" : "failed");
          if (e.timed_out()) {
            EXPECT_GE(records[1].ended_s, records[1].issued_s + 1.9);
          }
          std::ifstream in(record);
          std::stringstream text;
          text << in.rdbuf();
          EXPECT_EQ(text.str(), c.flight_records_json());
          std::remove(record.c_str());
        }
      },
      std::chrono::seconds(2));
  EXPECT_GE(timed_out.load(), 1) << "neither member that waited for rank 2 timed out";
}

// Ranks of one machine all-reduce fp32 (and bf16, widened) sums through shared memory: the sum of
// each element over the ranks in rank order, the same bits on every rank, through slots smaller than
// the tensor (pieces, an uneven split of each); reduce-scatters and all-gathers too; a group made
// later has it too.
TEST(ProcessGroups, SharedMemoryCollectivesSumInRankOrderOnEveryRank) {
  on_ranks(3, [](Communicator& c) {
    auto& world = c.world();
    EXPECT_EQ(world.local, nullptr);
    c.use_shared_memory(4096);  // 1024 floats per slot
    ASSERT_NE(world.local, nullptr);
    const int rank = world.rank;
    for (int round = 0; round < 10; ++round) {  // issued back to back: the pieces' slots reused
      const auto values = [round](int r) {           // a generator of its own: the ranks are threads
        return torch::randn({2500 + round}, at::detail::createCPUGenerator(100 * round + r)) * (r + 1) * 1e3;
      };
      auto sum = values(rank);
      auto operation = c.all_reduce(world, sum, c10d::ReduceOp::SUM);
      c.wait(operation);
      const auto expected = (values(0) + values(1)) + values(2);
      EXPECT_TRUE(torch::equal(sum, expected)) << round << ": " << (sum - expected).abs().max();
    }
    auto half = torch::full({3}, rank == 0 ? 1.0 : 1.0 / 256, torch::kBFloat16);
    auto widened = c.all_reduce(world, half, c10d::ReduceOp::SUM);
    c.wait(widened);
    EXPECT_TRUE(torch::equal(half, torch::full({3}, 1.0 + 1.0 / 128, torch::kBFloat16))) << half;
    // Reduce-scatters (sums, averages, bf16 widened) and all-gathers (bytes of any dtype), interleaved
    // with all-reduces: parts and gathered rows longer than a slot, the slot sets in turn across kinds.
    for (int round = 0; round < 6; ++round) {
      const int64_t part = 1000 + 7 * round;  // floats per rank: pieces of 341 (1024 / 3)
      const auto input = [round, part](int r) {
        return torch::randn({3 * part}, at::detail::createCPUGenerator(1000 + 100 * round + r)) * (r + 1);
      };
      auto mine = torch::empty({part});
      auto scattered = c.reduce_scatter(world, mine, input(rank), c10d::ReduceOp::SUM);
      c.wait(scattered);
      const auto whole = (input(0) + input(1)) + input(2);
      EXPECT_TRUE(torch::equal(mine, whole.narrow(0, rank * part, part))) << round;

      auto rows = torch::full({700 + round, 3}, static_cast<double>(rank * 10 + round), torch::kBFloat16);
      rows[0][0] = -rank;
      auto gathered = torch::empty({3 * (700 + round), 3}, torch::kBFloat16);
      auto gather = c.all_gather(world, gathered, rows);  // 4200+ bytes per rank: 2 pieces of 4096
      c.wait(gather);
      for (int r = 0; r < 3; ++r) {
        auto expected = torch::full({700 + round, 3}, static_cast<double>(r * 10 + round), torch::kBFloat16);
        expected[0][0] = -r;
        EXPECT_TRUE(torch::equal(gathered.narrow(0, r * (700 + round), 700 + round), expected)) << round << " " << r;
      }

      auto sum = torch::full({1500}, static_cast<double>(rank + round));
      auto reduced = c.all_reduce(world, sum, c10d::ReduceOp::SUM);
      c.wait(reduced);
      EXPECT_TRUE(torch::equal(sum, torch::full({1500}, 3.0 + 3 * round))) << round;
    }
    // Shapes whose elements do not add up are refused before anything is issued, on every rank alike.
    EXPECT_THROW(c.reduce_scatter(world, torch::empty({2, 4}), torch::empty({6, 2}), c10d::ReduceOp::SUM), Error);
    EXPECT_THROW(c.all_gather(world, torch::empty({6, 2}), torch::empty({2, 3})), Error);
    auto halves = torch::full({6, 2}, rank == 0 ? 1.0 : 1.0 / 256, torch::kBFloat16);
    auto averaged = torch::empty({2, 2}, torch::kBFloat16);
    auto average = c.reduce_scatter(world, averaged, halves, c10d::ReduceOp::AVG);
    c.wait(average);
    EXPECT_TRUE(torch::equal(averaged, torch::full({2, 2}, (1.0 + 1.0 / 128) / 3, torch::kBFloat16))) << averaged;
    auto& pair = c.create_group({0, 2});
    if (rank == 1) {
      EXPECT_EQ(pair.local, nullptr);
      return;
    }
    ASSERT_NE(pair.local, nullptr);
    auto ones = torch::ones({5000});
    auto in_pair = c.all_reduce(pair, ones, c10d::ReduceOp::SUM);
    c.wait(in_pair);
    EXPECT_TRUE(torch::equal(ones, torch::full({5000}, 2.0)));
  });
}

// A member that never reaches a shared-memory all-reduce is named as over Gloo: the others' wait
// times out within train.collective_timeout_s, and their next reduction fails at once, saying why.
TEST(ProcessGroups, ASharedMemoryAllReduceThatTimesOutNamesTheAbsentRank) {
  on_ranks(
      3,
      [](Communicator& c) {
        auto& world = c.world();
        c.use_shared_memory(1 << 20);
        ASSERT_NE(world.local, nullptr);
        auto value = torch::ones({4});
        auto first = c.all_reduce(world, value, c10d::ReduceOp::SUM);
        c.wait(first);
        EXPECT_TRUE(torch::equal(value, torch::full({4}, 3.0)));
        if (world.rank == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(3500));
          return;
        }
        auto second = c.all_reduce(world, value, c10d::ReduceOp::SUM);
        const auto start = std::chrono::steady_clock::now();
        try {
          c.wait(second);
          ADD_FAILURE() << "the all_reduce completed without rank 2";
        } catch (const CommError& e) {
          EXPECT_TRUE(e.timed_out()) << e.what();
          EXPECT_NE(std::string(e.what()).find("all_reduce #2 on group world timed out after 2 s (train.collective_timeout_s): "
                                               "rank 2 did not join it"),
                    std::string::npos)
              << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(3400));
        auto third = c.all_reduce(world, value, c10d::ReduceOp::SUM);
        try {
          c.wait(third);
          ADD_FAILURE() << "an all_reduce ran on a segment out of step";
        } catch (const CommError& e) {
          EXPECT_FALSE(e.timed_out()) << e.what();
          EXPECT_NE(std::string(e.what()).find("this group's segment is out of step since its all_reduce failed"),
                    std::string::npos)
              << e.what();
        }
      },
      std::chrono::seconds(2));
}

}  // namespace
}  // namespace weft
