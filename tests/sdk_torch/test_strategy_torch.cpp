// weft/strategy_torch.hpp: at::Tensor <-> DLTensor views share memory, keep shape and strides,
// and map dtypes and devices; unsupported ones throw weft::sdk::Error.
#include <cstdint>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <weft/strategy_torch.hpp>

namespace {

using weft::sdk::Error;
using weft::sdk::from_dl_view;
using weft::sdk::to_dl_view;

TEST(StrategyTorch, ViewOfATransposedTensorKeepsShapeStridesAndMemory) {
  const at::Tensor base = torch::arange(6, torch::kFloat).reshape({2, 3});
  const at::Tensor transposed = base.t();  // [3, 2], strides [1, 3]
  const DLTensor view = to_dl_view(transposed);
  EXPECT_EQ(view.data, base.data_ptr());
  EXPECT_EQ(view.byte_offset, 0u);
  EXPECT_EQ(view.ndim, 2);
  EXPECT_EQ(view.shape[0], 3);
  EXPECT_EQ(view.shape[1], 2);
  EXPECT_EQ(view.strides[0], 1);
  EXPECT_EQ(view.strides[1], 3);
  EXPECT_EQ(view.device.device_type, kDLCPU);
  EXPECT_EQ(view.dtype.code, kDLFloat);
  EXPECT_EQ(view.dtype.bits, 32);
  EXPECT_EQ(view.dtype.lanes, 1);

  const at::Tensor back = from_dl_view(view);
  EXPECT_EQ(back.data_ptr(), base.data_ptr());
  EXPECT_EQ(back.sizes(), transposed.sizes());
  EXPECT_EQ(back.strides(), transposed.strides());
  EXPECT_TRUE(torch::equal(back, transposed));
  back.mul_(2);  // writes go to the original memory: base[1][2] was 5
  EXPECT_EQ(base[1][2].item<float>(), 10.0f);
}

TEST(StrategyTorch, ViewOfASliceStartsAtItsFirstElement) {
  const at::Tensor base = torch::arange(10, torch::kLong);
  const at::Tensor slice = base.slice(0, 4, 10, 2);  // 4, 6, 8
  const DLTensor view = to_dl_view(slice);
  EXPECT_EQ(static_cast<int64_t*>(view.data), base.data_ptr<int64_t>() + 4);
  EXPECT_EQ(view.strides[0], 2);
  EXPECT_TRUE(torch::equal(from_dl_view(view), torch::tensor({4, 6, 8}, torch::kLong)));
}

TEST(StrategyTorch, DtypesRoundTrip) {
  struct Case {
    at::ScalarType type;
    uint8_t code;
    uint8_t bits;
  };
  const std::vector<Case> cases = {
      {at::kFloat, kDLFloat, 32},  {at::kHalf, kDLFloat, 16}, {at::kBFloat16, kDLBfloat, 16},
      {at::kDouble, kDLFloat, 64}, {at::kLong, kDLInt, 64},   {at::kInt, kDLInt, 32},
      {at::kByte, kDLUInt, 8}};
  for (const Case& c : cases) {
    const at::Tensor tensor = torch::ones({2, 2}, torch::TensorOptions().dtype(c.type));
    const DLTensor view = to_dl_view(tensor);
    EXPECT_EQ(view.dtype.code, c.code) << c10::toString(c.type);
    EXPECT_EQ(view.dtype.bits, c.bits) << c10::toString(c.type);
    EXPECT_EQ(from_dl_view(view).scalar_type(), c.type) << c10::toString(c.type);
  }
}

TEST(StrategyTorch, BoolCrossesAsEightBits) {
  const at::Tensor flags = torch::tensor({true, false, true});
  const DLTensor view = to_dl_view(flags);
  EXPECT_EQ(view.dtype.bits, 8);
  const at::Tensor back = from_dl_view(view);
#if DLPACK_VERSION >= 80
  EXPECT_EQ(view.dtype.code, kDLBool);
  EXPECT_EQ(back.scalar_type(), at::kBool);
#else
  EXPECT_EQ(view.dtype.code, kDLUInt);  // DLPack 0.6 has no bool: it comes back as uint8
  EXPECT_EQ(back.scalar_type(), at::kByte);
#endif
  EXPECT_TRUE(torch::equal(back.to(torch::kBool), flags));
}

TEST(StrategyTorch, UnsupportedDtypesAndDevicesThrowSdkErrors) {
  try {
    to_dl_view(torch::ones({2}, torch::kComplexFloat));
    FAIL() << "expected weft::sdk::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), WEFT_STATUS_UNSUPPORTED);
    EXPECT_NE(std::string(e.what()).find("ComplexFloat"), std::string::npos) << e.what();
  }
  EXPECT_THROW(to_dl_view(at::Tensor()), Error);

  float value = 1.0f;
  int64_t shape = 1;
  DLTensor view{};
  view.data = &value;
  view.ndim = 1;
  view.shape = &shape;
  view.dtype = {kDLFloat, 32, 2};  // two lanes
  view.device = {kDLCPU, 0};
  EXPECT_THROW(from_dl_view(view), Error);
  view.dtype = {kDLFloat, 32, 1};
  view.device = {kDLOpenCL, 0};
  EXPECT_THROW(from_dl_view(view), Error);
  view.device = {kDLCPU, 0};
  view.data = nullptr;
  EXPECT_THROW(from_dl_view(view), Error);
}

TEST(StrategyTorch, NullStridesMeanContiguous) {
  std::vector<float> values = {1, 2, 3, 4, 5, 6};
  int64_t shape[2] = {2, 3};
  DLTensor view{};
  view.data = values.data();
  view.ndim = 2;
  view.shape = shape;
  view.dtype = {kDLFloat, 32, 1};
  view.device = {kDLCPU, 0};
  const at::Tensor tensor = from_dl_view(view);
  EXPECT_EQ(tensor.strides(), at::IntArrayRef({3, 1}));
  EXPECT_EQ(tensor[1][0].item<float>(), 4.0f);
}

}  // namespace
