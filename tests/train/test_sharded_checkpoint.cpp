// Checkpoints under zero.so: the ranks' shards of the optimizer state are saved as one whole
// optimizer (the files single and ddp write), so a run saved at 2 ranks under one ZeRO stage
// resumes at 3 ranks under another, or under ddp, and its loss curve continues the uninterrupted
// run's. Real processes over Gloo.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/process.h"
#include "core/io/safetensors.h"

namespace {

using weft::testing::fresh_dir;
using weft::testing::read_text;
using weft::testing::run_trainer;

std::string run_args(const std::string& out, const std::string& plugin, int nproc) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --plugin " + plugin + " --nproc " +
         std::to_string(nproc) + " --set data.path=" + WEFT_SOURCE_DIR +
         "/data/austen/austen.jsonl --set data.cache_dir= --set train.out_dir=" + out +
         " --set train.batch_size=12 --set train.grad_accum_steps=2 --set train.max_steps=6 --set log.progress=off"
         " --set eval.every_steps=0 --set checkpoint.keep_best=false --set checkpoint.save_final=false";
}

// {step: loss} from a run's metrics.jsonl.
std::vector<std::pair<int64_t, double>> losses_of(const std::string& out) {
  std::vector<std::pair<int64_t, double>> losses;
  std::istringstream lines(read_text(out + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line);
    if (record.value("type", "") == "step") losses.emplace_back(record["step"].get<int64_t>(), record["loss"].get<double>());
  }
  return losses;
}

void expect_continues(const std::vector<std::pair<int64_t, double>>& whole, const std::vector<std::pair<int64_t, double>>& resumed,
                      const std::string& what) {
  ASSERT_EQ(resumed.size(), 3u) << what;
  for (const auto& [step, loss] : resumed) {
    ASSERT_GE(step, 4) << what;
    const double reference = whole[static_cast<size_t>(step - 1)].second;
    EXPECT_LE(std::abs(loss - reference) / reference, 1e-5) << what << " step " << step << ": " << loss << " vs "
                                                            << reference;
  }
}

TEST(ShardedCheckpoint, SavedAtTwoRanksResumesAtThreeUnderAnotherStageAndUnderDdp) {
  const std::string root = fresh_dir("sharded_checkpoint", "resume");
  // The uninterrupted run (zero stage 2, 2 ranks), which also saves a checkpoint at step 3.
  const std::string first = root + "/first";
  auto outcome = run_trainer(run_args(first, "zero", 2) + " --set plugin.stage=2 --set checkpoint.every_steps=3 "
                                                          "--set checkpoint.keep_last=2");
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  const auto whole = losses_of(first);
  ASSERT_EQ(whole.size(), 6u);
  const std::string checkpoint = first + "/checkpoints/step-00000003";
  ASSERT_TRUE(std::filesystem::exists(checkpoint + "/optimizer.pt")) << outcome.output;
  // The whole model and optimizer state, as ddp writes them (readable by any plugin).
  ASSERT_TRUE(std::filesystem::exists(checkpoint + "/model.safetensors"));

  const std::string stage3 = root + "/stage3";
  outcome = run_trainer(run_args(stage3, "zero", 3) + " --set plugin.stage=3 --set checkpoint.resume=" + checkpoint);
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  EXPECT_NE(outcome.output.find("resumed from"), std::string::npos) << outcome.output;
  expect_continues(whole, losses_of(stage3), "zero stage 3 at 3 ranks");

  const std::string ddp = root + "/ddp";
  outcome = run_trainer(run_args(ddp, "ddp", 2) + " --set checkpoint.resume=" + checkpoint);
  ASSERT_EQ(outcome.exit_code, 0) << outcome.output;
  expect_continues(whole, losses_of(ddp), "ddp at 2 ranks");
}

// Evaluation and generation through zero.so's job (stage 3 gathers each stage for evaluation;
// generation reads the whole model) give one process's numbers and tokens.
TEST(ShardedCheckpoint, EvaluationAndGenerationUnderZeroMatchOneProcess) {
  const std::string common = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                             WEFT_SOURCE_DIR + "/data/austen/austen.jsonl --set data.cache_dir=";
  const auto held_out = [](const std::string& output) {
    const auto at = output.find("held-out: ");
    return at == std::string::npos ? std::string() : output.substr(at, output.find('\n', at) - at);
  };
  const auto one = run_trainer("eval " + common);
  const auto zero = run_trainer("eval " + common + " --plugin zero --nproc 2 --set plugin.stage=3");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  ASSERT_EQ(zero.exit_code, 0) << zero.output;
  ASSERT_FALSE(held_out(one.output).empty()) << one.output;
  EXPECT_EQ(held_out(zero.output), held_out(one.output));
  const std::string prompt = " --prompt \"It is a truth\" --set generate.max_new_tokens=8";
  const auto tokens = [](const std::string& output) {
    const auto at = output.find("tokens: ");
    return at == std::string::npos ? std::string() : output.substr(at, output.find('\n', at) - at);
  };
  const auto g1 = run_trainer("generate " + common + prompt);
  const auto gz = run_trainer("generate " + common + prompt + " --plugin zero --nproc 2");
  ASSERT_EQ(gz.exit_code, 0) << gz.output;
  ASSERT_FALSE(tokens(g1.output).empty()) << g1.output;
  EXPECT_EQ(tokens(gz.output), tokens(g1.output));
}

// Under bf16, zero.so gathers matrices into bf16 parameters for the step (ABI 1.6), but a saved
// model is the fp32 masters: every matrix of the final model holds values bf16 cannot represent.
TEST(ShardedCheckpoint, ABf16RunUnderZeroSavesItsFp32Masters) {
  const std::string out = fresh_dir("sharded_checkpoint", "bf16_masters");
  const auto run = run_trainer(run_args(out, "zero", 2) + " --set train.precision=bf16 --set train.max_steps=2"
                                                           " --set checkpoint.save_final=true");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto model = weft::SafetensorsFile::open(out + "/final/model.safetensors");
  int matrices = 0;
  for (const auto& info : model->tensors()) {
    const std::string& name = info.name;
    const at::Tensor t = model->load(name);
    ASSERT_EQ(t.scalar_type(), at::kFloat) << name;
    if (t.dim() < 2) continue;
    ++matrices;
    EXPECT_FALSE(at::equal(t, t.to(at::kBFloat16).to(at::kFloat))) << name << " was saved rounded to bf16";
  }
  EXPECT_GE(matrices, 8);
}

}  // namespace
