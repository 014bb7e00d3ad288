// Process groups for strategies: c10d's Gloo process group for CPU tensors and, in a run that
// computes on CUDA devices where LibTorch has it, c10d's NCCL process group for CUDA tensors, over
// a rendezvous store (TCPStore for multi-process jobs, an in-memory HashStore for one process),
// plus sub-groups for meshes, and the operations on them. Every operation goes through
// Communicator, which routes it by its tensors' device (route()) and adapts a tensor to what the
// backend can do (a dtype it cannot reduce is reduced in a wider one, a dtype it cannot move is
// moved as raw bytes, a CUDA tensor in a group without NCCL is staged through host memory) and,
// when a collective times out, asks the store which ranks never reached it. A group whose members
// all run on this machine may all-reduce, reduce-scatter and all-gather CPU tensors through shared
// memory instead (use_shared_memory).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "core/util/error.h"

namespace c10d {
class Backend;
class Store;
}  // namespace c10d

namespace weft {

class SharedMemoryReduce;

struct ProcessGroup {
  c10::intrusive_ptr<c10d::Backend> backend;      // c10d's Gloo group (CPU tensors); null on ranks outside
  c10::intrusive_ptr<c10d::Backend> nccl;         // c10d's NCCL group (CUDA tensors), or null: see route()
  std::vector<int32_t> world_ranks;                 // members, in group-rank order
  int32_t rank = -1;                                // this process's rank in the group, or -1
  int32_t size = 0;
  std::string name;                                 // "world", "group1", ...
  std::atomic<int64_t> collectives{0};              // collectives issued on it so far by this process
  // Its members' collectives through shared memory where they all run on this machine
  // (Communicator::use_shared_memory), or null.
  std::shared_ptr<SharedMemoryReduce> local;
};

// One operation issued on a process group, until it is waited for.
struct Operation {
  c10::intrusive_ptr<c10d::Work> work;
  std::string name;                 // "all_reduce", "recv", ...
  ProcessGroup* group = nullptr;
  int64_t sequence = 0;             // a collective's number among its group's collectives (1, 2, ...);
                                    // every member numbers them alike. 0 for send and recv.
  int32_t peer = -1;                // send/recv: the other side (group rank)
  int64_t bytes = 0;                // what this rank contributes or receives
  std::vector<at::Tensor> tensors;  // kept alive until the operation completes
  std::function<void()> finish;     // after completion: copy a widened or staged result back
  int64_t flight_id = 0;            // its entry in the Communicator's flight recorder
};

// One operation in the flight recorder (as PyTorch's Flight Recorder): what this rank issued, on
// which group, and how far it got. After a timeout, the ranks' records side by side show which
// rank was behind (the lowest sequence number reached on a group).
struct FlightRecord {
  int64_t id = 0;          // issue order on this rank: 1, 2, ...
  std::string operation;   // "all_reduce", "send", ...
  std::string group;       // "world", "group1", ...
  int64_t sequence = 0;    // the collective's number among its group's (every member numbers alike); 0: send/recv
  int32_t peer = -1;       // send/recv: the other side (world rank)
  int64_t bytes = 0;       // what this rank contributes or receives
  double issued_s = 0.0;   // seconds since the Communicator was made
  double ended_s = -1.0;   // when a wait saw it end; -1 while it has not
  std::string state = "issued";  // "issued" (not waited for yet), "completed", "failed", "timed out"
};

// An operation that failed, or timed out (timed_out()).
class CommError : public Error {
 public:
  CommError(const std::string& message, bool timed_out) : Error(message), timed_out_(timed_out) {}
  bool timed_out() const { return timed_out_; }

 private:
  bool timed_out_;
};

// Which backend carries an operation on tensors of one device (Communicator::route).
struct Route {
  c10d::Backend* backend = nullptr;
  std::string name;     // "gloo" or "nccl"
  bool staged = false;  // a CUDA tensor through Gloo: copied to host memory and back
};

// Where this process's Gloo connections listen: the address it gives its peers through the store.
// One Gloo device per entry of `interfaces` (GLOO_SOCKET_IFNAME's, PyTorch's convention: Gloo
// spreads a group's pairs over them), otherwise one device on `address` (an IP address or a host
// name). gloo_network (rendezvous.h) chooses it for a job.
struct GlooNetwork {
  std::vector<std::string> interfaces;
  std::string address = "127.0.0.1";
  std::string describe() const;  // "10.0.0.2" or "interface eth0" / "interfaces eth0, eth1"
};

// Runs `query` on `store` from a thread of its own and waits at most `limit` for it. TCPStore's
// replies have no timeout of their own: behind a link that is down a check or get waits forever,
// so the query's thread is left behind then (it keeps the store alive until the query returns).
enum class StoreAnswer { kAnswered, kFailed, kSilent };
StoreAnswer query_store_within(const c10::intrusive_ptr<c10d::Store>& store, std::function<void(c10d::Store&)> query,
                               std::chrono::milliseconds limit);

class Communicator {
 public:
  // Joins the world group through `store` (rank, world size). Collective operations time out
  // after `timeout`. `backend`: "gloo" (every group has Gloo, for CPU tensors), or "nccl" (Gloo
  // and, for CUDA tensors, NCCL; only where LibTorch was built with NCCL, see nccl_compiled(), and
  // the process sees a CUDA device: bind_device (core/util/device.h) first). `network`: where
  // every group's Gloo connections listen. Throws weft::Error naming the problem otherwise.
  Communicator(c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::chrono::milliseconds timeout,
               std::string backend = "gloo", GlooNetwork network = {});
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
  // From now on, each group (the world and the groups made later) whose members all run on this
  // machine all-reduces and reduce-scatters CPU fp32 sums and averages (and bf16 ones, which
  // Gloo's path widens to fp32; all-reduce: sums only) and all-gathers CPU tensors of any dtype
  // through a shared memory segment of two `slot_bytes` slots per member (SharedMemoryReduce)
  // instead of Gloo's loopback connections; other operations stay on Gloo. Collective over the
  // world; a group that cannot (members on several machines, /dev/shm too small) keeps Gloo, and
  // says why in the log.
  void use_shared_memory(int64_t slot_bytes);
  // Where the store is ("10.0.0.1:29500"), for the messages that say it stopped answering.
  void set_store_address(std::string address) { store_address_ = std::move(address); }
  // Every rank's `value`, in rank order. Collective over the world.
  std::vector<double> all_gather(double value);

  // Operations on `group` (this rank must be a member). Each returns at once; wait() completes it.
  // Tensors must be contiguous; they stay alive in the Operation. Collective ones must be issued
  // by every member in the same order.
  Operation all_reduce(ProcessGroup& group, const at::Tensor& tensor, c10d::ReduceOp op);
  // input: dim 0 = group size x output's dim 0; the group rank's part of the reduction lands in output.
  // Over Gloo an all-to-all of the parts, reduced here in rank order (Gloo's own reduce_scatter moves
  // an all-reduce's bytes); over NCCL, NCCL's own.
  Operation reduce_scatter(ProcessGroup& group, const at::Tensor& output, const at::Tensor& input, c10d::ReduceOp op);
  // output: dim 0 = group size x input's dim 0, filled in group-rank order.
  Operation all_gather(ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
  Operation broadcast(ProcessGroup& group, const at::Tensor& tensor, int32_t root);
  // Equal splits along dim 0: part j of input goes to group rank j; part j of output comes from it.
  Operation all_to_all(ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
  Operation send(ProcessGroup& group, const at::Tensor& tensor, int32_t peer, int32_t tag);
  Operation recv(ProcessGroup& group, const at::Tensor& tensor, int32_t peer, int32_t tag);
  Operation barrier(ProcessGroup& group);
  // Blocks until `operation` completes, then runs its finish step. Throws CommError naming the
  // operation; for a collective that timed out, the message names the ranks that never reached
  // it and the setting that bounds the wait, and is also left in the store for the launcher
  // (fault_key).
  void wait(Operation& operation);

  // The backend for tensors on `device` in `group`: NCCL for CUDA tensors where the group has it;
  // Gloo otherwise, a CUDA tensor then staged through host memory (Gloo's own CUDA support does not
  // cover every operation, send and recv among them).
  static Route route(const ProcessGroup& group, const c10::Device& device);

  // What a backend can do with a dtype: reduce it, and move it (broadcast, gather, all-to-all,
  // send) without reinterpreting its bytes. Gloo reduces fp16/bf16 in fp32 here: Gloo's own
  // bf16 sum adds in bf16 rank after rank.
  static bool reduces_natively(const std::string& backend, at::ScalarType dtype);
  static bool moves_natively(const std::string& backend, at::ScalarType dtype);
  // The store key where rank `rank` leaves the description of a collective that timed out.
  static std::string fault_key(int rank);
  // The store key where rank `rank` says that its exit status (not 0) is the command's answer
  // (trainer plan's "does not fit": exit 1), not a failure: the --nproc launcher then waits for the
  // other ranks instead of reporting this one as failed and stopping them. Set after the last
  // collective, by every rank that exits with it.
  static std::string answer_key(int rank);
  void declare_exit_status_an_answer();

  // The flight recorder: the last kFlightRecords operations this rank issued, oldest first. When
  // a wait fails or times out, wait() writes them as JSON to `path` (if set; the trainer uses
  // <out_dir>/flight_recorder.rank<r>.json) before it throws, and its message names the file.
  static constexpr size_t kFlightRecords = 64;
  void set_flight_record_path(std::string path);
  std::vector<FlightRecord> flight_records() const;
  std::string flight_records_json() const;

 private:
  Operation issue(ProcessGroup& group, std::string name, bool collective, int64_t bytes, int32_t peer = -1);
  void end_flight(const Operation& operation, const char* state);
  // Writes the records to the flight record path; returns the path, or "" if none was written.
  std::string dump_flight_records() const;
  // Gives `group` (this rank a member) its Gloo backend and, with "nccl", its NCCL one.
  void attach_backends(ProcessGroup& group, const std::string& prefix);
  // Which members of `operation`'s group never reached it (asked through the store), followed by
  // where they ran, " (rank 1: pid P on HOST, Gloo on ADDRESS)", or with that put in
  // `where_they_ran` instead.
  std::string who_did_not_arrive(const Operation& operation, std::string* where_they_ran = nullptr);
  void mark_reached(const Operation& operation);
  // query_store_within store_answer_limit(); once one did not answer, the store is not used again
  // (the query's thread holds its client).
  bool ask_store(std::function<void(c10d::Store&)> query);
  std::string store_silence() const;  // "the rendezvous store at ... did not answer within 5 s: ..."
  std::chrono::milliseconds store_answer_limit() const {
    return std::min(timeout_ / 2, std::chrono::milliseconds(kStoreAnswerLimitMs));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, world_size_;
  std::chrono::milliseconds timeout_;
  std::string backend_;
  GlooNetwork network_;
  std::string store_address_;  // "host:port", for messages (set_store_address)
  std::atomic<bool> store_unresponsive_{false};

  static constexpr int64_t kStoreAnswerLimitMs = 5000;
  std::vector<std::unique_ptr<ProcessGroup>> groups_;
  int64_t shared_memory_slot_bytes_ = 0;  // use_shared_memory's; 0: none
  void attach_shared_memory(ProcessGroup& group);
  // The flight recorder (issue may run on the autograd thread, hence the lock).
  mutable std::mutex flight_mutex_;
  std::deque<FlightRecord> flight_;
  int64_t flight_issued_ = 0;
  std::string flight_path_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
};

}  // namespace weft
