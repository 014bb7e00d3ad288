// Training behaviour: the schedule, overfitting one batch, accumulation, LoRA, resume, atomic saves.
#include <cmath>
#include <limits>
#include <filesystem>
#include <fstream>

#include <sys/resource.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/adalora.h"
#include "core/model/lora.h"
#include "core/model/weights.h"
#include "core/train/optimizer.h"
#include "core/train/schedule.h"
#include "core/train/trainer.h"
#include "core/util/error.h"
#include "core/util/memory.h"
#include "train_test_util.h"

namespace weft {
namespace {

using testing::fresh_dir;
using testing::tiny_options;
namespace fs = std::filesystem;

TEST(Schedule, WarmupThenCosineToTheFloor) {
  LrSchedule s{1.0, 0.1, 10, 110, "cosine"};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // halfway: min + (peak-min)/2
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(500), 0.1, 1e-12);
  LrSchedule linear{1.0, 0.0, 0, 100, "linear"};
  EXPECT_NEAR(linear.at(25), 0.75, 1e-12);
  LrSchedule constant{0.5, 0.1, 0, 100, "constant"};
  EXPECT_DOUBLE_EQ(constant.at(99), 0.5);
}

TEST(Optimizer, ClipGradNormScalesToTheLimit) {
  auto a = torch::zeros({2}, torch::requires_grad());
  auto b = torch::zeros({1}, torch::requires_grad());
  (a * torch::tensor({3.0f, 0.0f})).sum().backward();
  (b * torch::tensor({4.0f})).sum().backward();
  EXPECT_NEAR(clip_grad_norm({a, b}, 1.0), 5.0, 1e-9);
  EXPECT_NEAR(a.grad()[0].item<double>(), 0.6, 1e-5);
  EXPECT_NEAR(b.grad()[0].item<double>(), 0.8, 1e-5);
}

// fp16: the gradients hold the loss scale; the norm is the unscaled one, and the gradients are
// unscaled (and clipped) only when every one is finite.
TEST(Optimizer, ClipGradNormRemovesTheLossScaleAndLeavesNonFiniteGradientsAlone) {
  auto a = torch::zeros({2}, torch::requires_grad());
  (a * torch::tensor({3.0f * 1024, 4.0f * 1024})).sum().backward();
  EXPECT_NEAR(clip_grad_norm({a}, 0.0, {}, 1024.0), 5.0, 1e-9);
  EXPECT_NEAR(a.grad()[0].item<double>(), 3.0, 1e-5);
  EXPECT_NEAR(a.grad()[1].item<double>(), 4.0, 1e-5);
  a.mutable_grad() = torch::tensor({3.0f * 1024, 4.0f * 1024});
  EXPECT_NEAR(clip_grad_norm({a}, 1.0, {}, 1024.0), 5.0, 1e-9);  // unscaled and clipped in one pass
  EXPECT_NEAR(a.grad()[1].item<double>(), 0.8, 1e-5);
  a.mutable_grad() = torch::tensor({std::numeric_limits<float>::infinity(), 1.0f});
  EXPECT_TRUE(std::isinf(clip_grad_norm({a}, 1.0, {}, 1024.0)));
  EXPECT_EQ(a.grad()[1].item<float>(), 1.0f);  // untouched: the step is skipped
  a.mutable_grad() = torch::tensor({std::numeric_limits<float>::quiet_NaN(), 1.0f});
  EXPECT_TRUE(std::isnan(clip_grad_norm({a}, 1.0, {}, 1024.0)));
}

namespace {

// The optimizer tests' tensors, drawn from `seed`: a decayed matrix, a vector without decay, a
// matrix longer than the fused kernel's vectors and, `with_unused`, one more small matrix.
std::vector<OptimizedTensor> optimized_tensors(uint64_t seed, bool with_unused) {
  torch::manual_seed(seed);
  std::vector<OptimizedTensor> tensors{{torch::randn({5, 3}), true}, {torch::randn({3}), false},
                                       {torch::randn({70, 33}), true}};
  if (with_unused) tensors.push_back({torch::randn({4, 2}), true});
  for (auto& t : tensors) t.tensor.set_requires_grad(true);
  return tensors;
}

OptimOptions adamw_test_options() {
  OptimOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  return o;
}

}  // namespace

// The fused step (what CUDA and the CPU run by default) against torch::optim::AdamW's own step, on
// the CPU: the same parameters, moments and step counts after steps with different learning rates,
// decay and no-decay groups, a tensor longer than the kernel's vectors, and one without a gradient.
TEST(Optimizer, TheFusedStepEqualsTheUnfusedOne) {
  const auto make = [] { return optimized_tensors(7, /*with_unused=*/true); };
  const OptimOptions o = adamw_test_options();
  auto plain = make(), fused = make(), automatic = make();
  auto plain_opt = make_adamw(plain, o), fused_opt = make_adamw(fused, o), auto_opt = make_adamw(automatic, o);
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(100 + step);
    for (size_t i = 0; i + 1 < plain.size(); ++i) {  // the last tensor never gets a gradient
      const auto g = torch::randn_like(plain[i].tensor);
      plain[i].tensor.mutable_grad() = g.clone();
      fused[i].tensor.mutable_grad() = g.clone();
      automatic[i].tensor.mutable_grad() = g.clone();
    }
    set_learning_rate(*plain_opt, 1e-2 * (step + 1));
    set_learning_rate(*fused_opt, 1e-2 * (step + 1));
    set_learning_rate(*auto_opt, 1e-2 * (step + 1));
    adamw_step(*plain_opt, AdamWKernel::kUnfused);
    adamw_step(*fused_opt, AdamWKernel::kFused);
    adamw_step(*auto_opt);
  }
  for (size_t i = 0; i < fused.size(); ++i) {  // kAuto on CPU fp32 tensors is the fused kernel
    EXPECT_TRUE(torch::equal(automatic[i].tensor, fused[i].tensor)) << "tensor " << i;
  }
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::allclose(plain[i].tensor, fused[i].tensor, 1e-5, 1e-6)) << "tensor " << i;
  }
  EXPECT_EQ(plain_opt->state().size(), 3u);
  ASSERT_EQ(fused_opt->state().size(), 3u);
  for (size_t i = 0; i + 1 < plain.size(); ++i) {
    const auto* a = adamw_state(*plain_opt, plain[i].tensor);
    const auto* b = adamw_state(*fused_opt, fused[i].tensor);
    ASSERT_TRUE(a != nullptr && b != nullptr) << "tensor " << i;
    EXPECT_EQ(a->step(), 4);
    EXPECT_EQ(b->step(), 4);
    EXPECT_TRUE(torch::allclose(a->exp_avg(), b->exp_avg(), 1e-6, 1e-7));
    EXPECT_TRUE(torch::allclose(a->exp_avg_sq(), b->exp_avg_sq(), 1e-6, 1e-7));
  }
  EXPECT_EQ(optimizer_state_bytes(*plain_opt), optimizer_state_bytes(*fused_opt));
}

// The state made before the first step (materialize_adamw_state): step 0 and zero moments shaped as
// each tensor, a tensor's existing state (a resumed checkpoint's) kept as it was, and steps from it,
// fused and unfused, equal those of an optimizer that made its state in its first step, bit for bit.
TEST(Optimizer, StateMadeBeforeTheFirstStepStepsAsTheFirstStepsOwn) {
  const auto make = [] { return optimized_tensors(9, /*with_unused=*/false); };
  const OptimOptions o = adamw_test_options();
  for (const auto kernel : {AdamWKernel::kFused, AdamWKernel::kUnfused}) {
    auto early = make(), lazy = make();
    auto early_opt = make_adamw(early, o), lazy_opt = make_adamw(lazy, o);
    materialize_adamw_state(*early_opt);
    ASSERT_EQ(early_opt->state().size(), 3u);
    EXPECT_TRUE(lazy_opt->state().empty());
    int64_t bytes = 0;
    for (const auto& t : early) {
      const auto* state = adamw_state(*early_opt, t.tensor);
      ASSERT_NE(state, nullptr);
      EXPECT_EQ(state->step(), 0);
      EXPECT_EQ(state->exp_avg().sizes(), t.tensor.sizes());
      EXPECT_TRUE(torch::equal(state->exp_avg(), torch::zeros_like(t.tensor)));
      EXPECT_TRUE(torch::equal(state->exp_avg_sq(), torch::zeros_like(t.tensor)));
      bytes += 2 * static_cast<int64_t>(t.tensor.nbytes());
    }
    EXPECT_EQ(optimizer_state_bytes(*early_opt), bytes);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(200 + step);
      for (size_t i = 0; i < early.size(); ++i) {
        const auto g = torch::randn_like(early[i].tensor);
        early[i].tensor.mutable_grad() = g.clone();
        lazy[i].tensor.mutable_grad() = g.clone();
      }
      adamw_step(*early_opt, kernel);
      adamw_step(*lazy_opt, kernel);
    }
    for (size_t i = 0; i < early.size(); ++i) {
      EXPECT_TRUE(torch::equal(early[i].tensor, lazy[i].tensor)) << "tensor " << i;
      const auto *a = adamw_state(*early_opt, early[i].tensor), *b = adamw_state(*lazy_opt, lazy[i].tensor);
      ASSERT_TRUE(a != nullptr && b != nullptr);
      EXPECT_EQ(a->step(), 3);
      EXPECT_EQ(b->step(), 3);
      EXPECT_TRUE(torch::equal(a->exp_avg(), b->exp_avg()) && torch::equal(a->exp_avg_sq(), b->exp_avg_sq()));
    }
    // A tensor that has state keeps it.
    const auto moment = torch::full_like(early[0].tensor, 0.5);
    set_adamw_state(*early_opt, early[0].tensor, 7, moment, moment);
    materialize_adamw_state(*early_opt);
    EXPECT_EQ(adamw_state(*early_opt, early[0].tensor)->step(), 7);
    EXPECT_TRUE(torch::equal(adamw_state(*early_opt, early[0].tensor)->exp_avg(), moment));
  }
}

// The tracker's kept blocks: a freed block of 1 MiB or more serves the next allocation of its size
// (the same memory, no page faults), smaller ones go back to malloc, the live count excludes kept
// blocks, and live + kept never exceed the high-water mark by more than 256 MiB.
TEST(TensorMemory, FreedBlocksServeTheNextAllocationOfTheirSizeWithinTheHighWaterMark) {
  install_memory_tracker();
  ASSERT_TRUE(memory_tracker_installed());
  const int64_t live0 = tensor_bytes_live();
  void* first = nullptr;
  {
    const auto t = torch::empty({3 << 20}, torch::kFloat32);  // 12 MiB
    first = t.data_ptr();
    EXPECT_EQ(tensor_bytes_live(), live0 + (int64_t{12} << 20));
  }
  EXPECT_EQ(tensor_bytes_live(), live0);
  const int64_t kept = tensor_bytes_cached();
  EXPECT_GE(kept, int64_t{12} << 20);
  {
    const auto again = torch::empty({3 << 20}, torch::kFloat32);
    EXPECT_EQ(again.data_ptr(), first);
    EXPECT_EQ(tensor_bytes_cached(), kept - (int64_t{12} << 20) - 64);  // the block and its header
  }
  {
    const auto small = torch::empty({1000}, torch::kFloat32);  // below 1 MiB: malloc's
  }
  EXPECT_EQ(tensor_bytes_cached(), kept);
  constexpr int64_t kMiB = int64_t{1} << 20;
  {  // 40 blocks of distinct sizes (40-79 MiB), all live at once, then freed: kept within the bound
    std::vector<torch::Tensor> blocks;
    for (int i = 0; i < 40; ++i) blocks.push_back(torch::empty({(40 + i) * kMiB}, torch::kUInt8));
  }
  EXPECT_LE(tensor_bytes_live() + tensor_bytes_cached(), tensor_bytes_high_water() + 256 * kMiB);
  EXPECT_GE(tensor_bytes_cached(), 40 * 40 * kMiB);
  {  // a new size past the mark releases kept blocks first
    const auto big = torch::empty({tensor_bytes_high_water() + 300 * kMiB}, torch::kUInt8);
    EXPECT_LE(tensor_bytes_live() + tensor_bytes_cached(), tensor_bytes_high_water() + 256 * kMiB);
    EXPECT_LT(tensor_bytes_cached(), 256 * kMiB);
  }
  EXPECT_EQ(tensor_bytes_live(), live0);
}

// Blocks below 1 MiB come from malloc's heap: freed and allocated again every step (LoRA dropout's
// masks, the adapters' small operands), they are served from memory already resident, not given
// back to the system at each free and faulted in again (glibc's trim threshold, which the
// tracker's mmap threshold would otherwise leave at 128 KiB). MALLOC_TRIM_THRESHOLD_=131072 in the
// environment brings the old behaviour back.
TEST(TensorMemory, SmallBlocksAllocatedAgainEveryStepAreNotFaultedInAgain) {
  install_memory_tracker();
  auto minor_faults = [] {
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    return static_cast<int64_t>(usage.ru_minflt);
  };
  auto round = [] {  // 64 blocks of 512 KiB, written, then all freed
    std::vector<torch::Tensor> blocks;
    for (int i = 0; i < 64; ++i) blocks.push_back(torch::ones({128 * 1024}, torch::kFloat32));
  };
  round();
  const int64_t before = minor_faults();
  for (int i = 0; i < 10; ++i) round();
  // Measured: ~2k faults over the 10 rounds, ~17k with the 128 KiB threshold (82k pages written).
  EXPECT_LT(minor_faults() - before, 6000) << "32 MiB of blocks per round, 10 rounds";
}

TEST(Training, OverfitsOneBatch) {
  torch::manual_seed(0);
  LlamaForCausalLM model(preset_config("tiny"));
  init_weights(*model, 1, 0.02);
  OptimOptions o;
  o.lr = 3e-3;  // at 1e-2 Adam memorised the batch by step 50, then spiked back to 0.5 (Intel Xeon with AMX)
  o.weight_decay = 0.0;
  auto optimizer = make_adamw(trainable_parameters(*model), o);
  auto inputs = torch::randint(0, 512, {2, 16}, torch::kLong);
  auto targets = torch::randint(0, 512, {2, 16}, torch::kLong);
  double first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    auto loss = cross_entropy(model->forward(inputs), targets);
    optimizer->zero_grad();
    loss.backward();
    optimizer->step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_GT(first, 6.0);  // ~ln(512) at initialisation
  EXPECT_LT(last, 0.1);   // memorised
}

std::vector<nlohmann::json> read_metrics(const std::string& path, const std::string& type) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j["type"] == type) out.push_back(j);
  }
  return out;
}

TEST(Training, LossFallsAndMetricsAreWritten) {
  const auto dir = fresh_dir("metrics");
  auto o = tiny_options(dir);
  o.max_steps = 0;
  o.epochs = 2;
  o.eval_every = 5;
  o.keep_best = true;
  o.save_final = true;
  Trainer trainer(o);
  const auto result = trainer.run();
  ASSERT_GE(result.step_losses.size(), 10u);
  EXPECT_LT(result.step_losses.back(), result.step_losses.front() - 1.0);
  EXPECT_EQ(result.epochs_completed, 2);
  ASSERT_EQ(result.epoch_seconds.size(), 2u);
  ASSERT_TRUE(result.final_eval.has_value());
  EXPECT_NEAR(result.final_eval->perplexity, std::exp(result.final_eval->loss), 1e-9);
  const auto steps = read_metrics(o.metrics_file, "step");
  ASSERT_EQ(static_cast<int64_t>(steps.size()), result.steps);
  for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}) {
    EXPECT_TRUE(steps[0].contains(key)) << key;
  }
  const auto epochs = read_metrics(o.metrics_file, "epoch");
  ASSERT_EQ(epochs.size(), 2u);
  EXPECT_TRUE(epochs[1].contains("perplexity"));
  EXPECT_TRUE(epochs[1].contains("time_s"));
  EXPECT_FALSE(read_metrics(o.metrics_file, "eval").empty());
  EXPECT_TRUE(fs::exists(o.out_dir + "/best/model.safetensors"));
  EXPECT_TRUE(fs::exists(o.out_dir + "/final/config.json"));
}

// eval.every_steps evaluates at its multiples and at each epoch end, once per step, and skips a
// multiple within half a period after an epoch end (the epoch's evaluation stands for it).
TEST(Training, PeriodicEvaluationsDoNotRepeatTheEpochEndsOne) {
  const auto dir = fresh_dir("eval_schedule");
  auto o = tiny_options(dir);
  o.max_steps = 0;
  o.epochs = 2;
  const int64_t per_epoch = Trainer(o).steps_per_epoch();
  ASSERT_GE(per_epoch, 4);
  o.eval_every = per_epoch + 1;  // its first multiple falls 1 step after the first epoch's end
  Trainer trainer(o);
  trainer.run();
  std::vector<int64_t> evaluated;
  for (const auto& e : read_metrics(o.metrics_file, "eval")) evaluated.push_back(e["step"].get<int64_t>());
  std::vector<int64_t> expected;
  for (int64_t step = 1; step <= 2 * per_epoch; ++step) {
    const bool epoch_end = step % per_epoch == 0;
    const bool multiple = step % o.eval_every == 0;
    const bool just_after_an_epoch = step > per_epoch && 2 * (step - per_epoch) < o.eval_every;
    if (epoch_end || (multiple && !just_after_an_epoch)) expected.push_back(step);
  }
  EXPECT_EQ(evaluated, expected);
  EXPECT_EQ(evaluated, (std::vector<int64_t>{per_epoch, 2 * per_epoch}));  // not per_epoch + 1
}

// eval.on_start: the starting model's held-out loss is step 0's evaluation (the loss of the model
// before any update), it does not save best/ (that is the model the run started from), and a run
// resumed from a checkpoint does not evaluate at its start again.
TEST(Training, OnStartEvaluatesTheStartingModelOnceAndNotAgainOnResume) {
  const auto dir = fresh_dir("eval_on_start");
  auto o = tiny_options(dir);
  o.max_steps = 4;
  o.checkpoint_every = 2;
  o.keep_best = true;
  o.eval_on_start = true;
  const double before = Trainer(o).evaluate().loss;  // the same seeded model, not trained
  Trainer(o).run();
  const auto evals = read_metrics(o.metrics_file, "eval");
  ASSERT_EQ(evals.size(), 2u);  // step 0, and the end of the run
  EXPECT_EQ(evals[0]["step"].get<int64_t>(), 0);
  EXPECT_DOUBLE_EQ(evals[0]["loss"].get<double>(), before);
  EXPECT_EQ(evals[1]["step"].get<int64_t>(), 4);
  EXPECT_LT(evals[1]["loss"].get<double>(), before);
  EXPECT_TRUE(fs::exists(o.out_dir + "/best/model.safetensors"));  // step 4's, the best

  auto resumed = o;
  resumed.max_steps = 6;
  resumed.resume = o.out_dir + "/checkpoints/step-00000004";
  Trainer(resumed).run();
  std::vector<int64_t> steps;
  for (const auto& e : read_metrics(o.metrics_file, "eval")) steps.push_back(e["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 4, 6}));

  o.data.heldout_fraction = 0;
  o.out_dir = dir + "/no-heldout";
  o.metrics_file = "";
  try {
    Trainer trainer(o);
    ADD_FAILURE() << "eval.on_start without a held-out split was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eval.on_start is set but data.heldout_fraction is 0"), std::string::npos) << e.what();
  }
}

TEST(Training, GradientAccumulationMatchesOneLargeBatch) {
  const auto dir = fresh_dir("accum");
  auto big = tiny_options(dir);
  big.batch_size = 4;
  auto small = tiny_options(dir);
  small.batch_size = 2;
  small.grad_accum_steps = 2;
  small.out_dir = dir + "/run2";
  small.metrics_file = "";
  const auto a = Trainer(big).run();
  const auto b = Trainer(small).run();
  ASSERT_EQ(a.step_losses.size(), b.step_losses.size());
  for (size_t i = 0; i < a.step_losses.size(); ++i) {
    EXPECT_NEAR(a.step_losses[i], b.step_losses[i], 1e-5 * a.step_losses[i]) << "step " << i;
  }
}

TEST(Training, LoraTrainsOnlyAdapters) {
  const auto dir = fresh_dir("lora");
  auto o = tiny_options(dir);
  o.mode = "lora";
  o.lora.spec = {4, 8.0, 0.1};
  o.optim.lr = 1e-2;
  o.save_final = true;
  Trainer trainer(o);
  std::map<std::string, torch::Tensor> before;
  for (auto& item : trainer.model().named_parameters()) before[item.key()] = item.value().detach().clone();
  trainer.run();
  int changed_adapters = 0;
  for (auto& item : trainer.model().named_parameters()) {
    const bool adapter = item.key().find("lora_") != std::string::npos;
    const bool same = torch::equal(item.value(), before[item.key()]);
    if (adapter) {
      changed_adapters += same ? 0 : 1;
    } else {
      EXPECT_TRUE(same) << "base parameter changed: " << item.key();
    }
  }
  EXPECT_GT(changed_adapters, 0);
  EXPECT_TRUE(fs::exists(o.out_dir + "/final/adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(o.out_dir + "/final/adapter_config.json"));
}

void expect_resume_is_exact(const std::string& name, bool lora) {
  const auto dir = fresh_dir(name);
  auto o = tiny_options(dir);
  o.max_steps = 8;
  o.checkpoint_every = 4;
  if (lora) {
    o.mode = "lora";
    o.lora.spec = {4, 8.0, 0.1};  // dropout: the RNG state must be restored too
  }
  const auto uninterrupted = Trainer(o).run();
  ASSERT_EQ(uninterrupted.step_losses.size(), 8u);

  auto resumed_options = o;
  resumed_options.out_dir = dir + "/resumed";
  resumed_options.metrics_file = dir + "/resumed/metrics.jsonl";
  fs::create_directories(resumed_options.out_dir + "/checkpoints");
  fs::copy(o.out_dir + "/checkpoints/step-00000004", resumed_options.out_dir + "/checkpoints/step-00000004",
           fs::copy_options::recursive);
  resumed_options.resume = resumed_options.out_dir + "/checkpoints/step-00000004";
  const auto resumed = Trainer(resumed_options).run();
  ASSERT_EQ(resumed.step_losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(resumed.step_losses[i], uninterrupted.step_losses[4 + i]) << "step " << 5 + i;
  }
  EXPECT_EQ(resumed.steps, 8);
}

TEST(Training, ResumeContinuesExactly) { expect_resume_is_exact("resume", false); }
TEST(Training, ResumeContinuesExactlyWithLoraDropout) { expect_resume_is_exact("resume_lora", true); }

TEST(Training, ResumeAutoFindsTheLatestCheckpointAndIgnoresACrashedSave) {
  const auto dir = fresh_dir("atomic");
  auto o = tiny_options(dir);
  o.max_steps = 4;
  o.checkpoint_every = 2;
  o.keep_last = 1;
  const auto first = Trainer(o).run();
  const std::string root = o.out_dir + "/checkpoints";
  EXPECT_FALSE(fs::exists(root + "/step-00000002"));  // pruned: keep_last = 1
  ASSERT_TRUE(fs::exists(root + "/step-00000004/trainer_state.json"));
  // A save that crashed half-way: a staging directory with a truncated model file.
  fs::create_directories(root + "/.tmp-step-00000006-999999");
  std::ofstream(root + "/.tmp-step-00000006-999999/model.safetensors") << "garbage";

  auto resumed = o;
  resumed.max_steps = 6;
  resumed.resume = "auto";
  Trainer trainer(resumed);
  const auto result = trainer.run();
  EXPECT_EQ(result.step_losses.size(), 2u);  // continued from step 4
  EXPECT_EQ(result.steps, 6);
  EXPECT_FALSE(fs::exists(root + "/.tmp-step-00000006-999999"));  // cleaned up by the next save
  EXPECT_TRUE(fs::exists(root + "/step-00000006/model.safetensors"));
}

TEST(Training, EarlyStoppingWithPatience) {
  const auto dir = fresh_dir("patience");
  auto o = tiny_options(dir);
  o.optim.lr = 0.0;  // no progress: every evaluation after the first fails to improve
  o.optim.warmup_steps = 0;
  o.max_steps = 0;
  o.epochs = 3;
  o.eval_every = 1;
  o.patience = 2;
  const auto result = Trainer(o).run();
  EXPECT_TRUE(result.early_stopped);
  EXPECT_EQ(result.steps, 3);  // evals at 1 (best), 2, 3 -> stop
}

TEST(Training, BadInputIsRejectedBeforeTraining) {
  const auto dir = fresh_dir("bad");
  auto o = tiny_options(dir);
  o.model.vocab_size = 100;  // the byte tokenizer has 258 ids
  EXPECT_THROW(Trainer{o}, Error);
  o = tiny_options(dir);
  o.batch_size = 100000;
  EXPECT_THROW(Trainer{o}, Error);
  o = tiny_options(dir);
  o.resume = dir + "/no-such-checkpoint";
  EXPECT_THROW(Trainer{o}, Error);
  o = tiny_options(dir);
  o.data.paths = {dir + "/missing.jsonl"};
  EXPECT_THROW(Trainer{o}, Error);
}

TEST(Training, ResumeOnDifferentDataIsRefused) {
  const auto dir = fresh_dir("otherdata");
  auto o = tiny_options(dir);
  o.max_steps = 2;
  o.checkpoint_every = 2;
  Trainer(o).run();
  auto other = o;
  other.data.seq_len = 16;
  other.resume = "auto";
  try {
    Trainer trainer(other);
    FAIL() << "resumed on different data";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different data"), std::string::npos) << e.what();
  }
}

// train.mode = "adalora": the allocator prunes to its budget by the end, a resume from a checkpoint
// in the middle of the schedule (EMAs, soft masks and all) continues bit for bit, and the final
// adapter is PEFT's AdaLoRA layout with the final rank pattern.
TEST(Training, AdaLoraPrunesToItsBudgetAndResumesExactly) {
  const auto dir = testing::fresh_dir("adalora");
  auto o = testing::tiny_options(dir);
  o.mode = "adalora";
  o.lora.spec.alpha = 8;
  o.lora.spec.dropout = 0;
  o.lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  o.adalora.spec.r = 4;
  o.adalora.target_r = 1;
  o.adalora.tinit = 2;
  o.adalora.tfinal = 3;
  o.adalora.delta_t = 2;
  o.max_steps = 12;
  o.checkpoint_every = 5;
  o.keep_last = 3;
  o.save_final = true;
  Trainer trainer(o);
  const auto uninterrupted = trainer.run();
  ASSERT_EQ(uninterrupted.step_losses.size(), 12u);
  int64_t kept = 0;
  for (const auto& [name, rank] : uninterrupted.adalora_ranks) kept += rank;
  const int64_t layers = static_cast<int64_t>(uninterrupted.adalora_ranks.size());
  EXPECT_EQ(layers, 3 * preset_config("tiny").num_hidden_layers);
  EXPECT_EQ(kept, layers);  // target_r 1 per layer on average
  RankPattern pattern;
  const auto saved = read_adalora_adapter_config(o.out_dir + "/final", &pattern);
  EXPECT_EQ(saved.target_r, 1);
  EXPECT_EQ(static_cast<int64_t>(pattern.size()), layers);
  EXPECT_TRUE(std::filesystem::exists(o.out_dir + "/checkpoints/step-00000005/adalora_state.safetensors"));

  auto resumed_options = o;
  resumed_options.out_dir = dir + "/resumed";
  resumed_options.metrics_file = dir + "/resumed/metrics.jsonl";
  resumed_options.resume = o.out_dir + "/checkpoints/step-00000005";
  const auto resumed = Trainer(resumed_options).run();
  ASSERT_EQ(resumed.step_losses.size(), 7u);
  for (size_t i = 0; i < 7; ++i) EXPECT_EQ(resumed.step_losses[i], uninterrupted.step_losses[5 + i]) << "step " << 6 + i;
  EXPECT_EQ(resumed.adalora_ranks, uninterrupted.adalora_ranks);
  auto a = SafetensorsFile::open(o.out_dir + "/final/adapter_model.safetensors");
  auto b = SafetensorsFile::open(resumed_options.out_dir + "/final/adapter_model.safetensors");
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (const auto& info : a->tensors()) EXPECT_TRUE(torch::equal(a->load(info.name), b->load(info.name))) << info.name;
}

}  // namespace
}  // namespace weft

namespace weft {
namespace {

TEST(Training, RefusesToOverwriteASavedRunUnlessAsked) {
  const auto dir = testing::fresh_dir("overwrite");
  auto o = testing::tiny_options(dir);
  o.max_steps = 2;
  o.save_final = true;
  Trainer(o).run();
  try {
    Trainer again(o);
    FAIL() << "started over a saved run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already holds a run"), std::string::npos) << e.what();
    // A finished run without a checkpoint: the advice is what works (before, it advised
    // checkpoint.resume=auto, which then refused the run for having no checkpoint).
    EXPECT_EQ(std::string(e.what()).find("checkpoint.resume=auto"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("to train its final model further, start a new run from it (model.weights=" +
                                         o.out_dir + "/final, another out_dir)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(std::filesystem::exists(o.out_dir + "/final/model.safetensors"));
  o.resume = "auto";  // a finished run without checkpoints: nothing to resume, and still refused
  try {
    Trainer again(o);
    FAIL() << "started over a finished run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("final exists); it has no checkpoint to resume (it finished, or stopped "
                                         "before its first): to train its final model further"),
              std::string::npos)
        << e.what();
  }
  o.resume.clear();
  o.overwrite = true;
  EXPECT_EQ(Trainer(o).run().steps, 2);
}

TEST(Training, ResumeAutoStartsAgainARunThatStoppedBeforeItsFirstCheckpoint) {
  // A run killed after it saved its best model but before its first checkpoint (found by
  // tools/fault_injection.py: a kill inside the first save) leaves best/ alone; resume = auto must
  // start it again rather than refuse to replace that model.
  const auto dir = testing::fresh_dir("restart");
  auto o = testing::tiny_options(dir);
  o.max_steps = 2;
  o.eval_every = 1;
  o.keep_best = true;
  o.save_final = false;
  Trainer(o).run();
  ASSERT_TRUE(std::filesystem::exists(o.out_dir + "/best"));
  ASSERT_FALSE(std::filesystem::exists(o.out_dir + "/checkpoints/latest"));
  o.resume = "auto";
  EXPECT_EQ(Trainer(o).run().steps, 2);
}

TEST(Training, LoraSavesAMergedModelThatComputesTheSameFunction) {
  const auto dir = testing::fresh_dir("merged");
  auto o = testing::tiny_options(dir);
  o.mode = "lora";
  o.lora.spec = {4, 8.0, 0.0};
  o.optim.lr = 1e-2;
  o.save_final = true;
  o.save_merged = true;
  Trainer trainer(o);
  trainer.run();
  auto merged = load_hf_config(o.out_dir + "/final-merged/config.json");
  LlamaForCausalLM plain(merged);
  load_weights(*plain, o.out_dir + "/final-merged");
  auto x = torch::randint(0, 258, {2, 16}, torch::kLong);
  trainer.model().eval();
  EXPECT_TRUE(torch::allclose(plain->forward(x), trainer.model().forward(x), 1e-5, 1e-5));
  // The adapter alone, applied to a fresh base with the same seed, gives the same function.
  LlamaForCausalLM base(preset_config("tiny"));
  init_weights(*base, o.seed, o.model.init_std);
  apply_lora(*base, o.lora, o.seed);
  load_lora_adapter(*base, o.out_dir + "/final");
  base->eval();
  EXPECT_TRUE(torch::allclose(base->forward(x), plain->forward(x), 1e-5, 1e-5));
}

// LoRA over an nf4 base: resuming from a checkpoint continues bit-exactly (the base is quantized
// again from its seed, to the same bytes), and the merged model (adapters folded into the
// dequantized base) computes what the trained quantized model computes.
TEST(Training, LoraOnAQuantizedBaseResumesExactlyAndMergesIntoTheDequantizedBase) {
  const auto dir = testing::fresh_dir("quantized_lora");
  auto o = testing::tiny_options(dir);
  o.mode = "lora";
  o.model.quantize = "nf4";
  o.lora.spec = {4, 8.0, 0.1};
  o.max_steps = 8;
  o.checkpoint_every = 4;
  o.save_final = true;
  o.save_merged = true;
  Trainer trainer(o);
  const auto uninterrupted = trainer.run();
  ASSERT_EQ(uninterrupted.step_losses.size(), 8u);

  auto resumed_options = o;
  resumed_options.out_dir = dir + "/resumed";
  resumed_options.metrics_file = dir + "/resumed/metrics.jsonl";
  resumed_options.save_final = false;
  resumed_options.save_merged = false;
  resumed_options.resume = o.out_dir + "/checkpoints/step-00000004";
  const auto resumed = Trainer(resumed_options).run();
  ASSERT_EQ(resumed.step_losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.step_losses[i], uninterrupted.step_losses[4 + i]) << "step " << 5 + i;

  LlamaForCausalLM merged(load_hf_config(o.out_dir + "/final-merged/config.json"));
  load_weights(*merged, o.out_dir + "/final-merged");
  // The saved adapter on a fresh nf4 base (quantized from the same seed) computes the same.
  ModelOptions quantized_options;
  quantized_options.quantize = QuantFormat::kNf4;
  LlamaForCausalLM adapted(preset_config("tiny"), quantized_options);
  init_weights(*adapted, o.seed, o.model.init_std);
  apply_lora(*adapted, o.lora, o.seed);
  load_lora_adapter(*adapted, o.out_dir + "/final");
  torch::manual_seed(3);
  auto x = torch::randint(0, 258, {2, 16}, torch::kLong);
  adapted->eval();
  merged->eval();
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(merged->forward(x), adapted->forward(x), 1e-5, 1e-5));
}

}  // namespace
}  // namespace weft
