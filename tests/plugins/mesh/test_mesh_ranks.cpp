// Plugins composed over a device mesh (ABI 1.12) with real processes: compositions that cannot
// work are refused in one line naming the problem, before compute; a composed run says how it laid
// the ranks out. (Loss and parameter parity: Conformance.mesh.*; checkpoints that reshard between
// meshes: ShardedCheckpoint.ATensorTimesPipelineMesh*.)
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

TEST(MeshRun, CompositionsThatCannotWorkAreRefusedBeforeCompute) {
  const auto dir = weft::testing::fresh_dir("weft_test_mesh", "refuse");
  const auto corpus = weft::testing::write_word_corpus(dir);
  const struct {
    std::string args, message;
  } cases[] = {
      {"--plugin tensor_parallel,gpipe --nproc 4", "the device mesh is ambiguous: set mesh.pp and mesh.tp"},
      {"--plugin tensor_parallel,gpipe --nproc 4 --set mesh.tp=2 --set mesh.pp=1",
       "has dp = 2 but no plugin of train.plugin = \"tensor_parallel,gpipe\" owns it: add ddp"},
      {"--plugin gpipe,pipedream --nproc 2", "pipedream owns the same mesh dimension as another: pp (gpipe)"},
      {"--plugin gpipe,zero --nproc 4 --set mesh.pp=2 --set plugin.stage=3",
       "zero: plugin.stage = 3 gathers each model stage's parameters around its own forward and backward"},
      // A plugin built before ABI 1.12 still runs alone (PluginLoader.*) but does not compose.
      {"--plugin " + std::string(WEFT_PLUGIN_FIXTURE_DIR) + "/good.so,gpipe --nproc 2",
       "plugin good (ABI 1.0) cannot compose with others on a device mesh (ABI 1.12)"},
      {"--plugin single,ddp --nproc 2", "plugin single runs alone only"},
      {"--plugin gpipe --nproc 2 --set mesh.tp=2", "[mesh] tp = 2 lays the ranks on a device mesh, which needs several plugins"},
      {"--plugin tensor_parallel,gpipe --nproc 4 --set mesh.tp=3", "multiply to 3, which does not divide the world size 4"},
  };
  for (const auto& c : cases) {
    const auto r = run_trainer(tiny_args(dir, corpus) + " " + c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("training:"), std::string::npos) << c.args << ": refused after compute started:\n" << r.output;
  }
}

TEST(MeshRun, AComposedRunSaysHowItLaysTheRanksOutAndWhoDrivesTheStep) {
  const auto dir = weft::testing::fresh_dir("weft_test_mesh", "describe");
  const auto corpus = weft::testing::write_word_corpus(dir);
  // The plugins as a TOML list (train.plugin = ["ddp", ...]; --plugin takes them comma-separated).
  const auto r = run_trainer(tiny_args(dir, corpus) + " --set 'train.plugin=[\"ddp\", \"tensor_parallel\", \"gpipe\"]' "
                             "--nproc 8 --set mesh.tp=2"
                             " --set mesh.pp=2 --set plugin.microbatches=2 --log-level info");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Listed in any order; the host orders them: the pipeline drives, then tp, then dp.
  EXPECT_NE(r.output.find("device mesh pp 2 x dp 2 x tp 2 (8 ranks): gpipe drives the step; gpipe owns pp (2), "
                          "tensor_parallel owns tp (2), ddp owns dp (2)"),
            std::string::npos)
      << r.output;
}

}  // namespace
