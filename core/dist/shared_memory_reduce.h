// Collectives among the processes of one machine through a shared memory segment, beside a group's
// Gloo connections: Gloo on loopback moves each byte through the kernel's sockets several times.
// Piece by piece (a slot's worth, small enough to stay in the caches), each rank copies its data
// into its slot; after a barrier, for an all-reduce (fp32 sum) it sums its 1/N of the elements over
// the slots in rank order (every rank then holds the same bits) and copies the others' sums back;
// for a reduce-scatter (fp32 sum) it sums its own part over the slots in rank order; for an
// all-gather (any bytes) it copies every slot out. Waits sleep on a futex in the segment.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace c10d {
class Store;
}

namespace weft {

class SharedMemoryReduce {
 public:
  // Collective over the group's `size` members (keys under `prefix` in `store`). Returns null on every
  // member when they do not all run on this machine (host name, boot, and the IPC, mount and network
  // namespaces: ranks in network namespaces of their own count as machines of their own) or when a
  // member could not map the segment (a small /dev/shm: the reason is in `why_not`). Each slot holds
  // `slot_floats`, two per member; longer vectors go through in pieces.
  static std::unique_ptr<SharedMemoryReduce> open(c10d::Store& store, const std::string& prefix, int rank, int size,
                                                  int64_t slot_floats, std::chrono::milliseconds timeout,
                                                  std::string* why_not = nullptr);
  ~SharedMemoryReduce();
  SharedMemoryReduce(const SharedMemoryReduce&) = delete;
  SharedMemoryReduce& operator=(const SharedMemoryReduce&) = delete;

  // Sums `count` floats at `data` over the members, in place, on this thread. Every member calls it
  // in the same order with the same count. Throws weft::Error ("timed out" in its message) when a
  // member does not arrive within the timeout, naming it, or at once when a member's process is gone.
  void all_reduce_sum(float* data, int64_t count);

  // This member's part of the sum over the members of their `input`s (each `size()` parts of `part`
  // floats, in group-rank order: part r goes to group rank r), summed in rank order, into `output`.
  // Every member calls it in the same order with the same part; errors as all_reduce_sum's.
  void reduce_scatter_sum(const float* input, float* output, int64_t part);

  // Every member's `bytes` at `input`, in group-rank order, into `output` (size() x bytes).
  void all_gather(const void* input, void* output, int64_t bytes);

  // Runs `operation` (one of the above) on this reducer's own thread, in issue order: `done` runs
  // there with the error, if any. After a failure every later operation fails with it.
  void enqueue(std::function<void(SharedMemoryReduce&)> operation, std::function<void(std::exception_ptr)> done);

  int rank() const { return rank_; }
  int size() const { return size_; }

  struct Header;  // the segment's start (shared_memory_reduce.cpp)

 private:
  SharedMemoryReduce(int rank, int size, int64_t slot_floats, std::chrono::milliseconds timeout, void* base, size_t bytes);
  void arrive_and_wait();
  float* slot(int set, int r) const;
  void worker();

  int rank_, size_;
  int64_t slot_floats_;
  std::chrono::milliseconds timeout_;
  void* base_;
  size_t bytes_;
  Header* header_;
  uint32_t phase_ = 0;    // barriers this rank passed
  uint64_t pieces_ = 0;   // pieces moved, over all operations (which set of slots is next)
  const char* operation_ = "all_reduce";  // the one under way, for errors
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::string broken_;  // the operation that failed first, if one did (every later one fails)
  std::thread thread_;
};

}  // namespace weft
