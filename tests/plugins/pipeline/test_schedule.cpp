// Pipeline schedules as data: gpipe.so's generators (plugins/gpipe/schedules.hpp) as the host runs
// them (their compute actions with the transfers added: core/pipeline/schedule.hpp), the verifier
// on every (stages, micro-batches) in 1..8 x 1..32, the verifier catching broken schedules, and
// the simulated bubble against GPipe's formula.
#include <algorithm>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "schedule.hpp"
#include "schedules.hpp"
#include "verify.hpp"

namespace {

using weft::pipeline::Action;
using weft::pipeline::ActionKind;
using weft::pipeline::Schedule;

// What the host runs for gpipe.so's schedule `name` ("forward": the host's own evaluation
// schedule): the plugin's compute actions for every stage, with the transfers added.
Schedule make_schedule(const std::string& name, int32_t stages, int32_t micro_batches, int32_t chunks = 1) {
  if (name == "forward") return weft::pipeline::forward_only_schedule(stages, micro_batches, chunks);
  return weft::pipeline::schedule_from_actions(name, stages, micro_batches, chunks, {},
                                               gpipe::make_schedule(name, stages, micro_batches, chunks));
}
Schedule gpipe_schedule(int32_t stages, int32_t micro_batches) { return make_schedule("gpipe", stages, micro_batches); }
Schedule one_f_one_b_schedule(int32_t stages, int32_t micro_batches) { return make_schedule("1f1b", stages, micro_batches); }
Schedule interleaved_one_f_one_b_schedule(int32_t stages, int32_t micro_batches, int32_t chunks) {
  return make_schedule("interleaved1f1b", stages, micro_batches, chunks);
}
Schedule zero_bubble_h1_schedule(int32_t stages, int32_t micro_batches) { return make_schedule("zbh1", stages, micro_batches); }

// The most micro-batches in flight on any stage, as the verifier measures them.
int32_t peak_in_flight(const Schedule& s) {
  const auto v = weft::pipeline::verify(s);
  return *std::max_element(v.peak_in_flight.begin(), v.peak_in_flight.end());
}

std::vector<std::string> names(const std::vector<Action>& actions) {
  std::vector<std::string> out;
  for (const Action& a : actions) out.push_back(weft::pipeline::to_string(a));
  return out;
}

TEST(Schedule, GpipeTwoStagesTwoMicroBatches) {
  const Schedule s = gpipe_schedule(2, 2);
  EXPECT_EQ(names(s.actions[0]),
            (std::vector<std::string>{"F0", "sA0", "rG1", "F1", "sA1", "rG0", "B1", "B0", "step"}));
  EXPECT_EQ(names(s.actions[1]),
            (std::vector<std::string>{"rA0", "rA1", "F0", "F1", "B1", "sG1", "B0", "sG0", "step"}));
  EXPECT_EQ(peak_in_flight(s), 2);
}

TEST(Schedule, OneFOneBAlternatesAfterWarmUp) {
  const Schedule s = one_f_one_b_schedule(3, 4);
  // Stage 0 warms up with stages - 1 = 2 forwards, then alternates, then drains.
  std::vector<std::string> compute;
  for (const auto& n : names(s.actions[0])) {
    if (n[0] == 'F' || n[0] == 'B') compute.push_back(n);
  }
  EXPECT_EQ(compute, (std::vector<std::string>{"F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"}));
  // The last stage does one forward then its backward right away.
  compute.clear();
  for (const auto& n : names(s.actions[2])) {
    if (n[0] == 'F' || n[0] == 'B') compute.push_back(n);
  }
  EXPECT_EQ(compute, (std::vector<std::string>{"F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"}));
  EXPECT_EQ(peak_in_flight(s), 3);
}

TEST(Verifier, AcceptsEveryShippedScheduleFor1To8StagesAnd1To32MicroBatches) {
  for (const std::string name : {"gpipe", "1f1b", "forward"}) {
    for (int32_t stages = 1; stages <= 8; ++stages) {
      for (int32_t m = 1; m <= 32; ++m) {
        const Schedule s = make_schedule(name, stages, m);
        const auto v = weft::pipeline::verify(s);
        ASSERT_TRUE(v.ok) << name << " S=" << stages << " M=" << m << ": " << v.error << "\n"
                          << weft::pipeline::to_string(s);
        const int32_t peak = *std::max_element(v.peak_in_flight.begin(), v.peak_in_flight.end());
        if (name == "gpipe") {
          EXPECT_EQ(peak, m) << "S=" << stages << " M=" << m;
        } else if (name == "1f1b") {
          EXPECT_EQ(peak, std::min(stages, m)) << "S=" << stages << " M=" << m;
          for (int32_t p = 0; p < stages; ++p) EXPECT_EQ(v.peak_in_flight[p], std::min(stages - p, m));
        }
      }
    }
  }
}

TEST(Verifier, SimulatedBubbleOfGpipeAnd1F1BIsTheFormula) {
  for (int32_t stages = 1; stages <= 8; ++stages) {
    for (int32_t m = 1; m <= 32; ++m) {
      const double formula = weft::pipeline::gpipe_bubble_formula(stages, m);
      for (const std::string name : {"gpipe", "1f1b"}) {
        const auto v = weft::pipeline::verify(make_schedule(name, stages, m));
        ASSERT_TRUE(v.ok) << v.error;
        EXPECT_NEAR(v.bubble, formula, 1e-12) << name << " S=" << stages << " M=" << m;
        EXPECT_NEAR(v.makespan, 3.0 * (m + stages - 1), 1e-9) << name << " S=" << stages << " M=" << m;
      }
    }
  }
}

// Returns `s` with the first action equal to `target` on `stage` removed.
Schedule without(Schedule s, int32_t stage, Action target) {
  auto& list = s.actions[stage];
  list.erase(std::find(list.begin(), list.end(), target));
  return s;
}

// Interleaved 1F1B (virtual stages): stage p's chunk c is virtual stage c x S + p, so the last
// stage's chunk 0 sends to stage 0's chunk 1; micro-batches go through the chunks in groups of S.
TEST(Schedule, InterleavedOneFOneBWalksTheChunksInGroupsOfTheStages) {
  const Schedule s = interleaved_one_f_one_b_schedule(2, 4, 2);
  EXPECT_EQ(s.chunks, 2);
  std::vector<std::string> compute;
  for (const auto& n : names(s.actions[0])) {
    if (n[0] == 'F' || n[0] == 'B') compute.push_back(n);
  }
  // Stage 0 of 2 with 2 chunks warms up with 2 (S - 1) + (v - 1) S = 4 forwards.
  EXPECT_EQ(compute, (std::vector<std::string>{"F0", "F1", "F0.1", "F1.1", "F2", "B0.1", "F3", "B1.1", "F2.1", "B0",
                                               "F3.1", "B1", "B2.1", "B3.1", "B2", "B3"}));
  const auto last = names(s.actions[1]);
  EXPECT_NE(std::find(last.begin(), last.end(), "sA0"), last.end());    // chunk 0's output goes on
  const auto first = names(s.actions[0]);
  EXPECT_NE(std::find(first.begin(), first.end(), "rA0.1"), first.end());  // to stage 0's chunk 1
  EXPECT_NE(std::find(first.begin(), first.end(), "sG0.1"), first.end());  // and its gradient back
  EXPECT_EQ(std::find(first.begin(), first.end(), "rA0"), first.end());    // virtual stage 0 reads the batch
  EXPECT_THROW(interleaved_one_f_one_b_schedule(4, 6, 2), std::invalid_argument);  // M % S != 0
  EXPECT_THROW(interleaved_one_f_one_b_schedule(2, 4, 0), std::invalid_argument);
}

// Every interleaved schedule the generator makes passes the verifier (matching transfers across
// chunks, no deadlock, its memory bound), and the simulated bubble is the 1F1B formula with the
// warm-up shortened v times: (S - 1) / (v M + S - 1).
TEST(Verifier, AcceptsInterleavedSchedulesAndTheirBubbleShrinksWithTheChunks) {
  for (int32_t stages = 1; stages <= 8; ++stages) {
    for (int32_t chunks = 1; chunks <= 4; ++chunks) {
      for (int32_t m = stages; m <= 32; m += stages) {
        const Schedule s = interleaved_one_f_one_b_schedule(stages, m, chunks);
        const auto v = weft::pipeline::verify(s);
        ASSERT_TRUE(v.ok) << "S=" << stages << " v=" << chunks << " M=" << m << ": " << v.error << "\n"
                          << weft::pipeline::to_string(s);
        // Stage 0 keeps up to 2 (S - 1) + (v - 1) S + 1 chunk activations (all of them when M = S).
        EXPECT_LE(v.peak_in_flight[0], m == stages ? m * chunks : std::min(m * chunks, 2 * (stages - 1) + (chunks - 1) * stages + 1));
        const double formula = static_cast<double>(stages - 1) / (chunks * m + stages - 1);
        EXPECT_NEAR(v.bubble, formula, 1e-9) << "S=" << stages << " v=" << chunks << " M=" << m;
        EXPECT_DOUBLE_EQ(weft::pipeline::interleaved_bubble_formula(stages, m, chunks), formula);
        // Its evaluation, chunk by chunk.
        const Schedule eval = make_schedule("forward", stages, m, chunks);
        const auto ve = weft::pipeline::verify(eval);
        ASSERT_TRUE(ve.ok) << "forward S=" << stages << " v=" << chunks << " M=" << m << ": " << ve.error;
        EXPECT_EQ(eval.chunks, chunks);
        EXPECT_EQ(ve.peak_in_flight[0], 1);  // forward only: one micro-batch at a time
      }
    }
  }
}

// ZB-H1: the backward split into B (input gradients) and W (weight gradients). Every schedule
// verifies; with B = W = F its simulated bubble is (S - 1) / (3 M + S - 1) once M >= S (a third of
// 1F1B's in the same units) and never above 1F1B's; it holds 1F1B's activations (S - p micro-batches
// between F and B on stage p) plus at most min(S, M) micro-batches waiting for their W.
TEST(Verifier, AcceptsZeroBubbleH1AndItsBubbleIsAThirdOf1F1Bs) {
  for (int32_t stages = 1; stages <= 8; ++stages) {
    for (int32_t m = 1; m <= 32; ++m) {
      const Schedule s = make_schedule("zbh1", stages, m);
      EXPECT_TRUE(s.split_backward);
      const auto v = weft::pipeline::verify(s);
      ASSERT_TRUE(v.ok) << "S=" << stages << " M=" << m << ": " << v.error << "\n" << weft::pipeline::to_string(s);
      const auto plain = weft::pipeline::verify(make_schedule("1f1b", stages, m));
      EXPECT_LE(v.bubble, plain.bubble + 1e-12) << "S=" << stages << " M=" << m;
      if (m >= stages) {
        EXPECT_NEAR(v.bubble, weft::pipeline::zero_bubble_h1_bubble_formula(stages, m), 1e-9)
            << "S=" << stages << " M=" << m << "\n" << weft::pipeline::to_string(s);
      }
      for (int32_t p = 0; p < stages; ++p) {
        EXPECT_EQ(v.peak_in_flight[p], std::min(stages - p, m)) << "S=" << stages << " M=" << m << " p=" << p;
        EXPECT_LE(v.peak_pending_weights[p], std::min(stages, m));
      }
    }
  }
  // The last stage runs F B W in turn; stage 0 of 2 defers its W to fill the drain.
  const Schedule s = zero_bubble_h1_schedule(2, 4);
  std::vector<std::string> compute;
  for (const auto& n : names(s.actions[1])) {
    if (n[0] == 'F' || n[0] == 'B' || n[0] == 'W') compute.push_back(n);
  }
  EXPECT_EQ(compute, (std::vector<std::string>{"F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "F3", "B3", "W2", "W3"}));
}

TEST(Verifier, CatchesAWeightPassBeforeItsBackwardOrMissingOrInAScheduleWithoutOne) {
  Schedule s = zero_bubble_h1_schedule(2, 2);
  auto& last = s.actions[1];
  const auto b0 = std::find(last.begin(), last.end(), Action{ActionKind::kBackward, 0});
  const auto w0 = std::find(last.begin(), last.end(), Action{ActionKind::kBackwardWeight, 0});
  ASSERT_TRUE(b0 != last.end() && w0 != last.end());
  std::iter_swap(b0, w0);
  auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 1 W0 comes before its backward B0"), std::string::npos) << v.error;
  v = weft::pipeline::verify(without(zero_bubble_h1_schedule(2, 2), 0, {ActionKind::kBackwardWeight, 1}));
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 0 W1 is missing"), std::string::npos) << v.error;
  Schedule plain = one_f_one_b_schedule(2, 2);
  plain.actions[0].insert(plain.actions[0].end() - 1, Action{ActionKind::kBackwardWeight, 0});
  v = weft::pipeline::verify(plain);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("a weight-gradient pass in a schedule whose backward is not split"), std::string::npos) << v.error;
  Schedule tight = zero_bubble_h1_schedule(4, 8);
  tight.max_pending_weights = 1;
  v = weft::pipeline::verify(tight);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("weight-gradient passes waiting, above the schedule's bound of 1"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesAMissingReceiveBetweenChunks) {
  const auto v = weft::pipeline::verify(
      without(interleaved_one_f_one_b_schedule(2, 2, 2), 0, {ActionKind::kRecvActivation, 1, 1}));
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 0 rA1.1 is missing"), std::string::npos) << v.error;
}


TEST(Verifier, CatchesAMissingReceive) {
  const auto v = weft::pipeline::verify(without(gpipe_schedule(2, 2), 1, {ActionKind::kRecvActivation, 1}));
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 1 rA1 is missing"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesAMissingSend) {
  // Stage 1 drops its gradient send for micro-batch 0: stage 0's backward of micro-batch 0
  // would wait for it forever.
  const Schedule s = without(gpipe_schedule(3, 2), 1, {ActionKind::kSendGradient, 0});
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 1 sG0 is missing"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesAMissingBackward) {
  const auto v = weft::pipeline::verify(without(one_f_one_b_schedule(2, 3), 0, {ActionKind::kBackward, 2}));
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 0 B2 is missing"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesBackwardBeforeForward) {
  Schedule s = gpipe_schedule(1, 2);  // F0 F1 B1 B0 step
  std::swap(s.actions[0][0], s.actions[0][3]);        // B0 F1 B1 F0 step
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("B0 comes before its forward"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesADeadlock) {
  // Two stages, each waiting for the other: stage 1 does B0 (needing nothing) only after its
  // F1, but stage 0 sends A1 only after receiving G0.
  Schedule s;
  s.name = "broken";
  s.stages = 2;
  s.micro_batches = 2;
  s.max_in_flight = 2;
  using K = ActionKind;
  s.actions = {
      {{K::kForward, 0}, {K::kSendActivation, 0}, {K::kRecvGradient, 0}, {K::kBackward, 0},
       {K::kForward, 1}, {K::kSendActivation, 1}, {K::kRecvGradient, 1}, {K::kBackward, 1}, {K::kOptimizerStep, -1}},
      {{K::kRecvActivation, 0}, {K::kRecvActivation, 1}, {K::kForward, 0}, {K::kForward, 1}, {K::kBackward, 0},
       {K::kSendGradient, 0}, {K::kBackward, 1}, {K::kSendGradient, 1}, {K::kOptimizerStep, -1}},
  };
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("deadlock"), std::string::npos) << v.error;
  EXPECT_NE(v.error.find("stage 0 B0 waits forever"), std::string::npos) << v.error;
  EXPECT_NE(v.error.find("stage 1 F1 waits forever"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesMoreInFlightThanTheBound) {
  Schedule s = gpipe_schedule(2, 4);
  s.max_in_flight = 2;  // GPipe holds all 4
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("3 micro-batches in flight, above the schedule's bound of 2"), std::string::npos) << v.error;
}

// NCCL matches sends and receives by order: receives posted in another order than the sends
// started would pair micro-batch 0's data with micro-batch 1's buffer. (Every shipped schedule,
// interleaved ones included, keeps one order per direction: the Accepts* tests above.)
TEST(Verifier, CatchesReceivesPostedInAnotherOrderThanTheSends) {
  Schedule s = gpipe_schedule(2, 2);  // stage 1: rA0 rA1 F0 F1 B1 sG1 B0 sG0 step
  std::swap(s.actions[1][0], s.actions[1][1]);
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("transfers from stage 0 to stage 1 are out of order: the sender's transfer 1 is stage 0 sA0 "
                         "but the receiver's is stage 1 rA1"),
            std::string::npos)
      << v.error;
}

TEST(Verifier, CatchesAReceivePostedAfterItsConsumer) {
  Schedule s = gpipe_schedule(2, 1);  // stage 1: rA0 F0 B0 sG0 step
  std::swap(s.actions[1][0], s.actions[1][1]);
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("stage 1 rA0 is posted after F0"), std::string::npos) << v.error;
}

TEST(Verifier, CatchesTransfersToStagesThatDoNotExist) {
  Schedule s = gpipe_schedule(2, 1);
  s.actions[0].insert(s.actions[0].begin(), Action{ActionKind::kRecvActivation, 0});
  const auto v = weft::pipeline::verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_NE(v.error.find("there is no virtual stage -1"), std::string::npos) << v.error;
}

TEST(Schedule, RefusesImpossibleShapesAndNames) {
  EXPECT_THROW(make_schedule("gpipe", 0, 4), std::invalid_argument);
  EXPECT_THROW(make_schedule("1f1b", 2, 0), std::invalid_argument);
  EXPECT_THROW(make_schedule("zb", 2, 2), std::invalid_argument);
  // Virtual stages run only under the interleaved schedule (and evaluation's forward-only one).
  EXPECT_THROW(make_schedule("gpipe", 2, 4, 2), std::invalid_argument);
  EXPECT_THROW(make_schedule("1f1b", 2, 4, 2), std::invalid_argument);
  EXPECT_THROW(make_schedule("interleaved1f1b", 2, 3, 2), std::invalid_argument);
  EXPECT_THROW(make_schedule("forward", 2, 4, 0), std::invalid_argument);
  EXPECT_THROW(gpipe::make_schedule("forward", 2, 4), std::invalid_argument);  // the host's, not a plugin's
}

TEST(Schedule, ForwardOnlyWithChunksRunsEveryMicroBatchThroughEachChunkInTurn) {
  const Schedule s = weft::pipeline::forward_only_schedule(2, 2, 2);
  EXPECT_FALSE(s.trains);
  std::vector<std::string> compute;
  for (const auto& n : names(s.actions[1])) {
    if (n[0] == 'F' || n[0] == 'B') compute.push_back(n);
  }
  EXPECT_EQ(compute, (std::vector<std::string>{"F0", "F1", "F0.1", "F1.1"}));
  const auto last = names(s.actions[1]);
  EXPECT_NE(std::find(last.begin(), last.end(), "sA1"), last.end());     // chunk 0's output to stage 0's chunk 1
  EXPECT_EQ(std::find(last.begin(), last.end(), "sA1.1"), last.end());   // the last virtual stage sends nothing
}

}  // namespace

namespace {

// A schedule of compute actions only, as an ABI 2 plugin gives it ("weft_schedule").
Schedule compute_only(int32_t stages, int32_t micro_batches, int32_t chunks, std::vector<int32_t> chunk_stage,
                      std::vector<std::vector<Action>> lists) {
  Schedule s;
  s.name = "test";
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.chunks = chunks;
  s.chunk_stage = std::move(chunk_stage);
  s.max_in_flight = micro_batches * chunks;
  s.actions = std::move(lists);
  return s;
}

}  // namespace

// The V placement (2 stages x 2 chunks: stage 0 holds virtual stages 0 and 3, stage 1 holds 1 and
// 2): add_transfers sends between stages and hands over between stage 1's two chunks (2 <- 1), and
// the result verifies; its forward-only schedule walks each stage's chunks in virtual-stage order.
TEST(Schedule, TransfersAddedToAVShapedPlacementVerify) {
  const std::vector<int32_t> v{0, 3, 1, 2};
  using K = ActionKind;
  Schedule s = compute_only(2, 1, 2, v,
                            {{{K::kForward, 0, 0}, {K::kForward, 0, 1}, {K::kBackward, 0, 1}, {K::kBackward, 0, 0},
                              {K::kOptimizerStep, -1}},
                             {{K::kForward, 0, 0}, {K::kForward, 0, 1}, {K::kBackward, 0, 1}, {K::kBackward, 0, 0},
                              {K::kOptimizerStep, -1}}});
  weft::pipeline::add_transfers(s);
  // Each receive one compute before its consumer (the first ones at the start), each send right
  // after its producer.
  EXPECT_EQ(names(s.actions[0]), (std::vector<std::string>{"rA0.1", "F0", "sA0", "F0.1", "rG0", "B0.1", "sG0.1", "B0",
                                                           "step"}));
  EXPECT_EQ(names(s.actions[1]), (std::vector<std::string>{"rA0", "rA0.1", "F0", "sA0", "rG0.1", "F0.1", "sA0.1", "rG0",
                                                           "B0.1", "sG0.1", "B0", "sG0", "step"}));
  const auto verified = weft::pipeline::verify(s);
  EXPECT_TRUE(verified.ok) << verified.error << "\n" << weft::pipeline::to_string(s);
  EXPECT_EQ(weft::pipeline::locate(s, 3), (std::pair<int32_t, int32_t>{0, 1}));
  EXPECT_EQ(weft::pipeline::virtual_stage(s, 1, 1), 2);
  const Schedule eval = weft::pipeline::forward_only_schedule(2, 2, 2, v);
  EXPECT_TRUE(weft::pipeline::verify(eval).ok) << weft::pipeline::verify(eval).error;
  // A transfer written into the lists is the runtime's to add: refused.
  Schedule with_send = compute_only(2, 1, 1, {}, {{{K::kForward, 0}, {K::kSendActivation, 0}}, {{K::kForward, 0}}});
  EXPECT_THROW(weft::pipeline::add_transfers(with_send), std::invalid_argument);
}

// Where a stage consumes two items from one peer in another order than the peer sends them, the
// receive of the one sent first is posted before the first consumer: the order NCCL matches by.
TEST(Schedule, ReceivesArePostedInTheOrderTheirSendsStart) {
  using K = ActionKind;
  // Stage 0 forwards micro-batches 0 then 1; stage 1 forwards 1 first, then 0 (a legal order with
  // free sends: both activations are sent before stage 1 waits for either).
  Schedule s = compute_only(2, 2, 1, {},
                            {{{K::kForward, 0}, {K::kForward, 1}, {K::kBackward, 1}, {K::kBackward, 0}, {K::kOptimizerStep, -1}},
                             {{K::kForward, 1}, {K::kForward, 0}, {K::kBackward, 1}, {K::kBackward, 0}, {K::kOptimizerStep, -1}}});
  weft::pipeline::add_transfers(s);
  EXPECT_EQ(names(s.actions[1]), (std::vector<std::string>{"rA0", "rA1", "F1", "F0", "B1", "sG1", "B0", "sG0", "step"}));
  const auto verified = weft::pipeline::verify(s);
  EXPECT_TRUE(verified.ok) << verified.error;
}

TEST(Schedule, AChunkMapMustBeAPermutationOfTheVirtualStages) {
  EXPECT_EQ(weft::pipeline::check_chunk_map(2, 2, {}), "");
  EXPECT_EQ(weft::pipeline::check_chunk_map(2, 2, {0, 3, 1, 2}), "");
  EXPECT_EQ(weft::pipeline::check_chunk_map(2, 2, {0, 3, 1}), "the chunk map has 3 entries for 2 stages x 2 chunks");
  EXPECT_EQ(weft::pipeline::check_chunk_map(2, 2, {0, 3, 3, 2}),
            "chunk 0 of stage 1 is virtual stage 3, which another chunk is too");
  EXPECT_EQ(weft::pipeline::check_chunk_map(2, 2, {0, 4, 1, 2}), "chunk 1 of stage 0 is virtual stage 4, outside [0, 4)");
}

// Gradient reductions over replicas are actions of the schedule: one kReduce per chunk, after the
// action that makes the chunk's gradients final and the sends right after it (the neighbour waits
// for those, the reduction for no one). The verifier accepts them there and refuses one placed
// before a backward (or weight pass) that still adds to its chunk's gradients, or twice.
TEST(Schedule, ReductionsFollowEachChunksLastBackwardAndItsSends) {
  using K = ActionKind;
  Schedule s = one_f_one_b_schedule(2, 2);
  weft::pipeline::lower_reductions(s);
  EXPECT_EQ(names(s.actions[0]), (std::vector<std::string>{"F0", "sA0", "rG0", "F1", "sA1", "rG1", "B0", "B1", "R", "step"}))
      << weft::pipeline::to_string(s);
  EXPECT_EQ(names(s.actions[1]).back(), "step");
  EXPECT_EQ(names(s.actions[1])[names(s.actions[1]).size() - 2], "R");  // after B1 sG1
  EXPECT_EQ(names(s.actions[1])[names(s.actions[1]).size() - 3], "sG1");
  EXPECT_TRUE(weft::pipeline::verify(s).ok) << weft::pipeline::verify(s).error;
  EXPECT_THROW(weft::pipeline::lower_reductions(s), std::invalid_argument);  // lowered twice

  // Interleaved (2 chunks per stage) and ZB-H1 (after the last W): every shipped schedule verifies.
  for (const std::string name : {"gpipe", "1f1b", "interleaved1f1b", "zbh1"}) {
    Schedule t = make_schedule(name, 2, 4, name == "interleaved1f1b" ? 2 : 1);
    weft::pipeline::lower_reductions(t);
    const auto v = weft::pipeline::verify(t);
    EXPECT_TRUE(v.ok) << name << ": " << v.error;
    for (const auto& list : t.actions) {
      int reduces = 0;
      for (const auto& a : list) reduces += a.kind == K::kReduce;
      EXPECT_EQ(reduces, t.chunks) << name;
    }
  }
  Schedule zb = zero_bubble_h1_schedule(2, 2);
  weft::pipeline::lower_reductions(zb);
  const auto& last = zb.actions[0];
  ASSERT_GE(last.size(), 3u);
  EXPECT_EQ(weft::pipeline::to_string(last[last.size() - 3]), "W1");
  EXPECT_EQ(weft::pipeline::to_string(last[last.size() - 2]), "R");

  // A reduction before a backward of its chunk, or two of one chunk: refused by name.
  Schedule early = compute_only(1, 2, 1, {},
                                {{{K::kForward, 0}, {K::kBackward, 0}, {K::kReduce, -1}, {K::kForward, 1},
                                  {K::kBackward, 1}, {K::kOptimizerStep, -1}}});
  EXPECT_THAT(weft::pipeline::verify(early).error, ::testing::HasSubstr("stage 0 R comes before B1, which adds to the "
                                                                        "gradients it reduces"));
  Schedule twice = compute_only(1, 1, 1, {},
                                {{{K::kForward, 0}, {K::kBackward, 0}, {K::kReduce, -1}, {K::kReduce, -1},
                                  {K::kOptimizerStep, -1}}});
  EXPECT_THAT(weft::pipeline::verify(twice).error, ::testing::HasSubstr("stage 0 R appears twice"));
}
