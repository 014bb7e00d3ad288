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
    program.push_back({WEFT_ACTION_FORWARD, 0, m});
    program.push_back({WEFT_ACTION_BACKWARD, 0, m});
  }
  program.push_back({WEFT_ACTION_OPTIMIZER_STEP, 0, -1});
  return program;
}

StepProgram lower_reductions(const StepProgram& program, const std::set<int>& reduced) {
  std::map<int, size_t> last_backward;
  for (size_t i = 0; i < program.size(); ++i) {
    if (program[i].kind == WEFT_ACTION_BACKWARD) last_backward[program[i].chunk] = i;
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
    if (after.count(i)) lowered.push_back({WEFT_ACTION_REDUCE, program[i].chunk, -1});
  }
  return lowered;
}

std::string describe(const StepAction& a) {
  switch (a.kind) {
    case WEFT_ACTION_FORWARD: return fmt::format("F{}.{}", a.chunk, a.micro_batch);
    case WEFT_ACTION_BACKWARD: return fmt::format("B{}.{}", a.chunk, a.micro_batch);
    case WEFT_ACTION_BACKWARD_INPUT: return fmt::format("Bi{}.{}", a.chunk, a.micro_batch);
    case WEFT_ACTION_BACKWARD_WEIGHT: return fmt::format("W{}.{}", a.chunk, a.micro_batch);
    case WEFT_ACTION_REDUCE: return fmt::format("R{}", a.chunk);
    case WEFT_ACTION_OPTIMIZER_STEP: return "OPT";
  }
  return fmt::format("?{}", static_cast<int>(a.kind));
}

std::string describe(const StepProgram& program) {
  std::string out;
  for (const auto& a : program) out += (out.empty() ? "" : " ") + describe(a);
  return out;
}

void verify_program(const StepProgram& program, int micro_batches, int chunks) {
  WEFT_CHECK(micro_batches >= 1 && chunks >= 1, "step program: {} micro-batches of {} chunks", micro_batches, chunks);
  std::set<std::pair<int, int>> forwarded, backwarded;
  std::set<int> reduced;
  bool stepped = false;
  for (size_t i = 0; i < program.size(); ++i) {
    const StepAction& a = program[i];
    const auto fail = [&](const std::string& why) {
      throw Error(fmt::format("step program: action {} ({}) {} [{}]", i, describe(a), why, describe(program)));
    };
    if (stepped) fail("comes after OPTIMIZER_STEP, which must be the last action");
    const bool per_micro_batch = a.kind == WEFT_ACTION_FORWARD || a.kind == WEFT_ACTION_BACKWARD;
    if (a.chunk < 0 || a.chunk >= chunks) fail(fmt::format("names chunk {}, the step has {}", a.chunk, chunks));
    if (per_micro_batch && (a.micro_batch < 0 || a.micro_batch >= micro_batches)) {
      fail(fmt::format("names micro-batch {}, the step has {}", a.micro_batch, micro_batches));
    }
    const std::pair<int, int> key{a.chunk, a.micro_batch};
    switch (a.kind) {
      case WEFT_ACTION_FORWARD:
        if (forwarded.count(key)) fail("repeats a forward");
        if (a.chunk > 0 && !forwarded.count({a.chunk - 1, a.micro_batch})) fail("comes before the previous chunk's forward");
        forwarded.insert(key);
        break;
      case WEFT_ACTION_BACKWARD:
        if (!forwarded.count(key)) fail("comes before its forward");
        if (backwarded.count(key)) fail("repeats a backward");
        if (a.chunk + 1 < chunks && !backwarded.count({a.chunk + 1, a.micro_batch})) {
          fail("comes before the next chunk's backward");
        }
        backwarded.insert(key);
        break;
      case WEFT_ACTION_REDUCE:
        if (reduced.count(a.chunk)) fail("repeats a REDUCE");
        for (int m = 0; m < micro_batches; ++m) {
          if (!backwarded.count({a.chunk, m})) fail(fmt::format("comes before the backward of micro-batch {}", m));
        }
        reduced.insert(a.chunk);
        break;
      case WEFT_ACTION_OPTIMIZER_STEP:
        if (static_cast<int64_t>(backwarded.size()) != static_cast<int64_t>(micro_batches) * chunks) {
          fail(fmt::format("comes after {} of the {} backwards", backwarded.size(), micro_batches * chunks));
        }
        stepped = true;
        break;
      default:
        fail("is not an action a step can execute");
    }
  }
  WEFT_CHECK(stepped, "step program: no OPTIMIZER_STEP [{}]", describe(program));
}

}  // namespace weft
