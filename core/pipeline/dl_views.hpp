// dl_views.hpp - small helpers over DLTensor views for the pipeline runtime: element counts, the
// dtype check, and views of small host vectors (loss and timing sums) to hand to the host's
// collectives. Data on the model's device lives in Host::buffer and is copied, scaled and measured
// through the host step interface (core/plugin/step/step.hpp), never with memcpy. Header-only, no LibTorch.
#ifndef WEFT_CORE_PIPELINE_DL_VIEWS_HPP
#define WEFT_CORE_PIPELINE_DL_VIEWS_HPP

#include <cstdint>
#include <vector>

#include "core/plugin/step/services.h"

namespace weft {
namespace plugins {

// The product of the shape (1 for a scalar).
inline int64_t element_count(const DLTensor& tensor) {
  int64_t count = 1;
  for (int32_t d = 0; d < tensor.ndim; ++d) count *= tensor.shape[d];
  return count;
}

// True for an fp32 view (any device, any strides).
inline bool is_fp32(const DLTensor& tensor) {
  return tensor.dtype.code == kDLFloat && tensor.dtype.bits == 32 && tensor.dtype.lanes == 1;
}

// A 1-D contiguous CPU view of a plugin-owned buffer. `shape_and_stride` ({n, 1}) must outlive
// the view; so must the buffer.
template <class T>
DLTensor flat_view(std::vector<T>& buffer, int64_t (&shape_and_stride)[2]) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "fp32 or fp64 buffers");
  shape_and_stride[0] = static_cast<int64_t>(buffer.size());
  shape_and_stride[1] = 1;
  DLTensor view{};
  view.data = buffer.data();
  view.device = {kDLCPU, 0};
  view.ndim = 1;
  view.dtype = {kDLFloat, static_cast<uint8_t>(sizeof(T) * 8), 1};
  view.shape = &shape_and_stride[0];
  view.strides = &shape_and_stride[1];
  view.byte_offset = 0;
  return view;
}

// A 1-D view of every element of a contiguous `tensor` (any dtype, any device), e.g. to hand a
// [parts, ...] tensor to the host's dim-0 collectives as parts equal runs of elements.
// `shape_and_stride` must outlive the view; so must the tensor.
inline DLTensor flat_contiguous_view(const DLTensor& tensor, int64_t (&shape_and_stride)[2]) {
  shape_and_stride[0] = element_count(tensor);
  shape_and_stride[1] = 1;
  DLTensor view = tensor;
  view.ndim = 1;
  view.shape = &shape_and_stride[0];
  view.strides = &shape_and_stride[1];
  return view;
}

}  // namespace plugins
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_DL_VIEWS_HPP
