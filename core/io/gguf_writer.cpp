#include "core/io/gguf_writer.h"

#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/util/error.h"
#include "core/util/fs.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "weft's GGUF writer assumes a little-endian host"
#endif

namespace weft {
// Named, not anonymous: weft_io builds as one unity source, beside gguf.cpp's own value types.
namespace gguf_writing {

constexpr uint64_t kAlignment = 32;
enum ValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// fp32 to IEEE half, rounding to nearest even (numpy's npy_floatbits_to_halfbits, which
// `astype(np.float16)` runs: subnormals, overflow to infinity and NaN payloads as it does).
uint16_t float_to_half(float value) {
  const uint32_t f = bits_of(value);
  const auto sign = static_cast<uint16_t>((f & 0x80000000u) >> 16);
  uint32_t exponent = f & 0x7f800000u;
  if (exponent >= 0x47800000u) {  // overflow, infinity or NaN
    if (exponent == 0x7f800000u && (f & 0x007fffffu) != 0) {
      auto nan = static_cast<uint16_t>(0x7c00u + ((f & 0x007fffffu) >> 13));
      if (nan == 0x7c00u) ++nan;
      return static_cast<uint16_t>(sign + nan);
    }
    return static_cast<uint16_t>(sign + 0x7c00u);
  }
  if (exponent <= 0x38000000u) {  // a subnormal half, or zero
    if (exponent < 0x33000000u) return sign;
    exponent >>= 23;
    uint32_t significand = 0x00800000u + (f & 0x007fffffu);
    significand >>= (113 - exponent);
    if ((significand & 0x00003fffu) != 0x00001000u || (f & 0x000007ffu) != 0) significand += 0x00001000u;
    return static_cast<uint16_t>(sign + (significand >> 13));
  }
  const auto half_exponent = static_cast<uint16_t>((exponent - 0x38000000u) >> 13);
  uint32_t significand = f & 0x007fffffu;
  if ((significand & 0x00003fffu) != 0x00001000u) significand += 0x00001000u;
  return static_cast<uint16_t>(sign + static_cast<uint16_t>((significand >> 13) + half_exponent));
}

// fp32 to bfloat16 as ggml_compute_fp32_to_bf16 (and gguf-py's BF16): NaN made quiet, round to
// nearest even.
uint16_t float_to_bf16(float value) {
  uint32_t n = bits_of(value);
  if ((n & 0x7fffffffu) > 0x7f800000u) n = (n & 0xffff0000u) | (64u << 16);
  return static_cast<uint16_t>((static_cast<uint64_t>(n) + (0x7fffu + ((n >> 16) & 1u))) >> 16);
}

// gguf-py's np_roundf: half away from zero, in fp32.
float roundf_as_gguf_py(float n) {
  const float a = std::fabs(n);
  const float floored = std::floor(a);
  const float b = floored + std::floor(2.0f * (a - floored));
  return n > 0 ? b : n < 0 ? -b : 0.0f * b;
}

void put(std::vector<uint8_t>& out, const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  out.insert(out.end(), b, b + n);
}
template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  put(out, &v, sizeof(v));
}
void put_string(std::vector<uint8_t>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  put(out, s.data(), s.size());
}

void put_scalar(std::vector<uint8_t>& out, uint32_t type, int64_t integer, double number, const std::string& key) {
  switch (type) {
    case kU8: put<uint8_t>(out, static_cast<uint8_t>(integer)); break;
    case kI8: put<int8_t>(out, static_cast<int8_t>(integer)); break;
    case kU16: put<uint16_t>(out, static_cast<uint16_t>(integer)); break;
    case kI16: put<int16_t>(out, static_cast<int16_t>(integer)); break;
    case kU32: put<uint32_t>(out, static_cast<uint32_t>(integer)); break;
    case kI32: put<int32_t>(out, static_cast<int32_t>(integer)); break;
    case kBool: put<uint8_t>(out, integer != 0 ? 1 : 0); break;
    case kU64: put<uint64_t>(out, static_cast<uint64_t>(integer)); break;
    case kI64: put<int64_t>(out, integer); break;
    case kF32: put<float>(out, static_cast<float>(number)); break;
    case kF64: put<double>(out, number); break;
    default: fail("GGUF metadata '{}': value type {} is not a scalar weft writes", key, type);
  }
}

bool is_float(uint32_t type) { return type == kF32 || type == kF64; }

void put_value(std::vector<uint8_t>& out, const std::string& key, const GgufValue& v) {
  put<uint32_t>(out, v.type);
  if (v.type == kString) {
    put_string(out, v.text);
  } else if (v.type == kArray) {
    put<uint32_t>(out, v.element_type);
    put<uint64_t>(out, v.count);
    if (v.element_type == kString) {
      WEFT_CHECK(v.texts.size() == v.count, "GGUF metadata '{}': {} strings for a count of {}", key, v.texts.size(),
                 v.count);
      for (const auto& s : v.texts) put_string(out, s);
    } else if (is_float(v.element_type)) {
      WEFT_CHECK(v.numbers.size() == v.count, "GGUF metadata '{}': {} numbers for a count of {}", key,
                 v.numbers.size(), v.count);
      for (double x : v.numbers) put_scalar(out, v.element_type, 0, x, key);
    } else {
      WEFT_CHECK(v.element_type != kArray, "GGUF metadata '{}': an array of arrays is not written", key);
      WEFT_CHECK(v.integers.size() == v.count, "GGUF metadata '{}': {} integers for a count of {}", key,
                 v.integers.size(), v.count);
      for (int64_t x : v.integers) put_scalar(out, v.element_type, x, 0, key);
    }
  } else {
    put_scalar(out, v.type, v.integer, v.number, key);
  }
}

uint64_t padded(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace gguf_writing

bool ggml_type_quantizable(uint32_t type) {
  return type == kGgmlF32 || type == kGgmlF16 || type == kGgmlBF16 || type == kGgmlQ8_0;
}

uint64_t ggml_type_bytes(uint32_t type, int64_t count) {
  switch (type) {
    case kGgmlF32: return static_cast<uint64_t>(count) * 4;
    case kGgmlF16: case kGgmlBF16: return static_cast<uint64_t>(count) * 2;
    case kGgmlQ8_0: return static_cast<uint64_t>(count / 32) * 34;
    default: fail("weft does not write GGUF tensors of type {}", ggml_type_name(type));
  }
}

std::vector<uint8_t> quantize_ggml(uint32_t type, const float* in, int64_t count) {
  WEFT_CHECK(ggml_type_quantizable(type), "weft does not write GGUF tensors of type {} (it writes F32, F16, BF16, Q8_0)",
             ggml_type_name(type));
  WEFT_CHECK(count >= 0 && (type != kGgmlQ8_0 || count % 32 == 0),
             "{} values are not whole blocks of {} (32 values)", count, ggml_type_name(type));
  std::vector<uint8_t> out;
  out.reserve(ggml_type_bytes(type, count));
  if (type == kGgmlF32) {
    gguf_writing::put(out, in, static_cast<size_t>(count) * sizeof(float));
  } else if (type == kGgmlF16) {
    for (int64_t i = 0; i < count; ++i) gguf_writing::put<uint16_t>(out, gguf_writing::float_to_half(in[i]));
  } else if (type == kGgmlBF16) {
    for (int64_t i = 0; i < count; ++i) gguf_writing::put<uint16_t>(out, gguf_writing::float_to_bf16(in[i]));
  } else {  // Q8_0: per block of 32, d = max |x| / 127 (stored as half), q = round(x / d)
    for (int64_t b = 0; b < count; b += 32) {
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(in[b + j]));
      const float d = amax / 127.0f;
      const float id = d == 0.0f ? 0.0f : 1.0f / d;
      gguf_writing::put<uint16_t>(out, gguf_writing::float_to_half(d));
      for (int j = 0; j < 32; ++j) gguf_writing::put<int8_t>(out, static_cast<int8_t>(gguf_writing::roundf_as_gguf_py(in[b + j] * id)));
    }
  }
  return out;
}

GgufValue GgufWriter::u32(uint32_t v) {
  GgufValue g;
  g.type = gguf_writing::kU32;
  g.integer = v;
  return g;
}
GgufValue GgufWriter::i32(int32_t v) {
  GgufValue g;
  g.type = gguf_writing::kI32;
  g.integer = v;
  return g;
}
GgufValue GgufWriter::f32(float v) {
  GgufValue g;
  g.type = gguf_writing::kF32;
  g.number = v;
  return g;
}
GgufValue GgufWriter::boolean(bool v) {
  GgufValue g;
  g.type = gguf_writing::kBool;
  g.integer = v ? 1 : 0;
  return g;
}
GgufValue GgufWriter::string(std::string v) {
  GgufValue g;
  g.type = gguf_writing::kString;
  g.text = std::move(v);
  return g;
}
GgufValue GgufWriter::strings(std::vector<std::string> v) {
  GgufValue g;
  g.type = gguf_writing::kArray;
  g.element_type = gguf_writing::kString;
  g.count = v.size();
  g.texts = std::move(v);
  return g;
}
GgufValue GgufWriter::i32s(const std::vector<int32_t>& v) {
  GgufValue g;
  g.type = gguf_writing::kArray;
  g.element_type = gguf_writing::kI32;
  g.count = v.size();
  g.integers.assign(v.begin(), v.end());
  return g;
}
GgufValue GgufWriter::f32s(const std::vector<float>& v) {
  GgufValue g;
  g.type = gguf_writing::kArray;
  g.element_type = gguf_writing::kF32;
  g.count = v.size();
  g.numbers.assign(v.begin(), v.end());
  return g;
}

void GgufWriter::set(const std::string& key, GgufValue value) {
  for (auto& [k, v] : values_) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  values_.emplace_back(key, std::move(value));
}

void GgufWriter::add_tensor(std::string name, std::vector<int64_t> shape, uint32_t type, std::vector<uint8_t> bytes) {
  WEFT_CHECK(!shape.empty() && shape.size() <= 4, "GGUF tensor '{}': {} dimensions (1 to 4)", name, shape.size());
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  WEFT_CHECK(bytes.size() == ggml_type_bytes(type, numel), "GGUF tensor '{}': {} bytes for {} {} values", name,
             bytes.size(), numel, ggml_type_name(type));
  for (const auto& t : tensors_) WEFT_CHECK(t.name != name, "GGUF tensor '{}' added twice", name);
  tensors_.push_back({std::move(name), std::move(shape), type, std::move(bytes)});
}

void GgufWriter::write(const std::string& path) const {
  std::vector<uint8_t> header;
  gguf_writing::put(header, "GGUF", 4);
  gguf_writing::put<uint32_t>(header, 3);
  gguf_writing::put<uint64_t>(header, tensors_.size());
  gguf_writing::put<uint64_t>(header, values_.size());
  for (const auto& [key, value] : values_) {
    gguf_writing::put_string(header, key);
    gguf_writing::put_value(header, key, value);
  }
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    gguf_writing::put_string(header, t.name);
    gguf_writing::put<uint32_t>(header, static_cast<uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) gguf_writing::put<uint64_t>(header, static_cast<uint64_t>(*d));
    gguf_writing::put<uint32_t>(header, t.type);
    gguf_writing::put<uint64_t>(header, offset);
    offset = gguf_writing::padded(offset + t.bytes.size());
  }
  header.resize(gguf_writing::padded(header.size()), 0);
  write_file_atomically(path, [&](const ByteSink& sink) {
    sink(header.data(), header.size());
    static const uint8_t zeros[gguf_writing::kAlignment] = {};
    for (const auto& t : tensors_) {
      sink(t.bytes.data(), t.bytes.size());
      const uint64_t pad = gguf_writing::padded(t.bytes.size()) - t.bytes.size();
      if (pad > 0) sink(zeros, pad);
    }
  });
}

}  // namespace weft
