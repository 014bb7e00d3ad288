#include "core/util/memory.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

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
std::atomic<bool> installed{false};

// Each block carries its size in a 64-byte header (keeping LibTorch's 64-byte alignment).
constexpr size_t kHeader = 64;

void release(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof bytes);
  live_bytes.fetch_sub(bytes, std::memory_order_relaxed);
  c10::free_cpu(base);
}

void raise_peak(int64_t now) {
  int64_t peak = peak_bytes.load(std::memory_order_relaxed);
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

class CountingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override { return allocate_counted(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

 private:
  static c10::DataPtr allocate_counted(size_t n) {
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
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
#endif
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
}

bool memory_tracker_installed() { return installed.load(); }
int64_t tensor_bytes_live() { return live_bytes.load(std::memory_order_relaxed); }
int64_t tensor_bytes_peak() { return peak_bytes.load(std::memory_order_relaxed); }
void reset_tensor_peak() { peak_bytes.store(live_bytes.load(std::memory_order_relaxed), std::memory_order_relaxed); }

}  // namespace weft
