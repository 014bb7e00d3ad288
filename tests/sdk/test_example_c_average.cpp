// The plain-C example plugin (sdk/examples/c_average) run against the fake host: its source is
// compiled here as C++ with its entry point renamed (this executable's weft_strategy_entry is
// the C++ test strategy's). A world of 2 where the other rank's gradients are all 3.
#include <vector>

#include <gtest/gtest.h>

#include "common/fake_host.h"

#define weft_strategy_entry c_average_entry
extern "C" {
#include "../../sdk/examples/c_average/c_average.c"
}
#undef weft_strategy_entry

namespace {

TEST(CAverageExample, StepsThenAveragesTrainableGradientsAndTheLossOverTheWorld) {
  fake_status_counts() = {};
  const weft_host_api api = make_fake_host_api();
  weft_host host;
  host.world = {0, 2};
  host.peer_value = 3.0;
  host.parameters = {{"embed", true, {1.0f, 5.0f}, 2}, {"frozen", false, {7.0f}, 1},
                     {"head", true, {-3.0f}, 1}};
  const weft_strategy_api* table = c_average_entry(1, 0);
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(c_average_entry(2, 0), nullptr);
  EXPECT_STREQ(table->name, "c_average");

  weft_strategy* instance = nullptr;
  ASSERT_EQ(take_status(table->create(&api, &host, &instance)).first, WEFT_STATUS_OK);
  weft_step_info step{};
  step.struct_size = sizeof step;
  step.micro_batches = 2;
  double loss = -1.0;
  const auto status = take_status(table->train_step(instance, &step, &loss));
  ASSERT_EQ(status.first, WEFT_STATUS_OK) << status.second;
  table->destroy(instance);

  EXPECT_EQ(host.loss_scales, (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(host.backward_scales, (std::vector<double>{0.5, 0.5}));
  // (local + peer) / 2 for trainable gradients; frozen ones untouched.
  EXPECT_EQ(host.parameters[0].grad, (std::vector<float>{2.0f, 4.0f}));
  EXPECT_EQ(host.parameters[1].grad, (std::vector<float>{7.0f}));
  EXPECT_EQ(host.parameters[2].grad, (std::vector<float>{0.0f}));
  // Local losses 1 and 2 (sum 3), the peer's sum 3: (3 + 3) / 2 micro-batches / 2 ranks.
  EXPECT_DOUBLE_EQ(loss, 1.5);
  EXPECT_EQ(host.all_reduces, 3);  // two trainable gradients and the loss
  EXPECT_TRUE(host.live_activations.empty());
  EXPECT_TRUE(host.live_works.empty());
  EXPECT_EQ(fake_status_counts().created, 0);
}

TEST(CAverageExample, RejectsGradientsItCannotAverage) {
  fake_status_counts() = {};
  const weft_host_api api = make_fake_host_api();
  weft_host host;
  host.parameters = {{"strided", true, {1.0f, 2.0f, 3.0f, 4.0f}, 2, 2}};  // every other float
  weft_strategy* instance = nullptr;
  const weft_strategy_api* table = c_average_entry(1, 0);
  ASSERT_EQ(take_status(table->create(&api, &host, &instance)).first, WEFT_STATUS_OK);
  weft_step_info step{};
  step.micro_batches = 1;
  double loss = -1.0;
  const auto status = take_status(table->train_step(instance, &step, &loss));
  EXPECT_EQ(status.first, WEFT_STATUS_UNSUPPORTED);
  EXPECT_EQ(status.second, "c_average: the gradient of strided is not a contiguous fp32 CPU tensor");
  EXPECT_EQ(loss, -1.0);
  EXPECT_TRUE(host.live_activations.empty());
  table->destroy(instance);
}

}  // namespace
