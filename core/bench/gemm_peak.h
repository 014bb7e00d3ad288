// The GEMM peak that trainer bench reports model FLOP utilisation against on a CPU: torch::mm's
// rate on the model's own products (the shapes a training step multiplies), in the job's compute
// dtype with its intra-op threads (one rank's share of the machine). A CPU has no data-sheet peak
// that its libraries reach (AMX, AVX512_BF16 and AVX2 machines differ by 10x in bf16), so the
// figure is measured where the bench runs, beside the runs it judges.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/model/config.h"
#include "core/model/gemm.h"

namespace weft {

// One product x [m, k] by w^T (w [n, k], as a linear layer stores its weight).
struct GemmShape {
  int64_t m = 0, k = 0, n = 0;
  std::string what;  // the layer(s) it stands for: "q/k/v", "gate/up", "down", "o", "head"
  double flops() const { return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n); }
};

// The forward products of one rank's micro-batch of `tokens` rows through `config`'s layers, as
// weft multiplies them: q/k/v and gate/up each as one product of their stacked weights, o, down,
// and the LM head on at most `head_rows` rows at a time (its chunk; 0: all `tokens`).
std::vector<GemmShape> model_gemm_shapes(const ModelConfig& config, int64_t tokens, int64_t head_rows = 0);

struct GemmRate {
  GemmShape shape;
  double gflops = 0;  // the product's FLOPs over its mean time, operands in cache
  std::string library = "aten";  // whose product it timed: "aten" (torch::mm) or "onednn" (gemm.h);
                                 // median_peak's "aten, onednn" where its measurements' differ
};

struct GemmPeak {
  std::string dtype;  // "fp32", "bf16", "fp16"
  int threads = 1;
  std::vector<GemmRate> rates;  // one per shape, in order
  double gflops = 0;            // the peak: the best of `rates`
  std::vector<double> measurements;  // median_peak's: each measurement's peak, in order
};

// Times torch::mm (or, for fp32 and `library` onednn, oneDNN's product: gemm_out_with) over each shape in `dtype` on the CPU with `threads` intra-op threads (the
// caller's setting restored after), after one warm-up call, for about `seconds_per_shape` each
// (at least one call). Throws
// weft::Error for no shapes, a shape with a zero or negative side, or threads < 1.
GemmPeak measure_gemm_peak(const std::vector<GemmShape>& shapes, torch::Dtype dtype, int threads,
                           double seconds_per_shape = 0.2, CpuFp32Gemm library = CpuFp32Gemm::aten);

// Each shape's better rate of two measurements of the same shapes (fp32 by ATen and by oneDNN),
// its library with it; the peak the best of those. Throws weft::Error for other shapes, dtypes or threads.
GemmPeak faster_of(const GemmPeak& a, const GemmPeak& b);

// Several measurements of the same shapes (measure_gemm_peak's, in order) as one: each shape's
// median rate (the mean of the middle two for an even count), the peak the best of those, and
// `measurements` each one's peak. Throws weft::Error for none, or measurements of other shapes,
// dtypes or threads.
GemmPeak median_peak(const std::vector<GemmPeak>& measured);

// bench.json's "gemm_peak": {"dtype", "threads", "gflops", "shapes": [{"m", "k", "n", "what", "gflops"}],
// "measurements": [gflops, ...]} (measurements: only where median_peak combined several or one).
nlohmann::json to_json(const GemmPeak& peak);

}  // namespace weft
