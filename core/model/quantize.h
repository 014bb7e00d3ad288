// Frozen base weights stored quantized (model.quantize): LLM.int8's vector-wise int8 and QLoRA's
// 4-bit NormalFloat, in bitsandbytes' layouts, so that adapter fine-tuning of a large base fits in
// a fraction of its full-precision bytes. Each function works on the tensor's device with ATen ops.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include <torch/types.h>

namespace weft {

enum class QuantFormat { kNone, kInt8, kNf4 };

// "none", "int8" or "nf4"; anything else is a weft::Error listing them.
QuantFormat parse_quant_format(const std::string& name);
const char* quant_format_name(QuantFormat format);

constexpr double kDefaultInt8Threshold = 6.0;  // LLM.int8's outlier threshold (bitsandbytes' default)

// How the decoder blocks' linear weights (q/k/v/o, gate/up/down) are stored and multiplied.
// Embeddings, norms, the LM head and LoRA adapters are never quantized.
struct QuantConfig {
  QuantConfig(QuantFormat format_ = QuantFormat::kNone, double int8_threshold_ = kDefaultInt8Threshold,
              bool int8_gemm_ = true)
      : format(format_), int8_threshold(int8_threshold_), int8_gemm(int8_gemm_) {}
  QuantFormat format;
  // int8 with the CPU's int8 GEMM (int8_linear): input elements of magnitude >= this are outliers,
  // multiplied in fp32 (model.int8_threshold); 0 = none.
  double int8_threshold;
  // int8 on the CPU where cpu_int8_gemm_available(): multiply in the int8 GEMM (int8_linear);
  // false: dequantize each layer for a float GEMM, as everywhere else (model.int8_gemm).
  bool int8_gemm;
  bool enabled() const { return format != QuantFormat::kNone; }
};

// Bytes a [rows, cols] weight takes in `format` (kNone: fp32), for the memory plan.
int64_t quantized_weight_bytes(int64_t rows, int64_t cols, QuantFormat format);

// QLoRA's 4-bit NormalFloat values (bitsandbytes' get_4bit_type("nf4")), ascending.
const std::array<float, 16>& nf4_code();
// bitsandbytes' signed dynamic 8-bit code (create_dynamic_map(signed=True)), ascending: the code
// of nf4's double quantization of the block scales.
const std::array<float, 256>& dynamic_code();

constexpr int64_t kNf4BlockSize = 64;         // weights per absmax
constexpr int64_t kNf4ScaleBlockSize = 256;   // absmaxes per second-level scale

// A quantized [rows, cols] matrix.
//   int8: data int8 [rows, cols] = round(127 w / absmax(row)); scale fp32 [rows] = absmax(row)
//         (bitsandbytes' int8_vectorwise_quant: CB and SCB).
//   nf4:  data uint8 [ceil(n / 2)]: the row-major elements' code indices, two per byte, the first
//         in the high nibble; blocks of 64 elements share an absmax, stored double-quantized:
//         scale uint8 [blocks] indexes dynamic_code(), scale2 fp32 [ceil(blocks / 256)] scales
//         each group of 256 of them, offset fp32 [1] is added back (absmax = code[scale] * scale2
//         + offset, offset = the mean absmax), as bitsandbytes' quantize_4bit(compress_statistics).
//         A slice of a quantized matrix (slice_quantized) keeps each block's absmax in fp32 instead:
//         scale fp32 [blocks], no scale2 or offset.
struct QuantizedMatrix {
  QuantFormat format = QuantFormat::kNone;
  int64_t rows = 0, cols = 0;
  torch::Tensor data, scale, scale2, offset;
  // int8 on the CPU: the forward multiplies in the int8 GEMM (int8_linear; use_int8_gemm).
  bool int8_gemm = false;

  // The matrix in `dtype` (fp32 math, then cast), on the data's device.
  torch::Tensor dequantize(torch::Dtype dtype = torch::kFloat32) const;
  int64_t bytes() const;
};

// Quantizes a floating-point [rows, cols] matrix (any float dtype; math in fp32).
QuantizedMatrix quantize_matrix(const torch::Tensor& weight, QuantFormat format);

// Rows (dim 0) or columns (dim 1) [start, start + length) of a quantized matrix, dequantizing to
// exactly the whole's values there: a tensor-parallel slice quantized as part of its whole, so
// that every split of a model holds the same weights as the unsplit model. int8 keeps the rows'
// scales; nf4 needs whole blocks (cols a multiple of 64, and for dim 1 start and length too) and
// keeps their absmaxes in fp32. Throws weft::Error for a slice that splits nf4 blocks.
QuantizedMatrix slice_quantized(const QuantizedMatrix& whole, int64_t dim, int64_t start, int64_t length);

// Whether int8_linear runs here: LibTorch's CPU int8 GEMM (quantized::linear_dynamic on the
// onednn, x86 or fbgemm engine) exists and, checked once per process on a product with every
// extreme value, computes 7-bit x 8-bit integer products exactly (x86 without VNNI saturates
// 8-bit x 8-bit pairs, hence 7-bit activations). Selects that engine (at::globalContext).
bool cpu_int8_gemm_available();

// Marks an int8 matrix on the CPU for int8_linear. Requires cpu_int8_gemm_available().
void use_int8_gemm(QuantizedMatrix& m);

// LLM.int8's forward, for an int8 W [rows, cols] on the CPU and x [..., cols] (any float dtype;
// result in x's dtype). W is prepacked for LibTorch's GEMM for this product only and the packed
// copy dropped after it (a persistent one would hold the int8 bytes twice: onednn's packed weight
// keeps the original beside its reordered copy, and x86's unpack, which backward would need, took
// as long as the product): elements of x with |x| >= threshold (threshold > 0) are outliers, multiplied in fp32
// with their columns of W dequantized; the others are quantized per row (token) to 7 bits,
// round(63 x / absmax(row)), and multiplied by W's int8 values in the int8 GEMM, the int32 sums
// scaled back by absmax(row) / 63 x scale(out row) / 127. Outliers are elements rather than whole
// columns (bitsandbytes takes a column out for every row once any row exceeds the threshold), so
// that a token's result never depends on the other tokens of its batch: a batch split over ranks
// computes what one process computes. `row_absmax` (may be empty) receives the rows' absmax of
// this process's columns [tokens] and must leave the maximum over every process holding the
// input's other columns (a row-parallel tensor-parallel layer: CommPoint::kRowAbsMax), so that
// every split quantizes as the whole does.
using RowAbsmaxSync = std::function<void(torch::Tensor& row_absmax)>;
torch::Tensor int8_linear(const torch::Tensor& x, const QuantizedMatrix& weight, double threshold,
                          const RowAbsmaxSync& row_absmax = {});

// How quantized_linear multiplies an int8_gemm weight (int8_linear's threshold and row sync).
struct Int8LinearOptions {
  double threshold = kDefaultInt8Threshold;
  RowAbsmaxSync row_absmax;
};

// x [..., cols] @ W^T in x's dtype, for a frozen quantized W: autograd gives x's gradient only,
// and neither pass keeps a dequantized copy of W beyond its own GEMM (backward dequantizes again),
// so at most one layer's weight is ever held in the compute precision. An int8_gemm W on the
// CPU computes the forward with int8_linear (`int8`; default options when null); backward is
// always the gradient of x W^T with W dequantized (the straight-through gradient LLM.int8 uses).
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedMatrix& weight,
                               const Int8LinearOptions* int8 = nullptr);

}  // namespace weft
