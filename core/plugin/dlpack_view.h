// Non-owning conversions between at::Tensor and DLPack's DLTensor for the plugin boundary.
#pragma once

#include <dlpack/dlpack.h>

#include <ATen/core/Tensor.h>

namespace weft {

// A DLTensor describing `tensor` (shape and strides point into the tensor's own metadata, so
// the view is valid while `tensor` is alive and not resized). Throws weft::Error for dtypes or
// devices DLPack 0.6 cannot describe.
DLTensor dl_view(const at::Tensor& tensor);

// An at::Tensor over the memory a DLTensor describes (no copy; the caller keeps the memory
// alive). Throws weft::Error on an unsupported dtype/device or a null data pointer.
at::Tensor tensor_from_dl(const DLTensor& dl);

}  // namespace weft
