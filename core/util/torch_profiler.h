// PyTorch's own profiler (Kineto) around a few training steps: every ATen operator on the CPU and
// every CUDA kernel and copy on the GPU, written as a Chrome/Perfetto trace (what
// torch.profiler.profile(...).export_chrome_trace writes). `log.torch_profile` turns it on;
// tools/gpu/profile_summary.py sums a trace's kernels by name.
#pragma once

#include <string>

namespace weft {

class TorchProfiler {
 public:
  // Starts recording CPU operators, and CUDA kernels when `cuda`. Throws weft::Error if a
  // profile is already being recorded.
  void start(bool cuda);
  // Stops recording and writes the trace to `path` (replacing it). No-op if not started.
  void stop_and_save(const std::string& path);
  bool running() const { return running_; }

 private:
  bool running_ = false;
};

}  // namespace weft
