// Plugins composed over a device mesh with real processes: compositions that cannot
// work are refused in one line naming the problem, before compute; a composed run says how it laid
// the ranks out. (Loss and parameter parity: Conformance.mesh.*; checkpoints that reshard between
// meshes: ShardedCheckpoint.ATensorTimesPipelineMesh*.) Settings a plugin alone would read from
// [plugin] come from [plugin.<name>] first in a composed run.
#include <string>

#include <gtest/gtest.h>

#include "common/corpus.h"
#include "common/process.h"
#include "test_paths.h"

namespace {

using weft::testing::run_trainer;

std::string tiny_args(const std::string& dir, const std::string& corpus) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + corpus +
         " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32 --set train.batch_size=8"
         " --set train.precision=fp32 --set log.progress=off --set train.max_steps=2 --set train.out_dir=" + dir + "/out";
}

// ~15 s (ctest -j2, 2-core Xeon): 8 compositions, each refused by its ranks once they have started
// (up to 8 processes), before the model is built.
TEST(MeshRun, CompositionsThatCannotWorkAreRefusedBeforeCompute) {
  const auto dir = weft::testing::fresh_dir("weft_test_mesh", "refuse");
  const auto corpus = weft::testing::write_word_corpus(dir);
  const struct {
    std::string args, message;
  } cases[] = {
      {"--plugin tensor_parallel,gpipe --nproc 4", "the device mesh is ambiguous: set mesh.pp and mesh.tp"},
      {"--plugin tensor_parallel,gpipe --nproc 4 --set mesh.tp=2 --set mesh.pp=1",
       "the device mesh dp 2 x tp 2 has dp = 2 but no plugin of train.plugin = \"tensor_parallel,gpipe\" owns it"},
      {"--plugin gpipe,pipedream --nproc 2", "plugins gpipe and pipedream both own the pipeline dimension"},
      {"--plugin single,ddp --nproc 2", "plugin single owns no mesh dimension, so it runs alone"},
      {"--plugin gpipe --nproc 2 --set mesh.tp=2", "[mesh] tp = 2 lays the ranks on a device mesh, which needs several plugins"},
      {"--plugin tensor_parallel,gpipe --nproc 4 --set mesh.tp=3", "multiply to 3, which does not divide the world size 4"},
      // Context parallelism and Megatron sequence parallelism together: the tensor-parallel ranks split each
      // context-parallel rank's share of the tokens, which must divide.
      {"--plugin context_parallel,tensor_parallel --nproc 4 --set mesh.cp=2 --set mesh.tp=2 --set plugin.sequence_parallel=true"
       " --set data.seq_len=34",
       "data.seq_len = 34 (17 tokens per context-parallel rank) cannot be split over 2 tensor-parallel ranks"},
      // The all-to-all over the heads tensor parallelism leaves a rank: the tiny model's 4, 2 per tp rank, over 4 cp ranks.
      {"--plugin context_parallel,tensor_parallel --nproc 8 --set mesh.cp=4 --set mesh.tp=2",
       "context parallelism: the model's 4 attention heads, 2 per tensor-parallel rank, cannot be split over 4 "
       "ranks by the all-to-all around attention (\"attention.exchange\")"},
  };
  for (const auto& c : cases) {
    const auto r = run_trainer(tiny_args(dir, corpus) + " " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("training:"), std::string::npos) << c.args << ": refused after compute started:\n" << r.output;
  }
}

TEST(MeshRun, AComposedRunSaysHowItLaysTheRanksOutAndWhichStepRuns) {
  const auto dir = weft::testing::fresh_dir("weft_test_mesh", "describe");
  const auto corpus = weft::testing::write_word_corpus(dir);
  // The plugins as a TOML list (train.plugin = ["ddp", ...]; --plugin takes them comma-separated).
  const auto r = run_trainer(tiny_args(dir, corpus) + " --set 'train.plugin=[\"ddp\", \"tensor_parallel\", \"gpipe\"]' "
                             "--nproc 8 --set mesh.tp=2"
                             " --set mesh.pp=2 --set plugin.microbatches=2 --log-level info");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Listed in any order: the pipeline's step runs, with the others' layouts over their dimensions.
  EXPECT_NE(r.output.find("device mesh pp 2 x dp 2 x tp 2 (8 ranks): gpipe runs the step, its pipeline over pp 2, with "
                          "ddp's layout over dp 2 and tensor_parallel's layout over tp 2"),
            std::string::npos)
      << r.output;
  // Without a pipeline the tensor-parallel plugin's step runs, ZeRO-3's and context parallelism's layouts in it.
  const auto fsdp = run_trainer(tiny_args(dir, corpus) + " --plugin context_parallel,zero,tensor_parallel --nproc 8"
                                " --set mesh.tp=2 --set mesh.cp=2 --set plugin.stage=3 --set train.overwrite=true --log-level info");
  ASSERT_EQ(fsdp.exit_code, 0) << fsdp.output;
  EXPECT_NE(fsdp.output.find("device mesh dp 2 x cp 2 x tp 2 (8 ranks): tensor_parallel runs the step, its slices over tp 2, "
                             "with zero's layout over dp 2 and context_parallel's layout over cp 2"),
            std::string::npos) << fsdp.output;
  EXPECT_NE(fsdp.output.find("plugin context_parallel splits every sequence over 2 ranks"), std::string::npos) << fsdp.output;
}

// [plugin.<name>] settings reach that plugin alone: context_parallel's and pipedream's `mode` differ in one run.
TEST(MeshRun, EachPluginReadsItsOwnSubTableOverTheSharedPluginSettings) {
  const auto dir = weft::testing::fresh_dir("weft_test_mesh", "subtable");
  const auto corpus = weft::testing::write_word_corpus(dir);
  const auto r = run_trainer(tiny_args(dir, corpus) + " --plugin context_parallel,pipedream --nproc 4 --set mesh.cp=2"
                             " --set mesh.pp=2 --set 'plugin.mode=\"flush\"' --set 'plugin.context_parallel.mode=\"ring\"'"
                             " --set plugin.microbatches=2 --log-level info");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("device mesh pp 2 x cp 2 (4 ranks): pipedream runs the step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("plugin pipedream settings: mode = \"flush\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("plugin context_parallel settings: mode = \"ring\""), std::string::npos) << r.output;
}

}  // namespace
