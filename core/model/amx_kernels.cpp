// LoRA dropout's backward on CPUs with AMX (kernels.h: add_kept_products_, kept_weight_grads_): the
// adapters' products with their masks applied, in bf16 tiles with fp32 sums (TDPBF16PS), instead of
// the dense products and a correction per dropped element. x's gradient: each adapter's v A in
// 16 x 16 tiles, added where its mask keeps the element. A's gradient: v^T D(x), x's dropped
// elements zeroed in the tiles' copy of x.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "core/model/kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define WEFT_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define WEFT_AMX 0
#endif

namespace weft {
namespace amx_detail {

#if WEFT_AMX

#define WEFT_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

// Whether this process may run AMX-BF16 tiles: the CPU has AMX-TILE, AMX-BF16 and AVX512_BF16
// (cpuid), and Linux grants the process the tiles' state (arch_prctl's ARCH_REQ_XCOMP_PERM for
// XTILEDATA, which oneDNN asks for too). Checked once.
bool tiles_available() {
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
    if (__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) == 0) return false;
    const bool avx512_bf16 = (eax >> 5) & 1u;
    if (!amx_bf16 || !amx_tile || !avx512_bf16) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return available;
}

// LDTILECFG's 64-byte operand (palette 1).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG takes 64 bytes");

constexpr int64_t kTile = 16;     // rows and fp32 columns of a product tile
constexpr int kMaxAdapters = 3;   // adapters per pass: three product tiles, three of v's blocks, one of A
// Tiles: 0-2 v's 16 x 16 blocks (one per adapter: the A operand, K = 16), 3 A's packed 16 x 16 block
// (the B operand: 8 rows of 16 pairs), 4-6 the products (16 x 16 fp32).

// One adapter's operands: its mask's ascending indices, v [rows, r] bf16 (row stride `stride`),
// and A packed for the B operand: for each K-step s (r / 16) and each 16 columns t, 8 rows of 16
// pairs (A[16 s + 2 k][16 t + n], A[16 s + 2 k + 1][16 t + n]), 512 bytes, at (t steps + s) 256.
struct Operand {
  const int32_t* d;
  int64_t count;
  const uint16_t* v;
  int64_t stride, steps;
  const uint16_t* packed;
};

WEFT_AMX_TARGET inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = kTile, cfg.colsb[t] = 32;
  cfg.rows[3] = 8, cfg.colsb[3] = 64;
  for (int t = 4; t < 7; ++t) cfg.rows[t] = kTile, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// Product tiles of columns [16 t, 16 t + 16) for rows [i0, i0 + 16) of each adapter, stored to
// out[a 256 .. a 256 + 256) (16 rows of 16 fp32).
template <int N>
WEFT_AMX_TARGET inline void product_tiles(const Operand* ops, int64_t i0, int64_t t, float* out) {
#define WEFT_PRODUCT(A, C)                                                                            \
  do {                                                                                                \
    const Operand& op = ops[A];                                                                       \
    _tile_zero(C);                                                                                    \
    for (int64_t s = 0; s < op.steps; ++s) {                                                          \
      if (op.steps > 1) _tile_loadd(A, op.v + i0 * op.stride + s * kTile, op.stride * 2);             \
      _tile_loadd(3, op.packed + (t * op.steps + s) * 256, 64);                                       \
      _tile_dpbf16ps(C, A, 3);                                                                        \
    }                                                                                                 \
    _tile_stored(C, out + (A) * 256, 64);                                                             \
  } while (0)
  WEFT_PRODUCT(0, 4);
  if constexpr (N > 1) WEFT_PRODUCT(1, 5);
  if constexpr (N > 2) WEFT_PRODUCT(2, 6);
#undef WEFT_PRODUCT
}

// Rows [i0, i0 + 16) of g [rows, cols] (bf16): g += each adapter's v A where its mask keeps the
// element, in fp32, rounded once. `dropped`: N planes of [16, cols] bytes, zero on entry and on
// return (this block's dropped elements are marked 1 meanwhile); `cursor`: each adapter's first
// index at or after row i0, advanced past the block; `tiles`: room for two columns' product tiles.
template <int N>
WEFT_AMX_TARGET void block_rows(uint16_t* g, int64_t cols, const Operand* ops, int64_t i0, int64_t* cursor,
                                uint8_t* dropped, float* tiles) {
  const int64_t plane = kTile * cols, base = i0 * cols, words = cols / kTile;
  int64_t end[kMaxAdapters];
  for (int a = 0; a < N; ++a) {  // this block's dropped elements, marked in a byte each
    const int32_t* d = ops[a].d;
    uint8_t* mark = dropped + a * plane - base;
    int64_t k = cursor[a];
    for (; k < ops[a].count && d[k] < base + plane; ++k) mark[d[k]] = 1;
    end[a] = k;
  }
  // v's blocks stay in their tiles for all of the block's columns where r = 16 (else loaded per step)
  if (ops[0].steps == 1) _tile_loadd(0, ops[0].v + i0 * ops[0].stride, ops[0].stride * 2);
  if constexpr (N > 1) {
    if (ops[1].steps == 1) _tile_loadd(1, ops[1].v + i0 * ops[1].stride, ops[1].stride * 2);
  }
  if constexpr (N > 2) {
    if (ops[2].steps == 1) _tile_loadd(2, ops[2].v + i0 * ops[2].stride, ops[2].stride * 2);
  }
  // The tiles of columns t + 1 are computed (and stored) while those of t are added into g.
  product_tiles<N>(ops, i0, 0, tiles);
  for (int64_t t = 0; t < words; ++t) {
    if (t + 1 < words) product_tiles<N>(ops, i0, t + 1, tiles + ((t + 1) & 1) * (kMaxAdapters * 256));
    const float* cur = tiles + (t & 1) * (kMaxAdapters * 256);
    for (int64_t m = 0; m < kTile; ++m) {
      uint16_t* gp = g + base + m * cols + t * kTile;
      // (the maskz forms: GCC 12 warns of the plain ones' undefined pass-through operand)
      const __m512i widened = _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp)));
      __m512 acc = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, widened, 16));
      for (int a = 0; a < N; ++a) {
        const __m128i marks = _mm_loadu_si128(reinterpret_cast<const __m128i*>(dropped + a * plane + m * cols + t * kTile));
        const __mmask16 keep = _mm_cmpeq_epi8_mask(marks, _mm_setzero_si128());
        acc = _mm512_mask_add_ps(acc, keep, acc, _mm512_loadu_ps(cur + a * 256 + m * kTile));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(gp), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc)));
    }
  }
  for (int a = 0; a < N; ++a) {  // the marks cleared for the next block
    const int32_t* d = ops[a].d;
    uint8_t* mark = dropped + a * plane - base;
    for (int64_t k = cursor[a]; k < end[a]; ++k) mark[d[k]] = 0;
    cursor[a] = end[a];
  }
}

// Rows [begin, end) (a multiple of 16 from begin) through the tiles.
WEFT_AMX_TARGET void tile_rows(uint16_t* g, int64_t cols, const Operand* ops, int n, int64_t begin, int64_t end) {
  configure_tiles();
  std::vector<uint8_t> dropped(static_cast<size_t>(kMaxAdapters * kTile * cols), 0);
  alignas(64) float tiles[2 * kMaxAdapters * 256];
  int64_t cursor[kMaxAdapters];
  for (int a = 0; a < n; ++a) {
    cursor[a] = std::lower_bound(ops[a].d, ops[a].d + ops[a].count, begin * cols) - ops[a].d;
  }
  for (int64_t i0 = begin; i0 < end; i0 += kTile) {
    if (n == 1) block_rows<1>(g, cols, ops, i0, cursor, dropped.data(), tiles);
    if (n == 2) block_rows<2>(g, cols, ops, i0, cursor, dropped.data(), tiles);
    if (n == 3) block_rows<3>(g, cols, ops, i0, cursor, dropped.data(), tiles);
  }
  _tile_release();
}

// A's gradients: ga = v^T D(x), [r, cols] fp32, through tiles of 32 of x's rows: the A operand v^T's
// [16, 32] block (v transposed once, its rows padded with zeros to a multiple of 32), the B operand
// x's block in pairs of rows ([16, cols, 2]: rows 2k and 2k + 1 of the block interleaved, zeros past
// x's last row), the dropped elements zeroed in it while one adapter's tiles run, then restored.
// Columns [c0, c1) (multiples of 16) of every adapter's ga; ga's tiles accumulate in memory.
struct WeightOperand {
  const int32_t* d;
  int64_t count;
  const uint16_t* vt;  // v^T [r, rows_padded] bf16
  int64_t rows_padded, steps;
  float* ga;  // [r, cols] fp32, zeroed by the caller
};

WEFT_AMX_TARGET inline void configure_weight_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = kTile, cfg.colsb[t] = 64;  // 0: v^T block, 1 and 3: x pairs, 2 and 4: ga's
  _tile_loadconfig(&cfg);
}

WEFT_AMX_TARGET void weight_columns(const uint16_t* x, int64_t rows, int64_t cols, const WeightOperand* ops, int n,
                                    int64_t c0, int64_t c1) {
  configure_weight_tiles();
  constexpr int64_t kPair = 2 * kTile;  // rows per block
  const int64_t width = c1 - c0;
  std::vector<uint16_t> pairs(static_cast<size_t>(kTile * width * 2));  // [16, width, 2]
  std::vector<int64_t> cursor(static_cast<size_t>(n)), zeroed(static_cast<size_t>(kPair * width));
  std::vector<uint16_t> saved(static_cast<size_t>(kPair * width));
  for (int a = 0; a < n; ++a) cursor[static_cast<size_t>(a)] = 0;
  // x's rows interleaved in pairs: 32 of one row's elements and 32 of the next into two vectors
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                          22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t i0 = 0; i0 < rows; i0 += kPair) {
    for (int64_t k = 0; k < kTile; ++k) {
      const int64_t r0 = i0 + 2 * k, r1 = r0 + 1;
      uint16_t* out = pairs.data() + k * width * 2;
      for (int64_t j = 0; j < width; j += 32) {
        const __mmask32 lanes = width - j >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (width - j)) - 1);
        const __m512i a = r0 < rows ? _mm512_maskz_loadu_epi16(lanes, x + r0 * cols + c0 + j) : _mm512_setzero_si512();
        const __m512i b = r1 < rows ? _mm512_maskz_loadu_epi16(lanes, x + r1 * cols + c0 + j) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 2 * j, _mm512_permutex2var_epi16(a, lo_idx, b));
        if (width - j > 16) _mm512_storeu_si512(out + 2 * j + 32, _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
    const int64_t block_rows = std::min(kPair, rows - i0);
    for (int a = 0; a < n; ++a) {
      const WeightOperand& op = ops[a];
      int64_t& cur = cursor[static_cast<size_t>(a)];
      // This adapter's dropped elements zeroed, row by row (their places and values kept to restore).
      const int32_t* __restrict d = op.d;
      const int64_t count = op.count;
      uint16_t* __restrict block = pairs.data();
      int64_t* __restrict places = zeroed.data();
      uint16_t* __restrict values = saved.data();
      int64_t nz = 0, k = cur;
      for (int64_t i = 0; i < block_rows; ++i) {
        const int64_t first = (i0 + i) * cols + c0, row_end = (i0 + i + 1) * cols;
        const int64_t base = (i / 2) * width * 2 + (i % 2);
        for (; k < count && d[k] < row_end; ++k) {
          const int64_t j = d[k] - first;
          if (static_cast<uint64_t>(j) >= static_cast<uint64_t>(width)) continue;  // another thread's columns
          const int64_t at = base + 2 * j;
          places[nz] = at;
          values[nz++] = block[at];
          block[at] = 0;
        }
      }
      cur = k;
      for (int64_t s = 0; s < op.steps; ++s) {
        _tile_loadd(0, op.vt + s * kTile * op.rows_padded + i0, op.rows_padded * 2);
        float* c = op.ga + s * kTile * cols + c0;
        int64_t t = 0;
        for (; t + 2 * kTile <= width; t += 2 * kTile) {  // two of ga's tiles at a time: independent chains
          _tile_loadd(2, c + t, cols * 4);
          _tile_loadd(4, c + t + kTile, cols * 4);
          _tile_loadd(1, pairs.data() + t * 2, width * 4);
          _tile_loadd(3, pairs.data() + (t + kTile) * 2, width * 4);
          _tile_dpbf16ps(2, 0, 1);
          _tile_dpbf16ps(4, 0, 3);
          _tile_stored(2, c + t, cols * 4);
          _tile_stored(4, c + t + kTile, cols * 4);
        }
        if (t < width) {
          _tile_loadd(2, c + t, cols * 4);
          _tile_loadd(1, pairs.data() + t * 2, width * 4);
          _tile_dpbf16ps(2, 0, 1);
          _tile_stored(2, c + t, cols * 4);
        }
      }
      for (int64_t z = 0; z < nz; ++z) block[places[z]] = values[z];  // restored for the next adapter
    }
  }
  _tile_release();
}

// Rows [begin, end) without tiles (the last rows, fewer than 16): the same sums in fp32, rounded once.
void plain_rows(uint16_t* g, int64_t cols, const Operand* ops, int n, int64_t begin, int64_t end) {
  std::vector<float> acc(static_cast<size_t>(cols));
  for (int64_t i = begin; i < end; ++i) {
    uint16_t* gi = g + i * cols;
    for (int64_t j = 0; j < cols; ++j) acc[static_cast<size_t>(j)] = c10::detail::f32_from_bits(gi[j]);
    for (int a = 0; a < n; ++a) {
      const Operand& op = ops[a];
      const int64_t r = op.steps * kTile;
      std::vector<float> prod(static_cast<size_t>(cols), 0.0f);
      for (int64_t c = 0; c < r; ++c) {
        const float vc = c10::detail::f32_from_bits(op.v[i * op.stride + c]);
        const int64_t s = c / kTile, k = (c % kTile) / 2, q = c % 2;
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t t = j / kTile, nn = j % kTile;
          prod[static_cast<size_t>(j)] += vc * c10::detail::f32_from_bits(op.packed[(t * op.steps + s) * 256 + k * 32 + nn * 2 + q]);
        }
      }
      const int32_t* lo = std::lower_bound(op.d, op.d + op.count, i * cols);
      for (const int32_t* e = lo; e < op.d + op.count && *e < (i + 1) * cols; ++e) prod[static_cast<size_t>(*e - i * cols)] = 0.0f;
      for (int64_t j = 0; j < cols; ++j) acc[static_cast<size_t>(j)] += prod[static_cast<size_t>(j)];
    }
    for (int64_t j = 0; j < cols; ++j) gi[j] = c10::BFloat16(acc[static_cast<size_t>(j)]).x;
  }
}

#endif  // WEFT_AMX

}  // namespace amx_detail

bool add_kept_products_(torch::Tensor& grad_x, const std::vector<DroppedAdapter>& adapters) {
#if WEFT_AMX
  using namespace amx_detail;
  if (adapters.empty() || !grad_x.defined() || !grad_x.device().is_cpu() || grad_x.scalar_type() != torch::kBFloat16 ||
      grad_x.dim() != 2 || !grad_x.is_contiguous() || grad_x.size(1) % kTile != 0) {
    return false;
  }
  const int64_t rows = grad_x.size(0), cols = grad_x.size(1);
  for (const auto& ad : adapters) {
    const auto& v = ad.rows;
    if (!ad.at.defined() || ad.at.dim() != 2 || ad.at.size(0) != cols || ad.at.size(1) % kTile != 0 ||
        ad.at.scalar_type() != torch::kFloat32 || !ad.at.is_contiguous() || !v.defined() ||
        v.scalar_type() != torch::kBFloat16 || v.dim() != 2 || v.size(0) != rows || v.size(1) != ad.at.size(1) ||
        v.stride(1) != 1 || !ad.dropped.defined() || ad.dropped.scalar_type() != torch::kInt32 ||
        !ad.dropped.is_contiguous()) {
      return false;
    }
  }
  if (!tiles_available()) return false;
  RECORD_FUNCTION("weft::add_kept_products_", std::vector<c10::IValue>());  // named in profiles
  // A in bf16 (rounded to nearest, as the dense product's cast of A), packed for the B operand.
  std::vector<std::vector<uint16_t>> packed(adapters.size());
  std::vector<Operand> ops;
  for (size_t o = 0; o < adapters.size(); ++o) {
    const auto& ad = adapters[o];
    const int64_t r = ad.at.size(1), steps = r / kTile, tiles = cols / kTile;
    const float* at = ad.at.data_ptr<float>();
    auto& p = packed[o];
    p.resize(static_cast<size_t>(cols * r));
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t s = 0; s < steps; ++s) {
        uint16_t* block = p.data() + (t * steps + s) * 256;
        for (int64_t k = 0; k < 8; ++k) {
          for (int64_t nn = 0; nn < kTile; ++nn) {
            for (int64_t q = 0; q < 2; ++q) {
              block[k * 32 + nn * 2 + q] = c10::BFloat16(at[(t * kTile + nn) * r + s * kTile + 2 * k + q]).x;
            }
          }
        }
      }
    }
    ops.push_back({ad.dropped.data_ptr<int32_t>(), ad.dropped.numel(),
                   reinterpret_cast<const uint16_t*>(ad.rows.data_ptr()), ad.rows.stride(0), steps, p.data()});
  }
  auto* g = reinterpret_cast<uint16_t*>(grad_x.data_ptr());
  const int64_t blocks = rows / kTile;
  for (size_t o = 0; o < ops.size(); o += kMaxAdapters) {  // each pass's sums rounded once into g
    const int n = static_cast<int>(std::min<size_t>(kMaxAdapters, ops.size() - o));
    at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) { tile_rows(g, cols, ops.data() + o, n, b0 * kTile, b1 * kTile); });
    plain_rows(g, cols, ops.data() + o, n, blocks * kTile, rows);
  }
  return true;
#else
  (void)grad_x;
  (void)adapters;
  return false;
#endif
}

bool kept_weight_grads_(const torch::Tensor& x, std::vector<DroppedAdapter>& adapters) {
#if WEFT_AMX
  using namespace amx_detail;
  if (adapters.empty() || !x.defined() || !x.device().is_cpu() || x.scalar_type() != torch::kBFloat16 ||
      x.dim() != 2 || !x.is_contiguous() || x.size(1) % kTile != 0) {
    return false;
  }
  const int64_t rows = x.size(0), cols = x.size(1);
  for (const auto& ad : adapters) {
    const auto& v = ad.rows;
    if (!v.defined() || v.scalar_type() != torch::kBFloat16 || v.dim() != 2 || v.size(0) != rows ||
        v.size(1) % kTile != 0 || !ad.dropped.defined() || ad.dropped.scalar_type() != torch::kInt32 ||
        !ad.dropped.is_contiguous()) {
      return false;
    }
  }
  if (!tiles_available()) return false;
  RECORD_FUNCTION("weft::kept_weight_grads_", std::vector<c10::IValue>());  // named in profiles
  const int64_t rows_padded = (rows + 2 * kTile - 1) / (2 * kTile) * (2 * kTile);
  std::vector<torch::Tensor> vts;
  std::vector<WeightOperand> ops;
  for (auto& ad : adapters) {
    const int64_t r = ad.rows.size(1);
    auto vt = torch::zeros({r, rows_padded}, ad.rows.options());
    vt.narrow(1, 0, rows).copy_(ad.rows.t());
    vts.push_back(vt);
    ad.grad_a = torch::zeros({r, cols}, torch::kFloat32);
    ops.push_back({ad.dropped.data_ptr<int32_t>(), ad.dropped.numel(), reinterpret_cast<const uint16_t*>(vt.data_ptr()),
                   rows_padded, r / kTile, ad.grad_a.data_ptr<float>()});
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t tiles = cols / kTile;
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    weight_columns(xp, rows, cols, ops.data(), static_cast<int>(ops.size()), t0 * kTile, t1 * kTile);
  });
  return true;
#else
  (void)x;
  (void)adapters;
  return false;
#endif
}

}  // namespace weft
