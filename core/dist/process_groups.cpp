#include "core/dist/process_groups.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL  // LibTorch's CUDA builds (PyTorch's wheels)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/cuda.h>
#endif

#include "core/dist/shared_memory_reduce.h"
#include "core/util/error.h"
#include "core/util/fault_injection.h"
#include "core/util/libtorch.h"

namespace weft {
namespace {

std::string first_line_of(const std::string& text) { return text.substr(0, text.find('\n')); }

c10::intrusive_ptr<c10d::Backend> make_backend(const std::string& backend,
                                                 const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 std::chrono::milliseconds timeout, const GlooNetwork& network) {
  if (backend == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = timeout;
    try {
      for (const auto& interface : network.interfaces) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(interface));
      }
      if (network.interfaces.empty()) {
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(network.address));
      }
    } catch (const std::exception& e) {
      fail("rank {} cannot open Gloo's connections on {}: {}", rank, network.describe(), first_line_of(e.what()));
    }
    try {
      return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    } catch (const std::exception& e) {
      // Each rank connects to the address every other one published (gloo_network, rendezvous.h).
      fail("rank {} (Gloo on {}) could not connect to the other {} ranks of a group: {} (each rank listens on "
           "the address it publishes; across nodes set MASTER_ADDR to an address every node reaches, or "
           "GLOO_SOCKET_IFNAME to the interface they share)",
           rank, network.describe(), size - 1, first_line_of(e.what()));
    }
  }
  WEFT_CHECK(backend == "nccl", "unknown collective backend '{}' (gloo or nccl)", backend);
#ifdef USE_C10D_NCCL
  WEFT_CHECK(torch::cuda::device_count() > 0,
             "the nccl backend needs a CUDA device, and rank {} sees none (use gloo on CPUs)", rank);
  // A wait on an NCCL operation blocks until it completes or the timeout passes, so that a hung
  // collective ends with an error naming it (Communicator::wait) rather than the watchdog's abort.
  ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  fail("the nccl backend is not in this build: weft was built against LibTorch {} without NCCL (build against "
       "PyTorch's CUDA wheel: tools/setup.sh)", libtorch_version());
#endif
}

}  // namespace

std::string GlooNetwork::describe() const {
  if (interfaces.empty()) return address;
  std::string list;
  for (const auto& interface : interfaces) list += (list.empty() ? "" : ", ") + interface;
  return (interfaces.size() == 1 ? "interface " : "interfaces ") + list;
}

bool Communicator::nccl_compiled() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

Communicator::Communicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                           std::chrono::milliseconds timeout, std::string backend, GlooNetwork network)
    : store_(std::move(store)),
      rank_(rank),
      world_size_(world),
      timeout_(timeout),
      backend_(std::move(backend)),
      network_(std::move(network)) {
  auto group = std::make_unique<ProcessGroup>();
  group->name = "world";
  group->rank = rank;
  group->size = world;
  for (int32_t r = 0; r < world; ++r) group->world_ranks.push_back(r);
  attach_backends(*group, "world");
  groups_.push_back(std::move(group));
}

std::unique_ptr<Communicator> Communicator::single_process(std::chrono::milliseconds timeout) {
  return std::make_unique<Communicator>(c10::make_intrusive<c10d::HashStore>(), 0, 1, timeout);
}

Communicator::~Communicator() {
  // NCCL groups are shut down before they are released (their watchdogs stopped); nothing throws
  // out of a destructor.
  for (auto& group : groups_) {
    if (!group || !group->nccl) continue;
    try {
      group->nccl->shutdown();
    } catch (const std::exception& e) {
      spdlog::warn("shutting down the NCCL group of {}: {}", group->name, e.what());
    }
  }
}

void Communicator::attach_backends(ProcessGroup& group, const std::string& prefix) {
  WEFT_CHECK(backend_ == "gloo" || backend_ == "nccl", "unknown collective backend '{}' (gloo or nccl)", backend_);
  group.backend =
      make_backend("gloo", c10::make_intrusive<c10d::PrefixStore>(prefix, store_), group.rank, group.size, timeout_,
                   network_);
  if (backend_ == "nccl") {
    group.nccl = make_backend("nccl", c10::make_intrusive<c10d::PrefixStore>(prefix + "/nccl", store_), group.rank,
                              group.size, timeout_, network_);
  }
}

Route Communicator::route(const ProcessGroup& group, const c10::Device& device) {
  if (device.is_cuda() && group.nccl) return Route{group.nccl.get(), "nccl", false};
  return Route{group.backend.get(), "gloo", !device.is_cpu()};
}

c10d::Store& Communicator::store() { return *store_; }

void Communicator::use_shared_memory(int64_t slot_bytes) {
  shared_memory_slot_bytes_ = std::max<int64_t>(0, slot_bytes);
  for (auto& group : groups_) {
    if (group->rank >= 0 && !group->local) attach_shared_memory(*group);
  }
}

void Communicator::attach_shared_memory(ProcessGroup& group) {
  if (shared_memory_slot_bytes_ <= 0 || group.size < 2) return;
  std::string why_not;
  group.local = SharedMemoryReduce::open(*store_, group.name, group.rank, group.size,
                                         std::max<int64_t>(1, shared_memory_slot_bytes_ / 4), timeout_, &why_not);
  if (group.rank != 0) return;
  if (group.local) {
    spdlog::info("group {}: its {} ranks reduce and gather CPU tensors over shared memory ({} KiB per rank)", group.name, group.size,
                 2 * shared_memory_slot_bytes_ >> 10);
  } else {
    spdlog::info("group {}: reduces and gathers over Gloo ({})", group.name, why_not);
  }
}

std::vector<double> Communicator::all_gather(double value) {
  auto& world = this->world();
  auto values = torch::zeros({world.size}, torch::kFloat64);
  values[world.rank] = value;
  auto operation = all_reduce(world, values, c10d::ReduceOp::SUM);
  wait(operation);
  return std::vector<double>(values.data_ptr<double>(), values.data_ptr<double>() + world.size);
}

// --- operations ---------------------------------------------------------------------------

namespace {

// The types weft hands Gloo's kernels as they are (c10d's GENERATE_ALL_TYPES; bf16, which Gloo sums in
// bf16, is reduced in fp32: reduces_natively).
bool gloo_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: case at::kDouble: case at::kHalf: case at::kChar: case at::kByte: case at::kInt: case at::kLong:
      return true;
    default:
      return false;
  }
}

// A same-sized type that `backend` moves, to reinterpret `tensor`'s bytes as.
at::Tensor as_movable(const at::Tensor& tensor) {
  switch (tensor.element_size()) {
    case 1: return tensor.view(at::kByte);
    case 2: return tensor.view(at::kHalf);
    case 4: return tensor.view(at::kInt);
    case 8: return tensor.view(at::kLong);
    default: fail("cannot communicate tensors of {} ({} bytes per element)", c10::toString(tensor.scalar_type()),
                  tensor.element_size());
  }
}

std::string rank_list(const std::vector<int32_t>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return text;
}

}  // namespace

bool Communicator::reduces_natively(const std::string& backend, at::ScalarType dtype) {
  if (backend == "nccl") return true;
  return gloo_type(dtype) && dtype != at::kHalf;
}

bool Communicator::moves_natively(const std::string& backend, at::ScalarType dtype) {
  return backend == "nccl" || gloo_type(dtype);
}

std::string Communicator::fault_key(int rank) { return "weft/fault/" + std::to_string(rank); }
std::string Communicator::answer_key(int rank) { return "weft/answer/" + std::to_string(rank); }

void Communicator::declare_exit_status_an_answer() {
  if (world_size_ <= 1 || !store_) return;  // no launcher to tell
  // Unanswered or failed: the launcher then reports the exit as a failure, still correct.
  ask_store([key = answer_key(rank_)](c10d::Store& store) { store.set(key, std::vector<uint8_t>{'1'}); });
}

Operation Communicator::issue(ProcessGroup& group, std::string name, bool collective, int64_t bytes, int32_t peer) {
  WEFT_CHECK(group.backend, "this rank is not a member of process group '{}'", group.name);
  if (collective) fault_point("collective");
  Operation operation;
  operation.name = std::move(name);
  operation.group = &group;
  operation.bytes = bytes;
  operation.peer = peer;
  if (collective) operation.sequence = ++group.collectives;
  FlightRecord record;
  record.operation = operation.name;
  record.group = group.name;
  record.sequence = operation.sequence;
  record.peer = peer >= 0 && static_cast<size_t>(peer) < group.world_ranks.size() ? group.world_ranks[static_cast<size_t>(peer)] : -1;
  record.bytes = bytes;
  record.issued_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  std::lock_guard<std::mutex> lock(flight_mutex_);
  record.id = operation.flight_id = ++flight_issued_;
  flight_.push_back(std::move(record));
  if (flight_.size() > kFlightRecords) flight_.pop_front();
  return operation;
}

void Communicator::end_flight(const Operation& operation, const char* state) {
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  std::lock_guard<std::mutex> lock(flight_mutex_);
  if (flight_.empty() || operation.flight_id < flight_.front().id) return;  // no longer recorded
  FlightRecord& record = flight_[static_cast<size_t>(operation.flight_id - flight_.front().id)];
  record.ended_s = now;
  record.state = state;
}

void Communicator::set_flight_record_path(std::string path) {
  std::lock_guard<std::mutex> lock(flight_mutex_);
  flight_path_ = std::move(path);
}

std::vector<FlightRecord> Communicator::flight_records() const {
  std::lock_guard<std::mutex> lock(flight_mutex_);
  return {flight_.begin(), flight_.end()};
}

std::string Communicator::flight_records_json() const {
  nlohmann::json records = nlohmann::json::array();
  for (const FlightRecord& r : flight_records()) {
    records.push_back({{"id", r.id}, {"operation", r.operation}, {"group", r.group}, {"sequence", r.sequence},
                       {"peer", r.peer}, {"bytes", r.bytes}, {"issued_s", r.issued_s}, {"ended_s", r.ended_s},
                       {"state", r.state}});
  }
  return nlohmann::json{{"rank", rank_}, {"world_size", world_size_}, {"operations", records}}.dump(1) + "\n";
}

std::string Communicator::dump_flight_records() const {
  std::string path;
  {
    std::lock_guard<std::mutex> lock(flight_mutex_);
    path = flight_path_;
  }
  if (path.empty()) return "";
  try {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream out(path, std::ios::trunc);
    out << flight_records_json();
    return out ? path : "";
  } catch (const std::exception&) {
    return "";  // the error being reported matters more than its record
  }
}

namespace {

// The tensor an operation hands its backend for `tensor`: a host copy when the route stages it.
at::Tensor on_route(const Route& route, const at::Tensor& tensor) { return route.staged ? tensor.cpu() : tensor; }

// Where an operation's result lands for `output`: the output itself, or a host buffer when staged.
at::Tensor landing(const Route& route, const at::Tensor& output) {
  return route.staged ? at::empty(output.sizes(), output.options().device(at::kCPU)) : output;
}

// An operation done on SharedMemoryReduce's thread: complete (or failed) when it calls done().
class LocalWork : public c10d::Work {
 public:
  void done(std::exception_ptr error) { finish(std::move(error)); }
};

// After completion, copies `result` into `tensor` where they are different tensors (staged or widened).
std::function<void()> copy_back(const at::Tensor& tensor, const at::Tensor& result) {
  if (result.is_same(tensor)) return {};
  return [tensor, result]() mutable { tensor.copy_(result); };
}

}  // namespace

Operation Communicator::all_reduce(ProcessGroup& group, const at::Tensor& tensor, c10d::ReduceOp op) {
  auto operation = issue(group, "all_reduce", true, static_cast<int64_t>(tensor.nbytes()));
  const Route route = Communicator::route(group, tensor.device());
  at::Tensor reduced = on_route(route, tensor);
  if (!reduces_natively(route.name, tensor.scalar_type())) reduced = reduced.to(at::kFloat);  // reduce wider
  std::vector<at::Tensor> tensors{reduced};
  if (group.local && op.op_ == c10d::ReduceOp::SUM && reduced.device().is_cpu() &&
      reduced.scalar_type() == at::kFloat && reduced.is_contiguous()) {
    auto work = c10::make_intrusive<LocalWork>();
    // The operation holds its tensors until it ran, whatever happens to the Operation.
    group.local->enqueue(
        [reduced](SharedMemoryReduce& local) { local.all_reduce_sum(reduced.data_ptr<float>(), reduced.numel()); },
                         [work](std::exception_ptr error) { work->done(error); });
    operation.work = work;
    operation.finish = copy_back(tensor, reduced);
    operation.tensors = {tensor, reduced};
    return operation;
  }
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  operation.work = route.backend->allreduce(tensors, options);
  operation.finish = copy_back(tensor, reduced);
  operation.tensors = {tensor, reduced};
  return operation;
}

Operation Communicator::reduce_scatter(ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                                       c10d::ReduceOp op) {
  WEFT_CHECK(input.size(0) == output.size(0) * group.size && input.numel() == output.numel() * group.size,
             "reduce_scatter: input ({}) must be {} x output ({}) along dim 0, with the same other dims",
             c10::str(input.sizes()), group.size, c10::str(output.sizes()));
  auto operation = issue(group, "reduce_scatter", true, static_cast<int64_t>(input.nbytes()));
  const Route route = Communicator::route(group, input.device());
  const bool widen = !reduces_natively(route.name, input.scalar_type());
  at::Tensor sent = on_route(route, input);
  sent = widen ? sent.to(at::kFloat).contiguous() : sent.contiguous();
  const int64_t part = output.size(0), rank = group.rank, ranks = group.size;
  if (route.name == "nccl") {  // NCCL's own: each rank sends and receives each part once
    at::Tensor received = landing(route, output);
    if (!received.is_contiguous()) received = at::empty(received.sizes(), received.options());
    c10d::ReduceScatterOptions options;
    options.reduceOp = op;
    operation.work = route.backend->_reduce_scatter_base(received, sent, options);
    operation.finish = copy_back(output, received);
    operation.tensors = {output, input, sent, received};
    return operation;
  }
  const auto kind = op.op_;
  if (group.local && sent.device().is_cpu() && sent.scalar_type() == at::kFloat &&
      (kind == c10d::ReduceOp::SUM || kind == c10d::ReduceOp::AVG)) {
    // Through the machine's shared memory: each rank sums its own part over the members' inputs in
    // rank order, into the output itself where it is a contiguous fp32 CPU tensor.
    const bool direct = output.device().is_cpu() && output.scalar_type() == at::kFloat && output.is_contiguous();
    at::Tensor received = direct ? output : at::empty({output.numel()}, sent.options());
    auto work = c10::make_intrusive<LocalWork>();
    group.local->enqueue(
        [sent, received](SharedMemoryReduce& local) {
          local.reduce_scatter_sum(sent.data_ptr<float>(), received.data_ptr<float>(), received.numel());
        },
                         [work](std::exception_ptr error) { work->done(error); });
    operation.work = work;
    operation.finish = [received, output, ranks, kind, direct]() mutable {
      if (kind == c10d::ReduceOp::AVG) received.div_(static_cast<double>(ranks));
      if (!direct) output.copy_(received.view(output.sizes()));
    };
    operation.tensors = {output, input, sent, received};
    return operation;
  }
  if (kind == c10d::ReduceOp::SUM || kind == c10d::ReduceOp::AVG || kind == c10d::ReduceOp::MIN ||
      kind == c10d::ReduceOp::MAX || kind == c10d::ReduceOp::PRODUCT) {
    // Gloo's reduce_scatter all-reduces (measured: a whole all-reduce's bytes on the link). An
    // all-to-all sends each rank's part to it once instead, (N - 1) / N of the input each way, as
    // a ring reduce-scatter does, and the parts are reduced here in rank order.
    at::Tensor received = at::empty(sent.sizes(), sent.options());
    std::vector<int64_t> equal_splits;
    operation.work = route.backend->alltoall_base(received, sent, equal_splits, equal_splits);
    operation.finish = [received, output, ranks, kind]() mutable {
      const auto parts = received.view({ranks, -1});
      at::Tensor reduced = kind == c10d::ReduceOp::MIN   ? parts.amin(0)
                           : kind == c10d::ReduceOp::MAX ? parts.amax(0)
                           : kind == c10d::ReduceOp::PRODUCT ? parts.prod(0)
                                                             : parts.sum(0);
      if (kind == c10d::ReduceOp::AVG) reduced.div_(static_cast<double>(ranks));
      output.copy_(reduced.view(output.sizes()));
    };
    operation.tensors = {output, input, sent, received};
    return operation;
  }
  // Any other operation: all-reduce a (widened) copy and keep this rank's part.
  at::Tensor full = sent.is_same(input) ? sent.clone() : sent;
  std::vector<at::Tensor> tensors{full};
  c10d::AllreduceOptions options;
  options.reduceOp = op;
  operation.work = route.backend->allreduce(tensors, options);
  operation.finish = [full, output, part, rank]() mutable { output.copy_(full.narrow(0, rank * part, part)); };
  operation.tensors = {full, output};
  return operation;
}

Operation Communicator::all_gather(ProcessGroup& group, const at::Tensor& output, const at::Tensor& input) {
  WEFT_CHECK(output.size(0) == input.size(0) * group.size && output.numel() == input.numel() * group.size,
             "all_gather: output ({}) must be {} x input ({}) along dim 0, with the same other dims",
             c10::str(output.sizes()), group.size, c10::str(input.sizes()));
  WEFT_CHECK(output.scalar_type() == input.scalar_type(), "all_gather: output and input dtypes differ");
  auto operation = issue(group, "all_gather", true, static_cast<int64_t>(input.nbytes()));
  const Route route = Communicator::route(group, input.device());
  const at::Tensor gathered = landing(route, output);
  const at::Tensor sent = on_route(route, input);
  if (group.local && sent.device().is_cpu()) {
    // Through the machine's shared memory, as bytes.
    const at::Tensor in = sent.contiguous();
    const at::Tensor out = gathered.is_contiguous() && gathered.device().is_cpu()
                               ? gathered
                               : at::empty(gathered.sizes(), gathered.options().device(at::kCPU));
    auto work = c10::make_intrusive<LocalWork>();
    group.local->enqueue(
        [in, out](SharedMemoryReduce& local) {
          local.all_gather(in.data_ptr(), out.data_ptr(), static_cast<int64_t>(in.nbytes()));
        },
                         [work](std::exception_ptr error) { work->done(error); });
    operation.work = work;
    operation.finish = copy_back(output, out);
    operation.tensors = {output, input, gathered, sent, in, out};
    return operation;
  }
  const bool native = moves_natively(route.name, input.scalar_type());
  const at::Tensor out = native ? gathered : as_movable(gathered), in = native ? sent : as_movable(sent);
  std::vector<std::vector<at::Tensor>> outputs{out.chunk(group.size, 0)};
  std::vector<at::Tensor> inputs{in};
  operation.work = route.backend->allgather(outputs, inputs);
  operation.finish = copy_back(output, gathered);
  operation.tensors = {output, input, gathered, sent};
  return operation;
}

Operation Communicator::broadcast(ProcessGroup& group, const at::Tensor& tensor, int32_t root) {
  WEFT_CHECK(0 <= root && root < group.size, "broadcast: root {} outside a group of {}", root, group.size);
  auto operation = issue(group, "broadcast", true, static_cast<int64_t>(tensor.nbytes()));
  const Route route = Communicator::route(group, tensor.device());
  const at::Tensor moved = on_route(route, tensor);
  std::vector<at::Tensor> tensors{moves_natively(route.name, tensor.scalar_type()) ? moved : as_movable(moved)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
  operation.work = route.backend->broadcast(tensors, options);
  operation.finish = copy_back(tensor, moved);
  operation.tensors = {tensor, moved};
  return operation;
}

Operation Communicator::all_to_all(ProcessGroup& group, const at::Tensor& output, const at::Tensor& input) {
  WEFT_CHECK(input.size(0) % group.size == 0 && output.sizes() == input.sizes() &&
                 output.scalar_type() == input.scalar_type(),
             "all_to_all: input and output must have the same shape and dtype with dim 0 divisible by {}", group.size);
  auto operation = issue(group, "all_to_all", true, static_cast<int64_t>(input.nbytes()));
  const Route route = Communicator::route(group, input.device());
  const at::Tensor received = landing(route, output);
  const at::Tensor sent = on_route(route, input);
  const bool native = moves_natively(route.name, input.scalar_type());
  at::Tensor out = native ? received : as_movable(received), in = native ? sent : as_movable(sent);
  std::vector<int64_t> equal_splits;
  operation.work = route.backend->alltoall_base(out, in, equal_splits, equal_splits);
  operation.finish = copy_back(output, received);
  operation.tensors = {output, input, received, sent};
  return operation;
}

Operation Communicator::send(ProcessGroup& group, const at::Tensor& tensor, int32_t peer, int32_t tag) {
  WEFT_CHECK(0 <= peer && peer < group.size && peer != group.rank, "send: invalid peer {}", peer);
  auto operation = issue(group, "send", false, static_cast<int64_t>(tensor.nbytes()), peer);
  const Route route = Communicator::route(group, tensor.device());
  std::vector<at::Tensor> tensors{on_route(route, tensor)};  // Gloo sends raw bytes: any dtype
  operation.work = route.backend->send(tensors, peer, tag);
  operation.tensors = {tensor, tensors[0]};
  return operation;
}

Operation Communicator::recv(ProcessGroup& group, const at::Tensor& tensor, int32_t peer, int32_t tag) {
  WEFT_CHECK(0 <= peer && peer < group.size && peer != group.rank, "recv: invalid peer {}", peer);
  auto operation = issue(group, "recv", false, static_cast<int64_t>(tensor.nbytes()), peer);
  const Route route = Communicator::route(group, tensor.device());
  const at::Tensor received = landing(route, tensor);
  std::vector<at::Tensor> tensors{received};
  operation.work = route.backend->recv(tensors, peer, tag);
  operation.finish = copy_back(tensor, received);
  operation.tensors = {tensor, received};
  return operation;
}

Operation Communicator::barrier(ProcessGroup& group) {
  auto operation = issue(group, "barrier", true, 0);
  operation.work = group.backend->barrier();
  return operation;
}

namespace {

std::string reached_key(const Operation& operation, int32_t world_rank) {
  return fmt::format("weft/reached/{}/{}/{}", operation.group->name, operation.sequence, world_rank);
}

}  // namespace

StoreAnswer query_store_within(const c10::intrusive_ptr<c10d::Store>& store, std::function<void(c10d::Store&)> query,
                               std::chrono::milliseconds limit) {
  auto answered = std::make_shared<std::promise<bool>>();
  auto answer = answered->get_future();
  std::thread([store, query = std::move(query), answered] {
    bool ok = true;
    try {
      query(*store);
    } catch (const std::exception&) {
      ok = false;
    }
    answered->set_value(ok);
  }).detach();
  if (answer.wait_for(limit) != std::future_status::ready) return StoreAnswer::kSilent;
  return answer.get() ? StoreAnswer::kAnswered : StoreAnswer::kFailed;
}

bool Communicator::ask_store(std::function<void(c10d::Store&)> query) {
  if (store_unresponsive_) return false;
  const StoreAnswer answer = query_store_within(store_, std::move(query), store_answer_limit());
  if (answer == StoreAnswer::kSilent) store_unresponsive_ = true;  // its thread holds the store's client
  return answer == StoreAnswer::kAnswered;
}

std::string Communicator::store_silence() const {
  return fmt::format("the rendezvous store{} did not answer within {:.0f} s: the link to the node that hosts it "
                     "may be down",
                     store_address_.empty() ? "" : " at " + store_address_,
                     std::chrono::duration<double>(store_answer_limit()).count());
}

// A member that waits on a collective for half the timeout says so in the store, so that the one
// whose wait times out can tell who was there.
void Communicator::mark_reached(const Operation& operation) {
  // The check is a round trip (a set is not answered): a store that does not answer it within
  // the wait's second half is known to be unreachable by the time the collective times out.
  const std::string key = reached_key(operation, rank_);
  ask_store([key](c10d::Store& store) {
    store.set(key, std::vector<uint8_t>{'1'});
    store.check({key});
  });
  // unanswered: the store is gone too, and the timeout's message will say so
}

std::string Communicator::who_did_not_arrive(const Operation& operation, std::string* where_they_ran) {
  std::vector<std::pair<int32_t, std::string>> keys;
  for (int32_t world_rank : operation.group->world_ranks) {
    if (world_rank != rank_) keys.emplace_back(world_rank, reached_key(operation, world_rank));
  }
  // The absent ranks, and where they ran as each published it at the rendezvous (join_world).
  auto absent = std::make_shared<std::vector<int32_t>>();
  auto where = std::make_shared<std::string>();
  auto error = std::make_shared<std::string>();
  const bool answered = ask_store([keys, absent, where, error](c10d::Store& store) {
    try {
      for (const auto& [world_rank, key] : keys) {
        if (!store.check({key})) absent->push_back(world_rank);
      }
    } catch (const std::exception& e) {
      *error = e.what();
      return;
    }
    try {
      for (size_t i = 0; i < absent->size() && i < 4; ++i) {
        const std::string key = "weft/rendezvous/rank/" + std::to_string((*absent)[i]);
        if (!store.check({key})) continue;
        const auto bytes = store.get(key);
        *where += fmt::format("{}rank {}: {}", where->empty() ? " (" : "; ", (*absent)[i],
                              std::string(bytes.begin(), bytes.end()));
      }
    } catch (const std::exception&) {
    }
    if (!where->empty()) *where += ")";
  });
  if (!answered && error->empty()) return store_silence();
  if (!error->empty()) {
    return fmt::format("the rendezvous store did not answer to tell which ranks were missing ({})", *error);
  }
  if (absent->empty()) return "every other member had joined it";
  if (where_they_ran) *where_they_ran = *where;
  return fmt::format("rank{} {} did not join it{}", absent->size() > 1 ? "s" : "", rank_list(*absent),
                     where_they_ran ? "" : *where);
}

void Communicator::wait(Operation& operation) {
  const auto seconds = std::chrono::duration<double>(timeout_).count();
  try {
    bool done = false;
    if (operation.sequence > 0 && world_size_ > 1) {
      try {  // the common case: a collective done within half the timeout
        done = operation.work->wait(std::max(timeout_ / 2, std::chrono::milliseconds(1)));
      } catch (const std::exception&) {
        if (operation.work->isCompleted()) throw;  // it failed (the wait rethrows its error)
      }
      if (!done) mark_reached(operation);  // still waiting: say so, for whoever times out
    }
    if (!done) operation.work->wait();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const bool timed_out = what.find("imeout") != std::string::npos || what.find("imed out") != std::string::npos;
    const std::string where = fmt::format("{}{} on group {}", operation.name,
                                          operation.sequence > 0 ? fmt::format(" #{}", operation.sequence) : "",
                                          operation.group->name);
    const std::string first_line = what.substr(0, what.find('\n'));
    end_flight(operation, timed_out ? "timed out" : "failed");
    const std::string record = dump_flight_records();
    const std::string record_note = record.empty() ? "" : fmt::format(" (this rank's last operations: {})", record);
    if (!timed_out) {
      // A member that timed out closes its connections, so the others' collective fails instead of
      // timing out; the ranks that never joined are still the cause worth naming.
      std::string absent;
      if (operation.sequence > 0) {
        std::string where_they_ran;
        const std::string who = who_did_not_arrive(operation, &where_they_ran);
        if (who.find("did not join") != std::string::npos) absent = " (" + who + ")" + where_they_ran;
      }
      throw CommError(fmt::format("{} failed: {}{}{}", where, first_line, absent, record_note), false);
    }
    std::string who;
    if (operation.sequence > 0) {
      mark_reached(operation);
      who = who_did_not_arrive(operation);
    } else {
      who = fmt::format("rank {} did not {}", operation.group->world_ranks.at(static_cast<size_t>(operation.peer)),
                        operation.name == "send" ? "receive it" : "send it");
    }
    const std::string message = fmt::format("rank {}: {} timed out after {:.0f} s (train.collective_timeout_s): {}{}",
                                            rank_, where, seconds, who, record_note);
    // For the launcher, which names the rank that did not join rather than the one that noticed.
    ask_store([key = fault_key(rank_), message](c10d::Store& store) {
      store.set(key, std::vector<uint8_t>(message.begin(), message.end()));
    });
    throw CommError(message, true);
  }
  end_flight(operation, "completed");
  if (operation.finish) operation.finish();
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
    attach_backends(*group, group->name);
    attach_shared_memory(*group);
  }
  groups_.push_back(std::move(group));
  return *groups_.back();
}

}  // namespace weft
