// AdaLoRA (core/model/adalora.h): the budget schedule against the paper's formula at every step,
// the allocator keeping exactly the budget and, once the pattern is final, the pruned triplets
// pruned; the orthogonal regulariser; the adapter files and the allocator's state round trips.
// Against PEFT itself: tools/hf_reference.py (ctest Reference.*).
#include <cmath>
#include <filesystem>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "common/process.h"
#include "core/io/safetensors.h"
#include "core/model/adalora.h"
#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/model/weights.h"
#include "core/util/error.h"

namespace weft {
namespace {

LlamaForCausalLM adalora_model(const AdaLoraConfig& config, uint64_t seed = 3) {
  LlamaForCausalLM model(preset_config("tiny"));
  init_weights(*model, 7, 0.05);
  apply_adalora(*model, config, seed);
  return model;
}

AdaLoraConfig adalora_settings() {
  AdaLoraConfig c;
  c.spec.r = 4;
  c.spec.alpha = 8;
  c.target_r = 1;
  c.target_modules = {"q_proj", "v_proj", "down_proj"};
  c.tinit = 2;
  c.tfinal = 3;
  c.delta_t = 2;
  c.total_step = 12;
  return c;
}

// One SGD step on a fixed batch, with PEFT's orthogonal regularisation in the loss.
void adalora_sgd_step(LlamaForCausalLMImpl& model, const AdaLoraConfig& config, const torch::Tensor& tokens) {
  const auto logits = model.forward(tokens.slice(1, 0, -1));
  const auto loss = model.loss(logits, tokens.slice(1, 1)) +
                    config.orth_reg_weight * adalora_orthogonal_regularization(model);
  loss.backward();
  torch::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    if (p.requires_grad() && p.grad().defined()) p.add_(p.grad(), -0.05);
  }
}

void clear_grads_of(LlamaForCausalLMImpl& model) {
  for (auto& p : model.parameters()) {
    if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
  }
}

TEST(AdaLora, BudgetScheduleIsThePapersCubicAtEveryStep) {
  auto config = adalora_settings();
  config.tinit = 3;
  config.tfinal = 4;
  config.total_step = 20;
  auto model = adalora_model(config);
  RankAllocator allocator(*model, config);
  const int64_t layers = 2 * 3;  // tiny has 2 blocks; three targets each
  EXPECT_EQ(allocator.initial_budget(), 4 * layers);
  EXPECT_EQ(allocator.target_budget(), 1 * layers);
  for (int64_t step = 0; step <= 24; ++step) {
    const auto b = allocator.budget_schedule(step);
    if (step <= 3) {
      EXPECT_EQ(b.budget, 24) << step;
      EXPECT_FALSE(b.mask) << step;
    } else if (step > 16) {
      EXPECT_EQ(b.budget, 6) << step;
      EXPECT_TRUE(b.mask) << step;
    } else {  // b(t) = b_T + (b_0 - b_T) (1 - (t - t_i) / (T - t_f - t_i))^3, reallocated every deltaT steps
      const double progress = (step - 3) / 13.0;
      EXPECT_EQ(b.budget, static_cast<int64_t>(std::floor(6 + 18 * std::pow(1 - progress, 3)))) << step;
      EXPECT_EQ(b.mask, step % 2 == 0) << step;
    }
  }
  EXPECT_EQ(allocator.budget_schedule(4).budget, 20);  // 6 + 18 (12/13)^3 = 20.18
  EXPECT_EQ(allocator.budget_schedule(16).budget, 6);
}

TEST(AdaLora, AllocatorKeepsTheBudgetAndPrunedTripletsStayPruned) {
  const auto config = adalora_settings();
  auto model = adalora_model(config);
  RankAllocator allocator(*model, config);
  torch::manual_seed(11);
  const auto tokens = torch::randint(0, 512, {2, 17}, torch::kLong);
  std::map<std::string, std::vector<bool>> final_pattern;
  for (int64_t step = 0; step < 16; ++step) {
    adalora_sgd_step(*model, config, tokens);
    allocator.update_and_allocate(step);
    clear_grads_of(*model);
    const auto budget = allocator.budget_schedule(step);
    int64_t kept = 0;
    for (const auto& [name, r] : allocator.ranks()) kept += r;
    if (step <= config.tinit) {
      EXPECT_TRUE(allocator.rank_pattern().empty()) << step;
    } else if (budget.mask && step <= config.total_step - config.tfinal) {
      EXPECT_EQ(kept, budget.budget) << step;  // no ties among random scores
    }
    if (step == config.total_step - config.tfinal) {
      EXPECT_EQ(kept, allocator.target_budget());
      final_pattern = allocator.rank_pattern();
    }
    if (step >= config.total_step - config.tfinal) {
      EXPECT_EQ(allocator.rank_pattern(), final_pattern) << step;
      // every masked triplet's Lambda is zero after each step, though SGD moved it
      for (auto& item : model->named_modules("", false)) {
        auto* linear = item.value()->as<LinearImpl>();
        auto* adapter = linear != nullptr ? linear->adapter_as<AdaLoraAdapter>() : nullptr;
        if (adapter == nullptr) continue;
        const auto& flags = final_pattern.at(item.key());
        for (size_t r = 0; r < flags.size(); ++r) {
          if (!flags[r]) {
            EXPECT_EQ(adapter->E[static_cast<int64_t>(r)][0].item<float>(), 0.0f) << step;
          }
        }
      }
    }
  }
  int64_t nonzero = 0;
  for (auto& item : model->named_parameters()) {
    if (item.key().size() > 7 && item.key().substr(item.key().size() - 6) == "lora_E") {
      nonzero += item.value().ne(0).sum().item<int64_t>();
    }
  }
  EXPECT_EQ(nonzero, allocator.target_budget());
}

TEST(AdaLora, OrthogonalRegularizationIsTheMeanFrobeniusDistanceFromIdentity) {
  auto config = adalora_settings();
  config.target_modules = {"q_proj"};
  auto model = adalora_model(config);
  double expected = 0;
  int count = 0;
  for (auto& item : model->named_modules("", false)) {
    auto* linear = item.value()->as<LinearImpl>();
    auto* adapter = linear != nullptr ? linear->adapter_as<AdaLoraAdapter>() : nullptr;
    if (adapter == nullptr) continue;
    const auto a = adapter->A.detach().to(torch::kDouble);
    const auto b = adapter->B.detach().to(torch::kDouble);
    expected += (a.matmul(a.t()) - torch::eye(4, torch::kDouble)).pow(2).sum().sqrt().item<double>();
    expected += (b.t().matmul(b) - torch::eye(4, torch::kDouble)).pow(2).sum().sqrt().item<double>();
    count += 2;
  }
  EXPECT_EQ(count, 4);
  const auto reg = adalora_orthogonal_regularization(*model);
  EXPECT_NEAR(reg.item<double>(), expected / count, 1e-5);
  reg.backward();
  for (auto& item : model->named_parameters()) {
    if (item.key().find("q_proj.lora_A") != std::string::npos) {
      EXPECT_TRUE(item.value().grad().defined() && item.value().grad().abs().sum().item<double>() > 0);
    }
  }
  // P with orthonormal rows and Q with orthonormal columns: no penalty.
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_modules("", false)) {
      auto* linear = item.value()->as<LinearImpl>();
      auto* adapter = linear != nullptr ? linear->adapter_as<AdaLoraAdapter>() : nullptr;
      if (adapter == nullptr) continue;
      adapter->A.copy_(torch::eye(4, linear->in_features()));
      adapter->B.copy_(torch::eye(linear->out_features(), 4));
    }
  }
  EXPECT_NEAR(adalora_orthogonal_regularization(*model).item<double>(), 0.0, 1e-6);
}

TEST(AdaLora, SavedAdapterAndAllocatorStateReloadExactly) {
  const auto config = adalora_settings();
  auto model = adalora_model(config);
  RankAllocator allocator(*model, config);
  torch::manual_seed(12);
  const auto tokens = torch::randint(0, 512, {2, 17}, torch::kLong);
  for (int64_t step = 0; step < 6; ++step) {
    adalora_sgd_step(*model, config, tokens);
    allocator.update_and_allocate(step);
    clear_grads_of(*model);
  }
  ASSERT_FALSE(allocator.rank_pattern().empty());
  // Between two reallocations the optimizer moves a masked triplet's Lambda again (PEFT's soft
  // mask); the file holds the pattern's kept triplets only, so compare against the masked model.
  apply_rank_pattern(*model, allocator.rank_pattern());
  const auto dir = testing::fresh_dir("weft_adalora", "adapter");
  save_adalora_adapter(*model, config, allocator.rank_pattern(), dir);
  RankPattern pattern;
  const auto read = read_adalora_adapter_config(dir, &pattern);
  EXPECT_EQ(pattern, allocator.rank_pattern());
  EXPECT_EQ(read.spec.r, 4);
  EXPECT_EQ(read.target_r, 1);
  EXPECT_EQ(read.target_modules, config.target_modules);
  EXPECT_EQ(adapter_peft_type(dir), "ADALORA");
  // The file holds only the kept triplets: [kept, in], [kept, 1], [out, kept].
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  const auto ranks = allocator.ranks();
  const std::string q = "model.layers.0.self_attn.q_proj";
  EXPECT_EQ(file->info("base_model.model." + q + ".lora_E").shape, (std::vector<int64_t>{ranks.at(q), 1}));
  EXPECT_EQ(file->info("base_model.model." + q + ".lora_B").shape[1], ranks.at(q));

  auto loaded = adalora_model(read, /*seed=*/99);  // other initial values: all must come from the file
  load_adalora_adapter(*loaded, dir);
  const auto input = tokens.slice(1, 0, -1);
  {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(model->forward(input), loaded->forward(input)));
  }
  // A LoRA reader refuses the AdaLoRA file by name.
  EXPECT_THROW(read_lora_adapter_config(dir), Error);

  // The allocator's state resumes: a copy of the model (every adapter parameter, as a checkpoint
  // holds them, masked triplets' P and Q included) with the restored state masks the same
  // triplets on the same steps and trains to the same values.
  auto copy = adalora_model(config, /*seed=*/99);
  {
    torch::NoGradGuard no_grad;
    auto params = copy->named_parameters();
    for (auto& item : model->named_parameters()) params[item.key()].copy_(item.value());
  }
  RankAllocator resumed(*copy, config);
  resumed.load_state(allocator.state());
  EXPECT_EQ(resumed.rank_pattern(), allocator.rank_pattern());
  for (int64_t step = 6; step < 12; ++step) {
    adalora_sgd_step(*model, config, tokens);
    adalora_sgd_step(*copy, config, tokens);
    allocator.update_and_allocate(step);
    resumed.update_and_allocate(step);
    clear_grads_of(*model);
    clear_grads_of(*copy);
    EXPECT_EQ(resumed.rank_pattern(), allocator.rank_pattern()) << step;
  }
  auto copied = copy->named_parameters();
  for (auto& item : model->named_parameters()) {
    if (item.key().find("lora_") != std::string::npos) {
      EXPECT_TRUE(torch::equal(item.value(), copied[item.key()])) << item.key();
    }
  }
}

TEST(AdaLora, BadSettingsAreNamed) {
  auto config = adalora_settings();
  config.target_r = 5;  // above init_r
  LlamaForCausalLM model(preset_config("tiny"));
  EXPECT_THROW(apply_adalora(*model, config, 1), Error);
  config = adalora_settings();
  config.target_modules = {"nope"};
  EXPECT_THROW(apply_adalora(*model, config, 1), Error);
  config = adalora_settings();
  auto adapted = adalora_model(config);
  config.tinit = 10;  // tinit must come before total_step - tfinal
  EXPECT_THROW(RankAllocator(*adapted, config), Error);
}

}  // namespace
}  // namespace weft
