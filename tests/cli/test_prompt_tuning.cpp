// Prompt tuning (train.mode = "prompt_tuning"), end to end on the tiny preset: only the prompt trains
// and it is saved in PEFT's layout; eval and generate take it back; a run resumes with the
// uninterrupted losses; tensor parallelism is refused by name. (PEFT both ways on the bundled model:
// Reference.PromptTuningMatchesPeft; every strategy against single: Conformance.*prompt_tuning*.)
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/corpus.h"
#include "common/metrics.h"
#include "common/process.h"
#include "test_paths.h"

namespace prompt_tuning_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

using nlohmann::json;
using weft::testing::read_text;
using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_prompt", name); }

std::string tiny_args(const std::string& dir, const std::string& out) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
         weft::testing::write_word_corpus(dir) + " --set data.cache_dir=" + dir +
         "/cache --set data.seq_len=32 --set train.batch_size=4 --set log.progress=off --set train.mode=prompt_tuning"
         " --set prompt_tuning.num_virtual_tokens=6 --set train.schedule=constant --set train.warmup_steps=0"
         " --set train.overwrite=true --set train.out_dir=" + out;
}

TEST(PromptTuning, TrainsThePromptAloneSavesItAsPeftAndEvalTakesItBack) {
  const std::string dir = fresh_dir("train");
  const auto trained = run_trainer(tiny_args(dir, dir + "/out") + " --set train.max_steps=4");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const json config = json::parse(read_text(dir + "/out/final/adapter_config.json"));
  EXPECT_EQ(config["peft_type"], "PROMPT_TUNING");
  EXPECT_EQ(config["num_virtual_tokens"], 6);
  EXPECT_EQ(config["token_dim"], 64);
  EXPECT_FALSE(std::filesystem::exists(dir + "/out/final/model.safetensors"));  // the base is not saved
  // The summary counts the prompt alone as trained: 6 x 64.
  const json summary = weft::testing::last_record(dir + "/out/metrics.jsonl", "summary");
  EXPECT_EQ(summary["model"]["trainable_parameters"], 6 * 64) << summary;
  // The same weights (seeded random base) with the saved prompt: the held-out loss training reported.
  const double reported = weft::testing::last_record(dir + "/out/metrics.jsonl", "eval")["loss"].get<double>();
  const auto evaluated = run_trainer("eval " + tiny_args(dir, dir + "/eval") + " --set train.mode=full" +
                                     " --set model.adapter=" + dir + "/out/final --json " + dir + "/eval.json");
  ASSERT_EQ(evaluated.exit_code, 0) << evaluated.output;
  EXPECT_NEAR(json::parse(read_text(dir + "/eval.json"))["loss"].get<double>(), reported, 1e-6 * reported);
  // Without the prompt the same model scores otherwise.
  const auto bare = run_trainer("eval " + tiny_args(dir, dir + "/eval") + " --set train.mode=full --json " + dir +
                                "/bare.json");
  ASSERT_EQ(bare.exit_code, 0) << bare.output;
  EXPECT_NE(json::parse(read_text(dir + "/bare.json"))["loss"].get<double>(), reported);
  const auto generated = run_trainer("generate " + tiny_args(dir, dir + "/eval") + " --set model.adapter=" + dir +
                                     "/out/final --set generate.max_new_tokens=8 --prompt 'the quick'");
  ASSERT_EQ(generated.exit_code, 0) << generated.output;
}

TEST(PromptTuning, AResumedRunHasTheUninterruptedLosses) {
  const std::string dir = fresh_dir("resume");
  const auto straight = run_trainer(tiny_args(dir, dir + "/straight") + " --set train.max_steps=6");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto first = run_trainer(tiny_args(dir, dir + "/resumed") + " --set train.max_steps=3 --set checkpoint.every_steps=3");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto second = run_trainer(tiny_args(dir, dir + "/resumed") +
                                  " --set train.max_steps=6 --set checkpoint.resume=auto --set train.overwrite=false");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_EQ(weft::testing::step_losses(dir + "/resumed/metrics.jsonl"),
            weft::testing::step_losses(dir + "/straight/metrics.jsonl"));
  EXPECT_EQ(read_text(dir + "/resumed/final/adapter_model.safetensors"),
            read_text(dir + "/straight/final/adapter_model.safetensors"));
}

TEST(PromptTuning, WhatCannotTakeAPromptIsRefusedByName) {
  const std::string dir = fresh_dir("refused");
  const auto run = run_trainer(tiny_args(dir, dir + "/out") + " --set train.max_steps=1 --plugin tensor_parallel --nproc 2");
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.output.find("train.mode = \"prompt_tuning\" needs the whole embedding"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("step 1"), std::string::npos) << run.output;
  const auto exported = run_trainer("export " + tiny_args(dir, dir + "/out") + " --out " + dir + "/m.gguf");
  EXPECT_NE(exported.exit_code, 0);
  EXPECT_NE(exported.output.find("a prompt-tuning adapter is not weights a GGUF model holds"), std::string::npos)
      << exported.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/m.gguf"));
}

}  // namespace prompt_tuning_test
