// Where a rank computes: train.device resolved against what this process sees, and the few
// device services the host needs that differ between a CPU and a CUDA device (binding the rank
// to its GPU, waiting for queued work before reading a clock, peak memory). Every CUDA-only call
// of the host is in device.cpp, compiled where LibTorch has CUDA (WEFT_WITH_CUDA); elsewhere the
// same functions answer for the CPU.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace weft {

// What a process can compute on: whether this weft has LibTorch's CUDA paths and how many CUDA
// devices it sees (after CUDA_VISIBLE_DEVICES). `share`: WEFT_SHARE_GPUS=1, a testing setting that
// lets more local ranks than GPUs share them round-robin (tools/gpu/kit.sh runs multi-rank plugins
// on one GPU that way); their collectives then go over Gloo, as NCCL refuses two ranks on one GPU.
struct DeviceInventory {
  bool cuda_compiled = false;
  int cuda_devices = 0;
  bool share = false;
};
DeviceInventory this_process_devices();

// Resolves train.device for the rank with `local_rank` (its index among the ranks of its
// machine: LOCAL_RANK under torchrun and trainer --nproc, SLURM_LOCALID under Slurm):
//   "cpu"  -> cpu;
//   "cuda" -> cuda:<local_rank>;
//   "auto" -> cuda:<local_rank> where this weft has CUDA and the process sees a device, else cpu.
// Throws weft::Error naming the problem, before any compute: an unknown setting, "cuda" in a
// build without CUDA or on a machine without a visible device, or a local rank whose device does
// not exist (more ranks on a machine than GPUs it shows). `rank` only names the rank in messages.
c10::Device resolve_device(const std::string& setting, int local_rank, int rank, const DeviceInventory& inventory);

// Makes `device` the calling thread's current CUDA device (what NCCL and the caching allocator
// use); nothing for the CPU.
void bind_device(const c10::Device& device);

// Waits until the work queued on `device` is done (a CUDA device runs kernels asynchronously, so
// a clock read without it measures the launch, not the work); nothing for the CPU.
void synchronize(const c10::Device& device);

// The device's name as its driver reports it ("NVIDIA H100 80GB HBM3"), or "cpu".
std::string device_name(const c10::Device& device);

// Peak memory of the CUDA caching allocator on `device` since the last reset: allocated (held
// by tensors) and reserved (held by the allocator); both 0 for the CPU (see memory.h for CPU RSS).
struct DeviceMemory {
  int64_t peak_allocated_bytes = 0;
  int64_t peak_reserved_bytes = 0;
};
DeviceMemory device_memory(const c10::Device& device);
// The memory `device` has in all: a CUDA device's total memory, or the machine's (MemTotal of
// /proc/meminfo) for the CPU; 0 when unknown.
int64_t device_total_bytes(const c10::Device& device);
void reset_device_memory_peaks(const c10::Device& device);

}  // namespace weft
