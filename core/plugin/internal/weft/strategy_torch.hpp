// weft/strategy_torch.hpp - the host's internal step interface (weft/strategy.hpp) with the SDK's
// views between DLTensor and at::Tensor (weft/plugin_torch.hpp). Not installed; no plugin sees it.
#ifndef WEFT_STRATEGY_TORCH_HPP
#define WEFT_STRATEGY_TORCH_HPP

#include <weft/plugin_torch.hpp>
#include <weft/strategy.hpp>

#endif  // WEFT_STRATEGY_TORCH_HPP
