#include "core/plugin/step_program.h"

#include <map>
#include <utility>

#include <fmt/format.h>

#include "core/util/error.h"

namespace weft {

StepProgram one_chunk_program(int micro_batches) {
  WEFT_CHECK(micro_batches >= 1, "a step needs at least one micro-batch, got {}", micro_batches);
  StepProgram program;
  for (int m = 0; m < micro_batches; ++m) {
    program.push_back({StepKind::kForward, 0, m});
    program.push_back({StepKind::kBackward, 0, m});
  }
  program.push_back({StepKind::kOptimizerStep, 0, -1});
  return program;
}

StepProgram sharded_program(const ProgramShape& shape, bool tied, bool keep_after_forward) {
  const int M = shape.micro_batches, S = shape.chunks, first = shape.first_trained;
  WEFT_CHECK(M >= 1 && S >= 1 && first >= 0 && first <= S, "a sharded step of {} micro-batches, {} chunks, first trained {}",
             M, S, first);
  StepProgram program;
  std::vector<char> whole(static_cast<size_t>(S), 0), flying(static_cast<size_t>(S), 0);
  const auto gather = [&](int c) {
    if (whole[c]) return;
    if (!program.empty() && program.back() == StepAction{StepKind::kRelease, c, -1}) {
      program.pop_back();  // released and gathered again at once (chunk 0 between micro-batches): kept
      whole[c] = 1;
      return;
    }
    program.push_back({StepKind::kGather, c, -1});
    whole[c] = 1;
    flying[c] = 0;
  };
  const auto prefetch = [&](int c) {
    if (c < 0 || c >= S || whole[c] || flying[c]) return;
    program.push_back({StepKind::kPrefetch, c, -1});
    flying[c] = 1;
  };
  const auto release = [&](int c) {
    if (!whole[c] || (tied && c == 0)) return;
    program.push_back({StepKind::kRelease, c, -1});
    whole[c] = 0;
  };
  if (tied) gather(0);
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < S; ++c) {
      gather(c);
      prefetch(c + 1);
      program.push_back({StepKind::kForward, c, m});
      if (c + 1 < S && !keep_after_forward) release(c);
    }
    for (int c = S - 1; c >= 0; --c) {
      if (c < first) {  // nothing before it trains: no backward
        release(c);
        continue;
      }
      gather(c);
      if (c - 1 >= first) prefetch(c - 1);
      program.push_back({StepKind::kBackward, c, m});
      release(c);
    }
  }
  if (tied && whole[0]) {
    program.push_back({StepKind::kRelease, 0, -1});
  }
  program.push_back({StepKind::kOptimizerStep, 0, -1});
  return program;
}

StepProgram lower_reductions(const StepProgram& program, const std::set<int>& reduced) {
  std::map<int, size_t> last_backward;
  for (size_t i = 0; i < program.size(); ++i) {
    if (program[i].kind == StepKind::kBackward) last_backward[program[i].chunk] = i;
  }
  std::set<size_t> after;
  for (int chunk : reduced) {
    const auto it = last_backward.find(chunk);
    WEFT_CHECK(it != last_backward.end(), "step program: chunk {} has gradients to reduce but no backward", chunk);
    after.insert(it->second);
  }
  StepProgram lowered;
  for (size_t i = 0; i < program.size(); ++i) {
    lowered.push_back(program[i]);
    if (after.count(i)) lowered.push_back({StepKind::kReduce, program[i].chunk, -1});
  }
  return lowered;
}

std::string describe(const StepAction& a) {
  switch (a.kind) {
    case StepKind::kForward: return fmt::format("F{}.{}", a.chunk, a.micro_batch);
    case StepKind::kBackward: return fmt::format("B{}.{}", a.chunk, a.micro_batch);
    case StepKind::kReduce: return fmt::format("R{}", a.chunk);
    case StepKind::kOptimizerStep: return "OPT";
    case StepKind::kGather: return fmt::format("G{}", a.chunk);
    case StepKind::kPrefetch: return fmt::format("P{}", a.chunk);
    case StepKind::kRelease: return fmt::format("X{}", a.chunk);
  }
  return fmt::format("?{}", static_cast<int>(a.kind));
}

std::string describe(const StepProgram& program) {
  std::string out;
  for (const auto& a : program) out += (out.empty() ? "" : " ") + describe(a);
  return out;
}

void verify_program(const StepProgram& program, const ProgramShape& shape) {
  const int M = shape.micro_batches, chunks = shape.chunks, first = shape.first_trained;
  WEFT_CHECK(M >= 1 && chunks >= 1 && first >= 0 && first < chunks, "step program: {} micro-batches of {} chunks, first trained {}",
             M, chunks, first);
  std::set<std::pair<int, int>> forwarded, backwarded;
  std::set<int> reduced, whole, flying;
  bool stepped = false;
  for (size_t i = 0; i < program.size(); ++i) {
    const StepAction& a = program[i];
    const auto fail = [&](const std::string& why) {
      throw Error(fmt::format("step program: action {} ({}) {} [{}]", i, describe(a), why, describe(program)));
    };
    if (stepped) fail("comes after OPTIMIZER_STEP, which must be the last action");
    const bool compute = a.kind == StepKind::kForward || a.kind == StepKind::kBackward;
    const bool gathers = a.kind == StepKind::kGather || a.kind == StepKind::kPrefetch || a.kind == StepKind::kRelease;
    if (a.chunk < 0 || a.chunk >= chunks) fail(fmt::format("names chunk {}, the step has {}", a.chunk, chunks));
    if (compute && (a.micro_batch < 0 || a.micro_batch >= M)) {
      fail(fmt::format("names micro-batch {}, the step has {}", a.micro_batch, M));
    }
    if (gathers && !shape.sharded) fail("gathers or releases parameters, but none are sharded");
    if (compute && shape.sharded && !whole.count(a.chunk)) fail("computes a chunk whose parameters are not gathered");
    const std::pair<int, int> key{a.chunk, a.micro_batch};
    switch (a.kind) {
      case StepKind::kForward:
        if (forwarded.count(key)) fail("repeats a forward");
        if (a.chunk > 0 && !forwarded.count({a.chunk - 1, a.micro_batch})) fail("comes before the previous chunk's forward");
        forwarded.insert(key);
        break;
      case StepKind::kBackward:
        if (a.chunk < first) fail(fmt::format("is a backward below the first trained chunk ({})", first));
        if (!forwarded.count(key)) fail("comes before its forward");
        if (backwarded.count(key)) fail("repeats a backward");
        if (a.chunk + 1 < chunks && !backwarded.count({a.chunk + 1, a.micro_batch})) {
          fail("comes before the next chunk's backward");
        }
        backwarded.insert(key);
        break;
      case StepKind::kReduce:
        if (reduced.count(a.chunk)) fail("repeats a REDUCE");
        for (int m = 0; m < M; ++m) {
          if (!backwarded.count({a.chunk, m})) fail(fmt::format("comes before the backward of micro-batch {}", m));
        }
        reduced.insert(a.chunk);
        break;
      case StepKind::kGather:
        if (whole.count(a.chunk)) fail("gathers a chunk that is whole");
        flying.erase(a.chunk);
        whole.insert(a.chunk);
        break;
      case StepKind::kPrefetch:
        if (whole.count(a.chunk) || flying.count(a.chunk)) fail("prefetches a chunk that is whole or under way");
        flying.insert(a.chunk);
        break;
      case StepKind::kRelease:
        if (!whole.erase(a.chunk)) fail("releases a chunk that is not whole");
        break;
      case StepKind::kOptimizerStep: {
        const int64_t expected = static_cast<int64_t>(M) * (chunks - first);
        if (static_cast<int64_t>(backwarded.size()) != expected) {
          fail(fmt::format("comes after {} of the {} backwards", backwarded.size(), expected));
        }
        if (!whole.empty() || !flying.empty()) {
          fail(fmt::format("comes while chunk {} is whole or under way", !whole.empty() ? *whole.begin() : *flying.begin()));
        }
        stepped = true;
        break;
      }
      default:
        fail("is not an action a step can execute");
    }
  }
  WEFT_CHECK(stepped, "step program: no OPTIMIZER_STEP [{}]", describe(program));
}

}  // namespace weft
