#include "core/model/quantize.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include "core/util/error.h"

#ifdef WEFT_WITH_CUDA  // the CUDA backend's dequantization kernels: core/model/cuda
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "core/model/cuda/kernels.h"
#endif

namespace weft {
namespace {

// A code book (a static table) as a tensor on `device`: on the CPU a view of the table, elsewhere
// a copy made once per device and kept (a copy per GEMM would be a host-to-device transfer and a
// synchronisation per layer and pass). The cache is never freed: it outlives CUDA's teardown.
torch::Tensor code_tensor(const float* values, int64_t n, const torch::Device& device) {
  auto table = torch::from_blob(const_cast<float*>(values), {n}, torch::kFloat32);
  if (device.is_cpu()) return table;
  static std::mutex mutex;
  static auto* copies = new std::map<std::tuple<const float*, int, int>, torch::Tensor>();
  const auto key = std::make_tuple(values, static_cast<int>(device.type()), static_cast<int>(device.index()));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = copies->find(key);
  if (it == copies->end()) it = copies->emplace(key, table.to(device)).first;
  return it->second;
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

// y = x W^T with W dequantized in x's dtype for the product only (or LLM.int8's int8 product for
// an int8_gemm W); backward gives x's gradient from W dequantized again.
class QuantizedLinearFunction : public torch::autograd::Function<QuantizedLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const QuantizedMatrix* weight, const Int8LinearOptions* int8) {
    ctx->saved_data["weight"] = reinterpret_cast<int64_t>(weight);
    if (weight->int8_gemm && x.device().is_cpu()) {
      static const Int8LinearOptions defaults;
      const auto& options = int8 ? *int8 : defaults;
      return int8_linear(x, *weight, options.threshold, options.row_absmax);
    }
    return torch::matmul(x, weight->dequantize(x.scalar_type()).t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto* weight = reinterpret_cast<const QuantizedMatrix*>(ctx->saved_data["weight"].toInt());
    const auto& grad = grads[0];
    if (weight->format == QuantFormat::kInt8 && grad.device().is_cpu()) {
      // The row scales on the gradient's columns: the int8 values are only cast, one pass over W
      // fewer than dequantizing them.
      const auto scaled = grad * (weight->scale / 127.0).to(grad.scalar_type());
      return {torch::matmul(scaled, weight->data.to(grad.scalar_type())), torch::Tensor(), torch::Tensor()};
    }
    return {torch::matmul(grad, weight->dequantize(grad.scalar_type())), torch::Tensor(), torch::Tensor()};
  }
};

// LibTorch's quantized ops through the dispatcher by name: their C++ declarations and the packed
// parameters' class live in version-specific internal headers, the schemas are stable across
// versions.
c10::IValue call_quantized_op(const char* name, std::vector<c10::IValue> args) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack(std::make_move_iterator(args.begin()), std::make_move_iterator(args.end()));
  op.callBoxed(&stack);
  return stack.empty() ? c10::IValue() : stack.front();  // the first result
}

// 7-bit activations: x86's u8 x s8 GEMM without VNNI sums pairs of products in int16, which
// 127 x 255 x 2 overflows and 127 x 127 x 2 does not.
constexpr double kActivationLevels = 63.0;

// The int8 values [rows, cols] packed with per-channel scales 1, zero points 0.
c10::IValue prepack_int8(const torch::Tensor& values) {
  const auto rows = values.size(0);
  const auto q = at::_make_per_channel_quantized_tensor(
      values.contiguous(), torch::ones({rows}, torch::kDouble), torch::zeros({rows}, torch::kLong), 0);
  return call_quantized_op("quantized::linear_prepack", {q, c10::IValue()});
}

// The int8 GEMM on activations already quantized to integers in [-63, 63] (fp32 [M, cols]): the
// exact int32 sums, as fp32. linear_dynamic quantizes its input per tensor from its range; two
// extra rows holding -64 and 63 fix that range, so that its scale is exactly 1 and its zero point
// 64, and each row's integers go through unchanged (reduce_range: the 7-bit quint8 range).
torch::Tensor int8_gemm(const torch::Tensor& integers, const c10::IValue& packed) {
  const auto m = integers.size(0), k = integers.size(1);
  auto range = torch::empty({2, k}, integers.options());
  range[0].fill_(-kActivationLevels - 1);
  range[1].fill_(kActivationLevels);
  const auto out = call_quantized_op("quantized::linear_dynamic", {torch::cat({integers, range}), packed, true});
  return out.toTensor().narrow(0, 0, m);
}

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

#ifdef WEFT_WITH_CUDA
torch::Tensor dequantize_on_cuda(const QuantizedMatrix& m, torch::Dtype dtype) {
  c10::cuda::CUDAGuard guard(m.data.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(m.data.device().index()).stream();
  auto out = torch::empty({m.rows, m.cols}, m.data.options().dtype(dtype));
  const auto type = dtype == torch::kBFloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat32;
  cudaError_t status;
  if (m.format == QuantFormat::kInt8) {
    const auto scale = m.scale.contiguous();
    status = cuda::int8_dequantize(m.data.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr(), type, m.rows,
                                   m.cols, stream);
  } else {
    const bool sliced = m.scale.scalar_type() == torch::kFloat32;  // absmaxes held in fp32 (slice_quantized)
    const auto scale = m.scale.contiguous();
    status = cuda::nf4_dequantize(
        m.data.data_ptr<uint8_t>(), code_tensor(nf4_code().data(), 16, m.data.device()).data_ptr<float>(),
        sliced ? scale.data_ptr<float>() : nullptr, sliced ? nullptr : scale.data_ptr<uint8_t>(),
        sliced ? nullptr : code_tensor(dynamic_code().data(), 256, m.data.device()).data_ptr<float>(),
        sliced ? nullptr : m.scale2.data_ptr<float>(), sliced ? nullptr : m.offset.data_ptr<float>(), out.data_ptr(),
        type, m.rows * m.cols, stream);
  }
  WEFT_CHECK(status == cudaSuccess, "dequantize ({}): CUDA kernel launch failed: {}", quant_format_name(m.format),
             cudaGetErrorString(status));
  return out;
}
#endif

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
  // exponent i in 0..6, the 2^i midpoints of linspace(0.1, 1, 2^i + 1) times 10^(i - 6), both
  // signs, then 0 and 1, sorted. Listed (as bitsandbytes 0.50.2 computes them in fp32) rather than
  // computed, so that every LibTorch build holds the same bits; tools/quant_reference.py checks.
  static const std::array<float, 256> code = {
      -0.99296874f, -0.9789063f, -0.96484375f, -0.9507812f, -0.93671876f, -0.92265624f,
      -0.9085938f, -0.89453125f, -0.8804687f, -0.86640626f, -0.85234374f, -0.8382813f,
      -0.82421875f, -0.8101562f, -0.79609376f, -0.78203124f, -0.7679688f, -0.75390625f,
      -0.7398437f, -0.72578126f, -0.7117188f, -0.6976563f, -0.68359375f, -0.6695312f,
      -0.65546876f, -0.6414063f, -0.6273438f, -0.61328125f, -0.5992187f, -0.58515626f,
      -0.5710938f, -0.5570313f, -0.54296875f, -0.5289062f, -0.5148437f, -0.50078124f,
      -0.4867187f, -0.47265625f, -0.45859373f, -0.44453126f, -0.43046874f, -0.41640624f,
      -0.40234375f, -0.38828123f, -0.37421876f, -0.36015624f, -0.34609374f, -0.33203125f,
      -0.31796873f, -0.30390626f, -0.28984374f, -0.27578127f, -0.26171875f, -0.24765624f,
      -0.23359375f, -0.21953125f, -0.20546874f, -0.19140625f, -0.17734376f, -0.16328125f,
      -0.14921875f, -0.13515624f, -0.12109375f, -0.107031256f, -0.09859375f, -0.09578126f,
      -0.092968754f, -0.09015625f, -0.08734375f, -0.08453125f, -0.08171876f, -0.07890625f,
      -0.07609375f, -0.07328125f, -0.070468746f, -0.067656256f, -0.06484375f, -0.06203125f,
      -0.059218753f, -0.05640625f, -0.05359375f, -0.05078125f, -0.04796875f, -0.04515625f,
      -0.042343747f, -0.03953125f, -0.036718752f, -0.03390625f, -0.03109375f, -0.028281251f,
      -0.02546875f, -0.02265625f, -0.019843752f, -0.01703125f, -0.01421875f, -0.01140625f,
      -0.00971875f, -0.009156249f, -0.00859375f, -0.00803125f, -0.00746875f, -0.00690625f,
      -0.00634375f, -0.00578125f, -0.0052187503f, -0.0046562497f, -0.00409375f, -0.0035312497f,
      -0.00296875f, -0.00240625f, -0.00184375f, -0.0012812499f, -0.0009437501f, -0.00083125f,
      -0.00071875006f, -0.0006062501f, -0.00049375003f, -0.00038125002f, -0.00026875004f, -0.00015625001f,
      -8.875e-05f, -6.625e-05f, -4.375e-05f, -2.1249998e-05f, -7.75e-06f, -3.2500002e-06f,
      -5.5000004e-07f, 0.0f, 5.5000004e-07f, 3.2500002e-06f, 7.75e-06f, 2.1249998e-05f,
      4.375e-05f, 6.625e-05f, 8.875e-05f, 0.00015625001f, 0.00026875004f, 0.00038125002f,
      0.00049375003f, 0.0006062501f, 0.00071875006f, 0.00083125f, 0.0009437501f, 0.0012812499f,
      0.00184375f, 0.00240625f, 0.00296875f, 0.0035312497f, 0.00409375f, 0.0046562497f,
      0.0052187503f, 0.00578125f, 0.00634375f, 0.00690625f, 0.00746875f, 0.00803125f,
      0.00859375f, 0.009156249f, 0.00971875f, 0.01140625f, 0.01421875f, 0.01703125f,
      0.019843752f, 0.02265625f, 0.02546875f, 0.028281251f, 0.03109375f, 0.03390625f,
      0.036718752f, 0.03953125f, 0.042343747f, 0.04515625f, 0.04796875f, 0.05078125f,
      0.05359375f, 0.05640625f, 0.059218753f, 0.06203125f, 0.06484375f, 0.067656256f,
      0.070468746f, 0.07328125f, 0.07609375f, 0.07890625f, 0.08171876f, 0.08453125f,
      0.08734375f, 0.09015625f, 0.092968754f, 0.09578126f, 0.09859375f, 0.107031256f,
      0.12109375f, 0.13515624f, 0.14921875f, 0.16328125f, 0.17734376f, 0.19140625f,
      0.20546874f, 0.21953125f, 0.23359375f, 0.24765624f, 0.26171875f, 0.27578127f,
      0.28984374f, 0.30390626f, 0.31796873f, 0.33203125f, 0.34609374f, 0.36015624f,
      0.37421876f, 0.38828123f, 0.40234375f, 0.41640624f, 0.43046874f, 0.44453126f,
      0.45859373f, 0.47265625f, 0.4867187f, 0.50078124f, 0.5148437f, 0.5289062f,
      0.54296875f, 0.5570313f, 0.5710938f, 0.58515626f, 0.5992187f, 0.61328125f,
      0.6273438f, 0.6414063f, 0.65546876f, 0.6695312f, 0.68359375f, 0.6976563f,
      0.7117188f, 0.72578126f, 0.7398437f, 0.75390625f, 0.7679688f, 0.78203124f,
      0.79609376f, 0.8101562f, 0.82421875f, 0.8382813f, 0.85234374f, 0.86640626f,
      0.8804687f, 0.89453125f, 0.9085938f, 0.92265624f, 0.93671876f, 0.9507812f,
      0.96484375f, 0.9789063f, 0.99296874f, 1.0f};
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
#ifdef WEFT_WITH_CUDA
  // On a GPU one kernel (core/model/cuda) instead of ATen's chain of indexing and elementwise
  // kernels: measured on an H200, ATen's nf4 dequantization took 2.5x the GEMM it feeds.
  if (data.is_cuda() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16)) return dequantize_on_cuda(*this, dtype);
#endif
  if (format == QuantFormat::kInt8) return (data * (scale / 127.0).unsqueeze(1)).to(dtype);
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

bool cpu_int8_gemm_available() {
  static const bool available = [] {
    try {
      auto& context = at::globalContext();
      const auto engines = context.supportedQEngines();
      const auto has = [&](at::QEngine e) { return std::find(engines.begin(), engines.end(), e) != engines.end(); };
      // onednn first: its GEMM is as fast as x86's (fbgemm's) here and its prepack, which every
      // product does, twice as fast (9 ms against 19 for 2048 x 2048, AMD EPYC, 2.11).
      if (has(at::kONEDNN)) context.setQEngine(at::kONEDNN);
      else if (has(at::kX86)) context.setQEngine(at::kX86);
      else if (has(at::kFBGEMM)) context.setQEngine(at::kFBGEMM);
      else return false;
      // Every extreme: rows of -64 and 63 against rows of -127 and 127, then mixed signs.
      torch::NoGradGuard no_grad;
      const int64_t m = 8, n = 8, k = 512;
      auto x = torch::full({m, k}, kActivationLevels);
      x.slice(0, 0, m, 2).fill_(-kActivationLevels);
      x[2] = torch::arange(k, torch::kFloat32).remainder(2 * kActivationLevels + 1) - kActivationLevels;
      auto w = torch::full({n, k}, 127, torch::kInt8);
      w.slice(0, 1, n, 2).fill_(-127);
      w[3] = (torch::arange(k, torch::kInt32).remainder(255) - 127).to(torch::kInt8);
      const auto got = int8_gemm(x, prepack_int8(w)).to(torch::kDouble);
      const auto want = torch::matmul(x.to(torch::kDouble), w.to(torch::kDouble).t());
      return torch::equal(got, want);
    } catch (const std::exception&) {
      return false;  // no quantized engine in this LibTorch
    }
  }();
  return available;
}

void use_int8_gemm(QuantizedMatrix& m) {
  WEFT_CHECK(m.format == QuantFormat::kInt8 && m.data.defined() && m.data.device().is_cpu(),
             "use_int8_gemm: an int8 matrix on the CPU is needed");
  WEFT_CHECK(cpu_int8_gemm_available(), "use_int8_gemm: this LibTorch has no exact CPU int8 GEMM");
  m.int8_gemm = true;
}

torch::Tensor int8_linear(const torch::Tensor& x, const QuantizedMatrix& weight, double threshold,
                          const RowAbsmaxSync& row_absmax) {
  WEFT_CHECK(weight.format == QuantFormat::kInt8 && weight.data.device().is_cpu() && cpu_int8_gemm_available(),
             "int8_linear: an int8 weight on the CPU and an exact int8 GEMM are needed");
  WEFT_CHECK(x.size(-1) == weight.cols, "int8 linear: input has {} features, the weight {}", x.size(-1), weight.cols);
  torch::NoGradGuard no_grad;
  auto out_shape = x.sizes().vec();
  out_shape.back() = weight.rows;
  const auto a = x.reshape({-1, weight.cols}).to(torch::kFloat32);
  const auto magnitude = a.abs();
  torch::Tensor outlier;  // |a| >= threshold, where any
  if (threshold > 0) {
    outlier = magnitude >= threshold;
    if (!outlier.any().item<bool>()) outlier = torch::Tensor();
  }
  const auto inliers = outlier.defined() ? a.masked_fill(outlier, 0.0) : a;
  auto absmax = a.size(0) == 0 ? torch::zeros({0})
                               : std::get<0>((outlier.defined() ? magnitude.masked_fill(outlier, 0.0) : magnitude).max(1));
  if (row_absmax) row_absmax(absmax);
  const auto row_scale = absmax.clamp_min(1e-30) / kActivationLevels;
  const auto integers = torch::round(inliers / row_scale.unsqueeze(1)).clamp_(-kActivationLevels, kActivationLevels);
  auto y = int8_gemm(integers, prepack_int8(weight.data));  // the packed copy lives for this product only
  y.mul_(row_scale.unsqueeze(1)).mul_((weight.scale / 127.0).unsqueeze(0));
  if (outlier.defined()) {
    // The outliers' columns: those where any token of the batch has one, so their number depends on
    // the batch. Summed in fp64 (each product of two fp32 values exact there), then rounded to fp32,
    // a token's result does not depend on how many columns its batch brought or how the GEMM
    // grouped them (in fp32 it did: MKL's AVX2 kernels sum a different K differently).
    const auto columns = outlier.any(0).nonzero().squeeze(1);
    const auto values = (a.index_select(1, columns) * outlier.index_select(1, columns)).to(torch::kFloat64);
    const auto w = weight.data.index_select(1, columns).to(torch::kFloat64) *
                   (weight.scale.to(torch::kFloat64) / 127.0).unsqueeze(1);
    y.add_(torch::matmul(values, w.t()).to(torch::kFloat32));
  }
  return y.to(x.scalar_type()).reshape(out_shape);
}

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedMatrix& weight, const Int8LinearOptions* int8) {
  WEFT_CHECK(x.size(-1) == weight.cols, "quantized linear: input has {} features, the weight {}", x.size(-1), weight.cols);
  return QuantizedLinearFunction::apply(x, &weight, int8);
}

}  // namespace weft
