// The C++ example plugin (sdk/examples/cpp_single) run against the fake host: its source is
// compiled into this test with its entry point renamed (the executable's weft_strategy_entry is
// the C++ test strategy's).
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/fake_host.h"

#define weft_strategy_entry cpp_single_entry
#include "../../sdk/examples/cpp_single/cpp_single.cpp"
#undef weft_strategy_entry

namespace {

TEST(CppSingleExample, RunsTheReferenceStepAndLogsThroughTheHost) {
  fake_status_counts() = {};
  const weft_host_api api = make_fake_host_api();
  weft_host host;
  host.ints["log_every"] = 5;
  const weft_strategy_api* table = cpp_single_entry(1, 0);
  ASSERT_NE(table, nullptr);
  EXPECT_STREQ(table->name, "cpp_single");
  EXPECT_EQ(table->eval_step, nullptr);  // left to the host

  weft_strategy* instance = nullptr;
  ASSERT_EQ(take_status(table->create(&api, &host, &instance)).first, WEFT_STATUS_OK);
  weft_step_info step{};
  step.struct_size = sizeof step;
  step.step = 10;
  step.micro_batches = 3;
  double loss = -1.0;
  ASSERT_EQ(take_status(table->train_step(instance, &step, &loss)).first, WEFT_STATUS_OK);
  table->destroy(instance);

  EXPECT_DOUBLE_EQ(loss, 2.0);  // the fake's losses 1, 2, 3
  EXPECT_EQ(host.forward_ranges, (std::vector<std::pair<int64_t, int64_t>>(3, {0, 4})));
  EXPECT_EQ(host.backward_scales, (std::vector<double>(3, 1.0 / 3)));
  EXPECT_TRUE(host.live_activations.empty());
  ASSERT_EQ(host.logs.size(), 1u);
  EXPECT_EQ(host.logs[0].second, "step 10: mean loss 2.0000 over 3 micro-batches");
}

TEST(CppSingleExample, RefusesAWorldOfMoreThanOneProcess) {
  fake_status_counts() = {};
  const weft_host_api api = make_fake_host_api();
  weft_host host;
  host.world = {1, 4};
  weft_strategy* instance = nullptr;
  const auto status = take_status(cpp_single_entry(1, 0)->create(&api, &host, &instance));
  EXPECT_EQ(status.first, WEFT_STATUS_BAD_CONFIG);
  EXPECT_EQ(status.second, "cpp_single runs on one process, not 4");
  EXPECT_EQ(instance, nullptr);
  EXPECT_EQ(fake_status_counts().created, fake_status_counts().released);
}

}  // namespace
