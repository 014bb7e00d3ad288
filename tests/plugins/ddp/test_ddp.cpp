// ddp.so (plugins/ddp) run in-process against the fake host: its sources are compiled into
// this executable with the entry point renamed (this executable's weft_strategy_entry is the
// C++ test strategy's). The world is usually 2 ranks whose peer holds 3 in every element of
// every all_reduce, so averaged values are (local + 3) / 2 exactly.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "plugins/ddp/ddp_fake_host.h"

#define weft_strategy_entry ddp_entry
#include "../../../plugins/ddp/ddp.cpp"
#undef weft_strategy_entry

namespace {

using weft::ddp::BucketLayout;
using weft::ddp::Ddp;

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

std::vector<std::vector<int64_t>> parameters_of(const std::vector<BucketLayout>& buckets) {
  std::vector<std::vector<int64_t>> out;
  for (const BucketLayout& bucket : buckets) out.push_back(bucket.parameters);
  return out;
}
std::vector<std::vector<int64_t>> offsets_of(const std::vector<BucketLayout>& buckets) {
  std::vector<std::vector<int64_t>> out;
  for (const BucketLayout& bucket : buckets) out.push_back(bucket.offsets);
  return out;
}

weft_step_info step_info(int64_t step, int32_t micro_batches) {
  weft_step_info info{};
  info.struct_size = sizeof info;
  info.step = step;
  info.micro_batches = micro_batches;
  info.rows_per_micro_batch = 2;
  info.seq_len = 5;
  return info;
}

// A fake rank of a world of `world_size` with buckets of at most 3 floats (12 bytes):
//   0 embed (trainable, 2)  1 frozen (1)  2 mid (trainable, 1)  3 head (trainable, 1)
//   4 big (trainable, 5: larger than a bucket)
// Gradient added per backward, times the loss scale: embed {2, 4}, mid {6}, head {-8},
// big {1, 3, 5, 7, 9}.
struct DdpRank {
  explicit DdpRank(int32_t world_size = 2, bool mid_produces_grad = true) {
    fake.host.world = {world_size > 1 ? 1 : 0, world_size};
    fake.host.peer_value = 3.0;
    fake.floats["bucket_mb"] = 12.0 / kBytesPerMiB;
    fake.add_parameter("embed", true, {0.5f, 1.5f}, {2.0f, 4.0f});
    fake.add_parameter("frozen", false, {9.0f}, {0.0f});
    fake.add_parameter("mid", true, {2.5f}, {6.0f}, mid_produces_grad);
    fake.add_parameter("head", true, {3.5f}, {-8.0f});
    fake.add_parameter("big", true, {1, 2, 3, 4, 5}, {1, 3, 5, 7, 9});
  }
  ~DdpRank() {
    if (instance != nullptr) table->destroy(instance);
  }
  // create + setup; returns the status of the first that fails.
  std::pair<weft_status_code, std::string> start() {
    auto status = take_status(table->create(&fake.api, &fake.host, &instance));
    if (status.first != WEFT_STATUS_OK) return status;
    return take_status(table->setup(instance));
  }
  Ddp& ddp() { return *dynamic_cast<Ddp*>(reinterpret_cast<weft::sdk::Strategy*>(instance)); }
  void clear_grads() {
    for (size_t i = 0; i < fake.host.parameters.size(); ++i) {
      fake.host.parameters[i].grad.clear();
      fake.grad_defined[i] = false;
    }
  }

  DdpFakeHost fake;
  const weft_strategy_api* table = ddp_entry(WEFT_ABI_VERSION_MAJOR, WEFT_ABI_VERSION_MINOR);
  weft_strategy* instance = nullptr;
};

TEST(DdpBuckets, FillInReverseOrderUpToTheLimitAndGiveLargeParametersTheirOwn) {
  // Elements: p0 10, p1 3, p2 100, p3 2, p4 2; limit 5 floats.
  const auto buckets = weft::ddp::build_buckets({{0, 10}, {1, 3}, {2, 100}, {3, 2}, {4, 2}}, 20);
  EXPECT_EQ(parameters_of(buckets), (std::vector<std::vector<int64_t>>{{4, 3}, {2}, {1}, {0}}));
  EXPECT_EQ(offsets_of(buckets), (std::vector<std::vector<int64_t>>{{0, 2}, {0}, {0}, {0}}));
  EXPECT_EQ(buckets[0].elements, 4);
  EXPECT_EQ(buckets[1].elements, 100);
  // Exactly at the limit still fits.
  const auto exact = weft::ddp::build_buckets({{7, 3}, {8, 2}}, 20);
  EXPECT_EQ(parameters_of(exact), (std::vector<std::vector<int64_t>>{{8, 7}}));
  EXPECT_THROW(weft::ddp::build_buckets({{0, 1}}, 0), std::invalid_argument);
}

TEST(Ddp, RejectsANonPositiveBucketSizeNamingTheKey) {
  for (const double bad : {0.0, -1.0}) {
    DdpRank rank;
    rank.fake.floats["bucket_mb"] = bad;
    const auto status = rank.start();
    EXPECT_EQ(status.first, WEFT_STATUS_BAD_CONFIG);
    EXPECT_EQ(status.second.rfind("plugin.bucket_mb must be > 0", 0), 0u) << status.second;
    EXPECT_EQ(rank.instance, nullptr);
  }
  DdpRank rank;
  rank.fake.host.ints["log_every"] = -2;
  const auto status = rank.start();
  EXPECT_EQ(status.first, WEFT_STATUS_BAD_CONFIG);
  EXPECT_EQ(status.second, "plugin.log_every must be >= 0, got -2");
}

TEST(Ddp, DefaultsTo25MiBBuckets) {
  DdpRank rank;
  rank.fake.floats.clear();
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  EXPECT_DOUBLE_EQ(rank.ddp().bucket_mb(), 25.0);
  EXPECT_EQ(parameters_of(rank.ddp().bucket_layouts()),
            (std::vector<std::vector<int64_t>>{{4, 3, 2, 0}}));
}

TEST(Ddp, PlansEveryStageOnEveryRankWithTheWorldAsDataParallelGroup) {
  DdpRank rank(3);
  ASSERT_EQ(take_status(rank.table->create(&rank.fake.api, &rank.fake.host, &rank.instance)).first,
            WEFT_STATUS_OK);
  weft_model_plan plan{};
  plan.struct_size = sizeof plan;
  plan.first_stage = 0;
  plan.last_stage = 4;
  ASSERT_EQ(take_status(rank.table->plan(rank.instance, &plan)).first, WEFT_STATUS_OK);
  EXPECT_EQ(plan.first_stage, 0);
  EXPECT_EQ(plan.last_stage, 4);
  EXPECT_EQ(plan.data_parallel_size, 3);
  EXPECT_EQ(plan.data_parallel_rank, 1);
}

TEST(Ddp, SetupBroadcastsEveryParameterFromRankZeroAndBucketsTheTrainableOnes) {
  DdpRank rank;
  const auto status = rank.start();
  ASSERT_EQ(status.first, WEFT_STATUS_OK) << status.second;
  EXPECT_EQ(rank.fake.broadcast_parameters, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(rank.fake.broadcast_roots, (std::vector<int32_t>{0, 0, 0, 0, 0}));
  EXPECT_TRUE(rank.fake.host.live_works.empty());  // every broadcast waited for and released
  const auto buckets = rank.ddp().bucket_layouts();
  EXPECT_EQ(parameters_of(buckets), (std::vector<std::vector<int64_t>>{{4}, {3, 2}, {0}}));
  EXPECT_EQ(offsets_of(buckets), (std::vector<std::vector<int64_t>>{{0}, {0, 1}, {0}}));
  EXPECT_NE(rank.fake.callback, nullptr);
  rank.table->destroy(rank.instance);
  rank.instance = nullptr;
  EXPECT_EQ(rank.fake.callback, nullptr);  // unregistered on destroy
}

TEST(Ddp, AveragesGradientsOnlyInTheLastMicroBatchAndTheLossOverTheWorld) {
  DdpRank rank;
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  for (int64_t step = 0; step < 2; ++step) {  // the second step checks the state is reset
    rank.clear_grads();
    rank.fake.all_reduce_log.clear();
    rank.fake.backward_calls = 0;
    rank.fake.host.loss_calls = 0;
    double loss = -1.0;
    const weft_step_info info = step_info(step, 4);
    const auto status = take_status(rank.table->train_step(rank.instance, &info, &loss));
    ASSERT_EQ(status.first, WEFT_STATUS_OK) << status.second;

    // Bucket all-reduces all come from inside the 4th (last) backward, in bucket order; the
    // loss follows after it.
    const auto& log = rank.fake.all_reduce_log;
    ASSERT_EQ(log.size(), 4u);
    const std::vector<int64_t> elements{5, 2, 2};
    for (size_t b = 0; b < 3; ++b) {
      EXPECT_EQ(log[b].elements, elements[b]);
      EXPECT_TRUE(log[b].in_backward);
      EXPECT_EQ(log[b].backward_calls, 4);
    }
    EXPECT_EQ(log[3].elements, 1);
    EXPECT_FALSE(log[3].in_backward);

    // Local gradient g (4 micro-batches x 0.25 g), the peer's 3: (g + 3) / 2.
    const auto& p = rank.fake.host.parameters;
    EXPECT_EQ(p[0].grad, (std::vector<float>{2.5f, 3.5f}));
    EXPECT_TRUE(p[1].grad.empty());  // frozen: no gradient, never touched
    EXPECT_EQ(p[2].grad, (std::vector<float>{4.5f}));
    EXPECT_EQ(p[3].grad, (std::vector<float>{-2.5f}));
    EXPECT_EQ(p[4].grad, (std::vector<float>{2.0f, 3.0f, 4.0f, 5.0f, 6.0f}));
    // Local losses 1 + 2 + 3 + 4, the peer's sum 3: 13 / (4 micro-batches x 2 ranks).
    EXPECT_DOUBLE_EQ(loss, 13.0 / 8.0);

    const weft::ddp::StepStats& stats = rank.ddp().last_step_stats();
    EXPECT_EQ(stats.step, step);
    EXPECT_EQ(stats.all_reduces, 4);
    EXPECT_EQ(stats.bytes_all_reduced, 9 * 4 + 8);
    EXPECT_EQ(stats.buckets_in_backward, 3);
    EXPECT_EQ(stats.missing_grads, 0);
    EXPECT_GE(stats.wait_seconds, 0.0);
  }
  EXPECT_EQ(rank.fake.host.loss_scales, std::vector<double>(8, 0.25));
  EXPECT_TRUE(rank.fake.host.live_activations.empty());
  EXPECT_TRUE(rank.fake.host.live_works.empty());
  EXPECT_EQ(rank.fake.host.double_releases, 0);
}

TEST(Ddp, ParametersWithoutAGradientCountAsZerosAndDelayLaterBuckets) {
  DdpRank rank(2, /*mid_produces_grad=*/false);
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  double loss = -1.0;
  const weft_step_info info = step_info(0, 1);
  const auto status = take_status(rank.table->train_step(rank.instance, &info, &loss));
  ASSERT_EQ(status.first, WEFT_STATUS_OK) << status.second;
  // Bucket {big} completes in backward; {head, mid} never does, so it and the bucket after it
  // ({embed}, complete but later in order) start after backward.
  const auto& log = rank.fake.all_reduce_log;
  ASSERT_EQ(log.size(), 4u);
  EXPECT_TRUE(log[0].in_backward);
  EXPECT_FALSE(log[1].in_backward);
  EXPECT_FALSE(log[2].in_backward);
  EXPECT_EQ(rank.ddp().last_step_stats().missing_grads, 1);
  EXPECT_EQ(rank.ddp().last_step_stats().buckets_in_backward, 1);
  const auto& p = rank.fake.host.parameters;
  EXPECT_EQ(p[0].grad, (std::vector<float>{2.5f, 3.5f}));
  EXPECT_EQ(p[3].grad, (std::vector<float>{-2.5f}));
  EXPECT_TRUE(p[2].grad.empty());
  ASSERT_FALSE(rank.fake.host.logs.empty());
  EXPECT_EQ(rank.fake.host.logs.back().first, WEFT_LOG_WARN);
  EXPECT_EQ(rank.fake.host.logs.back().second, "ddp: parameter 2 has no gradient to receive the average");
}

TEST(Ddp, OneRankLeavesGradientsAndLossExact) {
  DdpRank rank(1);
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  double loss = -1.0;
  const weft_step_info info = step_info(0, 2);
  ASSERT_EQ(take_status(rank.table->train_step(rank.instance, &info, &loss)).first, WEFT_STATUS_OK);
  const auto& p = rank.fake.host.parameters;
  EXPECT_EQ(p[0].grad, (std::vector<float>{2.0f, 4.0f}));
  EXPECT_EQ(p[2].grad, (std::vector<float>{6.0f}));
  EXPECT_EQ(p[3].grad, (std::vector<float>{-8.0f}));
  EXPECT_EQ(p[4].grad, (std::vector<float>{1.0f, 3.0f, 5.0f, 7.0f, 9.0f}));
  EXPECT_DOUBLE_EQ(loss, 1.5);  // (1 + 2) / 2
}

TEST(Ddp, ACollectiveThatFailsInTheCallbackFailsTheStep) {
  DdpRank rank;
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  rank.fake.fail_all_reduce = true;
  double loss = -1.0;
  const weft_step_info info = step_info(0, 2);
  const auto status = take_status(rank.table->train_step(rank.instance, &info, &loss));
  EXPECT_EQ(status.first, WEFT_STATUS_COMMUNICATION);
  EXPECT_EQ(status.second, "fake: link down");
  EXPECT_EQ(loss, -1.0);
  EXPECT_TRUE(rank.fake.host.live_activations.empty());
  EXPECT_TRUE(rank.fake.host.live_works.empty());
  // The next step runs normally.
  rank.fake.fail_all_reduce = false;
  rank.clear_grads();
  const auto again = take_status(rank.table->train_step(rank.instance, &info, &loss));
  ASSERT_EQ(again.first, WEFT_STATUS_OK) << again.second;
  EXPECT_EQ(rank.fake.host.parameters[3].grad, (std::vector<float>{-2.5f}));
}

TEST(Ddp, EvalSumsLossAndTokensOverTheWorld) {
  DdpRank rank;
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  double sum = -1.0;
  int64_t tokens = -1;
  const weft_step_info info = step_info(0, 1);
  ASSERT_EQ(take_status(rank.table->eval_step(rank.instance, &info, &sum, &tokens)).first,
            WEFT_STATUS_OK);
  // Local loss 1 over 10 tokens; the peer adds 3 to both sums.
  EXPECT_DOUBLE_EQ(sum, 13.0);
  EXPECT_EQ(tokens, 13);
  EXPECT_EQ(rank.fake.host.forward_flags, (std::vector<uint32_t>{WEFT_FORWARD_NO_GRAD}));
  EXPECT_EQ(rank.fake.host.loss_scales, (std::vector<double>{1.0}));
  EXPECT_TRUE(rank.fake.host.live_activations.empty());
}

TEST(Ddp, EvalWithNoRowsRunsNoForwardButJoinsTheReduction) {
  DdpRank rank;
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  rank.fake.eval_rows = 0;
  double sum = -1.0;
  int64_t tokens = -1;
  const weft_step_info info = step_info(0, 1);
  ASSERT_EQ(take_status(rank.table->eval_step(rank.instance, &info, &sum, &tokens)).first,
            WEFT_STATUS_OK);
  EXPECT_TRUE(rank.fake.host.forward_flags.empty());
  EXPECT_EQ(rank.fake.host.loss_calls, 0);
  ASSERT_EQ(rank.fake.all_reduce_log.size(), 1u);
  EXPECT_EQ(rank.fake.all_reduce_log[0].elements, 2);
  EXPECT_DOUBLE_EQ(sum, 3.0);  // the peer's only
  EXPECT_EQ(tokens, 3);
  EXPECT_TRUE(rank.fake.host.live_activations.empty());
}

TEST(Ddp, LogsTheStepCountersEveryLogEverySteps) {
  DdpRank rank;
  rank.fake.host.ints["log_every"] = 2;
  ASSERT_EQ(rank.start().first, WEFT_STATUS_OK);
  double loss = -1.0;
  int debug_lines = 0;
  for (int64_t step = 0; step < 4; ++step) {
    rank.clear_grads();
    const weft_step_info info = step_info(step, 1);
    ASSERT_EQ(take_status(rank.table->train_step(rank.instance, &info, &loss)).first, WEFT_STATUS_OK);
  }
  for (const auto& line : rank.fake.host.logs) {
    if (line.second.rfind("ddp step ", 0) == 0) {
      ++debug_lines;
      EXPECT_EQ(line.first, WEFT_LOG_DEBUG);
      EXPECT_NE(line.second.find("all-reduced 44 bytes in 4 calls"), std::string::npos) << line.second;
    }
  }
  EXPECT_EQ(debug_lines, 2);  // steps 1 and 3
}

}  // namespace
