// Every run goes through a strategy: without a plugin, the built-in single (plugins/single compiled
// into the host); single.so loaded from its file must take exactly the same steps.
#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/train/trainer.h"
#include "core/util/error.h"
#include "test_paths.h"
#include "train_test_util.h"

namespace weft {
namespace {

const std::string kSinglePlugin = std::string(WEFT_BINARY_DIR) + "/plugins/single.so";

TEST(Strategy, TheBuiltInSingleAndSingleSoTakeExactlyTheSameSteps) {
  const auto dir = testing::fresh_dir("single_plugin");
  auto builtin = testing::tiny_options(dir);
  builtin.grad_accum_steps = 2;
  builtin.batch_size = 2;
  builtin.eval_every = 3;
  auto plugin = builtin;
  plugin.plugin = kSinglePlugin;
  plugin.out_dir = dir + "/plugin";
  plugin.metrics_file = "";
  Trainer a(builtin);
  Trainer b(plugin);
  EXPECT_EQ(a.job().strategy().library().name(), "single");
  EXPECT_EQ(a.job().strategy().library().path(), "(built in)");
  EXPECT_EQ(b.job().strategy().library().name(), "single");
  EXPECT_EQ(b.job().strategy().library().path(), std::filesystem::canonical(kSinglePlugin).string());
  const auto ra = a.run();
  const auto rb = b.run();
  ASSERT_EQ(ra.step_losses.size(), rb.step_losses.size());
  for (size_t i = 0; i < ra.step_losses.size(); ++i) EXPECT_EQ(ra.step_losses[i], rb.step_losses[i]) << i;
  ASSERT_TRUE(ra.final_eval && rb.final_eval);
  EXPECT_EQ(ra.final_eval->loss, rb.final_eval->loss);
  auto pa = a.model().named_parameters();
  for (auto& item : b.model().named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), pa[item.key()])) << item.key();
  }
}

TEST(Strategy, AMissingPluginIsRefusedBeforeTraining) {
  const auto dir = testing::fresh_dir("missing_plugin");
  auto o = testing::tiny_options(dir);
  o.plugin = dir + "/nope.so";
  try {
    Trainer t(o);
    FAIL() << "loaded a missing plugin";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nope.so"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace weft
