#include "core/bench/gemm_peak.h"

#include <algorithm>
#include <chrono>

#include "core/util/error.h"

namespace weft {

std::vector<GemmShape> model_gemm_shapes(const ModelConfig& c, int64_t tokens, int64_t head_rows) {
  const int64_t attention = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  std::vector<GemmShape> shapes{{tokens, c.hidden_size, attention + 2 * kv, "q/k/v"},
                                {tokens, attention, c.hidden_size, "o"},
                                {tokens, c.hidden_size, 2 * c.intermediate_size, "gate/up"},
                                {tokens, c.intermediate_size, c.hidden_size, "down"}};
  if (!c.classification()) {
    shapes.push_back({head_rows > 0 ? std::min(head_rows, tokens) : tokens, c.hidden_size, c.vocab_size, "head"});
  }
  return shapes;
}

GemmPeak measure_gemm_peak(const std::vector<GemmShape>& shapes, torch::Dtype dtype, int threads,
                           double seconds_per_shape, CpuFp32Gemm library) {
  WEFT_CHECK(!shapes.empty(), "measure_gemm_peak: no shapes to time");
  WEFT_CHECK(threads >= 1, "measure_gemm_peak: {} threads (at least 1)", threads);
  for (const auto& s : shapes) {
    WEFT_CHECK(s.m > 0 && s.k > 0 && s.n > 0, "measure_gemm_peak: a product of [{} x {}] by [{} x {}]", s.m, s.k, s.k,
               s.n);
  }
  torch::NoGradGuard no_grad;
  struct Threads {  // the caller's setting back on every way out
    int previous = at::get_num_threads();
    ~Threads() { at::set_num_threads(previous); }
  } restore;
  at::set_num_threads(threads);
  GemmPeak peak;
  peak.dtype = dtype == torch::kBFloat16 ? "bf16" : dtype == torch::kHalf ? "fp16" : "fp32";
  peak.threads = threads;
  using Clock = std::chrono::steady_clock;
  for (const auto& s : shapes) {
    const auto options = torch::TensorOptions().dtype(dtype);
    const auto x = torch::randn({s.m, s.k}).to(options);
    const auto w = torch::randn({s.n, s.k}).to(options);
    auto y = torch::empty({s.m, s.n}, options);
    const auto product = [&] { gemm_out_with(library, y, x, w.t()); };
    product();  // warm-up: the library's kernel selection and packing
    // At least one timed call: a big model's head product alone may take seconds on a CPU.
    int64_t calls = 0;
    const auto start = Clock::now();
    double elapsed = 0;
    while (calls < 1 || elapsed < seconds_per_shape) {
      product();
      ++calls;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    }
    const bool routed = library == CpuFp32Gemm::onednn && cpu_gemm_routes(x, w.t(), y);
    peak.rates.push_back({s, s.flops() * static_cast<double>(calls) / elapsed / 1e9, routed ? "onednn" : "aten"});
    peak.gflops = std::max(peak.gflops, peak.rates.back().gflops);
  }
  return peak;
}

GemmPeak faster_of(const GemmPeak& a, const GemmPeak& b) {
  WEFT_CHECK(a.dtype == b.dtype && a.threads == b.threads && a.rates.size() == b.rates.size(),
             "faster_of: measurements of other dtypes, threads or shapes");
  GemmPeak out = a;
  out.gflops = 0;
  for (size_t s = 0; s < out.rates.size(); ++s) {
    const auto &x = a.rates[s].shape, &y = b.rates[s].shape;
    WEFT_CHECK(x.m == y.m && x.k == y.k && x.n == y.n, "faster_of: measurements of other shapes");
    if (b.rates[s].gflops > a.rates[s].gflops) out.rates[s] = b.rates[s];
    out.gflops = std::max(out.gflops, out.rates[s].gflops);
  }
  return out;
}

GemmPeak median_peak(const std::vector<GemmPeak>& measured) {
  WEFT_CHECK(!measured.empty(), "median_peak: no measurements");
  GemmPeak out = measured.front();
  out.gflops = 0;
  out.measurements.clear();
  for (const auto& m : measured) {
    WEFT_CHECK(m.dtype == out.dtype && m.threads == out.threads && m.rates.size() == out.rates.size(),
               "median_peak: measurements of other dtypes, threads or shapes");
    out.measurements.push_back(m.gflops);
  }
  for (size_t s = 0; s < out.rates.size(); ++s) {
    std::vector<double> rates;
    for (const auto& m : measured) {
      const auto& a = m.rates[s].shape;
      const auto& b = out.rates[s].shape;
      WEFT_CHECK(a.m == b.m && a.k == b.k && a.n == b.n, "median_peak: measurements of other shapes");
      rates.push_back(m.rates[s].gflops);
    }
    std::sort(rates.begin(), rates.end());
    const size_t n = rates.size();
    out.rates[s].gflops = n % 2 == 1 ? rates[n / 2] : 0.5 * (rates[n / 2 - 1] + rates[n / 2]);
    for (const auto& m : measured) {  // the faster library may differ from one measurement to the next
      if (m.rates[s].library != out.rates[s].library) out.rates[s].library = "aten, onednn";
    }
    out.gflops = std::max(out.gflops, out.rates[s].gflops);
  }
  return out;
}

nlohmann::json to_json(const GemmPeak& peak) {
  nlohmann::json shapes = nlohmann::json::array();
  for (const auto& r : peak.rates) {
    shapes.push_back({{"m", r.shape.m}, {"k", r.shape.k}, {"n", r.shape.n}, {"what", r.shape.what}, {"gflops", r.gflops},
                      {"library", r.library}});
  }
  nlohmann::json out = {{"dtype", peak.dtype}, {"threads", peak.threads}, {"gflops", peak.gflops}, {"shapes", shapes}};
  if (!peak.measurements.empty()) out["measurements"] = peak.measurements;
  return out;
}

}  // namespace weft
