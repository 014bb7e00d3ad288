// tensor_parallel.so with real processes: head counts a degree cannot split are refused in one
// line before compute; a model trained with tensor parallelism is saved whole (HF layout) and
// resumes under single.so, and back; greedy generation gives the same tokens under it as in one
// process. (Loss and parameter parity: Conformance.tensor_parallel.*.)
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "common/corpus.h"
#include "common/process.h"
#include "core/io/safetensors.h"
#include "test_paths.h"

namespace {

using weft::testing::run_trainer;

std::string tiny_args(const std::string& dir, const std::string& corpus) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + corpus +
         " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32 --set train.batch_size=8"
         " --set train.precision=fp32 --set log.progress=off";
}

TEST(TensorParallelRun, RefusesADegreeTheHeadsCannotSplit) {
  const auto dir = weft::testing::fresh_dir("weft_test_tp", "refuse");
  const auto corpus = weft::testing::write_word_corpus(dir);
  // The tiny preset has 4 attention heads and 2 kv heads.
  const auto r = run_trainer(tiny_args(dir, corpus) + " --set train.max_steps=2 --set train.out_dir=" + dir +
                             "/out --plugin tensor_parallel --nproc 3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("tensor_parallel (weft_place): the model's attention heads (4) cannot be split over 3 tensor-parallel ranks"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("training:"), std::string::npos) << "refused after compute started:\n" << r.output;
}

TEST(TensorParallelRun, SavesTheWholeModelThatResumesUnderSingle) {
  const auto dir = weft::testing::fresh_dir("weft_test_tp", "resume");
  const auto corpus = weft::testing::write_word_corpus(dir);
  const auto tp = run_trainer(tiny_args(dir, corpus) + " --set train.max_steps=4 --set train.out_dir=" + dir +
                              "/tp --plugin tensor_parallel --nproc 2");
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  auto saved = weft::SafetensorsFile::open(dir + "/tp/final/model.safetensors");
  for (const auto& info : saved->tensors()) {
    if (info.name == "model.embed_tokens.weight") {
      EXPECT_EQ(info.shape, (std::vector<int64_t>{512, 64}));
    }
    if (info.name == "model.layers.0.self_attn.o_proj.weight") {
      EXPECT_EQ(info.shape, (std::vector<int64_t>{64, 64}));
    }
    if (info.name == "model.layers.0.mlp.gate_proj.weight") {
      EXPECT_EQ(info.shape, (std::vector<int64_t>{176, 64}));
    }
  }
  // Fine-tune further from it in one process.
  const auto single = run_trainer(tiny_args(dir, corpus) + " --set train.max_steps=2 --set model.weights=" + dir +
                                  "/tp/final --set train.out_dir=" + dir + "/single");
  EXPECT_EQ(single.exit_code, 0) << single.output;
  // And back: each tensor-parallel rank loads its slices of the one-process checkpoint.
  const auto back = run_trainer(tiny_args(dir, corpus) + " --set train.max_steps=2 --set model.weights=" + dir +
                                "/single/final --set train.out_dir=" + dir + "/back --plugin tensor_parallel --nproc 2");
  EXPECT_EQ(back.exit_code, 0) << back.output;

  // Greedy generation from the trained model: the same tokens in one process and over 2 and 4
  // tensor-parallel ranks (each with a KV cache of its own heads).
  const std::string generate = "generate --config " + std::string(WEFT_SOURCE_DIR) +
                               "/configs/tiny.toml --set model.weights=" + dir +
                               "/tp/final --prompt 'the quick brown' --set generate.max_new_tokens=24 --log-level warn";
  const auto one = run_trainer(generate);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const std::string tokens = one.output.substr(0, one.output.find('\n'));
  ASSERT_EQ(tokens.rfind("tokens: ", 0), 0u) << one.output;
  EXPECT_GT(tokens.size(), std::string("tokens: ").size()) << one.output;
  for (const char* ranks : {"2", "4"}) {
    const auto tp_run = run_trainer(generate + " --plugin tensor_parallel --nproc " + ranks);
    ASSERT_EQ(tp_run.exit_code, 0) << tp_run.output;
    EXPECT_EQ(tp_run.output.substr(0, tp_run.output.find('\n')), tokens) << ranks << " ranks:\n" << tp_run.output;
  }
}

}  // namespace
