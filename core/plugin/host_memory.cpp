// The host services for plugins' own memory: buffers on the rank's device, and
// copy, scale and squared norm on views of any device the host knows (what a plugin cannot do
// with plain C++ on a GPU's memory).
#include "core/plugin/host_services.h"

#include "core/model/kernels.h"

namespace weft {
namespace host {

weft_status* buffer_create(weft_host* host, int32_t ndim, const int64_t* shape, DLDataType dtype, weft_buffer** out,
                           DLTensor* view_out) {
  return guarded([&] {
    WEFT_CHECK(out && view_out && ndim >= 0 && (shape || ndim == 0), "buffer_create: bad arguments");
    const std::vector<int64_t> sizes(shape, shape + ndim);
    for (int64_t extent : sizes) WEFT_CHECK(extent >= 0, "buffer_create: negative extent {}", extent);
    auto buffer = std::make_unique<weft_buffer>();
    buffer->tensor = torch::zeros(sizes, torch::TensorOptions().dtype(sdk::from_dl_dtype(dtype)).device(state_of(host).device));
    *view_out = sdk::to_dl_view(buffer->tensor);
    *out = buffer.release();
  });
}

void buffer_release(weft_host*, weft_buffer* buffer) { delete buffer; }

weft_status* tensor_copy(weft_host*, DLTensor* dst, const DLTensor* src) {
  return guarded([&] {
    WEFT_CHECK(dst && src, "tensor_copy: null view");
    auto to = sdk::from_dl_view(*dst);
    const auto from = sdk::from_dl_view(*src);
    // Since 1.6 floating-point views convert (fp32 <-> bf16 / fp16); other dtypes must match.
    const bool converts = at::isFloatingType(to.scalar_type()) && at::isFloatingType(from.scalar_type());
    WEFT_CHECK(to.numel() == from.numel() && (to.scalar_type() == from.scalar_type() || converts),
               "tensor_copy: {} elements of {} into {} elements of {}", from.numel(), c10::toString(from.scalar_type()),
               to.numel(), c10::toString(to.scalar_type()));
    torch::NoGradGuard no_grad;
    to.copy_(from.reshape(to.sizes()));
  });
}

weft_status* tensor_scale(weft_host*, DLTensor* tensor, double factor) {
  return guarded([&] {
    WEFT_CHECK(tensor, "tensor_scale: null view");
    auto t = sdk::from_dl_view(*tensor);
    torch::NoGradGuard no_grad;
    if (factor == 0.0) {
      t.zero_();
      return;
    }
    WEFT_CHECK(t.is_floating_point(), "tensor_scale: {} is not a floating-point type", c10::toString(t.scalar_type()));
    t.mul_(factor);
  });
}

weft_status* tensor_add(weft_host*, DLTensor* dst, const DLTensor* src, double alpha) {
  return guarded([&] {
    WEFT_CHECK(dst && src, "tensor_add: null view");
    auto to = sdk::from_dl_view(*dst);
    const auto from = sdk::from_dl_view(*src);
    WEFT_CHECK(to.numel() == from.numel() && to.scalar_type() == from.scalar_type() && to.is_floating_point(),
               "tensor_add: floating-point views of the same element count and dtype needed ({} of {} and {} of {})",
               to.numel(), c10::toString(to.scalar_type()), from.numel(), c10::toString(from.scalar_type()));
    torch::NoGradGuard no_grad;
    to.add_(from.reshape(to.sizes()).to(to.device()), alpha);
  });
}

weft_status* tensor_squared_norm(weft_host*, const DLTensor* tensor, double* out) {
  return guarded([&] {
    WEFT_CHECK(tensor && out, "tensor_squared_norm: null argument");
    const auto t = sdk::from_dl_view(*tensor);
    WEFT_CHECK(t.is_floating_point(), "tensor_squared_norm: {} is not a floating-point type",
               c10::toString(t.scalar_type()));
    torch::NoGradGuard no_grad;
    *out = squared_sum_fp64(t).item<double>();
  });
}

}  // namespace host
}  // namespace weft
