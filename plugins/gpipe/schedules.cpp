// schedules.cpp - the GPipe, 1F1B, interleaved 1F1B and ZB-H1 generators: each decides every
// rank's compute order; the host adds the transfers around it.
#include "schedules.hpp"

#include <algorithm>
#include <stdexcept>

namespace gpipe {
namespace {

weft_action forward(int32_t micro_batch, int32_t chunk = 0) { return {WEFT_ACTION_FORWARD, chunk, micro_batch}; }
weft_action backward(int32_t micro_batch, int32_t chunk = 0) { return {WEFT_ACTION_BACKWARD, chunk, micro_batch}; }
weft_action optimizer_step() { return {WEFT_ACTION_OPTIMIZER_STEP, 0, -1}; }

std::vector<Actions> empty_schedule(int32_t stages, int32_t micro_batches) {
  if (stages < 1) throw std::invalid_argument("a pipeline needs at least 1 stage, got " + std::to_string(stages));
  if (micro_batches < 1) {
    throw std::invalid_argument("a pipeline needs at least 1 micro-batch, got " + std::to_string(micro_batches));
  }
  return std::vector<Actions>(static_cast<size_t>(stages));
}

}  // namespace

std::vector<Actions> gpipe_schedule(int32_t stages, int32_t micro_batches) {
  auto s = empty_schedule(stages, micro_batches);
  for (auto& rank : s) {
    for (int32_t m = 0; m < micro_batches; ++m) rank.push_back(forward(m));
    for (int32_t m = micro_batches - 1; m >= 0; --m) rank.push_back(backward(m));
    rank.push_back(optimizer_step());
  }
  return s;
}

std::vector<Actions> one_f_one_b_schedule(int32_t stages, int32_t micro_batches) {
  auto s = empty_schedule(stages, micro_batches);
  for (int32_t p = 0; p < stages; ++p) {
    const int32_t warmup = std::min(stages - p - 1, micro_batches);
    auto& rank = s[static_cast<size_t>(p)];
    for (int32_t m = 0; m < warmup; ++m) rank.push_back(forward(m));
    for (int32_t i = 0; i < micro_batches - warmup; ++i) {
      rank.push_back(forward(warmup + i));
      rank.push_back(backward(i));
    }
    for (int32_t m = micro_batches - warmup; m < micro_batches; ++m) rank.push_back(backward(m));
    rank.push_back(optimizer_step());
  }
  return s;
}

std::vector<Actions> interleaved_one_f_one_b_schedule(int32_t stages, int32_t micro_batches, int32_t chunks) {
  if (chunks < 1) throw std::invalid_argument("an interleaved pipeline needs at least 1 chunk per stage, got " +
                                              std::to_string(chunks));
  auto s = empty_schedule(stages, micro_batches);
  if (micro_batches % stages != 0) {
    throw std::invalid_argument("interleaved 1F1B needs the micro-batches (" + std::to_string(micro_batches) +
                                ") to be a multiple of the stages (" + std::to_string(stages) + ")");
  }
  const int32_t total = micro_batches * chunks;  // compute units of each kind per stage
  const bool all_warmup = micro_batches == stages;
  // The k-th forward (backward) of a stage: micro-batch and chunk, in groups of `stages`.
  const auto unit = [&](int32_t k, bool is_forward) {
    const int32_t group = k / stages;
    const int32_t chunk = is_forward ? group % chunks : chunks - 1 - group % chunks;
    const int32_t micro_batch = (k / (stages * chunks)) * stages + k % stages;
    return is_forward ? forward(micro_batch, chunk) : backward(micro_batch, chunk);
  };
  for (int32_t p = 0; p < stages; ++p) {
    const int32_t warmup = all_warmup ? total : std::min(2 * (stages - p - 1) + (chunks - 1) * stages, total);
    auto& rank = s[static_cast<size_t>(p)];
    for (int32_t k = 0; k < warmup; ++k) rank.push_back(unit(k, true));
    for (int32_t i = 0; i < total - warmup; ++i) {
      rank.push_back(unit(warmup + i, true));
      rank.push_back(unit(i, false));
    }
    for (int32_t k = total - warmup; k < total; ++k) rank.push_back(unit(k, false));
    rank.push_back(optimizer_step());
  }
  return s;
}

std::vector<Actions> zero_bubble_h1_schedule(int32_t stages, int32_t micro_batches) {
  auto s = empty_schedule(stages, micro_batches);
  const int32_t S = stages, M = micro_batches;
  const int32_t max_pending_weights = std::min(S, M);
  // List scheduling in unit time steps: every F, B and W takes one step; a B on stage p needs
  // its F here and (but on the last stage) the B of stage p + 1 finished; an F on stage p > 0
  // the F of stage p - 1 finished.
  std::vector<std::vector<int64_t>> forward_done(S, std::vector<int64_t>(M, -1)), backward_done = forward_done;
  std::vector<int32_t> next_forward(S, 0), next_backward(S, 0), in_flight(S, 0);
  std::vector<std::vector<int32_t>> pending(S);  // micro-batches waiting for their W, oldest first
  int64_t remaining = 3 * static_cast<int64_t>(S) * M;
  for (int64_t t = 0; remaining > 0; ++t) {
    for (int32_t p = 0; p < S; ++p) {
      auto& rank = s[static_cast<size_t>(p)];
      const int32_t b = next_backward[p], f = next_forward[p];
      const bool b_ready = b < M && forward_done[p][b] >= 0 && forward_done[p][b] <= t &&
                           (p == S - 1 || (backward_done[p + 1][b] >= 0 && backward_done[p + 1][b] <= t));
      const bool f_ready = f < M && in_flight[p] < std::min(S - p, M) &&
                           static_cast<int32_t>(pending[p].size()) < max_pending_weights &&
                           (p == 0 || (forward_done[p - 1][f] >= 0 && forward_done[p - 1][f] <= t));
      if (b_ready) {
        rank.push_back({WEFT_ACTION_BACKWARD_INPUT, 0, b});
        backward_done[p][b] = t + 1;
        ++next_backward[p];
        --in_flight[p];
        pending[p].push_back(b);
      } else if (f_ready) {
        rank.push_back(forward(f));
        forward_done[p][f] = t + 1;
        ++next_forward[p];
        ++in_flight[p];
      } else if (!pending[p].empty()) {
        rank.push_back({WEFT_ACTION_BACKWARD_WEIGHT, 0, pending[p].front()});
        pending[p].erase(pending[p].begin());
      } else {
        continue;  // idle this step
      }
      --remaining;
    }
  }
  for (auto& rank : s) rank.push_back(optimizer_step());
  return s;
}

std::vector<Actions> make_schedule(const std::string& name, int32_t stages, int32_t micro_batches, int32_t chunks) {
  if (name == "interleaved1f1b") return interleaved_one_f_one_b_schedule(stages, micro_batches, chunks);
  if (name != "gpipe" && name != "1f1b" && name != "zbh1") {
    throw std::invalid_argument("unknown pipeline schedule '" + name + "' (known: gpipe, 1f1b, interleaved1f1b, zbh1)");
  }
  if (chunks != 1) {
    throw std::invalid_argument("schedule " + name + " runs one chunk per stage; " + std::to_string(chunks) +
                                " virtual stages per rank need interleaved1f1b");
  }
  if (name == "zbh1") return zero_bubble_h1_schedule(stages, micro_batches);
  return name == "gpipe" ? gpipe_schedule(stages, micro_batches) : one_f_one_b_schedule(stages, micro_batches);
}

}  // namespace gpipe
