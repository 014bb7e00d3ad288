#include "core/plugin/dlpack_view.h"

#include <torch/torch.h>

#include "core/util/error.h"

namespace weft {
namespace {

DLDataType dl_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kDouble: return {kDLFloat, 64, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kLong: return {kDLInt, 64, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kByte: return {kDLUInt, 8, 1};
    case at::kBool: return {kDLUInt, 8, 1};
    default: fail("tensor dtype {} cannot cross the plugin ABI", std::string(c10::toString(type)));
  }
}

at::ScalarType scalar_type(const DLDataType& t) {
  WEFT_CHECK(t.lanes == 1, "DLTensor with {} lanes is not supported", t.lanes);
  if (t.code == kDLFloat && t.bits == 32) return at::kFloat;
  if (t.code == kDLFloat && t.bits == 64) return at::kDouble;
  if (t.code == kDLFloat && t.bits == 16) return at::kHalf;
  if (t.code == kDLBfloat && t.bits == 16) return at::kBFloat16;
  if (t.code == kDLInt && t.bits == 64) return at::kLong;
  if (t.code == kDLInt && t.bits == 32) return at::kInt;
  if (t.code == kDLUInt && t.bits == 8) return at::kByte;
  fail("DLTensor dtype (code {}, {} bits) is not supported", static_cast<int>(t.code), static_cast<int>(t.bits));
}

}  // namespace

DLTensor dl_view(const at::Tensor& tensor) {
  DLTensor dl{};
  dl.data = tensor.data_ptr();
  dl.ndim = static_cast<int32_t>(tensor.dim());
  dl.dtype = dl_dtype(tensor.scalar_type());
  dl.shape = const_cast<int64_t*>(tensor.sizes().data());
  dl.strides = const_cast<int64_t*>(tensor.strides().data());
  dl.byte_offset = 0;
  if (tensor.is_cuda()) {
    dl.device = {kDLCUDA, static_cast<int32_t>(tensor.get_device())};
  } else {
    WEFT_CHECK(tensor.is_cpu(), "only CPU and CUDA tensors cross the plugin ABI");
    dl.device = {kDLCPU, 0};
  }
  return dl;
}

at::Tensor tensor_from_dl(const DLTensor& dl) {
  WEFT_CHECK(dl.data != nullptr || dl.ndim == 0, "DLTensor has no data");
  WEFT_CHECK(dl.device.device_type == kDLCPU || dl.device.device_type == kDLCUDA,
             "DLTensor on device type {} is not supported", static_cast<int>(dl.device.device_type));
  auto options = at::TensorOptions().dtype(scalar_type(dl.dtype));
  if (dl.device.device_type == kDLCUDA) options = options.device(at::kCUDA, dl.device.device_id);
  const std::vector<int64_t> sizes(dl.shape, dl.shape + dl.ndim);
  void* data = static_cast<char*>(dl.data) + dl.byte_offset;
  if (dl.strides == nullptr) return at::from_blob(data, sizes, options);
  const std::vector<int64_t> strides(dl.strides, dl.strides + dl.ndim);
  return at::from_blob(data, sizes, strides, options);
}

}  // namespace weft
