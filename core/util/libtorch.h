// The LibTorch weft is built against. weft needs LibTorch 2.5 or newer (the floor is stated once,
// in cmake/libtorch.cmake, which refuses an older one at configure time; the assertion below
// catches a build that bypasses it): at::scaled_dot_product_attention's enable_gqa (2.5),
// TCPStoreOptions::useLibUV and c10d::Backend::shutdown (2.4), aten::_fused_adamw_ on the CPU (2.4).
#pragma once

#include <string>

#include <torch/version.h>

static_assert(TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 5),
              "weft needs LibTorch 2.5 or newer (cmake/libtorch.cmake)");

namespace weft {

// "2.11.0": the LibTorch this weft was compiled against (in run summaries and `trainer plugins`).
inline std::string libtorch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

}  // namespace weft
