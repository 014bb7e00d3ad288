// ddp.so against the one-process reference, with real processes (trainer --nproc N over Gloo on
// 127.0.0.1): per-step losses within 1e-5 relative over 20 fp32 steps and final parameters within
// 1e-5, for 2 and 3 ranks, with gradient accumulation and with LoRA; and how the launcher ends a run
// when a rank dies or hangs.
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/util/torch_compat.h"
#include "common/corpus.h"
#include "common/process.h"
#include "dist/signal_run.h"
#include "test_paths.h"

namespace {

using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_dist", name); }

std::string write_corpus(const std::string& dir) { return weft::testing::write_word_corpus(dir); }

std::vector<double> step_losses(const std::string& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") out.push_back(j["loss"].get<double>());
  }
  return out;
}

// Trains the tiny preset for 20 fp32 steps with `extra` settings under `plugin` on `nproc`
// processes (0 = the built-in one-process step); returns the run directory.
std::string train(const std::string& dir, const std::string& name, const std::string& corpus, int nproc,
                  const std::string& extra) {
  const std::string out = dir + "/" + name;
  std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + corpus +
                     " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32 --set train.batch_size=6"
                     " --set train.max_steps=20 --set train.epochs=3 --set train.precision=fp32 --set log.progress=off"
                     " --set train.out_dir=" + out + " " + extra;
  if (nproc > 0) args += " --plugin ddp --nproc " + std::to_string(nproc);
  const auto r = run_trainer(args);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return out;
}

void expect_parity(const std::string& name, int nproc, const std::string& extra, const std::string& weights_file) {
  const auto dir = fresh_dir(name);
  const auto corpus = write_corpus(dir);
  const auto reference = train(dir, "reference", corpus, 0, extra);
  const auto ddp = train(dir, "ddp", corpus, nproc, extra);
  const auto a = step_losses(reference + "/metrics.jsonl");
  const auto b = step_losses(ddp + "/metrics.jsonl");
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
  auto ra = weft::SafetensorsFile::open(reference + "/final/" + weights_file);
  auto rb = weft::SafetensorsFile::open(ddp + "/final/" + weights_file);
  ASSERT_EQ(ra->tensors().size(), rb->tensors().size());
  double worst = 0;
  for (const auto& info : ra->tensors()) {
    worst = std::max(worst, (ra->load(info.name) - rb->load(info.name)).abs().max().item<double>());
  }
  EXPECT_LT(worst, 1e-5);
}

TEST(Ddp, TwoRanksMatchOneProcess) { expect_parity("r2", 2, "", "model.safetensors"); }

TEST(Ddp, HostMeasuresTheStepsCommunication) {
  const auto dir = fresh_dir("comm");
  const auto corpus = write_corpus(dir);
  const auto run = train(dir, "ddp", corpus, 2, "--set train.max_steps=3");
  auto weights = weft::SafetensorsFile::open(run + "/final/model.safetensors");
  int64_t parameters = 0;
  for (const auto& info : weights->tensors()) parameters += weights->load(info.name).numel();
  // Per step: every fp32 gradient all-reduced once, plus the step's loss (one double).
  std::ifstream in(run + "/metrics.jsonl");
  std::string line;
  int steps = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") {
      ++steps;
      EXPECT_EQ(j["comm_bytes"].get<int64_t>(), 4 * parameters + 8) << line;
      EXPECT_GE(j["comm_wait_s"].get<double>(), 0.0) << line;
      EXPECT_LT(j["comm_wait_s"].get<double>(), j["step_time_s"].get<double>()) << line;
    } else if (j["type"] == "summary") {
      EXPECT_EQ(j["comm_bytes_per_step"].get<double>(), static_cast<double>(4 * parameters + 8)) << line;
      EXPECT_GT(j["comm_wait_fraction"].get<double>(), 0.0) << line;
      EXPECT_LT(j["comm_wait_fraction"].get<double>(), 1.0) << line;
      // What the run was built on, for comparing runs: the LibTorch and the attention kernel.
      EXPECT_EQ(j["libtorch"], weft::compat::libtorch_version()) << line;
      EXPECT_EQ(j["attention"], weft::compat::kHasScaledDotProductAttention ? "sdpa" : "weft") << line;
    }
  }
  EXPECT_EQ(steps, 3);
}
TEST(Ddp, ThreeRanksMatchOneProcess) { expect_parity("r3", 3, "", "model.safetensors"); }
TEST(Ddp, GradientAccumulationMatchesOneProcess) {
  expect_parity("accum", 2, "--set train.grad_accum_steps=2", "model.safetensors");
}
TEST(Ddp, LoraMatchesOneProcess) {
  expect_parity("lora", 2, "--set train.mode=lora --set lora.dropout=0 --set train.lr=1e-2",
                "adapter_model.safetensors");
}

TEST(Launcher, AKilledRankStopsTheRunWithItsRankAndStatus) {
  // Rank 1 dies once training starts; the launcher must stop rank 0 and name rank 1.
  const auto run = weft::testing::signal_a_rank("kill", "KILL", "");
  EXPECT_NE(run.status, "0") << run.log;
  EXPECT_NE(run.log.find("rank 1 failed (signal"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("stopping the other ranks"), std::string::npos) << run.log;
}

TEST(Launcher, AHungRankIsNamedAndTheRunEndsWithinTheTimeout) {
  // Rank 1 is stopped (SIGSTOP: alive, connections open, never joins the next all-reduce). Rank 0
  // must give up after train.collective_timeout_s naming the operation, the setting and rank 1
  // (it asks the store who reached the all-reduce); the launcher must name rank 1 too (not the
  // healthy rank that noticed), kill the stopped rank at once, and end the run within the timeout
  // plus a small margin (it took the timeout plus a fixed 10 s grace before).
  const auto run = weft::testing::signal_a_rank("hang", "STOP", "--set train.collective_timeout_s=3");
  EXPECT_NE(run.status, "0") << run.log;
  EXPECT_NE(run.log.find("timed out after 3 s (train.collective_timeout_s): rank 1 did not join it"),
            std::string::npos) << run.log;
  EXPECT_NE(run.log.find("because a collective timed out: rank 0: all_reduce #"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("rank 1 is stopped (SIGSTOP or a debugger); killing it"), std::string::npos) << run.log;
  EXPECT_GT(run.seconds, 2.5) << run.log;
  EXPECT_LT(run.seconds, 3 + 3.5) << "the run did not end within the timeout and a small margin\n" << run.log;
}

TEST(Launcher, KillingTheLauncherKillsItsRanks) {
  // kill -9 of the launcher: its ranks must not live on (they would train to the end and write
  // checkpoints nobody asked for).
  const auto dir = fresh_dir("orphans");
  const auto corpus = write_corpus(dir);
  const std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                           corpus + " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32"
                           " --set train.max_steps=0 --set train.epochs=100000 --set log.progress=off"
                           " --set train.out_dir=" + dir + "/out --plugin ddp --nproc 2";
  const std::string script = "OMP_NUM_THREADS=1 " + std::string(WEFT_TRAINER_PATH) + " " + args + " > " + dir +
                             "/log.txt 2>&1 & pid=$!; for i in $(seq 300); do grep -q 'training:' " + dir +
                             "/log.txt && break; sleep 0.1; done; ranks=$(pgrep -P $pid | tr '\\n' ' '); "
                             "kill -KILL $pid; wait $pid; for i in $(seq 50); do alive=0; for r in $ranks; do "
                             "kill -0 $r 2>/dev/null && alive=$((alive+1)); done; [ $alive = 0 ] && break; sleep 0.1; "
                             "done; echo ranks $(echo $ranks | wc -w) alive $alive";
  const std::string line = weft::testing::last_line(weft::testing::run_command(script).output);
  EXPECT_EQ(line, "ranks 2 alive 0") << weft::testing::read_text(dir + "/log.txt");
}

TEST(Launcher, ASigtermIsACleanStopNotAFailure) {
  // SIGTERM to the launcher: it passes it on, every rank stops after the same step (rank 0 saves a
  // checkpoint), the launcher reports it as a stop, not as a failed rank, and exits 128 + 15.
  const auto run = weft::testing::signal_a_rank("sigterm", "TERM", "", /*rank=*/-1);
  EXPECT_EQ(run.status, "143") << run.log;
  EXPECT_NE(run.log.find("interrupted by signal 15"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("checkpoint saved"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("stopped on signal 15 after saving its work"), std::string::npos) << run.log;
  EXPECT_EQ(run.log.find("failed"), std::string::npos) << run.log;
  EXPECT_EQ(run.log.find("error"), std::string::npos) << run.log;
}

TEST(Launcher, TorchrunStyleEnvironmentJoinsTheJob) {
  const auto dir = fresh_dir("torchrun");
  const auto corpus = write_corpus(dir);
  const std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                           corpus + " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32"
                           " --set train.max_steps=3 --set log.progress=off --set train.out_dir=" + dir +
                           "/out --plugin ddp";
  // Two processes started by hand with torchrun's variables (no --nproc).
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=29631 WORLD_SIZE=2 OMP_NUM_THREADS=1";
  const std::string script = env + " RANK=1 LOCAL_RANK=1 " + std::string(WEFT_TRAINER_PATH) + " " + args + " > " +
                             dir + "/r1.txt 2>&1 & " + env + " RANK=0 LOCAL_RANK=0 " + WEFT_TRAINER_PATH + " " + args +
                             " > " + dir + "/r0.txt 2>&1; a=$?; wait %1; b=$?; echo $a$b";
  const std::string status = weft::testing::last_line(weft::testing::run_command(script).output);
  const std::string log = weft::testing::read_text(dir + "/r0.txt");
  EXPECT_EQ(status, "00") << log;
  EXPECT_NE(log.find("2 process(es)"), std::string::npos) << log;
}

}  // namespace
