#include "core/plugin/process_groups.h"

#include <algorithm>
#include <set>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL  // LibTorch's CUDA builds (PyTorch's wheels)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/cuda.h>
#endif

#include "core/util/error.h"

namespace weft {
namespace {

c10::intrusive_ptr<compat::Backend> make_backend(const std::string& backend,
                                                 const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 std::chrono::milliseconds timeout) {
  if (backend == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = timeout;
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
  }
  WEFT_CHECK(backend == "nccl", "unknown collective backend '{}' (gloo or nccl)", backend);
#ifdef USE_C10D_NCCL
  WEFT_CHECK(torch::cuda::device_count() > 0,
             "the nccl backend needs a CUDA device, and rank {} sees none (use gloo on CPUs)", rank);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  fail("the nccl backend is not in this build: weft was built against LibTorch {} without NCCL (build against "
       "PyTorch's CUDA wheel: tools/setup.sh)", compat::libtorch_version());
#endif
}

}  // namespace

bool Communicator::nccl_compiled() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

Communicator::Communicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                           std::chrono::milliseconds timeout, std::string backend)
    : store_(std::move(store)), rank_(rank), world_size_(world), timeout_(timeout), backend_(std::move(backend)) {
  auto group = std::make_unique<ProcessGroup>();
  group->name = "world";
  group->rank = rank;
  group->size = world;
  for (int32_t r = 0; r < world; ++r) group->world_ranks.push_back(r);
  group->backend = make_backend(backend_, c10::make_intrusive<c10d::PrefixStore>("world", store_), rank, world, timeout);
  groups_.push_back(std::move(group));
}

std::unique_ptr<Communicator> Communicator::single_process(std::chrono::milliseconds timeout) {
  return std::make_unique<Communicator>(c10::make_intrusive<c10d::HashStore>(), 0, 1, timeout);
}

Communicator::~Communicator() = default;

c10d::Store& Communicator::store() { return *store_; }

std::vector<double> Communicator::all_gather(double value) {
  auto& world = this->world();
  auto values = torch::zeros({world.size}, torch::kFloat64);
  values[world.rank] = value;
  std::vector<at::Tensor> tensors{values};
  world.backend->allreduce(tensors)->wait();
  return std::vector<double>(values.data_ptr<double>(), values.data_ptr<double>() + world.size);
}

ProcessGroup& Communicator::create_group(const std::vector<int32_t>& world_ranks) {
  WEFT_CHECK(!world_ranks.empty(), "a process group needs at least one rank");
  std::set<int32_t> seen;
  for (int32_t r : world_ranks) {
    WEFT_CHECK(0 <= r && r < world_size_, "process group rank {} is outside the world of {}", r, world_size_);
    WEFT_CHECK(seen.insert(r).second, "process group lists rank {} twice", r);
  }
  auto group = std::make_unique<ProcessGroup>();
  group->name = "group" + std::to_string(groups_.size());
  group->world_ranks = world_ranks;
  group->size = static_cast<int32_t>(world_ranks.size());
  const auto it = std::find(world_ranks.begin(), world_ranks.end(), rank_);
  if (it != world_ranks.end()) {
    group->rank = static_cast<int32_t>(it - world_ranks.begin());
    group->backend = make_backend(backend_, c10::make_intrusive<c10d::PrefixStore>(group->name, store_), group->rank,
                                  group->size, timeout_);
  }
  groups_.push_back(std::move(group));
  return *groups_.back();
}

}  // namespace weft
