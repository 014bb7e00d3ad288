// ddp.so against the one-process reference, with real processes (trainer --nproc N over Gloo on
// 127.0.0.1): per-step losses within 1e-5 relative over 20 fp32 steps and final parameters within
// 1e-5, for 2 and 3 ranks, with gradient accumulation and with LoRA, and the communication the
// host measures.
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
#include "core/util/libtorch.h"
#include "common/corpus.h"
#include "common/metrics.h"
#include "common/process.h"
#include "test_paths.h"

namespace {

using weft::testing::run_trainer;
using weft::testing::step_losses;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_dist", name); }

std::string write_corpus(const std::string& dir) { return weft::testing::write_word_corpus(dir); }

// Trains the tiny preset for 20 fp32 steps with `extra` settings under `plugin` on `nproc`
// processes (0: one process, the built-in single); returns the run directory.
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
      // What the run was built on, for comparing runs: the LibTorch.
      EXPECT_EQ(j["libtorch"], weft::libtorch_version()) << line;
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

// Replicas start equal from rank 0, and cost no copy of the model when they already are. A rank
// whose weights differ (its working directory holds other weights under the configured relative
// path, as a node with a stale copy of a checkpoint would) trains rank 0's: the run equals one whose
// ranks all loaded rank 0's, and rank 0 says how many parameters were broadcast; where the ranks
// loaded the same file, nothing was.
TEST(Ddp, ARankWhoseWeightsDifferTrainsRankZeros) {
  const auto dir = fresh_dir("differing_weights");
  const auto corpus = write_corpus(dir);
  const auto trained = train(dir, "trained", corpus, 0, "");
  const auto other = train(dir, "other", corpus, 0, "--set train.seed=7");
  for (const auto& [node, from] : {std::pair{"node0", trained}, std::pair{"node1", other}}) {
    std::filesystem::create_directories(dir + "/" + node);
    std::filesystem::copy_file(from + "/final/model.safetensors", dir + "/" + node + "/weights.safetensors");
  }
  const auto args = [&](const std::string& out, const std::string& weights) {
    return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + corpus +
           " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32 --set train.batch_size=6"
           " --set train.max_steps=20 --set train.epochs=3 --set train.precision=fp32 --set log.progress=off"
           " --set train.out_dir=" + dir + "/" + out + " --set model.weights=" + weights + " --plugin ddp";
  };
  const auto same = run_trainer(args("same", dir + "/node0/weights.safetensors") + " --nproc 2 --log-level debug");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("nothing broadcast"), std::string::npos) << same.output;
  EXPECT_EQ(same.output.find("were broadcast"), std::string::npos) << same.output;
  // By hand, torchrun's variables, each rank in its node's directory.
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=29641 WORLD_SIZE=2 OMP_NUM_THREADS=1";
  const auto rank = [&](int r) {
    return "(cd " + dir + "/node" + std::to_string(r) + " && " + env + " RANK=" + std::to_string(r) +
           " LOCAL_RANK=" + std::to_string(r) + " " + WEFT_TRAINER_PATH + " " + args("mixed", "weights.safetensors") +
           " > " + dir + "/r" +
           std::to_string(r) + ".txt 2>&1)";
  };
  const auto status = weft::testing::run_command(rank(1) + " & " + rank(0) + "; a=$?; wait %1; b=$?; echo $a$b");
  const std::string log = weft::testing::read_text(dir + "/r0.txt");
  ASSERT_EQ(weft::testing::last_line(status.output), "00") << log << weft::testing::read_text(dir + "/r1.txt");
  const auto expected = step_losses(dir + "/same/metrics.jsonl");
  ASSERT_EQ(expected.size(), 20u);
  EXPECT_EQ(step_losses(dir + "/mixed/metrics.jsonl"), expected);  // the same arithmetic, bit for bit
  auto a = weft::SafetensorsFile::open(dir + "/same/final/model.safetensors");
  auto b = weft::SafetensorsFile::open(dir + "/mixed/final/model.safetensors");
  for (const auto& info : a->tensors()) EXPECT_TRUE(torch::equal(a->load(info.name), b->load(info.name))) << info.name;
  // Every tensor of the two seeds' runs differs.
  const auto count = std::to_string(a->tensors().size());
  EXPECT_NE(log.find("replicas: " + count + " of " + count + " parameters"), std::string::npos) << log;
}

}  // namespace
