// HSDP (sdk/examples/hsdp/hsdp.c), the out-of-tree ABI 2 strategy written against the installed SDK
// alone: on 4 ranks in 2 groups of 2, a rank holds half of the parameters, gradients and optimizer
// state (ZeRO-3 over all 4: a quarter; ddp: all), trains as ZeRO-3 does within fp32 rounding, and
// a checkpoint resumes exactly; a group size that does not divide the ranks is refused. Its
// conformance against single: Conformance.hsdp.* and Sdk.ExamplesBuildAndConform.
#include <filesystem>
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

using ::testing::HasSubstr;

std::string hsdp_run(const std::string& settings) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + WEFT_SOURCE_DIR +
         "/data/austen/austen.jsonl --set data.cache_dir= --set log.progress=off --set eval.every_steps=0 " + settings;
}
const std::string kHsdp = std::string(WEFT_PLUGIN_FIXTURE_DIR) + "/hsdp.so";

TEST(Hsdp, ARankHoldsItsGroupsShareAndACheckpointResumesExactly) {
  const std::string dir = weft::testing::fresh_dir("weft_test_hsdp", "groups");
  const std::string run = hsdp_run("--nproc 4 --set train.batch_size=8 --set train.max_steps=6 "
                                   "--set checkpoint.every_steps=3 --set plugin.bucket_mb=0.05");
  const auto hsdp = weft::testing::run_trainer(run + " --plugin " + kHsdp + " --set plugin.shard_group=2 " +
                                               "--set train.out_dir=" + dir + "/hsdp");
  const auto zero = weft::testing::run_trainer(run + " --plugin zero --set plugin.stage=3 --set train.out_dir=" +
                                               dir + "/zero");
  ASSERT_EQ(hsdp.exit_code, 0) << hsdp.output;
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  const auto a = weft::testing::step_losses(dir + "/hsdp/metrics.jsonl");
  const auto b = weft::testing::step_losses(dir + "/zero/metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-5 * b[i]) << "step " << i + 1;
  for (const char* part : {"parameters", "gradients", "optimizer"}) {
    const auto half = weft::testing::state_mib_per_rank(dir + "/hsdp/metrics.jsonl", part);
    const auto quarter = weft::testing::state_mib_per_rank(dir + "/zero/metrics.jsonl", part);
    ASSERT_EQ(half.size(), 4u) << part;
    ASSERT_EQ(quarter.size(), 4u) << part;
    for (int r = 0; r < 4; ++r) EXPECT_NEAR(half[r], 2 * quarter[r], 0.02 * half[r]) << part << ", rank " << r;
  }
  const auto resumed = weft::testing::run_trainer(run + " --plugin " + kHsdp + " --set plugin.shard_group=2 " +
                                                  "--set train.out_dir=" + dir + "/resumed --set checkpoint.resume=" +
                                                  dir + "/hsdp/checkpoints/step-00000003");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto c = weft::testing::step_losses(dir + "/resumed/metrics.jsonl");
  ASSERT_EQ(c.size(), 3u);
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(c[i], a[i + 3]) << "step " << i + 4;
}

TEST(Hsdp, AGroupSizeThatDoesNotDivideTheRanksIsRefusedBeforeTheFirstStep) {
  const std::string dir = weft::testing::fresh_dir("weft_test_hsdp", "bad");
  const auto r = weft::testing::run_trainer(hsdp_run("--nproc 4 --set train.batch_size=8 --set train.max_steps=2 --plugin " +
                                                     kHsdp + " --set plugin.shard_group=3 --set train.out_dir=" + dir +
                                                     "/out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("plugin.shard_group must be >= 1 and divide the 4 ranks (groups of equal size), got 3"));
  EXPECT_TRUE(weft::testing::step_losses(dir + "/out/metrics.jsonl").empty());
}

}  // namespace
