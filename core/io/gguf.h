// Reading GGUF files (llama.cpp's format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
//
// Layout of one file (version 2 or 3, little-endian): the magic "GGUF", a u32 version, a u64
// tensor count, a u64 metadata count; the metadata as key (u64 length + UTF-8 bytes), u32 value
// type, value (arrays: u32 element type, u64 count, the elements); the tensor table as name, u32
// dimension count, u64 dimensions (innermost first), u32 ggml type, u64 offset; then, at the next
// multiple of `general.alignment` (default 32), the data region the offsets point into.
//
// Files are untrusted input. GgufFile::open validates the whole header before returning: every
// length and count is checked against the bytes that remain, dimension counts (1 to 4), element
// counts (no overflow, the innermost a multiple of the type's block), types (known to ggml),
// offsets (aligned, inside the data region, no two tensors overlapping) and names (no duplicates).
// Every rejection is a weft::Error with one line naming the file and the problem. No LibTorch.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace weft {

class MappedFile;  // core/io/mapped_file.h

// ggml's tensor types (ggml.h's ggml_type; the values GGUF stores).
enum GgmlType : uint32_t {
  kGgmlF32 = 0,
  kGgmlF16 = 1,
  kGgmlQ4_0 = 2,
  kGgmlQ4_1 = 3,
  kGgmlQ8_0 = 8,
  kGgmlQ4_K = 12,
  kGgmlQ5_K = 13,
  kGgmlQ6_K = 14,
  kGgmlBF16 = 30,
};

// Whether `path` names a GGUF file (by its extension, .gguf, in any case).
bool is_gguf_path(const std::string& path);

// "Q4_K" for 12; "type N" for a value ggml does not define.
std::string ggml_type_name(uint32_t type);
// Whether weft dequantizes the type: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K.
bool ggml_type_dequantizable(uint32_t type);
// Those types' names, for messages: "F32, F16, ...".
const char* ggml_dequantizable_names();
// Dequantizes `count` values of `type` (a multiple of its block size) from `in` into `out`, as
// gguf-py's gguf.quants.dequantize computes them (fp32, the same operations in the same order:
// the same bits). Throws weft::Error for a type weft does not dequantize.
void dequantize_ggml(uint32_t type, const uint8_t* in, int64_t count, float* out);

// One metadata value. Integers of every width and bools are `integer` (a u64 above INT64_MAX sets
// `integer_overflow`), floats `number`, strings `text`; arrays keep their elements in `integers`,
// `numbers` or `texts` by element type (an array of arrays keeps only `count`).
struct GgufValue {
  uint32_t type = 0;          // GGUF's value type: 0..12 (8 string, 9 array)
  uint32_t element_type = 0;  // an array's
  uint64_t count = 0;         // an array's length
  int64_t integer = 0;
  bool integer_overflow = false;
  double number = 0.0;
  std::string text;
  std::vector<int64_t> integers;
  std::vector<double> numbers;
  std::vector<std::string> texts;
};

struct GgufTensor {
  std::string name;
  uint32_t type = 0;            // GgmlType
  std::vector<int64_t> shape;   // outermost first, as PyTorch orders it (GGUF stores it reversed)
  int64_t numel = 0;
  uint64_t offset = 0;          // from the start of the file
  uint64_t nbytes = 0;
};

class GgufFile {
 public:
  // Maps `path` (core/io/mapped_file.h) and validates the whole header (above).
  static std::shared_ptr<GgufFile> open(const std::string& path);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  // Tensors in the file's order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find(const std::string& name) const;
  // Metadata keys in the file's order, and their values.
  const std::vector<std::string>& keys() const { return keys_; }
  const GgufValue* value(const std::string& key) const;
  // A scalar of the right kind, or nullopt when absent. A key of another kind (a string where a
  // number is meant) is an error naming the key and both types.
  std::optional<int64_t> get_int(const std::string& key) const;
  std::optional<double> get_float(const std::string& key) const;  // a float or an integer
  std::optional<std::string> get_string(const std::string& key) const;
  std::optional<bool> get_bool(const std::string& key) const;

  // The tensor's stored bytes (inside the mapping).
  const uint8_t* data(const GgufTensor& tensor) const;
  // Its numel values as fp32 into `out`. Throws weft::Error naming the file, the tensor and its
  // type when weft does not dequantize the type.
  void dequantize(const GgufTensor& tensor, float* out) const;

 private:
  GgufFile() = default;
  std::string path_;
  std::shared_ptr<const MappedFile> mapping_;
  uint32_t version_ = 0;
  std::vector<GgufTensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  std::vector<std::string> keys_;
  std::unordered_map<std::string, GgufValue> values_;
};

}  // namespace weft
