// The C++ SDK layer (weft/strategy.hpp) driven in-process through a fake host: the table the
// WEFT_STRATEGY macro generates, exception <-> status bridging, Host wrappers and RAII handles.
#include <cstring>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include <weft/strategy.hpp>

#include "common/fake_host.h"

namespace {

using weft::sdk::Activation;
using weft::sdk::Error;
using weft::sdk::Host;
using weft::sdk::Strategy;
using weft::sdk::Work;

// The strategy behind this executable's one weft_strategy_entry. Its train_step misbehaves on
// request (TestStrategy::mode) so the tests can see what crosses the boundary.
class TestStrategy : public Strategy {
 public:
  enum class Mode { reference, throw_std, throw_sdk_error, throw_int };
  static Mode mode;
  static int alive;

  explicit TestStrategy(Host host) : Strategy(host) {
    if (host.config_bool("fail_create", false)) throw Error(WEFT_STATUS_BAD_CONFIG, "bad create");
    factor_ = host.config_int("factor", 2);
    ++alive;
  }
  ~TestStrategy() override { --alive; }

  double train_step(const weft_step_info& step) override {
    switch (mode) {
      case Mode::throw_std: throw std::runtime_error("boom");
      case Mode::throw_sdk_error: throw Error(WEFT_STATUS_UNSUPPORTED, "not on this rank");
      case Mode::throw_int: throw 42;
      case Mode::reference: break;
    }
    return single_process_train_step(step);
  }
  double global_grad_norm_sq(double local_sq) override { return local_sq * factor_; }
  void comm_point(weft_comm_point point, weft_direction direction, int64_t layer,
                  DLTensor& tensor) override {
    if (layer < 0) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "no layer");
    static_cast<float*>(tensor.data)[0] = static_cast<float>(point * 100 + direction * 10 + layer);
  }

 private:
  int64_t factor_;
};
TestStrategy::Mode TestStrategy::mode = TestStrategy::Mode::reference;
int TestStrategy::alive = 0;

}  // namespace

WEFT_STRATEGY(TestStrategy, "test", "0.3.1", "drives the SDK's tests")

namespace {

// A strategy only used through detail::make_table (no second entry point): overrides plan.
class PlanStrategy : public Strategy {
 public:
  using Strategy::Strategy;
  double train_step(const weft_step_info&) override { return 0.0; }
  void plan(weft_model_plan& plan) override {
    plan.first_stage = 1;
    if (plan.last_stage == 99) throw std::logic_error("half-written plan");
    plan.data_parallel_size = 2;
  }
};
static_assert(weft::sdk::detail::overrides_plan<PlanStrategy>(), "declares plan");
static_assert(!weft::sdk::detail::overrides_setup<PlanStrategy>(), "inherits setup");
static_assert(WEFT_LOG_INFO == 2, "the log-level enumerators survive the logging macros");

weft_step_info step_with(int32_t micro_batches) {
  weft_step_info step{};
  step.struct_size = sizeof step;
  step.micro_batches = micro_batches;
  step.rows_per_micro_batch = 2;
  step.seq_len = 8;
  return step;
}

class SdkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_status_counts() = {};
    TestStrategy::mode = TestStrategy::Mode::reference;
    table = weft_strategy_entry(WEFT_ABI_VERSION_MAJOR, WEFT_ABI_VERSION_MINOR);
    ASSERT_NE(table, nullptr);
  }
  // Every status created was released, and no handle was released twice or leaked.
  void expect_clean() const {
    EXPECT_EQ(fake_status_counts().created, fake_status_counts().released);
    EXPECT_EQ(host.double_releases, 0);
    EXPECT_TRUE(host.live_activations.empty());
    EXPECT_TRUE(host.live_works.empty());
  }
  weft_strategy* create_instance() {
    weft_strategy* instance = nullptr;
    EXPECT_EQ(take_status(table->create(&api, &host, &instance)).first, WEFT_STATUS_OK);
    EXPECT_NE(instance, nullptr);
    return instance;
  }

  weft_host_api api = make_fake_host_api();
  weft_host host;
  Host sdk_host{&api, &host};
  const weft_strategy_api* table = nullptr;
};

// --- the generated entry point and table ---

TEST_F(SdkTest, EntryServesOnlyItsOwnMajor) {
  EXPECT_EQ(weft_strategy_entry(2, 0), nullptr);
  EXPECT_EQ(weft_strategy_entry(0, 7), nullptr);
  EXPECT_EQ(weft_strategy_entry(1, 9), table);  // a newer host minor gets the same table
}

TEST_F(SdkTest, TableHeaderNamesAndSlots) {
  EXPECT_EQ(table->header.struct_size, sizeof(weft_strategy_api));
  EXPECT_EQ(table->header.abi_major, 1);
  EXPECT_EQ(table->header.abi_minor, WEFT_ABI_VERSION_MINOR);
  EXPECT_EQ(table->min_host_minor, 0);
  EXPECT_STREQ(table->name, "test");
  EXPECT_STREQ(table->version, "0.3.1");
  EXPECT_STREQ(table->description, "drives the SDK's tests");
  EXPECT_NE(table->create, nullptr);
  EXPECT_NE(table->destroy, nullptr);
  EXPECT_NE(table->train_step, nullptr);
  // Overridden optional slots are filled; the others stay NULL (the host's defaults).
  EXPECT_NE(table->global_grad_norm_sq, nullptr);
  EXPECT_NE(table->comm_point, nullptr);
  EXPECT_EQ(table->plan, nullptr);
  EXPECT_EQ(table->shard_parameter, nullptr);
  EXPECT_EQ(table->setup, nullptr);
  EXPECT_EQ(table->eval_step, nullptr);
}

TEST_F(SdkTest, CreateTrainStepDestroyRoundTrip) {
  weft_strategy* instance = create_instance();
  EXPECT_EQ(TestStrategy::alive, 1);

  const weft_step_info step = step_with(2);
  double loss = -1.0;
  EXPECT_EQ(take_status(table->train_step(instance, &step, &loss)).first, WEFT_STATUS_OK);
  EXPECT_DOUBLE_EQ(loss, 1.5);  // the fake's losses 1 and 2, averaged
  EXPECT_EQ(host.batches, (std::vector<std::pair<int32_t, int32_t>>{{0, 1}, {1, 1}}));
  EXPECT_EQ(host.forward_ranges, (std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {0, 4}}));
  EXPECT_EQ(host.forward_flags, (std::vector<uint32_t>{0, 0}));
  EXPECT_EQ(host.loss_scales, (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(host.backward_scales, (std::vector<double>{0.5, 0.5}));
  EXPECT_EQ(host.activation_releases, 8);  // inputs, targets, logits, loss per micro-batch

  table->destroy(instance);
  EXPECT_EQ(TestStrategy::alive, 0);
  expect_clean();
}

TEST_F(SdkTest, CreateFailureIsAStatusAndLeavesOutUntouched) {
  host.bools["fail_create"] = true;
  auto* sentinel = reinterpret_cast<weft_strategy*>(&host);
  weft_strategy* instance = sentinel;
  const auto status = take_status(table->create(&api, &host, &instance));
  EXPECT_EQ(status.first, WEFT_STATUS_BAD_CONFIG);
  EXPECT_EQ(status.second, "bad create");
  EXPECT_EQ(instance, sentinel);
  EXPECT_EQ(TestStrategy::alive, 0);
  expect_clean();
}

TEST_F(SdkTest, StdExceptionBecomesInternalStatus) {
  weft_strategy* instance = create_instance();
  TestStrategy::mode = TestStrategy::Mode::throw_std;
  const weft_step_info step = step_with(1);
  double loss = -1.0;
  const auto status = take_status(table->train_step(instance, &step, &loss));
  EXPECT_EQ(status.first, WEFT_STATUS_INTERNAL);
  EXPECT_EQ(status.second, "boom");
  EXPECT_EQ(loss, -1.0);  // out-parameter untouched on error
  table->destroy(instance);
  expect_clean();
}

TEST_F(SdkTest, SdkErrorKeepsItsCode) {
  weft_strategy* instance = create_instance();
  TestStrategy::mode = TestStrategy::Mode::throw_sdk_error;
  const weft_step_info step = step_with(1);
  double loss = -1.0;
  const auto status = take_status(table->train_step(instance, &step, &loss));
  EXPECT_EQ(status.first, WEFT_STATUS_UNSUPPORTED);
  EXPECT_EQ(status.second, "not on this rank");
  table->destroy(instance);
  expect_clean();
}

TEST_F(SdkTest, NonStandardExceptionBecomesUnknownException) {
  weft_strategy* instance = create_instance();
  TestStrategy::mode = TestStrategy::Mode::throw_int;
  const weft_step_info step = step_with(1);
  double loss = -1.0;
  const auto status = take_status(table->train_step(instance, &step, &loss));
  EXPECT_EQ(status.first, WEFT_STATUS_INTERNAL);
  EXPECT_EQ(status.second, "unknown exception");
  table->destroy(instance);
  expect_clean();
}

TEST_F(SdkTest, HostFailureInsideAStepReturnsTheHostsErrorAndReleasesEverything) {
  weft_strategy* instance = create_instance();
  host.fail_forward = "rank 3 unreachable";
  const weft_step_info step = step_with(2);
  double loss = -1.0;
  const auto status = take_status(table->train_step(instance, &step, &loss));
  EXPECT_EQ(status.first, WEFT_STATUS_COMMUNICATION);
  EXPECT_EQ(status.second, "rank 3 unreachable");
  EXPECT_EQ(fake_status_counts().created, 2);  // the host's (released by the SDK) + the plugin's
  EXPECT_EQ(host.activation_releases, 2);      // the batch's inputs and targets, unwound
  table->destroy(instance);
  expect_clean();
}

TEST_F(SdkTest, OptionalSlotsReachTheOverrides) {
  host.ints["factor"] = 3;
  weft_strategy* instance = create_instance();
  double global_sq = 0.0;
  EXPECT_EQ(take_status(table->global_grad_norm_sq(instance, 2.5, &global_sq)).first,
            WEFT_STATUS_OK);
  EXPECT_DOUBLE_EQ(global_sq, 7.5);

  float value = 0.0f;
  int64_t shape = 1;
  DLTensor tensor{};
  tensor.data = &value;
  tensor.ndim = 1;
  tensor.shape = &shape;
  tensor.dtype = {kDLFloat, 32, 1};
  EXPECT_EQ(take_status(table->comm_point(instance, WEFT_COMM_MLP_OUTPUT, WEFT_BACKWARD, 5,
                                          &tensor)).first, WEFT_STATUS_OK);
  EXPECT_EQ(value, 315.0f);
  const auto status =
      take_status(table->comm_point(instance, WEFT_COMM_LOSS_SUM, WEFT_FORWARD, -1, &tensor));
  EXPECT_EQ(status.first, WEFT_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status.second, "no layer");
  table->destroy(instance);
  expect_clean();
}

TEST_F(SdkTest, PlanSlotWritesThePlanOnlyOnSuccess) {
  const weft_strategy_api plan_table =
      weft::sdk::detail::make_table<PlanStrategy>("plan", "1", "plans");
  ASSERT_NE(plan_table.plan, nullptr);
  EXPECT_EQ(plan_table.setup, nullptr);
  weft_strategy* instance = nullptr;
  ASSERT_EQ(take_status(plan_table.create(&api, &host, &instance)).first, WEFT_STATUS_OK);

  weft_model_plan plan{sizeof(weft_model_plan), 0, 4, 1, 0, 1, 0, 0, 0};
  EXPECT_EQ(take_status(plan_table.plan(instance, &plan)).first, WEFT_STATUS_OK);
  EXPECT_EQ(plan.first_stage, 1);
  EXPECT_EQ(plan.last_stage, 4);
  EXPECT_EQ(plan.data_parallel_size, 2);
  EXPECT_EQ(plan.struct_size, sizeof(weft_model_plan));

  weft_model_plan failing{sizeof(weft_model_plan), 0, 99, 1, 0, 1, 0, 0, 0};
  const auto status = take_status(plan_table.plan(instance, &failing));
  EXPECT_EQ(status.first, WEFT_STATUS_INTERNAL);
  EXPECT_EQ(status.second, "half-written plan");
  EXPECT_EQ(failing.first_stage, 0);  // the plugin wrote 1 before throwing: not copied back
  plan_table.destroy(instance);
  expect_clean();
}

// --- the Strategy base class's one-process defaults ---

TEST_F(SdkTest, BaseDefaultsReproduceOneProcessBehaviour) {
  TestStrategy strategy(sdk_host);
  const weft_shard shard = strategy.shard_parameter(weft_parameter_info{});
  EXPECT_EQ(shard.dim, 0);
  EXPECT_EQ(shard.parts, 1);
  EXPECT_EQ(shard.index, 0);

  weft_model_plan plan{sizeof(weft_model_plan), 0, 4, 1, 0, 1, 0, 0, 0};
  strategy.plan(plan);
  EXPECT_EQ(plan.first_stage, 0);
  EXPECT_EQ(plan.last_stage, 4);

  // Eval: whole model, no grad, unscaled losses 1 and 2 over 10 tokens each.
  const weft::sdk::EvalResult eval = strategy.eval_step(step_with(2));
  EXPECT_DOUBLE_EQ(eval.loss_sum, 30.0);
  EXPECT_EQ(eval.tokens, 20);
  EXPECT_EQ(host.forward_flags, (std::vector<uint32_t>{WEFT_FORWARD_NO_GRAD, WEFT_FORWARD_NO_GRAD}));
  EXPECT_EQ(host.loss_scales, (std::vector<double>{1.0, 1.0}));
  EXPECT_TRUE(host.backward_scales.empty());
  EXPECT_EQ(strategy.Strategy::global_grad_norm_sq(4.0), 4.0);
  expect_clean();
}

// --- errors and Host wrappers ---

TEST(SdkError, KeepsItsCodeAndNeverCarriesOk) {
  const Error error(WEFT_STATUS_TIMEOUT, "late");
  EXPECT_EQ(error.code(), WEFT_STATUS_TIMEOUT);
  EXPECT_STREQ(error.what(), "late");
  EXPECT_EQ(Error(WEFT_STATUS_OK, "odd").code(), WEFT_STATUS_INTERNAL);
}

TEST_F(SdkTest, HostConvertsAFailingStatusIntoErrorAndReleasesIt) {
  try {
    sdk_host.config_int("wrong_type", 1);
    FAIL() << "expected weft::sdk::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), WEFT_STATUS_BAD_CONFIG);
    EXPECT_STREQ(e.what(), "plugin.wrong_type: expected another type");
  }
  EXPECT_THROW(sdk_host.config_string("wrong_type", "x"), Error);
  EXPECT_EQ(fake_status_counts().created, 2);
  EXPECT_EQ(fake_status_counts().released, 2);
}

TEST_F(SdkTest, ConfigGettersReturnValuesOrFallbacks) {
  host.ints["layers"] = 12;
  host.bools["overlap"] = true;
  host.strings["mode"] = "bucketed";
  EXPECT_EQ(sdk_host.config_int("layers", 1), 12);
  EXPECT_EQ(sdk_host.config_int("absent", -4), -4);
  EXPECT_DOUBLE_EQ(sdk_host.config_float("layers", 0.5), 12.0);
  EXPECT_DOUBLE_EQ(sdk_host.config_float("absent", 0.5), 0.5);
  EXPECT_TRUE(sdk_host.config_bool("overlap", false));
  EXPECT_TRUE(sdk_host.config_bool("absent", true));
  EXPECT_EQ(sdk_host.config_string("mode", "plain"), "bucketed");
  EXPECT_EQ(sdk_host.config_string("absent", "plain"), "plain");
}

TEST_F(SdkTest, WorkWaitFailureThrowsAndTheHandleIsStillReleasedOnce) {
  host.fail_wait = true;
  {
    DLTensor tensor{};
    Work work = sdk_host.all_reduce(sdk_host.world(), tensor);
    try {
      work.wait();
      FAIL() << "expected weft::sdk::Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), WEFT_STATUS_TIMEOUT);
      EXPECT_STREQ(e.what(), "all_reduce timed out");
    }
  }
  EXPECT_EQ(host.work_releases, 1);
  EXPECT_THROW(Work().wait(), Error);
  expect_clean();
}

TEST_F(SdkTest, GroupsAreNonOwningViews) {
  host.world = {3, 8};
  const weft::sdk::Group world = sdk_host.world();
  EXPECT_EQ(world.get(), &host.world);
  EXPECT_EQ(world.rank(), 3);
  EXPECT_EQ(world.size(), 8);
  EXPECT_TRUE(world.contains_self());
}

TEST_F(SdkTest, NegotiatedMinorIsTheSmallerOfBoth) {
  weft_host_api newer = make_fake_host_api(WEFT_ABI_VERSION_MINOR + 1);
  EXPECT_EQ(Host(&newer, &host).negotiated_minor(), WEFT_ABI_VERSION_MINOR);
  EXPECT_EQ(sdk_host.negotiated_minor(), kFakeHostMinor);  // the fake host's own minor is older
}

// ABI 1.13 appended weft_step_info.stage_tokens: a plugin reads the host's step through the SDK's
// copy, which stops at the host's struct_size and says seq_len for a host that predates the field.
TEST(SdkStep, AStepFromAHostBefore113PassesWholeSequencesBetweenStages) {
  weft_step_info step{};
  step.struct_size = sizeof step;
  step.seq_len = 64;
  step.stage_tokens = 16;  // this rank's quarter of a split sequence
  EXPECT_EQ(weft::sdk::detail::step_of(&step).stage_tokens, 16);
  step.struct_size = offsetof(weft_step_info, stage_tokens);  // a 1.12 host's struct, whatever lies after it
  step.stage_tokens = 12345;
  const weft_step_info old = weft::sdk::detail::step_of(&step);
  EXPECT_EQ(old.stage_tokens, 64);
  EXPECT_EQ(old.seq_len, 64);
  EXPECT_EQ(old.struct_size, sizeof(weft_step_info));
}

TEST_F(SdkTest, Abi13ServicesRefuseAnOlderHostInOneLine) {
  ASSERT_LT(sdk_host.negotiated_minor(), 3);
  try {
    sdk_host.parameter_shard(0);
    FAIL() << "parameter_shard on a 1.2 host";
  } catch (const weft::sdk::Error& e) {
    EXPECT_EQ(e.code(), WEFT_STATUS_UNSUPPORTED);
    EXPECT_NE(std::string(e.what()).find("parameter_shard needs host ABI >= 1.3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(sdk_host.release_parameter(0), weft::sdk::Error);
  EXPECT_THROW(sdk_host.materialize_parameter(0), weft::sdk::Error);
}

TEST_F(SdkTest, Abi11ServicesWorkOnA11HostAndDegradeOnA10Host) {
  const weft_model_info info = sdk_host.model_info();
  EXPECT_EQ(info.struct_size, sizeof(weft_model_info));
  EXPECT_EQ(info.hidden_size, 64);
  EXPECT_EQ(info.tie_word_embeddings, 1);
  {
    weft::sdk::TraceSpan span(sdk_host, "forward", "F0");
    sdk_host.report_metric("bubble", 0.25);
  }
  EXPECT_EQ(host.trace, (std::vector<std::string>{"+forward/F0", "-"}));
  EXPECT_EQ(host.metrics.at("bubble"), 0.25);

  weft_host_api older = make_fake_host_api(0);  // a 1.0 host: the 1.1 slots must not be called
  older.model_info = nullptr;
  older.trace_begin = nullptr;
  older.trace_end = nullptr;
  older.report_metric = nullptr;
  const Host old_host(&older, &host);
  try {
    old_host.model_info();
    FAIL() << "no exception";
  } catch (const weft::sdk::Error& e) {
    EXPECT_EQ(e.code(), WEFT_STATUS_UNSUPPORTED);
  }
  { weft::sdk::TraceSpan span(old_host, "forward", "F1"); }
  old_host.report_metric("bubble", 0.5);
  EXPECT_EQ(host.trace.size(), 2u);
  EXPECT_EQ(host.metrics.at("bubble"), 0.25);
}

// --- RAII handles ---

TEST_F(SdkTest, ActivationsAreReleasedExactlyOnce) {
  {
    weft::sdk::Batch batch = sdk_host.batch(0);
    weft_activation* inputs = batch.inputs.get();
    Activation moved(std::move(batch.inputs));  // NOLINT: testing the moved-from state
    EXPECT_EQ(moved.get(), inputs);
    EXPECT_FALSE(batch.inputs);
    Activation assigned;
    assigned = std::move(moved);
    EXPECT_FALSE(moved);
    EXPECT_EQ(host.activation_releases, 0);

    assigned = std::move(batch.targets);  // releases the inputs it held
    EXPECT_EQ(host.activation_releases, 1);
    EXPECT_EQ(host.live_activations.count(inputs), 0u);

    weft_activation* raw = assigned.release();  // ownership back to the caller
    host.live_activations.count(raw) == 1 ? (void)0 : ADD_FAILURE() << "released early";
    Activation readopted = sdk_host.activation(raw);
    readopted.reset();
    readopted.reset();
    EXPECT_EQ(host.activation_releases, 2);
  }
  EXPECT_EQ(host.activation_releases, 2);
  expect_clean();
}

TEST_F(SdkTest, WorksAreReleasedExactlyOnce) {
  {
    Work first = sdk_host.barrier(sdk_host.world());
    Work second(std::move(first));  // NOLINT: testing the moved-from state
    EXPECT_FALSE(first);
    EXPECT_TRUE(second);
    Work third = sdk_host.barrier(sdk_host.world());
    third = std::move(second);  // releases third's own work
    EXPECT_EQ(host.work_releases, 1);
    third.wait();
  }
  EXPECT_EQ(host.work_releases, 2);
  expect_clean();
}

// --- logging ---

TEST_F(SdkTest, LoggingMacrosFormatThroughTheHost) {
  WEFT_LOG_WARN(sdk_host, "step %d: loss %.2f on %s", 7, 1.25, "rank 0");
  WEFT_LOG_DEBUG(sdk_host, "plain");
  sdk_host.log(WEFT_LOG_ERROR, std::string("direct"));
  WEFT_LOG_INFO(sdk_host, "%s", std::string(3000, 'x').c_str());
  ASSERT_EQ(host.logs.size(), 4u);
  EXPECT_EQ(host.logs[0].first, WEFT_LOG_WARN);
  EXPECT_EQ(host.logs[0].second, "step 7: loss 1.25 on rank 0");
  EXPECT_EQ(host.logs[1].first, WEFT_LOG_DEBUG);
  EXPECT_EQ(host.logs[1].second, "plain");
  EXPECT_EQ(host.logs[2].first, WEFT_LOG_ERROR);
  EXPECT_EQ(host.logs[3].second, std::string(1023, 'x'));  // truncated to the buffer
}

}  // namespace
