// schedule.cpp - pipeline schedules as data in the host: a plugin's compute actions with their
// transfers added, the forward-only schedule of evaluation, and the reductions and gathers lowered
// into a schedule.
//
// The forward-only schedule decides a stage's compute order, then adds the transfers around it: a
// send right after the compute that produced the data, and each receive one compute action before
// the compute that consumes it, so that the transfer overlaps that earlier compute (the very first
// receive goes first).
#include "schedule.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>
#include <tuple>

namespace weft {
namespace pipeline {
namespace {

struct Compute {
  bool forward;
  int32_t micro_batch;
  int32_t chunk = 0;
  bool weight = false;  // the weight-gradient half of a split backward (no transfers)
};

// The receive that `compute` on `stage` needs first, if any.
bool needs_receive(const Compute& compute, int32_t stage, const Schedule& s, Action* receive) {
  if (compute.weight) return false;
  const int32_t u = virtual_stage(s, stage, compute.chunk);
  if (compute.forward && u > 0) {
    *receive = {ActionKind::kRecvActivation, compute.micro_batch, compute.chunk};
    return true;
  }
  if (!compute.forward && u < s.stages * s.chunks - 1) {
    *receive = {ActionKind::kRecvGradient, compute.micro_batch, compute.chunk};
    return true;
  }
  return false;
}

// The send that follows `compute` on `stage`, if any.
bool makes_send(const Compute& compute, int32_t stage, const Schedule& s, Action* send) {
  if (compute.weight) return false;
  const int32_t u = virtual_stage(s, stage, compute.chunk);
  if (compute.forward && u < s.stages * s.chunks - 1) {
    *send = {ActionKind::kSendActivation, compute.micro_batch, compute.chunk};
    return true;
  }
  if (!compute.forward && u > 0) {
    *send = {ActionKind::kSendGradient, compute.micro_batch, compute.chunk};
    return true;
  }
  return false;
}

// Compute order -> full action list (receives posted one compute early, sends right after), for
// `stage` of `s` (its stages, chunks and chunk map).
std::vector<Action> with_transfers(const std::vector<Compute>& order, int32_t stage, const Schedule& s,
                                   bool optimizer_step) {
  std::vector<Action> actions;
  Action transfer{ActionKind::kOptimizerStep, -1};
  if (!order.empty() && needs_receive(order[0], stage, s, &transfer)) actions.push_back(transfer);
  for (size_t i = 0; i < order.size(); ++i) {
    if (i + 1 < order.size() && needs_receive(order[i + 1], stage, s, &transfer)) {
      actions.push_back(transfer);
    }
    const ActionKind kind = order[i].weight ? ActionKind::kBackwardWeight
                            : order[i].forward ? ActionKind::kForward
                                               : ActionKind::kBackward;
    actions.push_back({kind, order[i].micro_batch, order[i].chunk});
    if (makes_send(order[i], stage, s, &transfer)) actions.push_back(transfer);
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

Schedule forward_only_schedule(int32_t stages, int32_t micro_batches, int32_t chunks, std::vector<int32_t> chunk_stage) {
  if (chunks < 1) throw std::invalid_argument("a pipeline needs at least 1 chunk per stage, got " + std::to_string(chunks));
  const std::string bad = check_chunk_map(stages, chunks, chunk_stage);
  if (!bad.empty()) throw std::invalid_argument(bad);
  Schedule s = empty_schedule("forward", stages, micro_batches);
  s.trains = false;
  s.chunks = chunks;
  s.chunk_stage = std::move(chunk_stage);
  s.max_in_flight = 1;
  for (int32_t p = 0; p < stages; ++p) {
    std::vector<int32_t> by_stage(static_cast<size_t>(chunks));  // this stage's chunks, lowest virtual stage first
    for (int32_t c = 0; c < chunks; ++c) by_stage[static_cast<size_t>(c)] = c;
    std::sort(by_stage.begin(), by_stage.end(),
              [&](int32_t a, int32_t b) { return virtual_stage(s, p, a) < virtual_stage(s, p, b); });
    std::vector<Compute> order;
    for (int32_t c : by_stage) {
      for (int32_t m = 0; m < micro_batches; ++m) order.push_back({true, m, c});
    }
    s.actions[p] = with_transfers(order, p, s, false);
  }
  return s;
}

int32_t virtual_stage(const Schedule& s, int32_t stage, int32_t chunk) {
  if (s.chunk_stage.empty()) return chunk * s.stages + stage;
  return s.chunk_stage.at(static_cast<size_t>(stage) * static_cast<size_t>(s.chunks) + static_cast<size_t>(chunk));
}

std::pair<int32_t, int32_t> locate(const Schedule& s, int32_t u) {
  if (u < 0 || u >= s.stages * s.chunks) return {-1, -1};
  if (s.chunk_stage.empty()) return {u % s.stages, u / s.stages};
  for (size_t i = 0; i < s.chunk_stage.size(); ++i) {
    if (s.chunk_stage[i] == u) return {static_cast<int32_t>(i) / s.chunks, static_cast<int32_t>(i) % s.chunks};
  }
  return {-1, -1};
}

std::string check_chunk_map(int32_t stages, int32_t chunks, const std::vector<int32_t>& chunk_stage) {
  if (chunk_stage.empty()) return "";
  const int64_t n = static_cast<int64_t>(stages) * chunks;
  if (static_cast<int64_t>(chunk_stage.size()) != n) {
    return "the chunk map has " + std::to_string(chunk_stage.size()) + " entries for " + std::to_string(stages) +
           " stages x " + std::to_string(chunks) + " chunks";
  }
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (size_t i = 0; i < chunk_stage.size(); ++i) {
    const int32_t u = chunk_stage[i];
    const std::string where = "chunk " + std::to_string(i % static_cast<size_t>(chunks)) + " of stage " +
                              std::to_string(i / static_cast<size_t>(chunks));
    if (u < 0 || u >= n) return where + " is virtual stage " + std::to_string(u) + ", outside [0, " + std::to_string(n) + ")";
    if (seen[static_cast<size_t>(u)]) return where + " is virtual stage " + std::to_string(u) + ", which another chunk is too";
    seen[static_cast<size_t>(u)] = true;
  }
  return "";
}

void add_transfers(Schedule& s) {
  const auto stages = static_cast<int32_t>(s.actions.size());
  // Each stage's computes, and where its optimizer step was (after how many computes).
  std::vector<std::vector<Compute>> order(static_cast<size_t>(stages));
  std::vector<int64_t> step_after(static_cast<size_t>(stages), -1);
  for (int32_t p = 0; p < stages; ++p) {
    for (const Action& a : s.actions[static_cast<size_t>(p)]) {
      auto& list = order[static_cast<size_t>(p)];
      switch (a.kind) {
        case ActionKind::kForward: list.push_back({true, a.micro_batch, a.chunk}); break;
        case ActionKind::kBackward: list.push_back({false, a.micro_batch, a.chunk}); break;
        case ActionKind::kBackwardWeight: list.push_back({false, a.micro_batch, a.chunk, /*weight=*/true}); break;
        case ActionKind::kOptimizerStep: step_after[static_cast<size_t>(p)] = static_cast<int64_t>(list.size()); break;
        case ActionKind::kReduce:
        case ActionKind::kGather:
        case ActionKind::kRelease:
          throw std::invalid_argument("stage " + std::to_string(p) + " " + to_string(a) +
                                      ": reductions, gathers and releases are added after the transfers");
        default:
          throw std::invalid_argument("stage " + std::to_string(p) + " " + to_string(a) +
                                      ": transfers are the runtime's to add, not the schedule's");
      }
    }
  }
  // Where each transfer's data is made: (kind of the send, micro-batch, sender's chunk) -> index
  // of the producing compute in the sender's order.
  std::vector<std::map<std::tuple<int, int32_t, int32_t>, size_t>> made(static_cast<size_t>(stages));
  for (int32_t p = 0; p < stages; ++p) {
    const auto& list = order[static_cast<size_t>(p)];
    for (size_t i = 0; i < list.size(); ++i) {
      Action send{ActionKind::kOptimizerStep, -1};
      if (makes_send(list[i], p, s, &send)) made[static_cast<size_t>(p)][{static_cast<int>(send.kind), send.micro_batch, send.chunk}] = i;
    }
  }
  // Each receive is posted one compute before its consumer, or earlier where the sender sends an
  // item it needs later first: between two stages, receives are posted in the order the sends
  // start (NCCL matches by order; verify.hpp).
  struct Receive {
    Action action;
    size_t before;      // posted before this compute of the receiver
    size_t sent_at;     // the sender's producing compute
  };
  std::vector<std::vector<Receive>> posts(static_cast<size_t>(stages));
  for (int32_t q = 0; q < stages; ++q) {
    std::map<int32_t, std::vector<Receive>> by_sender;
    const auto& list = order[static_cast<size_t>(q)];
    for (size_t k = 0; k < list.size(); ++k) {
      Action receive{ActionKind::kOptimizerStep, -1};
      if (!needs_receive(list[k], q, s, &receive)) continue;
      const int32_t u = virtual_stage(s, q, receive.chunk);
      const bool activation = receive.kind == ActionKind::kRecvActivation;
      const auto [p, c] = locate(s, activation ? u - 1 : u + 1);
      if (p < 0) continue;  // the verifier reports it
      const ActionKind send = activation ? ActionKind::kSendActivation : ActionKind::kSendGradient;
      const auto& producers = made[static_cast<size_t>(p)];
      const auto it = producers.find({static_cast<int>(send), receive.micro_batch, c});
      const size_t sent_at = it == producers.end() ? std::numeric_limits<size_t>::max() : it->second;
      by_sender[p].push_back({receive, k == 0 ? 0 : k - 1, sent_at});
    }
    for (auto& [p, receives] : by_sender) {
      std::stable_sort(receives.begin(), receives.end(), [](const Receive& a, const Receive& b) { return a.sent_at < b.sent_at; });
      for (size_t i = receives.size(); i-- > 1;) receives[i - 1].before = std::min(receives[i - 1].before, receives[i].before);
      posts[static_cast<size_t>(q)].insert(posts[static_cast<size_t>(q)].end(), receives.begin(), receives.end());
    }
    std::stable_sort(posts[static_cast<size_t>(q)].begin(), posts[static_cast<size_t>(q)].end(),
                     [](const Receive& a, const Receive& b) { return a.before < b.before; });
  }
  for (int32_t p = 0; p < stages; ++p) {
    const auto& list = order[static_cast<size_t>(p)];
    const auto& receives = posts[static_cast<size_t>(p)];
    std::vector<Action> full;
    size_t r = 0;
    for (size_t k = 0; k <= list.size(); ++k) {
      if (static_cast<int64_t>(k) == step_after[static_cast<size_t>(p)]) full.push_back({ActionKind::kOptimizerStep, -1});
      if (k == list.size()) break;
      while (r < receives.size() && receives[r].before <= k) full.push_back(receives[r++].action);
      const Compute& c = list[k];
      full.push_back({c.weight ? ActionKind::kBackwardWeight : c.forward ? ActionKind::kForward : ActionKind::kBackward,
                      c.micro_batch, c.chunk});
      Action send{ActionKind::kOptimizerStep, -1};
      if (makes_send(c, p, s, &send)) full.push_back(send);
    }
    s.actions[static_cast<size_t>(p)] = std::move(full);
  }
}

Schedule schedule_from_actions(std::string name, int32_t stages, int32_t micro_batches, int32_t chunks,
                               std::vector<int32_t> chunk_stage, const std::vector<std::vector<weft_action>>& lists) {
  Schedule s = empty_schedule(name, stages, micro_batches);
  if (chunks < 1) throw std::invalid_argument("a pipeline needs at least 1 chunk per stage, got " + std::to_string(chunks));
  s.chunks = chunks;
  s.chunk_stage = std::move(chunk_stage);
  // The plugin promises no bound: the verifier measures the peaks (the memory plan uses them).
  s.max_in_flight = micro_batches * chunks;
  s.max_pending_weights = micro_batches * chunks;
  if (lists.size() != static_cast<size_t>(stages)) {
    throw std::invalid_argument(std::to_string(lists.size()) + " action lists for " + std::to_string(stages) + " stages");
  }
  bool split = false, whole = false;
  for (int32_t p = 0; p < stages; ++p) {
    const auto& list = lists[static_cast<size_t>(p)];
    for (size_t i = 0; i < list.size(); ++i) {
      const weft_action& a = list[i];
      Action action{ActionKind::kForward, a.micro_batch, a.chunk};
      switch (a.kind) {
        case WEFT_ACTION_FORWARD: break;
        case WEFT_ACTION_BACKWARD: action.kind = ActionKind::kBackward; whole = true; break;
        case WEFT_ACTION_BACKWARD_INPUT: action.kind = ActionKind::kBackward; split = true; break;
        case WEFT_ACTION_BACKWARD_WEIGHT: action.kind = ActionKind::kBackwardWeight; split = true; break;
        case WEFT_ACTION_OPTIMIZER_STEP: action = {ActionKind::kOptimizerStep, -1, 0}; break;
        default:
          throw std::invalid_argument("action " + std::to_string(i) + " for rank " + std::to_string(p) + " is of kind " +
                                      std::to_string(a.kind) + ", not one a schedule gives (FORWARD, BACKWARD, "
                                      "BACKWARD_INPUT, BACKWARD_WEIGHT, OPTIMIZER_STEP)");
      }
      s.actions[static_cast<size_t>(p)].push_back(action);
    }
  }
  if (split && whole) throw std::invalid_argument("it mixes whole backwards with split ones (BACKWARD_INPUT/BACKWARD_WEIGHT)");
  s.split_backward = split;
  add_transfers(s);
  return s;
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
    case ActionKind::kReduce: return action.chunk != 0 ? "R." + std::to_string(action.chunk) : "R";
    case ActionKind::kGather: return action.chunk != 0 ? "G." + std::to_string(action.chunk) : "G";
    case ActionKind::kRelease: return action.chunk != 0 ? "X." + std::to_string(action.chunk) : "X";
  }
  return "?";
}

void lower_reductions(Schedule& s) {
  if (!s.trains) throw std::invalid_argument("lower_reductions: a forward-only schedule has no gradients to reduce");
  const ActionKind last = s.split_backward ? ActionKind::kBackwardWeight : ActionKind::kBackward;
  for (size_t p = 0; p < s.actions.size(); ++p) {
    auto& list = s.actions[p];
    std::vector<int64_t> final_at(static_cast<size_t>(s.chunks), -1);  // the index that finishes each chunk
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].kind == ActionKind::kReduce) {
        throw std::invalid_argument("stage " + std::to_string(p) + " " + to_string(list[i]) + ": reductions lowered twice");
      }
      if (list[i].kind == last && list[i].chunk >= 0 && list[i].chunk < s.chunks) {
        final_at[static_cast<size_t>(list[i].chunk)] = static_cast<int64_t>(i);
      }
    }
    // After the sends that follow it too: a neighbour waits for those, the reduction waits for no one.
    for (int64_t& at : final_at) {
      while (at >= 0 && at + 1 < static_cast<int64_t>(list.size()) &&
             (list[static_cast<size_t>(at + 1)].kind == ActionKind::kSendGradient ||
              list[static_cast<size_t>(at + 1)].kind == ActionKind::kSendActivation)) {
        ++at;
      }
    }
    std::vector<Action> lowered;
    lowered.reserve(list.size() + final_at.size());
    for (size_t i = 0; i < list.size(); ++i) {
      lowered.push_back(list[i]);
      for (int32_t c = 0; c < s.chunks; ++c) {
        if (final_at[static_cast<size_t>(c)] == static_cast<int64_t>(i)) lowered.push_back({ActionKind::kReduce, -1, c});
      }
    }
    list = std::move(lowered);
  }
}

void lower_gathers(Schedule& s) {
  const auto compute = [](ActionKind k) {
    return k == ActionKind::kForward || k == ActionKind::kBackward || k == ActionKind::kBackwardWeight;
  };
  for (size_t p = 0; p < s.actions.size(); ++p) {
    auto& list = s.actions[p];
    std::vector<int64_t> first(static_cast<size_t>(s.chunks), -1), last(static_cast<size_t>(s.chunks), -1);
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (a.kind == ActionKind::kGather || a.kind == ActionKind::kRelease) {
        throw std::invalid_argument("stage " + std::to_string(p) + " " + to_string(a) + ": gathers lowered twice");
      }
      if (a.chunk < 0 || a.chunk >= s.chunks) continue;
      const auto c = static_cast<size_t>(a.chunk);
      if (compute(a.kind) && first[c] < 0) first[c] = static_cast<int64_t>(i);
      if (compute(a.kind) || a.kind == ActionKind::kReduce) last[c] = static_cast<int64_t>(i);
    }
    std::vector<Action> lowered;
    lowered.reserve(list.size() + 2 * first.size());
    for (size_t i = 0; i < list.size(); ++i) {
      for (int32_t c = 0; c < s.chunks; ++c) {
        if (first[static_cast<size_t>(c)] == static_cast<int64_t>(i)) lowered.push_back({ActionKind::kGather, -1, c});
      }
      lowered.push_back(list[i]);
      for (int32_t c = 0; c < s.chunks; ++c) {
        if (last[static_cast<size_t>(c)] == static_cast<int64_t>(i)) lowered.push_back({ActionKind::kRelease, -1, c});
      }
    }
    list = std::move(lowered);
  }
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
