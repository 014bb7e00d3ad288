// DiLoCo (sdk/examples/diloco/diloco.c), the out-of-tree ABI 2 strategy written against the installed
// SDK alone, on several real ranks: its workers' parameters drift apart between outer steps and are
// equal again after each; a rank sends 1/H of the bytes ddp's sends; its outer state survives
// a checkpoint; bad settings are refused before the first step. Its one-worker conformance against single: Conformance.diloco and
// Sdk.ExamplesBuildAndConform.
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

// The tiny preset on the bundled corpus with the in-tree build of the example, `settings` added.
std::string diloco_run(const std::string& settings) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + WEFT_SOURCE_DIR +
         "/data/austen/austen.jsonl --set data.cache_dir= --set log.progress=off --set eval.every_steps=0 " + settings;
}
const std::string kDiloco = std::string(WEFT_PLUGIN_FIXTURE_DIR) + "/diloco.so";

std::vector<nlohmann::json> step_records(const std::string& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto record = nlohmann::json::parse(line);
    if (record["type"] == "step") out.push_back(std::move(record));
  }
  return out;
}

// H = 3 on 2 ranks with the plugin's replica check: after steps 3, 6 and 9 every element is the same
// on both workers (spread 0), after the others the workers' own AdamW steps have moved them apart
// (spread > 0, so the check can fail); the outer steps come at exactly those steps.
TEST(Diloco, WorkersDriftApartBetweenOuterStepsAndAgreeAfterEach) {
  const std::string dir = weft::testing::fresh_dir("weft_test_diloco", "replicas");
  const auto r = weft::testing::run_trainer(diloco_run("--nproc 2 --set train.max_steps=9 --plugin " + kDiloco +
                                                       " --set plugin.inner_steps=3 --set plugin.check_replicas=true "
                                                       "--set train.out_dir=" + dir + "/out"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("strategy: diloco 0.1.0 (ABI 2.5)"));
  const auto steps = step_records(dir + "/out/metrics.jsonl");
  ASSERT_EQ(steps.size(), 9u);
  for (const auto& s : steps) {
    const int64_t step = s["step"].get<int64_t>();
    const bool outer = step % 3 == 0;
    EXPECT_EQ(s["plugin.outer_step"].get<double>(), outer ? 1.0 : 0.0) << s;
    if (outer) {
      EXPECT_EQ(s["plugin.replica_spread"].get<double>(), 0.0) << s;
      EXPECT_GT(s["plugin.outer_gradient_norm"].get<double>(), 0.0) << s;
    } else {
      EXPECT_GT(s["plugin.replica_spread"].get<double>(), 1e-6) << s;
    }
  }
}

// The same job under ddp and under DiLoCo with H = 4, 8 steps on 2 ranks: a DiLoCo rank sends the
// trainable parameters once per 4 steps (and each step's 8-byte loss sum), a ddp rank their gradients
// every step: a quarter of the bytes.
TEST(Diloco, ARankSendsOneHthOfTheBytesDdpSends) {
  const std::string dir = weft::testing::fresh_dir("weft_test_diloco", "bytes");
  const std::string run = diloco_run("--nproc 2 --set train.max_steps=8");
  const auto ddp = weft::testing::run_trainer(run + " --plugin ddp --set train.out_dir=" + dir + "/ddp");
  const auto diloco = weft::testing::run_trainer(run + " --plugin " + kDiloco + " --set plugin.inner_steps=4 " +
                                                 "--set train.out_dir=" + dir + "/diloco");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  ASSERT_EQ(diloco.exit_code, 0) << diloco.output;
  const auto bytes = [](const std::vector<nlohmann::json>& steps) {
    double sum = 0;
    for (const auto& s : steps) sum += s["comm_bytes"].get<double>();
    return sum;
  };
  const auto a = step_records(dir + "/ddp/metrics.jsonl"), b = step_records(dir + "/diloco/metrics.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  EXPECT_GT(bytes(a), 8 * 100000.0);  // the tiny model's gradients, every step
  EXPECT_NEAR(bytes(b) / bytes(a), 0.25, 0.001) << bytes(b) << " / " << bytes(a);
  for (const auto& s : b) {
    if (s["step"].get<int64_t>() % 4 != 0) {
      EXPECT_LE(s["comm_bytes"].get<double>(), 64.0) << s;
    }
  }
}

// The anchor and the outer momentum are state the host keeps for the plugin: a checkpoint of step 4
// (H = 2, momentum 0.9, one worker) carries them, and the resumed run's steps 5-8 give the
// uninterrupted run's losses to the bit (steps 7 and 8 follow the outer step at 6, which uses the
// momentum). A checkpoint ddp wrote has no such state: DiLoCo resumes it with a new anchor.
TEST(Diloco, ACheckpointCarriesTheOuterStateAndOneWorkerResumesExactly) {
  const std::string dir = weft::testing::fresh_dir("weft_test_diloco", "resume");
  const std::string run = diloco_run("--set train.max_steps=8 --set checkpoint.every_steps=2 --set checkpoint.keep_last=4");
  const std::string plugin = " --plugin " + kDiloco + " --set plugin.inner_steps=2";
  const auto whole = weft::testing::run_trainer(run + plugin + " --set train.out_dir=" + dir + "/whole");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string checkpoint = dir + "/whole/checkpoints/step-00000004";
  EXPECT_TRUE(std::filesystem::exists(checkpoint + "/plugin_state.safetensors"));
  const auto resumed = weft::testing::run_trainer(run + plugin + " --set train.out_dir=" + dir +
                                                  "/resumed --set checkpoint.resume=" + checkpoint);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto a = weft::testing::step_losses(dir + "/whole/metrics.jsonl");
  const auto b = weft::testing::step_losses(dir + "/resumed/metrics.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i], a[i + 4]) << "step " << i + 5;

  const auto ddp = weft::testing::run_trainer(run + " --plugin ddp --set train.max_steps=2 --set train.out_dir=" +
                                              dir + "/ddp");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  const auto switched = weft::testing::run_trainer(run + plugin + " --set train.out_dir=" + dir +
                                                   "/switched --set checkpoint.resume=" + dir +
                                                   "/ddp/checkpoints/step-00000002");
  ASSERT_EQ(switched.exit_code, 0) << switched.output;
  EXPECT_EQ(weft::testing::step_losses(dir + "/switched/metrics.jsonl").size(), 6u);
}

// Between outer steps each worker's parameters and AdamW state are its own (LOCAL): a checkpoint of
// step 3 (H = 4, 2 workers, mid-way to the outer step at 4) keeps every rank's (local/), and the
// resumed run's steps 4-8 give the uninterrupted run's losses and replica spreads to the bit (each
// step's loss is the mean of both workers', so a worker resumed from another's state would show). On
// another number of workers they resume from rank 0's, said in one line.
TEST(Diloco, ACheckpointKeepsEveryWorkersOwnStateAndTwoWorkersResumeExactly) {
  const std::string dir = weft::testing::fresh_dir("weft_test_diloco", "local");
  const std::string run = diloco_run("--nproc 2 --set train.max_steps=8 --set checkpoint.every_steps=3 --plugin " + kDiloco +
                                     " --set plugin.inner_steps=4 --set plugin.check_replicas=true");
  const auto whole = weft::testing::run_trainer(run + " --set train.out_dir=" + dir + "/whole");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const std::string checkpoint = dir + "/whole/checkpoints/step-00000003";
  for (const char* file : {"index.json", "rank-00000.safetensors", "rank-00001.safetensors", "rank-00001.generators.pt"}) {
    EXPECT_TRUE(std::filesystem::exists(checkpoint + "/local/" + file)) << file;
  }
  const auto resumed = weft::testing::run_trainer(run + " --set train.out_dir=" + dir + "/resumed --set checkpoint.resume=" +
                                                  checkpoint);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_THAT(resumed.output, ::testing::Not(HasSubstr("resumes them from rank 0's")));
  const auto a = step_records(dir + "/whole/metrics.jsonl");
  const auto b = step_records(dir + "/resumed/metrics.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 5u);
  EXPECT_GT(a[2]["plugin.replica_spread"].get<double>(), 0.0);  // the workers differ at the checkpoint
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i]["loss"].get<double>(), a[i + 3]["loss"].get<double>()) << "step " << i + 4;
    EXPECT_EQ(b[i]["plugin.replica_spread"].get<double>(), a[i + 3]["plugin.replica_spread"].get<double>())
        << "step " << i + 4;
  }
  const auto three = weft::testing::run_trainer(diloco_run("--nproc 4 --set train.max_steps=5 --plugin " + kDiloco +
                                                           " --set plugin.inner_steps=4 --set train.out_dir=" + dir +
                                                           "/three --set checkpoint.resume=" + checkpoint));
  ASSERT_EQ(three.exit_code, 0) << three.output;
  EXPECT_THAT(three.output, HasSubstr("but the checkpoint holds the own state of 2 ranks, this run has 4: every rank "
                                      "resumes them from rank 0's"));
}

TEST(Diloco, BadSettingsAreRefusedBeforeTheFirstStep) {
  const std::string dir = weft::testing::fresh_dir("weft_test_diloco", "bad");
  struct Case {
    std::string setting, expected;
  };
  const std::vector<Case> cases{
      {"plugin.inner_steps=0", "plugin.inner_steps must be >= 1, got 0"},
      {"plugin.outer_lr=0", "plugin.outer_lr must be > 0, got 0"},
      {"plugin.outer_momentum=1", "plugin.outer_momentum must be in [0, 1), got 1"},
      {"plugin.inner_steps=2.5", "create: config key 'plugin.inner_steps' must be an integer"},
  };
  for (const Case& c : cases) {
    std::filesystem::remove_all(dir + "/out");
    const auto r = weft::testing::run_trainer(diloco_run("--nproc 2 --set train.max_steps=2 --plugin " + kDiloco +
                                                         " --set train.out_dir=" + dir + "/out --set " + c.setting));
    EXPECT_EQ(r.exit_code, 1) << c.setting << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.expected)) << c.setting;
    EXPECT_TRUE(weft::testing::step_losses(dir + "/out/metrics.jsonl").empty()) << c.setting << ": a step ran";
  }
}

}  // namespace
