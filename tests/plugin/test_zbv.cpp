// ZB-V (sdk/examples/zbv/zbv.c), the out-of-tree ABI 2 pipeline schedule shipped as data: a V-shaped
// placement of two chunks per rank and each rank's list of F, B and W actions; the host partitions,
// adds the transfers, verifies and runs it. On 2 ranks it trains as 1F1B does (pipedream.so) within
// fp32 rounding, its simulated bubble is under half of 1F1B's at the same micro-batches and its
// activations in flight stay within 1F1B's peak (2 S chunks of half a stage); a checkpoint resumes
// to the bit, on 2 ranks and resharded to 1 (both chunks on one rank: transfers kept in memory).
// A schedule that deadlocks is refused before the first step (test_abi2.cpp's refusals). Its
// conformance against single: Conformance.zbv.* and Sdk.ExamplesBuildAndConform.
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/metrics.h"
#include "common/process.h"
#include "test_paths.h"

namespace {

std::string zbv_run(const std::string& settings) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + WEFT_SOURCE_DIR +
         "/data/austen/austen.jsonl --set data.cache_dir= --set log.progress=off --set eval.every_steps=0 " + settings;
}
const std::string kZbv = std::string(WEFT_PLUGIN_FIXTURE_DIR) + "/zbv.so";

// The last step record's metrics (plugin.* and the rest) and the summary's held-out loss.
struct Last {
  nlohmann::json step, summary;
};
Last last_records(const std::string& metrics) {
  Last last;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record["type"] == "step") last.step = record;
    if (record["type"] == "summary") last.summary = record;
  }
  return last;
}

TEST(Zbv, TrainsAs1F1BWithUnderHalfItsSimulatedBubbleAndAtMostItsActivations) {
  const std::string dir = weft::testing::fresh_dir("weft_test_zbv", "vs_1f1b");
  const std::string run = zbv_run("--nproc 2 --set train.max_steps=4 --set plugin.microbatches=4");
  const auto zbv = weft::testing::run_trainer(run + " --plugin " + kZbv + " --set train.out_dir=" + dir + "/zbv");
  const auto f1b = weft::testing::run_trainer(run + " --plugin pipedream --set train.out_dir=" + dir + "/1f1b");
  ASSERT_EQ(zbv.exit_code, 0) << zbv.output;
  ASSERT_EQ(f1b.exit_code, 0) << f1b.output;
  const auto a = weft::testing::step_losses(dir + "/zbv/metrics.jsonl");
  const auto b = weft::testing::step_losses(dir + "/1f1b/metrics.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * b[i]) << "step " << i + 1;
  const Last v = last_records(dir + "/zbv/metrics.jsonl"), one = last_records(dir + "/1f1b/metrics.jsonl");
  // 1F1B's formula at S = 2, M = 4: (S - 1) / (M + S - 1) = 0.2; the verifier's simulation of the V.
  EXPECT_NEAR(one.step["plugin.bubble_formula"].get<double>(), 0.2, 1e-12);
  EXPECT_LT(v.step["plugin.bubble_formula"].get<double>(), 0.1);
  // Rank 0's most chunk activations in flight: at most 2 S = 4 chunks of half a stage, 1F1B's S
  // micro-batches of a whole stage.
  EXPECT_LE(v.step["plugin.peak_in_flight"].get<double>(), 4.0);
  EXPECT_EQ(one.step["plugin.peak_in_flight"].get<double>(), 2.0);
  // Evaluation runs the V forward-only: the same held-out loss.
  EXPECT_NEAR(v.summary["eval_loss"].get<double>(), one.summary["eval_loss"].get<double>(), 1e-5);
}

TEST(Zbv, ACheckpointResumesToTheBitOnTwoRanksAndOnOne) {
  const std::string dir = weft::testing::fresh_dir("weft_test_zbv", "resume");
  const std::string run = zbv_run("--set train.max_steps=4 --plugin " + kZbv);
  const auto whole = weft::testing::run_trainer(run + " --nproc 2 --set checkpoint.every_steps=2 --set train.out_dir=" +
                                                dir + "/whole");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto a = weft::testing::step_losses(dir + "/whole/metrics.jsonl");
  ASSERT_EQ(a.size(), 4u);
  for (const char* ranks : {"2", "1"}) {
    const std::string out = dir + "/resumed" + ranks;
    const auto resumed = weft::testing::run_trainer(run + " --nproc " + ranks + " --set train.out_dir=" + out +
                                                    " --set checkpoint.resume=" + dir + "/whole/checkpoints/step-00000002");
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const auto c = weft::testing::step_losses(out + "/metrics.jsonl");
    ASSERT_EQ(c.size(), 2u) << ranks;
    for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], a[i + 2]) << ranks << " ranks, step " << i + 3;
  }
}

}  // namespace
