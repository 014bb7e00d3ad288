// verify.cpp - static checks, then a dataflow simulation of the schedule.
#include "verify.hpp"

#include <algorithm>
#include <map>
#include <utility>

namespace weft {
namespace pipeline {
namespace {

bool is_compute(ActionKind kind) { return kind == ActionKind::kForward || kind == ActionKind::kBackward; }

// The stage a transfer action talks to.
int32_t peer_of(ActionKind kind, int32_t stage) {
  return (kind == ActionKind::kRecvActivation || kind == ActionKind::kSendGradient) ? stage - 1 : stage + 1;
}

// The action on the peer that matches `kind` (a send's receive or a receive's send).
ActionKind matching(ActionKind kind) {
  switch (kind) {
    case ActionKind::kRecvActivation: return ActionKind::kSendActivation;
    case ActionKind::kSendActivation: return ActionKind::kRecvActivation;
    case ActionKind::kRecvGradient: return ActionKind::kSendGradient;
    case ActionKind::kSendGradient: return ActionKind::kRecvGradient;
    default: return kind;
  }
}

std::string at(int32_t stage, const Action& action) {
  return "stage " + std::to_string(stage) + " " + to_string(action);
}

// Counts of each (kind, micro-batch) on one stage.
using Counts = std::map<std::pair<int, int32_t>, int>;

int count(const Counts& counts, ActionKind kind, int32_t micro_batch) {
  const auto it = counts.find({static_cast<int>(kind), micro_batch});
  return it == counts.end() ? 0 : it->second;
}

// Checks 1-3 of verify.hpp. Returns the first problem, or "".
std::string check_structure(const Schedule& s) {
  if (s.stages < 1 || s.micro_batches < 1) return "a schedule needs at least 1 stage and 1 micro-batch";
  if (static_cast<int32_t>(s.actions.size()) != s.stages) {
    return "the schedule has " + std::to_string(s.actions.size()) + " action lists for " +
           std::to_string(s.stages) + " stages";
  }
  std::vector<Counts> counts(s.actions.size());
  for (int32_t p = 0; p < s.stages; ++p) {
    const auto& list = s.actions[p];
    std::map<std::pair<int, int32_t>, size_t> first_index;
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (a.kind == ActionKind::kOptimizerStep) {
        if (!s.trains) return at(p, a) + ": a forward-only schedule has no optimizer step";
        if (i + 1 != list.size()) return at(p, a) + " is not the stage's last action";
        continue;
      }
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches) return at(p, a) + ": no such micro-batch";
      if (!is_compute(a.kind)) {
        const int32_t peer = peer_of(a.kind, p);
        if (peer < 0 || peer >= s.stages) return at(p, a) + ": there is no stage " + std::to_string(peer);
      }
      if (a.kind == ActionKind::kBackward && !s.trains) return at(p, a) + ": backward in a forward-only schedule";
      const auto key = std::make_pair(static_cast<int>(a.kind), a.micro_batch);
      if (++counts[p][key] > 1) return at(p, a) + " appears twice";
      first_index[key] = i;
    }
    const auto index_of = [&](ActionKind kind, int32_t m) {
      return first_index.at({static_cast<int>(kind), m});
    };
    for (int32_t m = 0; m < s.micro_batches; ++m) {
      const Action forward{ActionKind::kForward, m}, backward{ActionKind::kBackward, m};
      if (count(counts[p], ActionKind::kForward, m) != 1) return at(p, forward) + " is missing";
      if (s.trains) {
        if (count(counts[p], ActionKind::kBackward, m) != 1) return at(p, backward) + " is missing";
        if (index_of(ActionKind::kBackward, m) < index_of(ActionKind::kForward, m)) {
          return at(p, backward) + " comes before its forward";
        }
      }
      // Where each transfer must sit relative to the compute it serves.
      struct Rule {
        ActionKind transfer;
        ActionKind compute;
        bool before;  // the transfer precedes the compute (receives) or follows it (sends)
        bool required;
      };
      const Rule rules[] = {
          {ActionKind::kRecvActivation, ActionKind::kForward, true, p > 0},
          {ActionKind::kSendActivation, ActionKind::kForward, false, p < s.stages - 1},
          {ActionKind::kRecvGradient, ActionKind::kBackward, true, s.trains && p < s.stages - 1},
          {ActionKind::kSendGradient, ActionKind::kBackward, false, s.trains && p > 0},
      };
      for (const Rule& r : rules) {
        const Action transfer{r.transfer, m};
        const int n = count(counts[p], r.transfer, m);
        if (r.required && n == 0) return at(p, transfer) + " is missing";
        if (!r.required && n > 0) return at(p, transfer) + " has no use on this stage";
        if (n == 0) continue;
        const bool before = index_of(r.transfer, m) < index_of(r.compute, m);
        if (before != r.before) {
          return at(p, transfer) + (r.before ? " is posted after " : " comes before ") + to_string(Action{r.compute, m});
        }
      }
    }
    if (s.trains && (list.empty() || list.back().kind != ActionKind::kOptimizerStep)) {
      return "stage " + std::to_string(p) + " does not end with the optimizer step";
    }
  }
  // Every send has one matching receive on the peer, and vice versa.
  for (int32_t p = 0; p < s.stages; ++p) {
    for (const auto& [key, n] : counts[p]) {
      const auto kind = static_cast<ActionKind>(key.first);
      if (is_compute(kind) || kind == ActionKind::kOptimizerStep) continue;
      const int32_t peer = peer_of(kind, p);
      if (count(counts[peer], matching(kind), key.second) != n) {
        return at(p, Action{kind, key.second}) + " has no matching " + to_string(Action{matching(kind), key.second}) +
               " on stage " + std::to_string(peer);
      }
    }
  }
  return "";
}

}  // namespace

Verification verify(const Schedule& s, const CostModel& costs) {
  Verification v;
  v.error = check_structure(s);
  if (!v.error.empty()) return v;

  // Dataflow simulation. sent[(kind, m)] on stage p = the time the data is usable by the peer.
  const size_t stages = s.actions.size();
  std::vector<size_t> pc(stages, 0);
  std::vector<double> clock(stages, 0.0), busy(stages, 0.0);
  std::vector<std::map<std::pair<int, int32_t>, double>> arrived(stages);  // at the receiver
  std::vector<int32_t> in_flight(stages, 0);
  v.peak_in_flight.assign(stages, 0);
  bool progressed = true;
  while (progressed) {
    progressed = false;
    for (size_t p = 0; p < stages; ++p) {
      while (pc[p] < s.actions[p].size()) {
        const Action& a = s.actions[p][pc[p]];
        double start = clock[p];
        if (is_compute(a.kind)) {
          const bool needs = a.kind == ActionKind::kForward ? p > 0 : (p + 1 < stages);
          if (needs) {
            const ActionKind data = a.kind == ActionKind::kForward ? ActionKind::kRecvActivation : ActionKind::kRecvGradient;
            const auto it = arrived[p].find({static_cast<int>(data), a.micro_batch});
            if (it == arrived[p].end()) break;  // waits for the peer's send
            start = std::max(start, it->second);
          }
          const double cost = a.kind == ActionKind::kForward ? costs.forward : costs.backward;
          clock[p] = start + cost;
          busy[p] += cost;
          if (s.trains) {
            in_flight[p] += a.kind == ActionKind::kForward ? 1 : -1;
            v.peak_in_flight[p] = std::max(v.peak_in_flight[p], in_flight[p]);
            if (in_flight[p] > s.max_in_flight) {
              v.error = at(static_cast<int32_t>(p), a) + " makes " + std::to_string(in_flight[p]) +
                        " micro-batches in flight, above the schedule's bound of " +
                        std::to_string(s.max_in_flight);
              return v;
            }
          } else {
            v.peak_in_flight[p] = 1;
          }
        } else if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGradient) {
          const size_t peer = static_cast<size_t>(peer_of(a.kind, static_cast<int32_t>(p)));
          arrived[peer][{static_cast<int>(matching(a.kind)), a.micro_batch}] = clock[p] + costs.transfer;
        }
        ++pc[p];
        progressed = true;
      }
    }
  }
  std::string stuck;
  for (size_t p = 0; p < stages; ++p) {
    if (pc[p] < s.actions[p].size()) {
      stuck += (stuck.empty() ? "" : "; ") + at(static_cast<int32_t>(p), s.actions[p][pc[p]]) + " waits forever";
    }
  }
  if (!stuck.empty()) {
    v.error = "deadlock: " + stuck;
    return v;
  }
  v.makespan = *std::max_element(clock.begin(), clock.end());
  double total_busy = 0.0;
  for (double b : busy) total_busy += b;
  v.bubble = v.makespan > 0 ? 1.0 - total_busy / (static_cast<double>(stages) * v.makespan) : 0.0;
  v.ok = true;
  return v;
}

double gpipe_bubble_formula(int32_t stages, int32_t micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

}  // namespace pipeline
}  // namespace weft
