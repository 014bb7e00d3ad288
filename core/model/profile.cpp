#include "core/model/profile.h"

#include <algorithm>
#include <chrono>

#include <torch/torch.h>

#include "core/model/llama.h"
#include "core/model/weights.h"

namespace weft {
namespace {

// The median of `repeats` timings of `body` after one warm-up run.
template <typename Body>
double median_seconds(int32_t repeats, Body&& body) {
  body();
  std::vector<double> times;
  for (int32_t r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

std::vector<double> profile_stage_seconds(const ModelConfig& config, torch::Dtype compute_dtype, int64_t rows,
                                          int64_t seq_len, int32_t repeats) {
  const int64_t layers = config.num_hidden_layers;
  ModelOptions options;
  options.compute_dtype = compute_dtype;
  torch::manual_seed(0);
  const auto tokens = torch::randint(0, config.vocab_size, {rows, seq_len}, torch::kLong);
  const auto hidden = [&] { return torch::randn({rows, seq_len, config.hidden_size}).requires_grad_(true); };
  // Embedding and one block.
  options.stages = StageRange{0, 2};
  LlamaForCausalLM front(config, options);
  init_weights(*front, 0, 0.02);
  const double embed = median_seconds(repeats, [&] { front->forward_stages(0, 1, tokens).sum().backward(); });
  const double block = median_seconds(repeats, [&] {
    auto x = hidden();
    front->forward_stages(1, 2, x).sum().backward();
  });
  // Norm, head and loss.
  options.stages = StageRange{layers + 1, layers + 2};
  LlamaForCausalLM back(config, options);
  init_weights(*back, 0, 0.02);
  const auto targets = torch::randint(0, config.vocab_size, {rows, seq_len}, torch::kLong);
  const double head = median_seconds(repeats, [&] {
    auto x = hidden();
    cross_entropy(back->forward_stages(layers + 1, layers + 2, x), targets).backward();
  });
  std::vector<double> seconds(static_cast<size_t>(layers + 2), block);
  seconds.front() = embed;
  seconds.back() = head;
  return seconds;
}

}  // namespace weft
