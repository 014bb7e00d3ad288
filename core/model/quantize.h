// Frozen base weights stored quantized (model.quantize): LLM.int8's vector-wise int8 and QLoRA's
// 4-bit NormalFloat, in bitsandbytes' layouts, so that adapter fine-tuning of a large base fits in
// a fraction of its full-precision bytes. Each function works on the tensor's device with ATen ops.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include <torch/types.h>

namespace weft {

enum class QuantFormat { kNone, kInt8, kNf4 };

// "none", "int8" or "nf4"; anything else is a weft::Error listing them.
QuantFormat parse_quant_format(const std::string& name);
const char* quant_format_name(QuantFormat format);

// How the decoder blocks' linear weights (q/k/v/o, gate/up/down) are stored. Embeddings, norms,
// the LM head and LoRA adapters are never quantized.
struct QuantConfig {
  QuantFormat format = QuantFormat::kNone;
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

// x [..., cols] @ W^T in x's dtype, for a frozen quantized W: autograd gives x's gradient only,
// and neither pass keeps a dequantized copy of W beyond its own GEMM (backward dequantizes again),
// so at most one layer's weight is ever held in the compute precision.
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedMatrix& weight);

}  // namespace weft
