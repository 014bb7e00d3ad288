// reductions.hpp - small collectives on doubles the pipeline runtime needs (loss and timing sums,
// gradient-norm pieces; the norms themselves: Host::squared_norm). Header-only, no LibTorch.
#ifndef WEFT_CORE_PIPELINE_REDUCTIONS_HPP
#define WEFT_CORE_PIPELINE_REDUCTIONS_HPP

#include <vector>

#include "core/plugin/step/step.hpp"

#include "dl_views.hpp"

namespace weft {
namespace plugins {

// `values` summed element-wise over `group` (returned as is for a group of one). Collective.
inline std::vector<double> sum_over(const weft::sdk::Host& host, weft::sdk::Group group, std::vector<double> values) {
  if (group.size() <= 1) return values;
  int64_t shape_and_stride[2];
  DLTensor view = flat_view(values, shape_and_stride);
  host.all_reduce(group, view).wait();
  return values;
}

// A held-out batch's sums added over `group` (finish_eval of a plugin whose ranks see
// different rows or tokens). Collective.
inline weft::sdk::EvalResult eval_sums_over(const weft::sdk::Host& host, weft::sdk::Group group,
                                            const weft::sdk::EvalResult& sums) {
  const std::vector<double> total = sum_over(host, group, {sums.loss_sum, static_cast<double>(sums.tokens)});
  weft::sdk::EvalResult result;
  result.loss_sum = total[0];
  result.tokens = static_cast<int64_t>(total[1] + 0.5);
  return result;
}

}  // namespace plugins
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_REDUCTIONS_HPP
