#include "core/util/memory.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace weft {
namespace {

std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> peak_bytes{0};
std::atomic<int64_t> high_water{0};  // the most live bytes ever (never reset)
std::atomic<bool> installed{false};

// Each block carries its size in a 64-byte header (keeping LibTorch's 64-byte alignment).
constexpr size_t kHeader = 64;

void raise_peak(int64_t now) {
  int64_t peak = peak_bytes.load(std::memory_order_relaxed);
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  int64_t high = high_water.load(std::memory_order_relaxed);
  while (now > high && !high_water.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
  }
}

// Freed blocks of 1 MiB and more, kept by their exact size for the next allocation of that size:
// a training step allocates the same sizes every step, and a block malloc returned to the system
// (mmap, 4 MiB and more below) costs a page fault per 4 KiB each time it is allocated again.
// Measured on one core of an Intel Xeon, SmolLM2-135M in bf16, 4 x 256 tokens: without the cache
// 245k page faults and ~0.65 s of system time per full fine-tuning step (of ~4.2 s), 74k and
// ~0.15 s per LoRA step (of ~2.8 s); with it 32k and 6k. The blocks are kept only while the live
// tensors and the kept blocks together stay within 256 MiB above the most live bytes the process
// has had, so the resident memory it adds is bounded by the run's own peak plus that margin. (With
// no margin, the blocks freed at a step's peak, the head's logits among them, went back to the
// system and faulted again every step: 107k page faults per full fine-tuning step.)
class BlockCache {
 public:
  static constexpr size_t kMinBytes = size_t{1} << 20;
  static constexpr int64_t kSlack = int64_t{256} << 20;

  // A kept block of exactly `bytes`, or else nullptr after releasing kept blocks until a new one
  // of `bytes` fits under the bound.
  char* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = blocks_.find(bytes);
    if (it != blocks_.end()) {
      char* base = it->second;
      blocks_.erase(it);
      cached_ -= static_cast<int64_t>(bytes);
      return base;
    }
    const int64_t bound = high_water.load(std::memory_order_relaxed) + kSlack;
    const int64_t live = live_bytes.load(std::memory_order_relaxed);
    while (!blocks_.empty() && live + cached_ + static_cast<int64_t>(bytes) > bound) {
      const auto largest = std::prev(blocks_.end());
      cached_ -= static_cast<int64_t>(largest->first);
      c10::free_cpu(largest->second);
      blocks_.erase(largest);
    }
    return nullptr;
  }

  // Keeps `base` (a block of `bytes`, no longer live) where it fits under the bound; false: the
  // caller frees it.
  bool keep(char* base, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t live = live_bytes.load(std::memory_order_relaxed);
    if (live + cached_ + static_cast<int64_t>(bytes) > high_water.load(std::memory_order_relaxed) + kSlack) return false;
    blocks_.emplace(bytes, base);
    cached_ += static_cast<int64_t>(bytes);
    return true;
  }

  int64_t cached() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

 private:
  std::mutex mutex_;
  std::multimap<size_t, char*> blocks_;
  int64_t cached_ = 0;
};

BlockCache& block_cache() {
  static auto* cache = new BlockCache();  // never destroyed: blocks are freed until exit
  return *cache;
}

void release(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof bytes);
  live_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  const size_t total = static_cast<size_t>(bytes) + kHeader;
  if (total >= BlockCache::kMinBytes && block_cache().keep(base, total)) return;
  c10::free_cpu(base);
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override { return allocate_counted(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  static c10::DataPtr allocate_counted(size_t n) {
    const size_t total = n + kHeader;
    char* base = total >= BlockCache::kMinBytes ? block_cache().take(total) : nullptr;
    if (base == nullptr) base = static_cast<char*>(c10::alloc_cpu(total));
    const auto bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof bytes);
    raise_peak(live_bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    void* data = base + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
};

}  // namespace

void install_memory_tracker() {
  static CountingCpuAllocator allocator;
  if (installed.exchange(true)) return;
#if defined(__GLIBC__)
  // Blocks of 4 MiB and more come from mmap and go back to the system when freed, so a rank's
  // resident memory follows its live tensors. glibc's default threshold rises to 32 MiB after the
  // first large free and then keeps freed blocks below that in its heaps: measured, 0.8 GiB more
  // resident per rank in a step of the 1B shape with flat-sharded parameters, gathered and released.
  // MALLOC_MMAP_THRESHOLD_ in the environment (glibc's own setting) wins.
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 4 << 20);
  // Setting that threshold also fixes glibc's trim threshold at its 128 KiB default: whenever 128
  // KiB at the top of the heap were free, they went back to the system and faulted in again at
  // the next allocations there. The blocks below 1 MiB that a step allocates and frees (LoRA
  // dropout's masks, each adapter's small operands and gradients) then cost a page fault per 4 KiB
  // every step: measured on the quickstart's bf16 LoRA step, 25k page faults per step with dropout
  // 0.05 and 5k without; with the heap's top kept up to 64 MiB, none and under 100 (peak RSS +3
  // MiB). MALLOC_TRIM_THRESHOLD_ in the environment wins.
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") == nullptr) mallopt(M_TRIM_THRESHOLD, 64 << 20);
#endif
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
}

bool memory_tracker_installed() { return installed.load(); }
int64_t tensor_bytes_live() { return live_bytes.load(std::memory_order_relaxed); }
int64_t tensor_bytes_peak() { return peak_bytes.load(std::memory_order_relaxed); }
int64_t tensor_bytes_high_water() { return high_water.load(std::memory_order_relaxed); }
int64_t tensor_bytes_cached() { return block_cache().cached(); }
void reset_tensor_peak() { peak_bytes.store(live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed); }

}  // namespace weft
