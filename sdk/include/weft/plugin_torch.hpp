// weft/plugin_torch.hpp - for plugins (weft/plugin.h) that do their own maths with LibTorch:
// non-owning views between DLTensor and at::Tensor, and the function that tells the host which
// LibTorch the plugin was built against ("weft_torch_build"), which the host checks at load against
// its own (version and C++ ABI) and refuses in one line on a mismatch.
//
//   #include <weft/plugin_torch.hpp>
//   WEFT_PLUGIN_TORCH_BUILD(my_torch_build)           // defines my_torch_build()
//   ... get_proc_address: if (strcmp(name, "weft_torch_build") == 0) return (weft_proc)my_torch_build;
//
// The plugin links LibTorch itself (find_package(Torch), target_link_libraries(... torch)) and must
// be built against the host's own LibTorch (same version and build; `trainer plugins` prints the
// host's), since both load into one process; a plugin without LibTorch works with any host of its
// ABI major.
//
// Views: dtypes float32, float64, float16, bfloat16, int64, int32, uint8, bool; devices CPU and
// CUDA. Under DLPack < 0.8 (no kDLBool, e.g. Debian's 0.6) bool is described as {kDLUInt, 8, 1} -
// the same bits as uint8, as weft's host does - so a bool tensor comes back from from_dl_view as
// uint8 there. Anything else throws std::invalid_argument (catch it: no exception may cross the ABI).
#ifndef WEFT_PLUGIN_TORCH_HPP
#define WEFT_PLUGIN_TORCH_HPP

#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/version.h>

#include <weft/plugin.h>

// Defines `const weft_torch_build* name(void)` returning this translation unit's LibTorch build.
#define WEFT_PLUGIN_TORCH_BUILD(name)                                                              \
  static const weft_torch_build* name(void) {                                                      \
    static const weft_torch_build build = {sizeof(weft_torch_build), TORCH_VERSION_MAJOR,          \
                                           TORCH_VERSION_MINOR, TORCH_VERSION_PATCH,               \
                                           _GLIBCXX_USE_CXX11_ABI};                                \
    return &build;                                                                                 \
  }

namespace weft {
namespace sdk {

// The DLPack description of a LibTorch dtype. Throws std::invalid_argument for other dtypes.
inline DLDataType to_dl_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DLDataType{kDLFloat, 32, 1};
    case at::kDouble: return DLDataType{kDLFloat, 64, 1};
    case at::kHalf: return DLDataType{kDLFloat, 16, 1};
    case at::kBFloat16: return DLDataType{kDLBfloat, 16, 1};
    case at::kLong: return DLDataType{kDLInt, 64, 1};
    case at::kInt: return DLDataType{kDLInt, 32, 1};
    case at::kByte: return DLDataType{kDLUInt, 8, 1};
#if defined(DLPACK_VERSION) && DLPACK_VERSION >= 80
    case at::kBool: return DLDataType{kDLBool, 8, 1};
#else
    case at::kBool: return DLDataType{kDLUInt, 8, 1};
#endif
    default:
      throw std::invalid_argument(
                  std::string("tensor dtype ") + c10::toString(type) + " has no DLPack view");
  }
}

// The LibTorch dtype of a DLPack description. Throws std::invalid_argument for other dtypes and
// for lanes != 1.
inline at::ScalarType from_dl_dtype(DLDataType type) {
  if (type.lanes == 1) {
    if (type.code == kDLFloat && type.bits == 32) return at::kFloat;
    if (type.code == kDLFloat && type.bits == 64) return at::kDouble;
    if (type.code == kDLFloat && type.bits == 16) return at::kHalf;
    if (type.code == kDLBfloat && type.bits == 16) return at::kBFloat16;
    if (type.code == kDLInt && type.bits == 64) return at::kLong;
    if (type.code == kDLInt && type.bits == 32) return at::kInt;
    if (type.code == kDLUInt && type.bits == 8) return at::kByte;
#if defined(DLPACK_VERSION) && DLPACK_VERSION >= 80
    if (type.code == kDLBool && type.bits == 8) return at::kBool;
#endif
  }
  throw std::invalid_argument("DLPack dtype (code " + std::to_string(static_cast<int>(type.code)) + ", " +
                                           std::to_string(static_cast<int>(type.bits)) + " bits, " +
                                           std::to_string(static_cast<int>(type.lanes)) + " lanes) has no LibTorch dtype");
}

// A DLTensor describing `tensor` without copying: data points at its first element (byte_offset
// 0), shape and strides point into the tensor's own size/stride metadata, so the view is valid
// while `tensor` (its TensorImpl) lives and is neither resized nor restrided. Writable through
// the view if the tensor is. Throws std::invalid_argument for an undefined tensor, an unsupported
// dtype or a device other than CPU/CUDA.
inline DLTensor to_dl_view(const at::Tensor& tensor) {
  if (!tensor.defined()) throw std::invalid_argument("an undefined tensor has no DLPack view");
  DLTensor view{};
  if (tensor.is_cuda()) {
    view.device = DLDevice{kDLCUDA, static_cast<int32_t>(tensor.get_device())};
  } else if (tensor.is_cpu()) {
    view.device = DLDevice{kDLCPU, 0};
  } else {
    throw std::invalid_argument("only CPU and CUDA tensors have a DLPack view");
  }
  view.dtype = to_dl_dtype(tensor.scalar_type());
  view.data = tensor.data_ptr();
  view.ndim = static_cast<int32_t>(tensor.dim());
  view.shape = const_cast<int64_t*>(tensor.sizes().data());
  view.strides = const_cast<int64_t*>(tensor.strides().data());
  view.byte_offset = 0;
  return view;
}

// An at::Tensor over the memory `view` describes (at::from_blob with its strides; contiguous
// strides when view.strides is NULL): no copy, no ownership - the memory must outlive the
// tensor and every tensor sharing its storage. Throws std::invalid_argument for an unsupported
// dtype or device, or a NULL data pointer with elements.
inline at::Tensor from_dl_view(const DLTensor& view) {
  at::TensorOptions options = at::TensorOptions().dtype(from_dl_dtype(view.dtype));
  if (view.device.device_type == kDLCUDA) {
    options = options.device(at::kCUDA, static_cast<c10::DeviceIndex>(view.device.device_id));
  } else if (view.device.device_type != kDLCPU) {
    throw std::invalid_argument("DLPack device type " +
                                             std::to_string(static_cast<int>(view.device.device_type)) +
                                             " has no LibTorch device (CPU and CUDA only)");
  }
  const std::vector<int64_t> sizes(view.shape, view.shape + view.ndim);
  int64_t elements = 1;
  for (int64_t size : sizes) elements *= size;
  if (view.data == nullptr && elements != 0) {
    throw std::invalid_argument("DLTensor has no data");
  }
  void* data = static_cast<char*>(view.data) + view.byte_offset;
  if (view.strides == nullptr) return at::from_blob(data, sizes, options);
  const std::vector<int64_t> strides(view.strides, view.strides + view.ndim);
  return at::from_blob(data, sizes, strides, options);
}

}  // namespace sdk
}  // namespace weft

#endif  // WEFT_PLUGIN_TORCH_HPP
