// reductions.hpp - small collectives on doubles and local norms that several plugins need
// (loss and timing sums, gradient-norm pieces). Header-only, SDK only.
#ifndef WEFT_PLUGINS_COMMON_REDUCTIONS_HPP
#define WEFT_PLUGINS_COMMON_REDUCTIONS_HPP

#include <vector>

#include <weft/strategy.hpp>

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

// The sum of squares of a contiguous fp32 CPU view, in double.
inline double squared_norm(const DLTensor& tensor) {
  const float* x = float_data(tensor);
  double sum = 0.0;
  for (int64_t i = 0, n = element_count(tensor); i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

}  // namespace plugins
}  // namespace weft

#endif  // WEFT_PLUGINS_COMMON_REDUCTIONS_HPP
