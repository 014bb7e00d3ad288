#include "core/dist/shared_memory_reduce.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <vector>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/util/error.h"

namespace weft {

// The segment: this header (a line for the barrier's count, one per member), then two sets of one
// slot per member.
struct SharedMemoryReduce::Header {
  struct alignas(64) Line {
    std::atomic<uint32_t> value;
    int32_t pid;
  };
  Line count;     // barriers arrived at, over all members (wraps; compared as a difference)
  Line ranks[1];  // [size]: each member's barriers passed, and its process
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the barrier's counters must be lock-free to be shared");

namespace {

constexpr size_t kPage = 4096;

size_t header_bytes(int size) {
  const size_t bytes = sizeof(SharedMemoryReduce::Header) + static_cast<size_t>(size) * 64;
  return (bytes + kPage - 1) / kPage * kPage;
}

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespace_of(const char* kind) {
  char target[256] = {};
  const std::string path = std::string("/proc/self/ns/") + kind;
  const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string("?");
}

// What members that can share a segment have in common.
std::string machine_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::ostringstream out;
  out << host << ' ' << read_first_line("/proc/sys/kernel/random/boot_id");
  for (const char* kind : {"ipc", "mnt", "net", "pid"}) out << ' ' << namespace_of(kind);
  return out.str();
}

std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string string_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

}  // namespace

std::unique_ptr<SharedMemoryReduce> SharedMemoryReduce::open(c10d::Store& store, const std::string& prefix, int rank,
                                                             int size, int64_t slot_floats,
                                                             std::chrono::milliseconds timeout, std::string* why_not) {
  const auto say = [&](const std::string& why) {
    if (why_not != nullptr) *why_not = why;
  };
  if (size < 2 || slot_floats < size) {
    say(size < 2 ? "one member" : "slots smaller than one float per member");
    return nullptr;
  }
  const std::string key = prefix + "/shared_memory/";
  const std::string me = machine_identity();
  store.set(key + "where/" + std::to_string(rank), bytes_of(me));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    if (string_of(store.get(key + "where/" + std::to_string(r))) != me) {
      say("its members run on more than one machine (or namespace)");
      return nullptr;
    }
  }
  const size_t bytes = header_bytes(size) + 2 * static_cast<size_t>(size) * static_cast<size_t>(slot_floats) * sizeof(float);
  std::string name;
  std::string problem;
  if (rank == 0) {
    std::random_device random;
    name = "/weft-" + std::to_string(::getpid()) + "-" + std::to_string((static_cast<uint64_t>(random()) << 32) | random());
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      problem = std::string("shm_open: ") + std::strerror(errno);
    } else {
      // Reserve the pages now (tmpfs): a full /dev/shm is an error here, not a SIGBUS at the first touch.
      int err = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
      if (err == 0) err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
      if (err != 0) problem = "reserving " + std::to_string(bytes >> 20) + " MiB in /dev/shm: " + std::strerror(err);
      ::close(fd);
    }
    if (!problem.empty()) ::shm_unlink(name.c_str());
    store.set(key + "name", bytes_of(problem.empty() ? name : std::string()));
  } else {
    name = string_of(store.get(key + "name"));
    if (name.empty()) problem = "rank 0 could not make the segment";
  }
  void* base = MAP_FAILED;
  if (problem.empty()) {
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      problem = std::string("shm_open: ") + std::strerror(errno);
    } else {
      base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED) problem = std::string("mmap: ") + std::strerror(errno);
      ::close(fd);
    }
  }
  // Every member says whether it mapped the segment; all use it or none. Then the name goes (the
  // mappings keep the memory until the last member unmaps it, and nothing is left behind after a crash).
  store.set(key + "mapped/" + std::to_string(rank), bytes_of(problem.empty() ? "1" : problem));
  std::string failed;
  for (int r = 0; r < size; ++r) {
    const std::string answer = string_of(store.get(key + "mapped/" + std::to_string(r)));
    if (answer != "1" && failed.empty()) failed = "rank " + std::to_string(r) + ": " + answer;
  }
  if (rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
  if (!failed.empty()) {
    if (base != MAP_FAILED) ::munmap(base, bytes);
    say(failed);
    return nullptr;
  }
  auto reduce = std::unique_ptr<SharedMemoryReduce>(new SharedMemoryReduce(rank, size, slot_floats, timeout, base, bytes));
  reduce->header_->ranks[rank].pid = static_cast<int32_t>(::getpid());
  reduce->arrive_and_wait();  // every pid is written before anyone reads one
  return reduce;
}

SharedMemoryReduce::SharedMemoryReduce(int rank, int size, int64_t slot_floats, std::chrono::milliseconds timeout,
                                       void* base, size_t bytes)
    : rank_(rank),
      size_(size),
      slot_floats_(slot_floats),
      timeout_(timeout),
      base_(base),
      bytes_(bytes),
      header_(static_cast<Header*>(base)) {}

SharedMemoryReduce::~SharedMemoryReduce() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  ::munmap(base_, bytes_);
}

float* SharedMemoryReduce::slot(int set, int r) const {
  return reinterpret_cast<float*>(static_cast<char*>(base_) + header_bytes(size_)) +
         (static_cast<int64_t>(set) * size_ + r) * slot_floats_;
}

// A barrier: each member adds one to the count; the last wakes the others, who sleep on it.
void SharedMemoryReduce::arrive_and_wait() {
  ++phase_;
  header_->ranks[rank_].value.store(phase_, std::memory_order_release);
  const uint32_t target = phase_ * static_cast<uint32_t>(size_);
  std::atomic<uint32_t>* count = &header_->count.value;
  const uint32_t now = count->fetch_add(1, std::memory_order_acq_rel) + 1;
  if (now == target) {
    futex(count, FUTEX_WAKE, INT_MAX, nullptr);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (int spin = 0;; ++spin) {
    const uint32_t seen = count->load(std::memory_order_acquire);
    if (static_cast<int32_t>(seen - target) >= 0) return;
    if (spin < 64) continue;
    const timespec slice{0, 50 * 1000 * 1000};
    futex(count, FUTEX_WAIT, seen, &slice);
    if (spin % 4 != 0) continue;
    // Who has not arrived: gone (its process no longer exists), or late past the timeout.
    std::string late;
    for (int r = 0; r < size_; ++r) {
      const uint32_t passed = header_->ranks[r].value.load(std::memory_order_acquire);
      if (static_cast<int32_t>(passed - phase_) >= 0) continue;
      const int32_t pid = header_->ranks[r].pid;
      if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) {
        fail("{} over shared memory: group rank {} (pid {}) exited before it", operation_, r, pid);
      }
      late += (late.empty() ? "" : ", ") + std::to_string(r);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      fail("{} over shared memory timed out after {:.0f} s: group rank(s) {} did not arrive", operation_,
           std::chrono::duration<double>(timeout_).count(), late);
    }
  }
}

void SharedMemoryReduce::all_reduce_sum(float* data, int64_t count) {
  operation_ = "all_reduce";
  // Pieces of a slot each, small enough to stay in the caches between the copies; two sets of slots
  // in turn, so that one barrier per piece separates the copies in from the sums and one the sums
  // from the copies out (a set is written again two pieces later, after every member passed the
  // next piece's first barrier, so after its copies out of this one).
  for (int64_t offset = 0; offset < count; offset += slot_floats_) {
    const int set = static_cast<int>(pieces_++ % 2);  // in turn over calls too
    const int64_t n = std::min(slot_floats_, count - offset);
    std::memcpy(slot(set, rank_), data + offset, static_cast<size_t>(n) * sizeof(float));
    arrive_and_wait();
    // This member's share of the elements, summed over the slots in rank order into slot 0 (whose
    // elements of this range no other member reads until the next barrier) and into its own vector.
    const int64_t first = n * rank_ / size_, last = n * (rank_ + 1) / size_;
    float* out = slot(set, 0);
    for (int r = 1; r < size_; ++r) {
      const float* in = slot(set, r);
      for (int64_t i = first; i < last; ++i) out[i] += in[i];
    }
    std::memcpy(data + offset + first, out + first, static_cast<size_t>(last - first) * sizeof(float));
    arrive_and_wait();
    std::memcpy(data + offset, out, static_cast<size_t>(first) * sizeof(float));
    std::memcpy(data + offset + last, out + last, static_cast<size_t>(n - last) * sizeof(float));
  }
}

// A reduce-scatter's and an all-gather's pieces need one barrier each: a member reads only the
// slots of its piece's set, and before the next piece's barrier; the set is written again two
// pieces later, after every member passed the next piece's barrier.
void SharedMemoryReduce::reduce_scatter_sum(const float* input, float* output, int64_t part) {
  operation_ = "reduce_scatter";
  const int64_t piece = slot_floats_ / size_;  // a slot holds a piece of every part (open: slot_floats_ >= size_)
  for (int64_t offset = 0; offset < part; offset += piece) {
    const int set = static_cast<int>(pieces_++ % 2);
    const int64_t n = std::min(piece, part - offset);
    float* mine = slot(set, rank_);
    for (int r = 0; r < size_; ++r) {
      std::memcpy(mine + r * n, input + r * part + offset, static_cast<size_t>(n) * sizeof(float));
    }
    arrive_and_wait();
    float* out = output + offset;
    std::memcpy(out, slot(set, 0) + rank_ * n, static_cast<size_t>(n) * sizeof(float));
    for (int r = 1; r < size_; ++r) {
      const float* in = slot(set, r) + rank_ * n;
      for (int64_t i = 0; i < n; ++i) out[i] += in[i];
    }
  }
}

void SharedMemoryReduce::all_gather(const void* input, void* output, int64_t bytes) {
  operation_ = "all_gather";
  const int64_t piece = slot_floats_ * static_cast<int64_t>(sizeof(float));
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  for (int64_t offset = 0; offset < bytes; offset += piece) {
    const int set = static_cast<int>(pieces_++ % 2);
    const auto n = static_cast<size_t>(std::min(piece, bytes - offset));
    std::memcpy(slot(set, rank_), in + offset, n);
    arrive_and_wait();
    for (int r = 0; r < size_; ++r) std::memcpy(out + r * bytes + offset, slot(set, r), n);
  }
}

void SharedMemoryReduce::enqueue(std::function<void(SharedMemoryReduce&)> operation,
                                 std::function<void(std::exception_ptr)> done) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!thread_.joinable()) thread_ = std::thread([this] { worker(); });
  queue_.emplace_back([this, operation = std::move(operation), done = std::move(done)] {
    // After a failure the members' barriers are out of step: every later operation fails, naming the
    // first failure's operation (its own message, with the ranks it named, went to that operation's waiter).
    std::exception_ptr error;
    if (!broken_.empty()) {
      try {
        fail("not run over shared memory: this group's segment is out of step since its {} failed", broken_);
      } catch (...) {
        error = std::current_exception();
      }
    } else {
      try {
        operation(*this);
      } catch (...) {
        error = std::current_exception();
        broken_ = operation_;
      }
    }
    done(error);
  });
  cv_.notify_one();
}

void SharedMemoryReduce::worker() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace weft
