// Writing GGUF files (the layout core/io/gguf.h describes: version 3, little-endian, alignment 32),
// and quantizing fp32 values into the ggml types weft writes: F32, F16, BF16 and Q8_0, each as
// gguf-py's gguf.quants.quantize computes it (the same bits). No LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/io/gguf.h"

namespace weft {

// Whether weft writes the type: F32, F16, BF16, Q8_0.
bool ggml_type_quantizable(uint32_t type);
// `count` fp32 values (a multiple of the type's block: 32 for Q8_0) as the type's bytes. Throws
// weft::Error for a type weft does not write or a count that is not whole blocks.
std::vector<uint8_t> quantize_ggml(uint32_t type, const float* in, int64_t count);
// The bytes `count` values of the type take (whole blocks).
uint64_t ggml_type_bytes(uint32_t type, int64_t count);

class GgufWriter {
 public:
  // Metadata values of GGUF's value types (core/io/gguf.h's GgufValue).
  static GgufValue u32(uint32_t v);
  static GgufValue i32(int32_t v);
  static GgufValue f32(float v);
  static GgufValue boolean(bool v);
  static GgufValue string(std::string v);
  static GgufValue strings(std::vector<std::string> v);
  static GgufValue i32s(const std::vector<int32_t>& v);
  static GgufValue f32s(const std::vector<float>& v);

  // Sets a metadata key (in the order first set; setting it again replaces the value in place). A
  // value copied from a GgufFile keeps its types; an array of arrays cannot be written (an error).
  void set(const std::string& key, GgufValue value);
  // A tensor of `type` whose shape is outermost first (PyTorch's order; the file stores it
  // reversed) and whose bytes are the type's encoding of its values in row-major order.
  void add_tensor(std::string name, std::vector<int64_t> shape, uint32_t type, std::vector<uint8_t> bytes);
  // Writes the file atomically (core/util/fs.h: a crash leaves the old file or the new one).
  void write(const std::string& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;
    uint32_t type;
    std::vector<uint8_t> bytes;
  };
  std::vector<std::pair<std::string, GgufValue>> values_;
  std::vector<Tensor> tensors_;
};

}  // namespace weft
