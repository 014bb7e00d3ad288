// weft/plugin_torch.hpp - for ABI 2 plugins (weft/plugin.h) that do their own maths with LibTorch:
// the views between DLTensor and at::Tensor of weft/strategy_torch.hpp, and the function that
// tells the host which LibTorch the plugin was built against ("weft_torch_build"), which the host
// checks at load against its own (version and C++ ABI) and refuses in one line on a mismatch.
//
//   #include <weft/plugin_torch.hpp>
//   WEFT_PLUGIN_TORCH_BUILD(my_torch_build)           // defines my_torch_build()
//   ... get_proc_address: if (strcmp(name, "weft_torch_build") == 0) return (weft_proc)my_torch_build;
//
// The plugin links LibTorch itself (find_package(Torch), target_link_libraries(... torch)).
#ifndef WEFT_PLUGIN_TORCH_HPP
#define WEFT_PLUGIN_TORCH_HPP

#include <torch/version.h>

#include <weft/plugin.h>
#include <weft/strategy_torch.hpp>

// Defines `const weft_torch_build* name(void)` returning this translation unit's LibTorch build.
#define WEFT_PLUGIN_TORCH_BUILD(name)                                                              \
  static const weft_torch_build* name(void) {                                                      \
    static const weft_torch_build build = {sizeof(weft_torch_build), TORCH_VERSION_MAJOR,          \
                                           TORCH_VERSION_MINOR, TORCH_VERSION_PATCH,               \
                                           _GLIBCXX_USE_CXX11_ABI};                                \
    return &build;                                                                                 \
  }

#endif  // WEFT_PLUGIN_TORCH_HPP
