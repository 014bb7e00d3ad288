// ABI 1.2's memory services (1.6: copies between floating-point dtypes), through the real host and through the SDK's fallback for older hosts:
// buffers on the rank's device (the CPU here: the GPU kit runs this on CUDA models through the
// plugins' conformance checks) and copy / scale / add / squared norm on views, strided ones too.
#include <cstring>
#include <vector>

#include <gtest/gtest.h>
#include <weft/strategy.hpp>

#include "core/dist/process_groups.h"
#include "core/plugin/host_api.h"

namespace weft {
namespace {

constexpr DLDataType kF32{kDLFloat, 32, 1};

DLTensor view_of(std::vector<float>& values, std::vector<int64_t>& shape, std::vector<int64_t>* strides = nullptr) {
  DLTensor view{};
  view.data = values.data();
  view.device = DLDevice{kDLCPU, 0};
  view.ndim = static_cast<int32_t>(shape.size());
  view.dtype = kF32;
  view.shape = shape.data();
  view.strides = strides ? strides->data() : nullptr;
  return view;
}

std::vector<float> read(const DLTensor& view, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  std::memcpy(out.data(), static_cast<const char*>(view.data) + view.byte_offset, out.size() * sizeof(float));
  return out;
}

// The same sequence of operations on `host`; returns what the buffer holds at the end.
std::vector<float> exercise(const sdk::Host& host) {
  sdk::Buffer buffer = host.buffer({2, 3}, kF32);
  EXPECT_EQ(buffer.elements(), 6);
  EXPECT_EQ(buffer.view().device.device_type, kDLCPU);  // a CPU model: the CPU
  EXPECT_EQ(read(buffer.view(), 6), std::vector<float>(6, 0.0f));  // zero-filled
  // A transposed (strided) 3 x 2 source: its elements in row-major order are 1 4 2 5 3 6.
  std::vector<float> source{1, 2, 3, 4, 5, 6};
  std::vector<int64_t> shape{3, 2}, strides{1, 3};
  const DLTensor transposed = view_of(source, shape, &strides);
  DLTensor whole = buffer.view();
  host.copy(whole, transposed);
  EXPECT_EQ(read(buffer.view(), 6), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_DOUBLE_EQ(host.squared_norm(buffer.view()), 91.0);
  int64_t part_shape[2];
  DLTensor tail = buffer.part(3, 3, part_shape);  // elements 3..5: 5 3 6
  host.scale(tail, 2.0);
  std::vector<float> ones(3, 1.0f);
  std::vector<int64_t> three{3};
  host.add(tail, view_of(ones, three), -0.5);
  EXPECT_EQ(read(buffer.view(), 6), (std::vector<float>{1, 4, 2, 9.5f, 5.5f, 11.5f}));
  std::vector<float> out(3, 0.0f);
  DLTensor out_view = view_of(out, three);
  host.copy(out_view, buffer.part(0, 3, part_shape));
  EXPECT_EQ(out, (std::vector<float>{1, 4, 2}));
  DLTensor head = buffer.part(0, 3, part_shape);
  host.scale(head, 0.0);  // zeros
  // A view of another element count is refused with the host's error.
  std::vector<float> two(2, 0.0f);
  std::vector<int64_t> two_shape{2};
  DLTensor wrong = view_of(two, two_shape);
  EXPECT_THROW(host.copy(wrong, buffer.view()), sdk::Error);
  return read(buffer.view(), 6);
}

TEST(HostMemory, BuffersAndViewOperationsWorkAlikeOnTheHostAndInTheSdkFallback) {
  auto communicator = Communicator::single_process(std::chrono::seconds(5));
  PluginHost plugin_host("memory-test", toml::table{}, *communicator);
  const sdk::Host host(plugin_host.api(), plugin_host.handle());
  ASSERT_GE(host.negotiated_minor(), 2);
  const auto through_host = exercise(host);
  EXPECT_EQ(through_host, (std::vector<float>{0, 0, 0, 9.5f, 5.5f, 11.5f}));
  // A host that speaks 1.1: the SDK allocates and computes in host memory itself.
  weft_host_api older = *plugin_host.api();
  older.header.abi_minor = 1;
  const sdk::Host old_host(&older, plugin_host.handle());
  ASSERT_EQ(old_host.negotiated_minor(), 1);
  EXPECT_EQ(exercise(old_host), through_host);
}

// Since 1.6 tensor_copy converts between floating-point dtypes (zero.so widens bf16 gradients into
// its fp32 buffers and narrows fp32 masters into bf16 parameters): rounded to nearest even, as
// ATen's copy_; an integer view still needs the same dtype.
TEST(HostMemory, CopyConvertsBetweenFloatingPointDtypesSinceAbi16) {
  auto communicator = Communicator::single_process(std::chrono::seconds(5));
  PluginHost plugin_host("memory-test", toml::table{}, *communicator);
  const sdk::Host host(plugin_host.api(), plugin_host.handle());
  ASSERT_GE(host.negotiated_minor(), 6);
  // 1 + 2^-8 lies halfway between two bf16 values (ties to the even 1.0); 1 + 3 * 2^-8 rounds up
  // to 1 + 2^-6; pi to 3.140625.
  std::vector<float> values{1.0f + 1.0f / 256, 1.0f + 3.0f / 256, 3.14159265f}, back(3, 0.0f);
  std::vector<int64_t> shape{3};
  DLTensor from = view_of(values, shape), to = view_of(back, shape);
  sdk::Buffer bf16 = host.buffer({3}, DLDataType{kDLBfloat, 16, 1});
  DLTensor narrow = bf16.view();
  host.copy(narrow, from);
  host.copy(to, narrow);
  EXPECT_EQ(back, (std::vector<float>{1.0f, 1.0f + 1.0f / 64, 3.140625f}));
  sdk::Buffer ints = host.buffer({3}, DLDataType{kDLInt, 32, 1});
  DLTensor int_view = ints.view();
  EXPECT_THROW(host.copy(int_view, from), sdk::Error);
}

}  // namespace
}  // namespace weft
