#include "core/model/quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "core/util/error.h"

namespace weft {
namespace {

torch::Tensor code_tensor(const float* values, int64_t n, const torch::Device& device) {
  return torch::from_blob(const_cast<float*>(values), {n}, torch::kFloat32).to(device);
}

// Index of the nearest code value for each element of `scaled` (in [-1, 1]): bitsandbytes'
// bucketize against the midpoints of the sorted code.
torch::Tensor nearest_code(const torch::Tensor& scaled, const torch::Tensor& code) {
  const auto bounds = (code.slice(0, 0, -1) + code.slice(0, 1)) / 2;
  return torch::bucketize(scaled, bounds, /*out_int32=*/true).to(torch::kUInt8);
}

// Splits flat fp32 `values` into blocks of `block` (the last may be shorter) and returns
// (absmax per block, values / absmax clamped to [-1, 1]), as bitsandbytes' blockwise quantizers.
std::pair<torch::Tensor, torch::Tensor> blockwise_scaled(const torch::Tensor& values, int64_t block) {
  const int64_t n = values.numel(), rem = n % block, full = n - rem;
  auto whole = values.slice(0, 0, full).reshape({full / block, block});
  auto absmax = std::get<0>(whole.abs().max(-1));
  auto scaled = torch::clamp(whole * (1.0 / absmax.clamp_min(1e-38).unsqueeze(1)), -1, 1).reshape({-1});
  if (rem > 0) {
    auto tail = values.slice(0, full);
    auto tail_max = tail.abs().max().clamp_min(1e-38);
    absmax = torch::cat({absmax, tail_max.unsqueeze(0)});
    scaled = torch::cat({scaled, torch::clamp(tail / tail_max, -1, 1)});
  }
  return {absmax, scaled};
}

// Multiplies each block of `values` (flat) by its scale.
torch::Tensor scale_blocks(const torch::Tensor& values, const torch::Tensor& scales, int64_t block) {
  const int64_t n = values.numel(), rem = n % block, full = n - rem;
  auto out = (values.slice(0, 0, full).reshape({full / block, block}) * scales.slice(0, 0, full / block).unsqueeze(1))
                 .reshape({-1});
  if (rem > 0) out = torch::cat({out, values.slice(0, full) * scales[full / block]});
  return out;
}

// The absmax of every nf4 block, undoing the double quantization (a slice holds them in fp32).
torch::Tensor nf4_absmax(const QuantizedMatrix& m) {
  if (m.scale.scalar_type() == torch::kFloat32) return m.scale;
  const auto code = code_tensor(dynamic_code().data(), 256, m.scale.device());
  return scale_blocks(code.index_select(0, m.scale.to(torch::kInt)), m.scale2, kNf4ScaleBlockSize) + m.offset;
}

// y = x W^T with W dequantized in x's dtype for the product only; backward gives x's gradient
// from W dequantized again.
class QuantizedLinearFunction : public torch::autograd::Function<QuantizedLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const QuantizedMatrix* weight) {
    ctx->saved_data["weight"] = reinterpret_cast<int64_t>(weight);
    return torch::matmul(x, weight->dequantize(x.scalar_type()).t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* weight = reinterpret_cast<const QuantizedMatrix*>(ctx->saved_data["weight"].toInt());
    const auto& grad = grads[0];
    return {torch::matmul(grad, weight->dequantize(grad.scalar_type())), torch::Tensor()};
  }
};

// nf4's code indices, one uint8 per element [n], from the packed nibbles.
torch::Tensor nf4_indices(const QuantizedMatrix& m) {
  return torch::stack({m.data.__rshift__(4), torch::bitwise_and(m.data, 0xF)}, 1).reshape({-1}).slice(0, 0, m.rows * m.cols);
}

// Two code indices per byte, the first in the high nibble; an odd count is padded with the code of
// 0.0 (index 7), as bitsandbytes pads its values with zeros.
torch::Tensor pack_nibbles(torch::Tensor index) {
  if (index.numel() % 2 != 0) index = torch::cat({index, torch::full({1}, 7, index.options())});
  return torch::bitwise_or(index.slice(0, 0, {}, 2).__lshift__(4), index.slice(0, 1, {}, 2));
}

}  // namespace

QuantFormat parse_quant_format(const std::string& name) {
  if (name == "none" || name.empty()) return QuantFormat::kNone;
  if (name == "int8") return QuantFormat::kInt8;
  if (name == "nf4") return QuantFormat::kNf4;
  throw Error(fmt::format("model.quantize must be none, int8 or nf4, got '{}'", name));
}

const char* quant_format_name(QuantFormat format) {
  switch (format) {
    case QuantFormat::kInt8: return "int8";
    case QuantFormat::kNf4: return "nf4";
    default: return "none";
  }
}

int64_t quantized_weight_bytes(int64_t rows, int64_t cols, QuantFormat format) {
  const int64_t n = rows * cols;
  switch (format) {
    case QuantFormat::kInt8: return n + 4 * rows;
    case QuantFormat::kNf4: {
      const int64_t blocks = (n + kNf4BlockSize - 1) / kNf4BlockSize;
      return (n + 1) / 2 + blocks + 4 * ((blocks + kNf4ScaleBlockSize - 1) / kNf4ScaleBlockSize) + 4;
    }
    default: return 4 * n;
  }
}

const std::array<float, 16>& nf4_code() {
  // QLoRA's NormalFloat4 (Dettmers et al. 2023, appendix E), as bitsandbytes lists it.
  static const std::array<float, 16> code = {
      -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
      -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
      0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
      0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
  return code;
}

const std::array<float, 256>& dynamic_code() {
  // bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for each
  // exponent i in 0..6, 2^i evenly spaced fractions (midpoints of linspace(0.1, 1, 2^i + 1)) times
  // 10^(i - 6), both signs; then 0 and 1; sorted. Computed with the same fp32 ATen ops.
  static const std::array<float, 256> code = [] {
    std::vector<float> data;
    for (int i = 0; i < 7; ++i) {
      const auto bounds = torch::linspace(0.1, 1.0, (1 << i) + 1, torch::kFloat32);
      const auto means = (bounds.slice(0, 0, -1) + bounds.slice(0, 1)) / 2.0;
      const double magnitude = std::pow(10.0, -6 + i);
      for (double sign : {1.0, -1.0}) {
        const auto values = (means * (sign * magnitude)).contiguous();
        data.insert(data.end(), values.data_ptr<float>(), values.data_ptr<float>() + values.numel());
      }
    }
    data.push_back(0.0f);
    data.push_back(1.0f);
    WEFT_CHECK(data.size() == 256, "dynamic_code: {} values instead of 256", data.size());
    std::sort(data.begin(), data.end());
    std::array<float, 256> out{};
    std::copy(data.begin(), data.end(), out.begin());
    return out;
  }();
  return code;
}

QuantizedMatrix quantize_matrix(const torch::Tensor& weight, QuantFormat format) {
  WEFT_CHECK(weight.dim() == 2, "quantize: a matrix is needed, got {} dimensions", weight.dim());
  WEFT_CHECK(format != QuantFormat::kNone, "quantize: no format");
  torch::NoGradGuard no_grad;
  QuantizedMatrix m;
  m.format = format;
  m.rows = weight.size(0);
  m.cols = weight.size(1);
  const auto w = weight.detach().to(torch::kFloat32).contiguous();
  if (format == QuantFormat::kInt8) {
    // LLM.int8's vector-wise quantization (bitsandbytes' int8_vectorwise_quant, threshold 0).
    m.scale = std::get<0>(w.abs().max(1));
    // A row of zeros stays zeros (bitsandbytes would divide by its zero absmax).
    m.data = torch::round(w * (127.0 / m.scale.clamp_min(1e-38).unsqueeze(1))).to(torch::kInt8);
    return m;
  }
  // nf4 (bitsandbytes' quantize_4bit(blocksize=64, quant_type="nf4", compress_statistics=True)).
  auto [absmax, scaled] = blockwise_scaled(w.reshape({-1}), kNf4BlockSize);
  m.data = pack_nibbles(nearest_code(scaled, code_tensor(nf4_code().data(), 16, w.device())));
  m.offset = absmax.mean().reshape({1});
  auto [scale2, scaled2] = blockwise_scaled(absmax - m.offset, kNf4ScaleBlockSize);
  m.scale = nearest_code(scaled2, code_tensor(dynamic_code().data(), 256, w.device()));
  m.scale2 = scale2;
  return m;
}

QuantizedMatrix slice_quantized(const QuantizedMatrix& whole, int64_t dim, int64_t start, int64_t length) {
  WEFT_CHECK(dim == 0 || dim == 1, "slice_quantized: dim {} of a matrix", dim);
  const int64_t extent = dim == 0 ? whole.rows : whole.cols;
  WEFT_CHECK(start >= 0 && length > 0 && start + length <= extent, "slice_quantized: [{}, {}) of {}", start,
             start + length, extent);
  torch::NoGradGuard no_grad;
  QuantizedMatrix m;
  m.format = whole.format;
  m.rows = dim == 0 ? length : whole.rows;
  m.cols = dim == 1 ? length : whole.cols;
  if (whole.format == QuantFormat::kInt8) {
    m.data = whole.data.narrow(dim, start, length).contiguous();
    m.scale = dim == 0 ? whole.scale.narrow(0, start, length).contiguous() : whole.scale.clone();
    return m;
  }
  WEFT_CHECK(whole.format == QuantFormat::kNf4, "slice_quantized: unknown format");
  WEFT_CHECK(whole.cols % kNf4BlockSize == 0 && (dim == 0 || (start % kNf4BlockSize == 0 && length % kNf4BlockSize == 0)),
             "nf4: the slice [{}, {}) of dim {} of a [{}, {}] weight would split blocks of {} weights; tensor "
             "parallelism over an nf4 base needs the split columns in whole blocks",
             start, start + length, dim, whole.rows, whole.cols, kNf4BlockSize);
  const int64_t blocks_per_row = whole.cols / kNf4BlockSize;
  const auto index = nf4_indices(whole).reshape({whole.rows, whole.cols}).narrow(dim, start, length).contiguous();
  m.data = pack_nibbles(index.reshape({-1}));
  const auto absmax = nf4_absmax(whole).reshape({whole.rows, blocks_per_row});
  m.scale = (dim == 0 ? absmax.narrow(0, start, length) : absmax.narrow(1, start / kNf4BlockSize, length / kNf4BlockSize))
                .reshape({-1})
                .contiguous();
  return m;
}

torch::Tensor QuantizedMatrix::dequantize(torch::Dtype dtype) const {
  torch::NoGradGuard no_grad;
  WEFT_CHECK(data.defined(), "dequantize: the matrix holds no data");
  if (format == QuantFormat::kInt8) {
    return (data.to(torch::kFloat32) * (scale / 127.0).unsqueeze(1)).to(dtype);
  }
  WEFT_CHECK(format == QuantFormat::kNf4, "dequantize: unknown format");
  const auto index = nf4_indices(*this);
  const auto code = code_tensor(nf4_code().data(), 16, data.device());
  auto values = scale_blocks(code.index_select(0, index.to(torch::kInt)), nf4_absmax(*this), kNf4BlockSize);
  return values.reshape({rows, cols}).to(dtype);
}

int64_t QuantizedMatrix::bytes() const {
  int64_t total = 0;
  for (const auto* t : {&data, &scale, &scale2, &offset}) {
    if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
  }
  return total;
}

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedMatrix& weight) {
  WEFT_CHECK(x.size(-1) == weight.cols, "quantized linear: input has {} features, the weight {}", x.size(-1), weight.cols);
  return QuantizedLinearFunction::apply(x, &weight);
}

}  // namespace weft
