// ggml's block formats, dequantized to fp32 as gguf-py (gguf/quants.py) does: each value from the
// same fp32 operations in the same order, so that the results are the same bits. (weft_io builds
// with -ffp-contract=off: a fused multiply-add would round once where gguf-py rounds twice.)
#include <cstring>

#include <fmt/format.h>

#include "core/io/gguf.h"
#include "core/util/error.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "weft's GGUF reader assumes a little-endian host"
#endif

namespace weft {
namespace {

constexpr int64_t kQK = 256;  // a K-quant super-block's values

// IEEE half to float, exactly (subnormals, infinities and NaN payloads included).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

float read_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return half_to_float(h);
}

// Q4_K and Q5_K: eight 6-bit scales and mins packed in 12 bytes (gguf-py's Q4_K.get_scale_min).
void scale_min_k4(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3f;
    m[j] = s[4 + j] & 0x3f;
    sc[4 + j] = static_cast<uint8_t>((s[8 + j] & 0x0f) | ((s[j] >> 2) & 0x30));
    m[4 + j] = static_cast<uint8_t>((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
  }
}

void q4_0(const uint8_t* b, float* out) {  // d, 16 bytes: low nibbles are values 0..15, high 16..31
  const float d = read_half(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(static_cast<int8_t>(qs[i] & 0x0f) - 8);
    out[16 + i] = d * static_cast<float>(static_cast<int8_t>(qs[i] >> 4) - 8);
  }
}

void q4_1(const uint8_t* b, float* out) {  // d, m, 16 bytes of nibbles
  const float d = read_half(b), m = read_half(b + 2);
  const uint8_t* qs = b + 4;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(qs[i] & 0x0f) + m;
    out[16 + i] = d * static_cast<float>(qs[i] >> 4) + m;
  }
}

void q8_0(const uint8_t* b, float* out) {  // d, 32 int8
  const float d = read_half(b);
  for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

// Q4_K: d, dmin, 12 bytes of scales and mins, 128 bytes: four groups of 32 bytes, each the low
// nibbles of one 32-value sub-block and the high nibbles of the next.
void q4_k(const uint8_t* b, float* out) {
  const float d = read_half(b), dmin = read_half(b + 2);
  uint8_t sc[8], m[8];
  scale_min_k4(b + 4, sc, m);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    const float dj = d * static_cast<float>(sc[j]), mj = dmin * static_cast<float>(m[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) out[32 * j + i] = dj * static_cast<float>((q[i] >> shift) & 0x0f) - mj;
  }
}

// Q5_K: Q4_K's layout with 32 bytes of high bits before the nibbles: bit j of byte i is the fifth
// bit of value i of sub-block j.
void q5_k(const uint8_t* b, float* out) {
  const float d = read_half(b), dmin = read_half(b + 2);
  uint8_t sc[8], m[8];
  scale_min_k4(b + 4, sc, m);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    const float dj = d * static_cast<float>(sc[j]), mj = dmin * static_cast<float>(m[j]);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) {
      const int value = ((q[i] >> shift) & 0x0f) | (((qh[i] >> j) & 1) << 4);
      out[32 * j + i] = dj * static_cast<float>(value) - mj;
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales (one per 16 values),
// d. Value e of a half h = e / 128 (r = e % 128): its nibble from byte h * 64 + r % 64 (low for
// r < 64), its two high bits from byte h * 32 + r % 32 at bit 2 * (r / 32).
void q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = read_half(b + 208);
  for (int e = 0; e < kQK; ++e) {
    const int h = e / 128, r = e % 128;
    const int low = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
    const int high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
    const auto q = static_cast<int8_t>((low | (high << 4)) - 32);
    const float dl = d * static_cast<float>(scales[e / 16]);
    out[e] = dl * static_cast<float>(q);
  }
}

struct Blocks {
  int64_t values, bytes;
  void (*row)(const uint8_t*, float*);
};

}  // namespace

bool ggml_type_dequantizable(uint32_t type) {
  switch (type) {
    case kGgmlF32: case kGgmlF16: case kGgmlBF16: case kGgmlQ8_0: case kGgmlQ4_0: case kGgmlQ4_1:
    case kGgmlQ4_K: case kGgmlQ5_K: case kGgmlQ6_K:
      return true;
    default:
      return false;
  }
}

const char* ggml_dequantizable_names() { return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"; }

void dequantize_ggml(uint32_t type, const uint8_t* in, int64_t count, float* out) {
  switch (type) {
    case kGgmlF32:
      std::memcpy(out, in, static_cast<size_t>(count) * 4);
      return;
    case kGgmlF16:
      for (int64_t i = 0; i < count; ++i) out[i] = read_half(in + 2 * i);
      return;
    case kGgmlBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, in + 2 * i, sizeof(h));
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(out + i, &bits, sizeof(bits));
      }
      return;
    default:
      break;
  }
  Blocks blocks{};
  switch (type) {
    case kGgmlQ4_0: blocks = {32, 18, q4_0}; break;
    case kGgmlQ4_1: blocks = {32, 20, q4_1}; break;
    case kGgmlQ8_0: blocks = {32, 34, q8_0}; break;
    case kGgmlQ4_K: blocks = {kQK, 144, q4_k}; break;
    case kGgmlQ5_K: blocks = {kQK, 176, q5_k}; break;
    case kGgmlQ6_K: blocks = {kQK, 210, q6_k}; break;
    default:
      throw Error(fmt::format("ggml type {} is not one weft dequantizes ({})", ggml_type_name(type),
                              ggml_dequantizable_names()));
  }
  WEFT_CHECK(count % blocks.values == 0, "{} values of {} are not whole blocks of {}", count, ggml_type_name(type),
             blocks.values);
  for (int64_t k = 0; k < count / blocks.values; ++k) blocks.row(in + k * blocks.bytes, out + k * blocks.values);
}

}  // namespace weft
