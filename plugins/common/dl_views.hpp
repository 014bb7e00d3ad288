// dl_views.hpp - small helpers over DLTensor views shared by the shipped plugins: element
// counts, the fp32 CPU contiguity check a plugin needs before it memcpy's a gradient, and views
// of plugin-owned buffers to hand to the host's collectives. Header-only, SDK only (no LibTorch).
#ifndef WEFT_PLUGINS_COMMON_DL_VIEWS_HPP
#define WEFT_PLUGINS_COMMON_DL_VIEWS_HPP

#include <cstdint>
#include <vector>

#include <weft/strategy.h>

namespace weft {
namespace plugins {

// The product of the shape (1 for a scalar).
inline int64_t element_count(const DLTensor& tensor) {
  int64_t count = 1;
  for (int32_t d = 0; d < tensor.ndim; ++d) count *= tensor.shape[d];
  return count;
}

// True for a row-major, gap-free fp32 tensor in CPU memory (NULL strides mean contiguous).
inline bool is_contiguous_cpu_fp32(const DLTensor& tensor) {
  if (tensor.device.device_type != kDLCPU) return false;
  if (tensor.dtype.code != kDLFloat || tensor.dtype.bits != 32 || tensor.dtype.lanes != 1) return false;
  if (tensor.strides == nullptr) return true;
  int64_t expected = 1;
  for (int32_t d = tensor.ndim - 1; d >= 0; --d) {
    if (tensor.shape[d] != 1 && tensor.strides[d] != expected) return false;
    expected *= tensor.shape[d];
  }
  return true;
}

// The first element of a view (data + byte_offset).
inline float* float_data(const DLTensor& tensor) {
  return reinterpret_cast<float*>(static_cast<char*>(tensor.data) + tensor.byte_offset);
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

// A contiguous N-D fp32 CPU view of a plugin-owned buffer with `shape`; `shape` and `strides`
// (filled here) must outlive the view; so must the buffer (at least the product of shape).
inline DLTensor dense_view(float* data, std::vector<int64_t>& shape, std::vector<int64_t>& strides) {
  strides.assign(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  DLTensor view{};
  view.data = data;
  view.device = {kDLCPU, 0};
  view.ndim = static_cast<int32_t>(shape.size());
  view.dtype = {kDLFloat, 32, 1};
  view.shape = shape.data();
  view.strides = strides.data();
  view.byte_offset = 0;
  return view;
}

}  // namespace plugins
}  // namespace weft

#endif  // WEFT_PLUGINS_COMMON_DL_VIEWS_HPP
