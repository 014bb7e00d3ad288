// trainer eval, end to end: the held-out loss it reports is the one training reported for the
// same weights; every plugin reports the numbers of one process, per sequence too; --data
// evaluates every sequence of other files (token files as they are); LoRA adapters load.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/corpus.h"
#include "common/metrics.h"
#include "common/process.h"
#include "test_paths.h"

namespace eval_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

using nlohmann::json;
using weft::testing::read_text;
using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_eval", name); }

// The tiny preset on the word corpus (seq_len 32, 20 documents), writing to DIR/out.
std::string tiny_args(const std::string& dir) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
         weft::testing::write_word_corpus(dir) + " --set data.cache_dir=" + dir +
         "/cache --set data.seq_len=32 --set train.batch_size=4 --set log.progress=off --set train.out_dir=" + dir +
         "/out";
}

json read_json(const std::string& path) { return json::parse(read_text(path)); }

// The last held-out evaluation training recorded in its metrics.
json last_eval(const std::string& metrics) { return weft::testing::last_record(metrics, "eval"); }

class Eval : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fresh_dir("suite");
    args_ = tiny_args(dir_);
    const auto trained = run_trainer(args_ + " --set train.max_steps=6 --set train.mode=full");
    ASSERT_EQ(trained.exit_code, 0) << trained.output;
  }
  static std::string dir_, args_;
};
std::string Eval::dir_, Eval::args_;

TEST_F(Eval, TheHeldOutLossIsTheOneTrainingReported) {
  const auto r = run_trainer(args_ + " --set model.weights=" + dir_ + "/out/final --json " + dir_ + "/single.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json eval = read_json(dir_ + "/single.json");
  const json trained = last_eval(dir_ + "/out/metrics.jsonl");
  EXPECT_EQ(eval["tokens"], trained["tokens"]);
  // (--json sums each token's loss in float64; training's evaluation averages in float32.)
  EXPECT_NEAR(eval["loss"].get<double>(), trained["loss"].get<double>(), 1e-6 * trained["loss"].get<double>())
      << r.output;
  EXPECT_NEAR(eval["perplexity"].get<double>(), std::exp(eval["loss"].get<double>()), 1e-9);
  EXPECT_NE(r.output.find("held-out: "), std::string::npos) << r.output;
  EXPECT_EQ(eval["weights"], dir_ + "/out/final");  // where the weights came from
  EXPECT_EQ(r.output.find("random weights"), std::string::npos) << r.output;
  // Every sequence holds seq_len targets: the token-weighted loss is the mean of the sequences'.
  const auto losses = eval["sequence_losses"].get<std::vector<double>>();
  ASSERT_EQ(static_cast<int64_t>(losses.size()), eval["sequences"].get<int64_t>());
  ASSERT_EQ(eval["tokens"].get<int64_t>(), eval["sequences"].get<int64_t>() * 32);
  double sum = 0;
  for (double l : losses) sum += l;
  EXPECT_NEAR(sum / losses.size(), eval["loss"].get<double>(), 1e-9);
}

// A config that names no weights evaluates and generates from the seeded random initialisation:
// the JSON says so, and both commands warn that their numbers are chance's (before, the log read the
// same with and without weights, and the README's examples evaluated random weights).
TEST_F(Eval, RandomWeightsAreNamedAndWarnedOf) {
  const auto r = run_trainer(args_ + " --json " + dir_ + "/random.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(dir_ + "/random.json")["weights"].get<std::string>().rfind("random init (seed ", 0), 0u);
  EXPECT_NE(r.output.find("trainer eval: the model has random weights"), std::string::npos) << r.output;
  const auto g = run_trainer(args_ + " generate --prompt \"It is\" --set generate.max_new_tokens=2");
  ASSERT_EQ(g.exit_code, 0) << g.output;
  EXPECT_NE(g.output.find("trainer generate: the model has random weights"), std::string::npos) << g.output;
  const auto trained = run_trainer(args_ + " --set model.weights=" + dir_ + "/out/final generate --prompt \"It is\""
                                   " --set generate.max_new_tokens=2");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_EQ(trained.output.find("random weights"), std::string::npos) << trained.output;
  EXPECT_NE(trained.output.find("weights: " + dir_ + "/out/final"), std::string::npos) << trained.output;
}

TEST_F(Eval, EveryPluginReportsTheNumbersOfOneProcess) {
  const std::string weights = " --set model.weights=" + dir_ + "/out/final";
  ASSERT_EQ(run_trainer(args_ + weights + " --json " + dir_ + "/reference.json eval").exit_code, 0);
  const json reference = read_json(dir_ + "/reference.json");
  const auto reference_losses = reference["sequence_losses"].get<std::vector<double>>();
  const struct {
    std::string plugin;
    int processes;
  } cases[] = {{"ddp --nproc 2", 2}, {"tensor_parallel --nproc 2", 2}, {"gpipe --nproc 2", 2},
               {"context_parallel --nproc 2", 2}, {"context_parallel --nproc 2 --set plugin.mode=\"ring\"", 2},
               // Sequence splits across pipeline stages (ABI 1.13).
               {"context_parallel,gpipe --nproc 4 --set mesh.cp=2 --set mesh.pp=2", 4},
               {"tensor_parallel,pipedream --nproc 4 --set mesh.tp=2 --set mesh.pp=2 --set plugin.sequence_parallel=true", 4},
               // ZeRO-3 driving tp (sequence parallelism) and cp: each stage gathered for evaluation (ABI 1.14).
               {"tensor_parallel,zero --nproc 4 --set mesh.tp=2 --set plugin.stage=3 --set plugin.sequence_parallel=true", 4},
               {"context_parallel,zero --nproc 4 --set mesh.cp=2 --set plugin.stage=3", 4},
               // Context parallelism (ring) with Megatron sequence parallelism.
               {"context_parallel,tensor_parallel --nproc 4 --set mesh.cp=2 --set mesh.tp=2 --set plugin.sequence_parallel=true"
                " --set plugin.mode=\"ring\"", 4}};
  for (const auto& [plugin, processes] : cases) {
    const std::string out = dir_ + "/" + std::to_string(std::hash<std::string>{}(plugin)) + ".json";
    const auto r = run_trainer(args_ + weights + " --plugin " + plugin + " --json " + out + " eval");
    ASSERT_EQ(r.exit_code, 0) << plugin << "\n" << r.output;
    const json eval = read_json(out);
    EXPECT_EQ(eval["processes"], processes) << plugin;
    EXPECT_EQ(eval["tokens"], reference["tokens"]) << plugin;
    EXPECT_NEAR(eval["loss"].get<double>(), reference["loss"].get<double>(), 1e-5 * reference["loss"].get<double>())
        << plugin;
    const auto losses = eval["sequence_losses"].get<std::vector<double>>();
    ASSERT_EQ(losses.size(), reference_losses.size()) << plugin;
    for (size_t i = 0; i < losses.size(); ++i) {
      EXPECT_NEAR(losses[i], reference_losses[i], 1e-5 * reference_losses[i]) << plugin << ", sequence " << i;
    }
  }
}

TEST_F(Eval, DataFilesAreEvaluatedWholeAndTokenFilesAsTheyAre) {
  // A token file: 1 + 5 x 32 tokens make exactly 5 windows of 33 at a stride of 32.
  const std::string tokens = dir_ + "/tokens.u32";
  {
    std::ofstream out(tokens, std::ios::binary);
    for (uint32_t i = 0; i < 1 + 5 * 32; ++i) {
      const uint32_t id = (i * 7) % 250;
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
  }
  const std::string weights = " --set model.weights=" + dir_ + "/out/final";
  const auto r = run_trainer(args_ + weights + " --data " + tokens + " --json " + dir_ + "/tokens.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json eval = read_json(dir_ + "/tokens.json");
  EXPECT_EQ(eval["sequences"], 5);
  EXPECT_EQ(eval["tokens"], 5 * 32);
  EXPECT_EQ(eval["data"], json::array({tokens}));
  // The same file under ddp on 2 ranks: the same numbers.
  const auto ddp = run_trainer(args_ + weights + " --plugin ddp --nproc 2 --data " + tokens + " --json " + dir_ +
                               "/tokens_ddp.json eval");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  EXPECT_NEAR(read_json(dir_ + "/tokens_ddp.json")["loss"].get<double>(), eval["loss"].get<double>(),
              1e-5 * eval["loss"].get<double>());
  // The training corpus itself with --data: every sequence of it, none held out.
  const auto all = run_trainer(args_ + weights + " --data " + dir_ + "/corpus.jsonl eval");
  ASSERT_EQ(all.exit_code, 0) << all.output;
  EXPECT_NE(all.output.find("data: "), std::string::npos) << all.output;
}

// Token files from another tokenizer need none of the model's: their ids are checked against the
// model's vocabulary (the tiny preset's 512), not the configured tokenizer's (the byte one's 258).
TEST_F(Eval, TokenFilesAreCheckedAgainstTheModelsVocabulary) {
  const auto write_ids = [&](const std::string& name, uint16_t top) {
    const std::string path = dir_ + "/" + name;
    std::ofstream out(path, std::ios::binary);
    for (uint16_t i = 0; i < 1 + 32; ++i) {
      const uint16_t id = i == 5 ? top : static_cast<uint16_t>(300 + i);
      out.write(reinterpret_cast<const char*>(&id), sizeof id);
    }
    return path;
  };
  const std::string weights = " --set model.weights=" + dir_ + "/out/final";
  const std::string fits = write_ids("fits.u16", 511);
  const auto r = run_trainer(args_ + weights + " --data " + fits + " --json " + dir_ + "/fits.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_json(dir_ + "/fits.json")["tokens"], 32);
  const std::string beyond = write_ids("beyond.u16", 512);
  const auto refused = run_trainer(args_ + weights + " --data " + beyond + " eval");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("token 512 at index 5 (byte offset 10) is >= the model's vocab_size 512"),
            std::string::npos)
      << refused.output;
}

TEST_F(Eval, ALoraAdapterIsEvaluatedOnItsBase) {
  // Adapters trained on the final model: evaluating base + model.adapter gives the held-out loss
  // the LoRA run reported.
  const std::string lora_dir = dir_ + "/lora";
  std::filesystem::create_directories(lora_dir);
  const auto trained = run_trainer(tiny_args(lora_dir) + " --set train.mode=lora" +
                                   " --set model.weights=" + dir_ + "/out/final --set train.max_steps=4" +
                                   " --set lora.dropout=0");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const auto r = run_trainer(args_ + " --set model.weights=" + dir_ + "/out/final --set model.adapter=" + lora_dir +
                             "/out/final --json " + dir_ + "/lora.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double trained_loss = last_eval(lora_dir + "/out/metrics.jsonl")["loss"].get<double>();
  EXPECT_NEAR(read_json(dir_ + "/lora.json")["loss"].get<double>(), trained_loss, 1e-6 * trained_loss);
  // An adapter directory that is not one: one error naming it.
  const auto bad = run_trainer(args_ + " --set model.adapter=" + dir_ + " eval");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(dir_ + "/adapter_config.json"), std::string::npos) << bad.output;
}

TEST_F(Eval, AnAdaLoraAdapterIsEvaluatedOnItsBase) {
  // AdaLoRA adapters pruned to their final pattern: evaluating base + model.adapter (PEFT's layout,
  // the kept triplets only) gives the held-out loss the run reported, in one process and under
  // tensor_parallel; training from it is refused.
  const std::string ada_dir = dir_ + "/adalora";
  std::filesystem::create_directories(ada_dir);
  const auto trained = run_trainer(tiny_args(ada_dir) + " --set train.mode=adalora --set model.weights=" + dir_ +
                                   "/out/final --set train.max_steps=6 --set lora.dropout=0 --set adalora.init_r=4"
                                   " --set adalora.target_r=2 --set adalora.tinit=1 --set adalora.tfinal=2");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_NE(trained.output.find("AdaLoRA: 16 of 32 triplets kept"), std::string::npos) << trained.output;
  const auto r = run_trainer(args_ + " --set model.weights=" + dir_ + "/out/final --set model.adapter=" + ada_dir +
                             "/out/final --json " + dir_ + "/adalora.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const double trained_loss = last_eval(ada_dir + "/out/metrics.jsonl")["loss"].get<double>();
  EXPECT_NEAR(read_json(dir_ + "/adalora.json")["loss"].get<double>(), trained_loss, 1e-6 * trained_loss);
  // The same under tensor_parallel: each rank loads its slices of the kept triplets.
  const auto tp = run_trainer(args_ + " --set model.weights=" + dir_ + "/out/final --set model.adapter=" + ada_dir +
                              "/out/final --plugin tensor_parallel --nproc 2 --json " + dir_ + "/adalora_tp.json eval");
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  EXPECT_NEAR(read_json(dir_ + "/adalora_tp.json")["loss"].get<double>(), trained_loss, 1e-6 * trained_loss);
  std::filesystem::create_directories(ada_dir + "/again");
  const auto again = run_trainer(tiny_args(ada_dir + "/again") + " --set train.mode=lora --set model.weights=" + dir_ +
                                 "/out/final --set model.adapter=" + ada_dir + "/out/final");
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("is an AdaLoRA adapter"), std::string::npos) << again.output;
}

// A file shorter than seq_len + 1 tokens is one sequence of all of them (as transformers scores a
// text), with the loss of the same file evaluated at that seq_len.
TEST_F(Eval, AShortFileIsOneShorterSequence) {
  const std::string path = dir_ + "/short.jsonl";
  std::ofstream(path) << "{\"text\": \"a short note\"}\n";  // 12 bytes + BOS + EOS: 14 tokens
  const std::string weights = " --set model.weights=" + dir_ + "/out/final";
  const auto r = run_trainer(args_ + weights + " --data " + path + " --json " + dir_ + "/short.json eval");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json whole = read_json(dir_ + "/short.json");
  EXPECT_EQ(whole["sequences"], 1);
  EXPECT_EQ(whole["seq_len"], 13);
  EXPECT_EQ(whole["tokens"], 13);
  const auto fitted = run_trainer(args_ + weights + " --set data.seq_len=13 --data " + path + " --json " + dir_ +
                                  "/fitted.json eval");
  ASSERT_EQ(fitted.exit_code, 0) << fitted.output;
  EXPECT_EQ(read_json(dir_ + "/fitted.json")["loss"], whole["loss"]);
}

TEST_F(Eval, NoHeldOutSplitIsOneError) {
  const auto r = run_trainer(args_ + " --set data.heldout_fraction=0 eval");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("data.heldout_fraction is 0"), std::string::npos) << r.output;
}

}  // namespace eval_test
