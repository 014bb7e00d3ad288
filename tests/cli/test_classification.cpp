// Sequence classification end to end (train.task = "classification"): GLUE's TSV files train a
// classifier whose evaluations carry the task's metrics and confusion matrix; trainer eval gives the
// same numbers for the saved model under every plugin that can run it; MNLI's two dev sets; and the
// one-line refusals.
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/process.h"
#include "test_paths.h"

namespace classification_test {  // named: a unity-build unit shares anonymous namespaces

using nlohmann::json;
using weft::testing::read_text;
using weft::testing::run_trainer;

// A GLUE MRPC directory as distributed: a header, then "Quality #1 ID #2 ID #1 String #2 String";
// the pair is a paraphrase (1) when both sentences name the same animal.
std::string write_mrpc(const std::string& dir) {
  static const char* animals[] = {"fox", "dog", "cat", "owl"};
  static const char* rest[] = {"ran away", "slept all day", "came back at noon", "sat on the wall", "was seen"};
  std::filesystem::create_directories(dir);
  for (const auto& [file, rows] : {std::pair<std::string, int>{"train.tsv", 160}, {"dev.tsv", 40}}) {
    std::ofstream out(dir + "/" + file);
    out << "\xEF\xBB\xBFQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n";
    for (int i = 0; i < rows; ++i) {
      const int a = (i * 7 + (file == "dev.tsv")) % 4, b = (i * 3) % 4;
      out << (a == b ? 1 : 0) << "\t" << 1000 + i << "\t" << 2000 + i << "\tThe " << animals[a] << " " << rest[i % 5]
          << ".\tA " << animals[b] << " " << rest[(i + 2) % 5] << " today.\n";
    }
  }
  return dir;
}

std::string args(const std::string& dir, const std::string& glue) {
  return "--config " + std::string(WEFT_SOURCE_DIR) +
         "/configs/tiny.toml --set train.task=classification --set data.format=glue --set data.glue_task=mrpc"
         " --set data.path=" + glue + " --set data.seq_len=48 --set train.batch_size=8 --set log.progress=off"
         " --set train.out_dir=" + dir + "/out";
}

json last_of(const std::string& metrics, const std::string& type) {
  json last;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = json::parse(line);
    if (j["type"] == type) last = j;
  }
  return last;
}

TEST(Classification, GlueTrainsAClassifierThatEveryPluginEvaluatesAlike) {
  const std::string dir = weft::testing::fresh_dir("weft_test_classification", "mrpc");
  const std::string glue = write_mrpc(dir + "/MRPC");
  const auto trained = run_trainer(args(dir, glue) + " --set train.max_steps=12 --set eval.every_steps=6");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  EXPECT_NE(trained.output.find("160 train and 40 held-out examples"), std::string::npos) << trained.output;
  EXPECT_NE(trained.output.find("accuracy "), std::string::npos) << trained.output;
  // metrics.jsonl: GLUE's MRPC metrics (accuracy and F1) and the confusion matrix of the 40 pairs.
  const json eval = last_of(dir + "/out/metrics.jsonl", "eval");
  ASSERT_TRUE(eval.contains("accuracy") && eval.contains("f1")) << eval;
  EXPECT_EQ(eval["tokens"], 40);  // labeled positions: one per example
  EXPECT_EQ(eval["classes"], json::array({"0", "1"}));
  int64_t total = 0, correct = 0;
  for (int t = 0; t < 2; ++t) {
    for (int p = 0; p < 2; ++p) {
      total += eval["confusion"][t][p].get<int64_t>();
      if (t == p) correct += eval["confusion"][t][p].get<int64_t>();
    }
  }
  EXPECT_EQ(total, 40);
  EXPECT_DOUBLE_EQ(eval["accuracy"].get<double>(), correct / 40.0);
  EXPECT_EQ(last_of(dir + "/out/metrics.jsonl", "summary")["eval_accuracy"], eval["accuracy"]);
  // The saved classifier's config.json is transformers' LlamaForSequenceClassification's.
  const json config = json::parse(read_text(dir + "/out/final/config.json"));
  EXPECT_EQ(config["architectures"], json::array({"LlamaForSequenceClassification"}));
  EXPECT_EQ(config["id2label"], json({{"0", "0"}, {"1", "1"}}));

  // trainer eval on the saved model: training's numbers, with the majority-class baseline, and the
  // same from every plugin that splits the model or the data.
  const std::string weights = " --set model.weights=" + dir + "/out/final";
  const auto single = run_trainer(args(dir, glue) + weights + " --json " + dir + "/single.json eval");
  ASSERT_EQ(single.exit_code, 0) << single.output;
  EXPECT_NE(single.output.find("majority-class baseline: accuracy"), std::string::npos) << single.output;
  const json reference = json::parse(read_text(dir + "/single.json"));
  EXPECT_EQ(reference["accuracy"], eval["accuracy"]);
  EXPECT_NEAR(reference["loss"].get<double>(), eval["loss"].get<double>(), 1e-6);
  for (const std::string plugin : {"ddp --nproc 2", "tensor_parallel --nproc 2", "gpipe --nproc 2"}) {
    const std::string out = dir + "/" + std::to_string(std::hash<std::string>{}(plugin)) + ".json";
    const auto r = run_trainer(args(dir, glue) + weights + " --plugin " + plugin + " --json " + out + " eval");
    ASSERT_EQ(r.exit_code, 0) << plugin << "\n" << r.output;
    const json e = json::parse(read_text(out));
    EXPECT_EQ(e["accuracy"], reference["accuracy"]) << plugin;
    EXPECT_EQ(e["f1"], reference["f1"]) << plugin;
    EXPECT_NEAR(e["loss"].get<double>(), reference["loss"].get<double>(), 1e-5) << plugin;
  }
}

// LoRA with the head: a run stopped at a checkpoint and resumed ends with the uninterrupted run's
// adapter file byte for byte (the head is saved with the adapters, its AdamW state with the rest).
TEST(Classification, ALoraClassifierResumesExactly) {
  const std::string dir = weft::testing::fresh_dir("weft_test_classification", "resume");
  const std::string glue = write_mrpc(dir + "/MRPC");
  const std::string lora = args(dir, glue) + " --set train.mode=lora --set checkpoint.every_steps=3 --set train.max_steps=6";
  ASSERT_EQ(run_trainer(lora + " --set train.out_dir=" + dir + "/whole").exit_code, 0);
  ASSERT_EQ(run_trainer(lora + " --set train.out_dir=" + dir + "/parts --set train.max_steps=3").exit_code, 0);
  const auto resumed = run_trainer(lora + " --set train.out_dir=" + dir + "/parts --set checkpoint.resume=auto");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resum"), std::string::npos) << resumed.output;
  const std::string whole = read_text(dir + "/whole/final/adapter_model.safetensors");
  EXPECT_NE(whole.find("base_model.model.score.weight"), std::string::npos);
  EXPECT_TRUE(whole == read_text(dir + "/parts/final/adapter_model.safetensors"));
}

TEST(Classification, MnliEvaluatesItsMatchedAndMismatchedDevSets) {
  const std::string dir = weft::testing::fresh_dir("weft_test_classification", "mnli");
  const std::string glue = dir + "/MNLI";
  std::filesystem::create_directories(glue);
  static const char* labels[] = {"entailment", "neutral", "contradiction"};
  for (const auto& [file, rows] : {std::pair<std::string, int>{"train.tsv", 48}, {"dev_matched.tsv", 12},
                                   {"dev_mismatched.tsv", 9}}) {
    std::ofstream out(glue + "/" + file);
    out << "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
           "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n";
    for (int i = 0; i < rows; ++i) {
      out << i << "\t1\t1\tfiction\t(x)\t(y)\t(X)\t(Y)\tA premise number " << i << ".\tA hypothesis " << i % 5
          << ".\t" << labels[i % 3] << "\t" << labels[i % 3] << "\n";
    }
  }
  const auto r = run_trainer("--config " + std::string(WEFT_SOURCE_DIR) +
                             "/configs/tiny.toml --set train.task=classification --set data.format=glue"
                             " --set data.glue_task=mnli --set data.path=" + glue +
                             " --set data.seq_len=48 --set train.batch_size=8 --set train.max_steps=4"
                             " --set log.progress=off --set train.out_dir=" + dir + "/out");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("48 train and 12 held-out examples (+ 9 mismatched), 3 classes"), std::string::npos)
      << r.output;
  const json eval = last_of(dir + "/out/metrics.jsonl", "eval");
  EXPECT_TRUE(eval.contains("accuracy") && eval.contains("mismatched_accuracy") && eval.contains("mismatched_loss"))
      << eval;
  EXPECT_EQ(eval["classes"], json::array({"contradiction", "entailment", "neutral"}));
}

TEST(Classification, BadSettingsAreOneClearError) {
  const std::string dir = weft::testing::fresh_dir("weft_test_classification", "errors");
  const std::string glue = write_mrpc(dir + "/MRPC");
  const std::string base = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set log.progress=off"
                           " --set train.out_dir=" + dir + "/out --set data.seq_len=48 --set train.max_steps=2";
  const auto expect_error = [&](const std::string& settings, const std::string& message) {
    const auto r = run_trainer(base + " " + settings);
    EXPECT_NE(r.exit_code, 0) << settings;
    EXPECT_NE(r.output.find(message), std::string::npos) << settings << "\n" << r.output;
  };
  expect_error("--set data.format=glue --set data.glue_task=mrpc --set data.path=" + glue,
               "data.format = \"glue\" and data.glue_task are for train.task = \"classification\"");
  expect_error("--set train.task=classification --set data.glue_task=mrpc --set data.path=" + glue,
               "data.format = \"glue\" needs data.glue_task, and data.glue_task needs data.format = \"glue\"");
  expect_error("--set train.task=classification --set data.format=glue --set data.glue_task=rte --set data.path=" + glue,
               "/MRPC/train.tsv");  // an MRPC file read as RTE: its header is not RTE's
  expect_error("--set train.task=classification --set data.format=glue --set data.glue_task=mrpc --set data.path=" +
                   glue + " --plugin context_parallel --nproc 2",
               "pools each sequence at its last token");
}

}  // namespace classification_test
