#include "core/util/device.h"

#include <cstdlib>
#include <fstream>
#include <string>

#include <fmt/format.h>

#ifdef WEFT_WITH_CUDA  // LibTorch's CUDA builds (PyTorch's wheels) on a machine with the CUDA toolkit
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#include "core/util/error.h"

namespace weft {

DeviceInventory this_process_devices() {
  DeviceInventory inventory;
#ifdef WEFT_WITH_CUDA
  inventory.cuda_compiled = true;
  inventory.cuda_devices = static_cast<int>(c10::cuda::device_count());
#endif
  const char* share = std::getenv("WEFT_SHARE_GPUS");
  inventory.share = share != nullptr && std::string(share) == "1";
  return inventory;
}

c10::Device resolve_device(const std::string& setting, int local_rank, int rank, const DeviceInventory& inventory) {
  WEFT_CHECK(setting == "auto" || setting == "cpu" || setting == "cuda",
             "train.device must be \"auto\", \"cpu\" or \"cuda\", got \"{}\"", setting);
  if (setting == "cpu") return c10::Device(c10::kCPU);
  if (setting == "auto" && (!inventory.cuda_compiled || inventory.cuda_devices == 0)) return c10::Device(c10::kCPU);
  WEFT_CHECK(inventory.cuda_compiled,
             "train.device = \"cuda\", but this weft was built without CUDA (against a CPU LibTorch, or without a "
             "CUDA toolkit on the build machine: tools/setup.sh builds against PyTorch's CUDA wheel)");
  WEFT_CHECK(inventory.cuda_devices > 0,
             "train.device = \"cuda\", but rank {} sees no CUDA device (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
             rank);
  if (inventory.share) return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % inventory.cuda_devices));
  WEFT_CHECK(local_rank >= 0 && local_rank < inventory.cuda_devices,
             "rank {} is local rank {} on its machine and would compute on cuda:{}, but the machine shows {} CUDA "
             "device{} to it: start at most {} rank{} per machine (--nproc, torchrun's --nproc-per-node, Slurm's "
             "--ntasks-per-node), or check CUDA_VISIBLE_DEVICES",
             rank, local_rank, local_rank, inventory.cuda_devices, inventory.cuda_devices == 1 ? "" : "s",
             inventory.cuda_devices, inventory.cuda_devices == 1 ? "" : "s");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

void bind_device(const c10::Device& device) {
  if (!device.is_cuda()) return;
#ifdef WEFT_WITH_CUDA
  c10::cuda::set_device(device.index());
#endif
}

void synchronize(const c10::Device& device) {
  if (!device.is_cuda()) return;
#ifdef WEFT_WITH_CUDA
  c10::cuda::device_synchronize();
#endif
}

std::string device_name(const c10::Device& device) {
  if (!device.is_cuda()) return "cpu";
#ifdef WEFT_WITH_CUDA
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, device.index()) == cudaSuccess) return properties.name;
#endif
  return device.str();
}

DeviceMemory device_memory(const c10::Device& device) {
  DeviceMemory memory;
  if (!device.is_cuda()) return memory;
#ifdef WEFT_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const size_t all = 0;  // StatType::AGGREGATE (its namespace moved between versions; 0 in all)
  memory.peak_allocated_bytes = stats.allocated_bytes[all].peak;
  memory.peak_reserved_bytes = stats.reserved_bytes[all].peak;
#endif
  return memory;
}

int64_t device_total_bytes(const c10::Device& device) {
  if (device.is_cuda()) {
#ifdef WEFT_WITH_CUDA
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, device.index()) == cudaSuccess) {
      return static_cast<int64_t>(properties.totalGlobalMem);
    }
#endif
    return 0;
  }
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

void reset_device_memory_peaks(const c10::Device& device) {
  if (!device.is_cuda()) return;
#ifdef WEFT_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

}  // namespace weft
