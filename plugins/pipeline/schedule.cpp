// schedule.cpp - the GPipe, 1F1B, interleaved 1F1B, ZB-H1 and forward-only schedule generators.
//
// Each generator first decides a stage's compute order (forwards and backwards), then adds the
// transfers around it: a send right after the compute that produced the data, and each receive
// one compute action before the compute that consumes it, so that the transfer overlaps that
// earlier compute (the very first receive goes first).
#include "schedule.hpp"

#include <algorithm>
#include <stdexcept>

namespace weft {
namespace pipeline {
namespace {

struct Compute {
  bool forward;
  int32_t micro_batch;
  int32_t chunk = 0;
  bool weight = false;  // the weight-gradient half of a split backward (no transfers)
};

// The receive that `compute` on `stage` needs first, if any (`virtual_stages` = stages x chunks;
// chunk c of stage p is virtual stage c x stages + p).
bool needs_receive(const Compute& compute, int32_t stage, int32_t stages, int32_t virtual_stages, Action* receive) {
  if (compute.weight) return false;
  const int32_t u = compute.chunk * stages + stage;
  if (compute.forward && u > 0) {
    *receive = {ActionKind::kRecvActivation, compute.micro_batch, compute.chunk};
    return true;
  }
  if (!compute.forward && u < virtual_stages - 1) {
    *receive = {ActionKind::kRecvGradient, compute.micro_batch, compute.chunk};
    return true;
  }
  return false;
}

// The send that follows `compute` on `stage`, if any.
bool makes_send(const Compute& compute, int32_t stage, int32_t stages, int32_t virtual_stages, Action* send) {
  if (compute.weight) return false;
  const int32_t u = compute.chunk * stages + stage;
  if (compute.forward && u < virtual_stages - 1) {
    *send = {ActionKind::kSendActivation, compute.micro_batch, compute.chunk};
    return true;
  }
  if (!compute.forward && u > 0) {
    *send = {ActionKind::kSendGradient, compute.micro_batch, compute.chunk};
    return true;
  }
  return false;
}

// Compute order -> full action list (receives posted one compute early, sends right after).
std::vector<Action> with_transfers(const std::vector<Compute>& order, int32_t stage, int32_t stages,
                                   bool optimizer_step, int32_t chunks = 1) {
  const int32_t virtual_stages = stages * chunks;
  std::vector<Action> actions;
  Action transfer{ActionKind::kOptimizerStep, -1};
  if (!order.empty() && needs_receive(order[0], stage, stages, virtual_stages, &transfer)) actions.push_back(transfer);
  for (size_t i = 0; i < order.size(); ++i) {
    if (i + 1 < order.size() && needs_receive(order[i + 1], stage, stages, virtual_stages, &transfer)) {
      actions.push_back(transfer);
    }
    const ActionKind kind = order[i].weight ? ActionKind::kBackwardWeight
                            : order[i].forward ? ActionKind::kForward
                                               : ActionKind::kBackward;
    actions.push_back({kind, order[i].micro_batch, order[i].chunk});
    if (makes_send(order[i], stage, stages, virtual_stages, &transfer)) actions.push_back(transfer);
  }
  if (optimizer_step) actions.push_back({ActionKind::kOptimizerStep, -1});
  return actions;
}

void check_shape(int32_t stages, int32_t micro_batches) {
  if (stages < 1) throw std::invalid_argument("a pipeline needs at least 1 stage, got " + std::to_string(stages));
  if (micro_batches < 1) {
    throw std::invalid_argument("a pipeline needs at least 1 micro-batch, got " + std::to_string(micro_batches));
  }
}

Schedule empty_schedule(const std::string& name, int32_t stages, int32_t micro_batches) {
  check_shape(stages, micro_batches);
  Schedule s;
  s.name = name;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.actions.resize(static_cast<size_t>(stages));
  return s;
}

}  // namespace

Schedule gpipe_schedule(int32_t stages, int32_t micro_batches) {
  Schedule s = empty_schedule("gpipe", stages, micro_batches);
  s.max_in_flight = micro_batches;
  for (int32_t p = 0; p < stages; ++p) {
    std::vector<Compute> order;
    for (int32_t m = 0; m < micro_batches; ++m) order.push_back({true, m});
    for (int32_t m = micro_batches - 1; m >= 0; --m) order.push_back({false, m});
    s.actions[p] = with_transfers(order, p, stages, true);
  }
  return s;
}

Schedule one_f_one_b_schedule(int32_t stages, int32_t micro_batches) {
  Schedule s = empty_schedule("1f1b", stages, micro_batches);
  s.max_in_flight = std::min(stages, micro_batches);
  for (int32_t p = 0; p < stages; ++p) {
    const int32_t warmup = std::min(stages - p - 1, micro_batches);
    std::vector<Compute> order;
    for (int32_t m = 0; m < warmup; ++m) order.push_back({true, m});
    for (int32_t i = 0; i < micro_batches - warmup; ++i) {
      order.push_back({true, warmup + i});
      order.push_back({false, i});
    }
    for (int32_t m = micro_batches - warmup; m < micro_batches; ++m) order.push_back({false, m});
    s.actions[p] = with_transfers(order, p, stages, true);
  }
  return s;
}

Schedule interleaved_one_f_one_b_schedule(int32_t stages, int32_t micro_batches, int32_t chunks) {
  if (chunks < 1) throw std::invalid_argument("an interleaved pipeline needs at least 1 chunk per stage, got " +
                                              std::to_string(chunks));
  Schedule s = empty_schedule("interleaved1f1b", stages, micro_batches);
  if (micro_batches % stages != 0) {
    throw std::invalid_argument("interleaved 1F1B needs the micro-batches (" + std::to_string(micro_batches) +
                                ") to be a multiple of the stages (" + std::to_string(stages) + ")");
  }
  s.chunks = chunks;
  const int32_t total = micro_batches * chunks;  // compute units of each kind per stage
  const bool all_warmup = micro_batches == stages;
  s.max_in_flight = all_warmup ? total : std::min(total, 2 * (stages - 1) + (chunks - 1) * stages + 1);
  // The k-th forward (backward) of a stage: micro-batch and chunk, in groups of `stages`.
  const auto unit = [&](int32_t k, bool forward) {
    const int32_t group = k / stages;
    const int32_t chunk = forward ? group % chunks : chunks - 1 - group % chunks;
    return Compute{forward, (k / (stages * chunks)) * stages + k % stages, chunk};
  };
  for (int32_t p = 0; p < stages; ++p) {
    const int32_t warmup = all_warmup ? total : std::min(2 * (stages - p - 1) + (chunks - 1) * stages, total);
    std::vector<Compute> order;
    for (int32_t k = 0; k < warmup; ++k) order.push_back(unit(k, true));
    for (int32_t i = 0; i < total - warmup; ++i) {
      order.push_back(unit(warmup + i, true));
      order.push_back(unit(i, false));
    }
    for (int32_t k = total - warmup; k < total; ++k) order.push_back(unit(k, false));
    s.actions[p] = with_transfers(order, p, stages, true, chunks);
  }
  return s;
}

Schedule zero_bubble_h1_schedule(int32_t stages, int32_t micro_batches) {
  Schedule s = empty_schedule("zbh1", stages, micro_batches);
  const int32_t S = stages, M = micro_batches;
  s.split_backward = true;
  s.max_in_flight = std::min(S, M);
  s.max_pending_weights = std::min(S, M);
  // List scheduling in unit time steps: every F, B and W takes one step; a B on stage p needs
  // its F here and (but on the last stage) the B of stage p + 1 finished; an F on stage p > 0
  // the F of stage p - 1 finished.
  std::vector<std::vector<Compute>> order(static_cast<size_t>(S));
  std::vector<std::vector<int64_t>> forward_done(S, std::vector<int64_t>(M, -1)), backward_done = forward_done;
  std::vector<int32_t> next_forward(S, 0), next_backward(S, 0), in_flight(S, 0);
  std::vector<std::vector<int32_t>> pending(S);  // micro-batches waiting for their W, oldest first
  int64_t remaining = 3 * static_cast<int64_t>(S) * M;
  for (int64_t t = 0; remaining > 0; ++t) {
    for (int32_t p = 0; p < S; ++p) {
      const int32_t b = next_backward[p], f = next_forward[p];
      const bool b_ready = b < M && forward_done[p][b] >= 0 && forward_done[p][b] <= t &&
                           (p == S - 1 || (backward_done[p + 1][b] >= 0 && backward_done[p + 1][b] <= t));
      const bool f_ready = f < M && in_flight[p] < std::min(S - p, M) &&
                           static_cast<int32_t>(pending[p].size()) < s.max_pending_weights &&
                           (p == 0 || (forward_done[p - 1][f] >= 0 && forward_done[p - 1][f] <= t));
      if (b_ready) {
        order[p].push_back({false, b});
        backward_done[p][b] = t + 1;
        ++next_backward[p];
        --in_flight[p];
        pending[p].push_back(b);
      } else if (f_ready) {
        order[p].push_back({true, f});
        forward_done[p][f] = t + 1;
        ++next_forward[p];
        ++in_flight[p];
      } else if (!pending[p].empty()) {
        order[p].push_back({false, pending[p].front(), 0, /*weight=*/true});
        pending[p].erase(pending[p].begin());
      } else {
        continue;  // idle this step
      }
      --remaining;
    }
  }
  for (int32_t p = 0; p < S; ++p) s.actions[p] = with_transfers(order[p], p, S, true);
  return s;
}

Schedule forward_only_schedule(int32_t stages, int32_t micro_batches, int32_t chunks) {
  if (chunks < 1) throw std::invalid_argument("a pipeline needs at least 1 chunk per stage, got " + std::to_string(chunks));
  Schedule s = empty_schedule("forward", stages, micro_batches);
  s.trains = false;
  s.chunks = chunks;
  s.max_in_flight = 1;
  for (int32_t p = 0; p < stages; ++p) {
    std::vector<Compute> order;
    for (int32_t c = 0; c < chunks; ++c) {
      for (int32_t m = 0; m < micro_batches; ++m) order.push_back({true, m, c});
    }
    s.actions[p] = with_transfers(order, p, stages, false, chunks);
  }
  return s;
}

Schedule make_schedule(const std::string& name, int32_t stages, int32_t micro_batches, int32_t chunks) {
  if (name == "interleaved1f1b") return interleaved_one_f_one_b_schedule(stages, micro_batches, chunks);
  if (name == "forward") return forward_only_schedule(stages, micro_batches, chunks);
  if (name != "gpipe" && name != "1f1b" && name != "zbh1") {
    throw std::invalid_argument("unknown pipeline schedule '" + name +
                                "' (known: gpipe, 1f1b, interleaved1f1b, zbh1, forward)");
  }
  if (chunks != 1) {
    throw std::invalid_argument("schedule " + name + " runs one chunk per stage; " + std::to_string(chunks) +
                                " virtual stages per rank need interleaved1f1b");
  }
  if (name == "zbh1") return zero_bubble_h1_schedule(stages, micro_batches);
  return name == "gpipe" ? gpipe_schedule(stages, micro_batches) : one_f_one_b_schedule(stages, micro_batches);
}

std::string to_string(const Action& action) {
  const std::string m = std::to_string(action.micro_batch) + (action.chunk != 0 ? "." + std::to_string(action.chunk) : "");
  switch (action.kind) {
    case ActionKind::kRecvActivation: return "rA" + m;
    case ActionKind::kForward: return "F" + m;
    case ActionKind::kSendActivation: return "sA" + m;
    case ActionKind::kRecvGradient: return "rG" + m;
    case ActionKind::kBackward: return "B" + m;
    case ActionKind::kSendGradient: return "sG" + m;
    case ActionKind::kOptimizerStep: return "step";
    case ActionKind::kBackwardWeight: return "W" + m;
  }
  return "?";
}

std::string to_string(const Schedule& schedule) {
  std::string out;
  for (size_t p = 0; p < schedule.actions.size(); ++p) {
    out += "stage " + std::to_string(p) + ":";
    for (const Action& a : schedule.actions[p]) out += " " + to_string(a);
    out += "\n";
  }
  return out;
}

}  // namespace pipeline
}  // namespace weft
