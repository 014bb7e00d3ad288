// verify.cpp - static checks, then a dataflow simulation of the schedule.
#include "verify.hpp"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

namespace weft {
namespace pipeline {
namespace {

bool is_compute(ActionKind kind) {
  return kind == ActionKind::kForward || kind == ActionKind::kBackward || kind == ActionKind::kBackwardWeight;
}

bool is_transfer(ActionKind kind) {
  return kind == ActionKind::kRecvActivation || kind == ActionKind::kSendActivation || kind == ActionKind::kRecvGradient ||
         kind == ActionKind::kSendGradient;
}

// Where a transfer action on chunk `chunk` of `stage` goes or comes from: the neighbouring virtual
// stage (schedule.hpp's virtual_stage), as (stage, chunk); (-1, -1) if none.
std::pair<int32_t, int32_t> peer_of(const Schedule& s, ActionKind kind, int32_t stage, int32_t chunk) {
  const int32_t u = virtual_stage(s, stage, chunk);
  const int32_t other = (kind == ActionKind::kRecvActivation || kind == ActionKind::kSendGradient) ? u - 1 : u + 1;
  return locate(s, other);
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

// (kind, micro-batch, chunk): one action of a stage.
using Key = std::tuple<int, int32_t, int32_t>;
Key key_of(ActionKind kind, int32_t micro_batch, int32_t chunk) { return {static_cast<int>(kind), micro_batch, chunk}; }

// Counts of each (kind, micro-batch, chunk) on one stage.
using Counts = std::map<Key, int>;

int count(const Counts& counts, ActionKind kind, int32_t micro_batch, int32_t chunk) {
  const auto it = counts.find(key_of(kind, micro_batch, chunk));
  return it == counts.end() ? 0 : it->second;
}

// Checks 1-3 of verify.hpp. Returns the first problem, or "".
std::string check_structure(const Schedule& s) {
  if (s.stages < 1 || s.micro_batches < 1) return "a schedule needs at least 1 stage and 1 micro-batch";
  if (s.chunks < 1) return "a schedule needs at least 1 chunk per stage";
  if (std::string bad = check_chunk_map(s.stages, s.chunks, s.chunk_stage); !bad.empty()) return bad;
  if (static_cast<int32_t>(s.actions.size()) != s.stages) {
    return "the schedule has " + std::to_string(s.actions.size()) + " action lists for " +
           std::to_string(s.stages) + " stages";
  }
  const int32_t virtual_stages = s.stages * s.chunks;
  std::vector<Counts> counts(s.actions.size());
  for (int32_t p = 0; p < s.stages; ++p) {
    const auto& list = s.actions[p];
    std::map<Key, size_t> first_index;
    for (size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (a.kind == ActionKind::kOptimizerStep) {
        if (!s.trains) return at(p, a) + ": a forward-only schedule has no optimizer step";
        if (i + 1 != list.size()) return at(p, a) + " is not the stage's last action";
        continue;
      }
      if (a.kind == ActionKind::kGather || a.kind == ActionKind::kRelease) {  // around the chunk's uses: below
        if (a.chunk < 0 || a.chunk >= s.chunks) return at(p, a) + ": no such chunk";
        if (++counts[p][key_of(a.kind, -1, a.chunk)] > 1) return at(p, a) + " appears twice";
        first_index[key_of(a.kind, -1, a.chunk)] = i;
        continue;
      }
      if (a.kind == ActionKind::kReduce) {  // after every gradient of its chunk: checked below
        if (!s.trains) return at(p, a) + ": a forward-only schedule has no gradients to reduce";
        if (a.chunk < 0 || a.chunk >= s.chunks) return at(p, a) + ": no such chunk";
        if (++counts[p][key_of(a.kind, -1, a.chunk)] > 1) return at(p, a) + " appears twice";
        first_index[key_of(a.kind, -1, a.chunk)] = i;
        continue;
      }
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches) return at(p, a) + ": no such micro-batch";
      if (a.chunk < 0 || a.chunk >= s.chunks) return at(p, a) + ": no such chunk";
      if (is_transfer(a.kind)) {
        const int32_t peer = peer_of(s, a.kind, p, a.chunk).first;
        if (peer < 0) {
          const bool before = a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kSendGradient;
          return at(p, a) + ": there is no virtual stage " + std::to_string(virtual_stage(s, p, a.chunk) + (before ? -1 : 1));
        }
      }
      if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) && !s.trains) {
        return at(p, a) + ": backward in a forward-only schedule";
      }
      if (a.kind == ActionKind::kBackwardWeight && !s.split_backward) {
        return at(p, a) + ": a weight-gradient pass in a schedule whose backward is not split";
      }
      const Key key = key_of(a.kind, a.micro_batch, a.chunk);
      if (++counts[p][key] > 1) return at(p, a) + " appears twice";
      first_index[key] = i;
    }
    const auto index_of = [&](ActionKind kind, int32_t m, int32_t c) { return first_index.at(key_of(kind, m, c)); };
    for (int32_t c = 0; c < s.chunks; ++c) {
      const int32_t u = virtual_stage(s, p, c);
      const bool reduces = count(counts[p], ActionKind::kReduce, -1, c) > 0;
      const bool gathers = count(counts[p], ActionKind::kGather, -1, c) > 0;
      const bool releases = count(counts[p], ActionKind::kRelease, -1, c) > 0;
      if (gathers != releases) {
        return at(p, Action{gathers ? ActionKind::kGather : ActionKind::kRelease, -1, c}) + " has no " +
               (gathers ? "release" : "gather");
      }
      if (gathers && index_of(ActionKind::kRelease, -1, c) < index_of(ActionKind::kGather, -1, c)) {
        return at(p, Action{ActionKind::kRelease, -1, c}) + " comes before its gather";
      }
      if (gathers && reduces && index_of(ActionKind::kRelease, -1, c) < index_of(ActionKind::kReduce, -1, c)) {
        return at(p, Action{ActionKind::kRelease, -1, c}) + " comes before the reduction of its gradients";
      }
      for (int32_t m = 0; m < s.micro_batches && gathers; ++m) {  // every use between the gather and the release
        for (ActionKind kind : {ActionKind::kForward, ActionKind::kBackward, ActionKind::kBackwardWeight}) {
          if (count(counts[p], kind, m, c) == 0) continue;
          const size_t at_use = index_of(kind, m, c);
          if (at_use < index_of(ActionKind::kGather, -1, c) || at_use > index_of(ActionKind::kRelease, -1, c)) {
            return at(p, Action{kind, m, c}) + " uses chunk " + std::to_string(c) + "'s parameters outside its gather and release";
          }
        }
      }
      for (int32_t m = 0; m < s.micro_batches; ++m) {
        const Action forward{ActionKind::kForward, m, c}, backward{ActionKind::kBackward, m, c};
        if (count(counts[p], ActionKind::kForward, m, c) != 1) return at(p, forward) + " is missing";
        if (s.trains) {
          if (count(counts[p], ActionKind::kBackward, m, c) != 1) return at(p, backward) + " is missing";
          if (index_of(ActionKind::kBackward, m, c) < index_of(ActionKind::kForward, m, c)) {
            return at(p, backward) + " comes before its forward";
          }
          if (s.split_backward) {
            const Action weight{ActionKind::kBackwardWeight, m, c};
            if (count(counts[p], ActionKind::kBackwardWeight, m, c) != 1) return at(p, weight) + " is missing";
            if (index_of(ActionKind::kBackwardWeight, m, c) < index_of(ActionKind::kBackward, m, c)) {
              return at(p, weight) + " comes before its backward " + to_string(backward);
            }
          }
          // A reduction starts once the chunk's gradients are final: after its every B and W.
          const ActionKind last = s.split_backward ? ActionKind::kBackwardWeight : ActionKind::kBackward;
          if (reduces && index_of(ActionKind::kReduce, -1, c) < index_of(last, m, c)) {
            return at(p, Action{ActionKind::kReduce, -1, c}) + " comes before " + to_string(Action{last, m, c}) +
                   ", which adds to the gradients it reduces";
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
            {ActionKind::kRecvActivation, ActionKind::kForward, true, u > 0},
            {ActionKind::kSendActivation, ActionKind::kForward, false, u < virtual_stages - 1},
            {ActionKind::kRecvGradient, ActionKind::kBackward, true, s.trains && u < virtual_stages - 1},
            {ActionKind::kSendGradient, ActionKind::kBackward, false, s.trains && u > 0},
        };
        for (const Rule& r : rules) {
          const Action transfer{r.transfer, m, c};
          const int n = count(counts[p], r.transfer, m, c);
          if (r.required && n == 0) return at(p, transfer) + " is missing";
          if (!r.required && n > 0) return at(p, transfer) + " has no use on this stage";
          if (n == 0) continue;
          const bool before = index_of(r.transfer, m, c) < index_of(r.compute, m, c);
          if (before != r.before) {
            return at(p, transfer) + (r.before ? " is posted after " : " comes before ") + to_string(Action{r.compute, m, c});
          }
        }
      }
    }
    if (s.trains && (list.empty() || list.back().kind != ActionKind::kOptimizerStep)) {
      return "stage " + std::to_string(p) + " does not end with the optimizer step";
    }
  }
  // Each direction between two stages carries its transfers in one order at both ends: the order
  // the sender starts them is the order the receiver posts them. Gloo matches by tag and would not
  // need it; NCCL's send/recv have no tags and match by order.
  std::map<std::pair<int32_t, int32_t>, std::vector<std::pair<Key, std::string>>> sent, posted;
  for (int32_t p = 0; p < s.stages; ++p) {
    for (const Action& a : s.actions[p]) {
      if (!is_transfer(a.kind)) continue;
      const auto [peer, peer_chunk] = peer_of(s, a.kind, p, a.chunk);
      const bool sends = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGradient;
      // The transfer named by its send: (kind, micro-batch, the sender's chunk).
      const Key transfer = sends ? key_of(a.kind, a.micro_batch, a.chunk) : key_of(matching(a.kind), a.micro_batch, peer_chunk);
      (sends ? sent[{p, peer}] : posted[{peer, p}]).push_back({transfer, at(p, a)});
    }
  }
  for (const auto& [pair, sends] : sent) {
    const auto& receives = posted[pair];
    for (size_t i = 0; i < sends.size() && i < receives.size(); ++i) {
      if (sends[i].first != receives[i].first) {
        return "transfers from stage " + std::to_string(pair.first) + " to stage " + std::to_string(pair.second) +
               " are out of order: the sender's transfer " + std::to_string(i + 1) + " is " + sends[i].second +
               " but the receiver's is " + receives[i].second;
      }
    }
  }
  // Every send has one matching receive on the peer, and vice versa.
  for (int32_t p = 0; p < s.stages; ++p) {
    for (const auto& [key, n] : counts[p]) {
      const auto kind = static_cast<ActionKind>(std::get<0>(key));
      if (!is_transfer(kind)) continue;
      const int32_t m = std::get<1>(key), c = std::get<2>(key);
      const auto [peer, peer_chunk] = peer_of(s, kind, p, c);
      if (count(counts[peer], matching(kind), m, peer_chunk) != n) {
        return at(p, Action{kind, m, c}) + " has no matching " + to_string(Action{matching(kind), m, peer_chunk}) +
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

  // Dataflow simulation. arrived[p][(kind, m, chunk)] = when the data of that receive is usable
  // on stage p. A chunk's compute costs 1 / chunks of the stage's (the stage's work is the same).
  const size_t stages = s.actions.size();
  const int32_t virtual_stages = s.stages * s.chunks;
  std::vector<size_t> pc(stages, 0);
  std::vector<double> clock(stages, 0.0), busy(stages, 0.0);
  std::vector<std::map<Key, double>> arrived(stages);
  std::vector<int32_t> in_flight(stages, 0), pending(stages, 0);
  v.peak_in_flight.assign(stages, 0);
  v.peak_pending_weights.assign(stages, 0);
  bool progressed = true;
  while (progressed) {
    progressed = false;
    for (size_t p = 0; p < stages; ++p) {
      while (pc[p] < s.actions[p].size()) {
        const Action& a = s.actions[p][pc[p]];
        double start = clock[p];
        if (is_compute(a.kind)) {
          const int32_t u = virtual_stage(s, static_cast<int32_t>(p), a.chunk);
          const bool needs = a.kind == ActionKind::kForward    ? u > 0
                             : a.kind == ActionKind::kBackward ? u + 1 < virtual_stages
                                                               : false;  // W: its own B, earlier in the list
          if (needs) {
            const ActionKind data = a.kind == ActionKind::kForward ? ActionKind::kRecvActivation : ActionKind::kRecvGradient;
            const auto it = arrived[p].find(key_of(data, a.micro_batch, a.chunk));
            if (it == arrived[p].end()) break;  // waits for the peer's send
            start = std::max(start, it->second);
          }
          const double backward = s.split_backward ? costs.backward - costs.weight : costs.backward;
          const double cost = (a.kind == ActionKind::kForward    ? costs.forward
                               : a.kind == ActionKind::kBackward ? backward
                                                                 : costs.weight) /
                              s.chunks;
          clock[p] = start + cost;
          busy[p] += cost;
          if (s.split_backward && a.kind != ActionKind::kForward) {
            pending[p] += a.kind == ActionKind::kBackward ? 1 : -1;
            v.peak_pending_weights[p] = std::max(v.peak_pending_weights[p], pending[p]);
            if (pending[p] > s.max_pending_weights) {
              v.error = at(static_cast<int32_t>(p), a) + " leaves " + std::to_string(pending[p]) +
                        " weight-gradient passes waiting, above the schedule's bound of " +
                        std::to_string(s.max_pending_weights);
              return v;
            }
          }
          if (a.kind == ActionKind::kBackwardWeight) {
            // frees no activations: the micro-batch left the in-flight count at its B
          } else if (s.trains) {
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
          const auto [peer, peer_chunk] = peer_of(s, a.kind, static_cast<int32_t>(p), a.chunk);
          arrived[static_cast<size_t>(peer)][key_of(matching(a.kind), a.micro_batch, peer_chunk)] =
              clock[p] + costs.transfer;
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

double interleaved_bubble_formula(int32_t stages, int32_t micro_batches, int32_t chunks) {
  return static_cast<double>(stages - 1) / static_cast<double>(chunks * micro_batches + stages - 1);
}

double zero_bubble_h1_bubble_formula(int32_t stages, int32_t micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(3 * micro_batches + stages - 1);
}

}  // namespace pipeline
}  // namespace weft
