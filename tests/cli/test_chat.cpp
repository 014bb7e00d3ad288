// Instruction tuning (data.format = "chat"), end to end: a step's loss is the mean over every trained
// token of the step, whichever ranks and micro-batches hold them (transformers' num_items_in_batch),
// and bad chat data gets one error naming the file and line before anything is built.
// (TRL's and transformers' tokens, masks and losses: tools/sft_reference.py, ctest
// Reference.SftMatchesTrlAndTransformers; every strategy against single: Conformance.*Chat.)
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/metrics.h"
#include "common/process.h"
#include "test_paths.h"

namespace chat_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

using nlohmann::json;
using weft::testing::read_text;
using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_chat", name); }

// 8 prompt-completion pairs with 5 to 38 completion tokens each (byte tokenizer, seq_len 48).
std::string write_pairs(const std::string& dir) {
  const std::string path = dir + "/pairs.jsonl";
  std::ofstream out(path);
  for (int i = 0; i < 8; ++i) {
    std::string completion = " yes";
    for (int k = 0; k < (i % 4) * 3; ++k) completion += " and so on";
    out << json{{"prompt", "Question " + std::to_string(i) + "?"}, {"completion", completion}}.dump() << "\n";
  }
  return path;
}

std::string tiny_args(const std::string& dir, const std::string& data) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.format=chat --set data.path=" + data +
         " --set data.seq_len=48 --set data.heldout_fraction=0 --set data.max_documents=0 --set log.progress=off"
         " --set train.out_dir=" + dir + "/out --set train.overwrite=true";
}

TEST(Chat, TheStepLossIsTheMeanOverEveryTrainedTokenOfTheStep) {
  const std::string dir = fresh_dir("step_loss");
  const std::string args = tiny_args(dir, write_pairs(dir));
  // The starting model's loss on each example and over all of their completion tokens.
  const auto evaluated = run_trainer("eval " + args + " --data " + dir + "/pairs.jsonl --json " + dir + "/eval.json");
  ASSERT_EQ(evaluated.exit_code, 0) << evaluated.output;
  const json eval = json::parse(read_text(dir + "/eval.json"));
  ASSERT_EQ(eval["sequences"], 8);
  // The mean of the examples' means is another number: a loss averaged per row, micro-batch or rank
  // would not pass.
  double mean_of_means = 0;
  for (double loss : eval["sequence_losses"]) mean_of_means += loss / 8;
  const double expected = eval["loss"];
  ASSERT_GT(std::abs(mean_of_means - expected), 1e-3 * expected);
  // One step holds all 8 (2 micro-batches of 4), on one process and on 2 ranks.
  for (const std::string& run : {std::string(), std::string(" --plugin ddp --nproc 2")}) {
    const auto trained = run_trainer(args + run + " --set train.batch_size=4 --set train.grad_accum_steps=2"
                                              " --set train.max_steps=1");
    ASSERT_EQ(trained.exit_code, 0) << trained.output;
    const auto losses = weft::testing::step_losses(dir + "/out/metrics.jsonl");
    ASSERT_EQ(losses.size(), 1u);
    EXPECT_NEAR(losses[0], expected, 1e-5 * expected) << (run.empty() ? "one process" : run);
  }
}

// data.packing: the 8 pairs of 16 to 46 tokens packed into 6 rows train as they do one per row. A
// step over all of them has the same token-weighted loss, hence the same gradients and the same next
// steps, on one process and under ddp; evaluation gives the same loss over fewer rows.
TEST(Chat, PackedRowsTrainAsOneExamplePerRow) {
  const std::string dir = fresh_dir("packed");
  const std::string path = dir + "/pairs.jsonl";
  {
    std::ofstream out(path);
    for (int i = 0; i < 8; ++i) {
      std::string completion = " yes";
      for (int k = 0; k < i % 4; ++k) completion += " and so on";
      out << json{{"prompt", "Question " + std::to_string(i) + "?"}, {"completion", completion}}.dump() << "\n";
    }
  }
  const std::string args = tiny_args(dir, path) + " --set train.epochs=3 --set train.max_steps=0";
  const auto evaluate = [&](const std::string& packing) {
    const auto r = run_trainer("eval " + tiny_args(dir, path) + " --set data.packing=" + packing + " --data " + path +
                               " --json " + dir + "/eval.json");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return json::parse(read_text(dir + "/eval.json"));
  };
  const json one = evaluate("false"), packed = evaluate("true");
  EXPECT_EQ(one["sequences"], 8);
  EXPECT_EQ(packed["sequences"], 6);
  EXPECT_EQ(packed["tokens"], one["tokens"]);
  EXPECT_NEAR(packed["loss"].get<double>(), one["loss"].get<double>(), 1e-6 * one["loss"].get<double>());
  const auto train = [&](const std::string& run) {
    const auto r = run_trainer(args + run);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return weft::testing::step_losses(dir + "/out/metrics.jsonl");
  };
  const auto expected = train(" --set train.batch_size=8");
  ASSERT_EQ(expected.size(), 3u);
  for (const std::string& run : {std::string(), std::string(" --plugin ddp --nproc 2")}) {
    const auto losses = train(" --set data.packing=true --set train.batch_size=6" + run);
    ASSERT_EQ(losses.size(), 3u) << run;
    for (size_t k = 0; k < 3; ++k) EXPECT_NEAR(losses[k], expected[k], 1e-5 * expected[k]) << "step " << k + 1 << run;
  }
  // What packing cannot do is refused in one line before the first step.
  const struct {
    std::string settings, message;
  } refused[] = {
      {" --set train.mode=prompt_tuning", "data.packing: prompt tuning prepends its virtual tokens to every sequence"},
      {" --plugin context_parallel --nproc 2 --set plugin.mode=ring",
       "data.packing keeps packed examples apart with an attention mask, which plugin context_parallel does not take: it "
       "computes the attention core itself"},
  };
  for (const auto& c : refused) {
    const auto r = run_trainer(args + " --set data.packing=true --set train.batch_size=6" + c.settings);
    EXPECT_NE(r.exit_code, 0) << c.settings;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 1"), std::string::npos) << r.output;
  }
  const auto text = run_trainer("--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.packing=true "
                                "--set data.path=" + path + " --set train.max_steps=1 --set train.out_dir=" + dir + "/text --set log.progress=off");
  EXPECT_NE(text.exit_code, 0);
  EXPECT_NE(text.output.find("data.packing is for data.format = \"chat\""), std::string::npos) << text.output;
}

TEST(Chat, BadDataIsOneErrorNamingTheLine) {
  const std::string dir = fresh_dir("bad");
  const struct {
    std::string line, message;
  } cases[] = {
      {R"({"text": "no chat here"})", "pairs.jsonl:2: a chat example needs 'messages', or 'prompt' and 'completion'"},
      {R"({"messages": [{"role": "user", "content": "hi"}]})", "pairs.jsonl:2: the conversation has no assistant message"},
      {R"({"messages": [{"role": "user"}]})", "pairs.jsonl:2: messages[0] needs a string 'role' and a string 'content'"},
      {R"({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]})",
       "pairs.jsonl:2: 'prompt' and 'completion' must both be strings or both lists of messages"},
      // the byte tokenizer has no chat template to render a conversation with
      {R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})",
       "pairs.jsonl:2: a conversation needs the tokenizer's chat template, and it has none"},
  };
  for (const auto& c : cases) {
    {
      std::ofstream out(dir + "/pairs.jsonl");
      out << R"({"prompt": "fine", "completion": " yes"})" << "\n" << c.line << "\n";
    }
    const auto run = run_trainer(tiny_args(dir, dir + "/pairs.jsonl") + " --set train.max_steps=1");
    EXPECT_NE(run.exit_code, 0) << c.line;
    EXPECT_NE(run.output.find(c.message), std::string::npos) << c.line << "\n" << run.output;
    EXPECT_EQ(run.output.find("step 1"), std::string::npos) << run.output;
  }
  const auto classify = run_trainer(tiny_args(dir, dir + "/pairs.jsonl") + " --set train.task=classification");
  EXPECT_NE(classify.exit_code, 0);
  EXPECT_NE(classify.output.find("data.format = \"chat\" is for train.task = \"causal_lm\""), std::string::npos)
      << classify.output;
}

// configs/instruct.toml for 2 steps under ddp: the bundled model on the bundled instruction set (the
// conversations as rendered by its ChatML template), the pretrained model's held-out loss on the
// assistant's tokens first, the adapter saved; generate --chat with the config's system message.
TEST(Chat, TheInstructionConfigTunesTheBundledModel) {
  const std::string source = WEFT_SOURCE_DIR;
  const std::string model = source + "/data/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  const std::string data = source + "/data/austen-instruct/austen-instruct.jsonl";
  ASSERT_TRUE(std::ifstream(model).good()) << model << " is missing: tools/setup.sh links it";
  ASSERT_TRUE(std::ifstream(data).good()) << data << " is missing: tools/setup.sh writes it";
  const std::string dir = fresh_dir("instruct");
  const std::string config = "--config " + source + "/configs/instruct.toml --set model.weights=" + model +
                             " --set data.tokenizer=" + model + " --set data.path=" + data +
                             " --set log.progress=off --set train.out_dir=" + dir + "/out";
  const auto r = run_trainer(config + " --set train.max_steps=2 --set eval.max_batches=1 --plugin ddp --nproc 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<json> evals = weft::testing::records_of(dir + "/out/metrics.jsonl", "eval");
  ASSERT_EQ(evals.size(), 2u) << r.output;
  EXPECT_EQ(evals[0]["step"], 0);
  // Measured 0.889 over all 40 held-out conversations; the first batch's 8 hold about 110 answer tokens.
  EXPECT_GT(evals[0]["loss"].get<double>(), 0.3);
  EXPECT_LT(evals[0]["loss"].get<double>(), 2.0);
  EXPECT_GT(evals[0]["tokens"].get<int64_t>(), 40);
  EXPECT_LT(evals[0]["tokens"].get<int64_t>(), 400);  // the answers' tokens, not the rows' 8 x 176
  EXPECT_TRUE(std::filesystem::exists(dir + "/out/final/adapter_model.safetensors"));
  const auto answer = run_trainer("generate " + config + " --set model.adapter=" + dir + "/out/final" +
                                  " --set generate.max_new_tokens=4 --chat --prompt 'Which novel is this from?'");
  ASSERT_EQ(answer.exit_code, 0) << answer.output;
}

}  // namespace chat_test
