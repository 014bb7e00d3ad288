// The staged LLaMA model: configs and presets, stage ranges, checkpointing, precision, weights, LoRA.
#include <filesystem>
#include <map>
#include <set>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/model/weight_grad.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {
namespace {

std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("weft_test_model_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

LlamaForCausalLM tiny_model(uint64_t seed = 7, ModelOptions options = {}) {
  LlamaForCausalLM model(preset_config("tiny"), options);
  init_weights(*model, seed, 0.05);
  return model;
}

torch::Tensor tokens(int64_t batch, int64_t seq, uint64_t seed = 1) {
  torch::manual_seed(seed);
  return torch::randint(0, 512, {batch, seq}, torch::kLong);
}

TEST(ModelConfig, PresetParameterCounts) {
  EXPECT_EQ(preset_config("small").parameter_count(), 6123168);  // the 6.1M reference shape
  EXPECT_EQ(preset_config("llama-3.2-1b").parameter_count(), 1235814400);
  EXPECT_EQ(preset_config("llama-3.2-3b").parameter_count(), 3212749824);
  LlamaForCausalLM model(preset_config("small"));
  int64_t n = 0;
  for (auto& p : model->parameters()) n += p.numel();
  EXPECT_EQ(n, 6123168);
  EXPECT_THROW(preset_config("huge"), Error);
}

TEST(ModelConfig, ParsesHfConfigJsonAndRoundTrips) {
  const std::string json = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": true,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})";
  auto c = parse_hf_config(json, "config.json");
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(*c.eos_token_id, 128001);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 8192);
  auto again = parse_hf_config(to_hf_config_json(c), "roundtrip");
  EXPECT_EQ(again.parameter_count(), c.parameter_count());
  EXPECT_EQ(again.rope_scaling->factor, 32.0);
  EXPECT_EQ(again.tie_word_embeddings, true);
}

// transformers 5 writes rope_parameters in place of rope_theta and rope_scaling (and dtype in place
// of torch_dtype): the same model as the older form.
TEST(ModelConfig, ReadsTransformers5sRopeParameters) {
  const std::string shape = R"("model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "bfloat16")";
  const auto c = parse_hf_config("{" + shape + R"(, "rope_parameters": {"factor": 8.0, "high_freq_factor": 4.0,
    "low_freq_factor": 1.0, "original_max_position_embeddings": 64, "rope_theta": 500000.0, "rope_type": "llama3"}})",
                                 "config.json");
  EXPECT_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 64);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  const auto plain =
      parse_hf_config("{" + shape + R"(, "rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}})", "c");
  EXPECT_EQ(plain.rope_theta, 1000.0);
  EXPECT_FALSE(plain.rope_scaling.has_value());
  EXPECT_THROW(parse_hf_config("{" + shape + R"(, "rope_parameters": {"rope_theta": 1.0, "rope_type": "yarn"}})", "c"),
               Error);
  EXPECT_THROW(parse_hf_config("{" + shape + R"(, "rope_parameters": {"full_attention": {"rope_theta": 1.0}}})", "c"),
               Error);
}

TEST(ModelConfig, RejectsUnsupportedOrInconsistentConfigs) {
  auto expect_error = [](const std::string& json, const std::string& needle) {
    try {
      parse_hf_config(json, "cfg.json");
      ADD_FAILURE() << "no error for " << json;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const std::string base = R"("vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1)";
  expect_error("{" + base + R"(, "num_attention_heads": 4, "num_key_value_heads": 3})", "num_key_value_heads");
  expect_error("{" + base + R"(, "num_attention_heads": 2, "model_type": "gpt2"})", "model_type");
  expect_error("{" + base + R"(, "num_attention_heads": 2, "attention_bias": true})", "attention_bias");
  expect_error("{" + base + R"(, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn"}})", "yarn");
  expect_error("{ not json", "not valid JSON");
}

TEST(Model, StageRangesComposeToTheFullForward) {
  auto model = tiny_model();
  auto x = tokens(2, 12);
  auto full = model->forward(x);
  EXPECT_EQ(full.sizes(), (std::vector<int64_t>{2, 12, 512}));
  auto h = model->forward_stages(0, 2, x);
  h = model->forward_stages(2, 3, h);
  auto logits = model->forward_stages(3, model->num_stages(), h);
  EXPECT_TRUE(torch::equal(full, logits));
}

TEST(Model, PartialModelHoldsOnlyItsStagesWithTheSameInit) {
  auto full = tiny_model(11);
  ModelOptions options;
  options.stages = StageRange{2, 4};  // block 1 and the head
  LlamaForCausalLM part(preset_config("tiny"), options);
  init_weights(*part, 11, 0.05);
  auto full_params = full->named_parameters();
  int64_t held = 0;
  for (auto& item : part->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), full_params[item.key()])) << item.key();
    EXPECT_EQ(item.key().find("layers.0."), std::string::npos);
    ++held;
  }
  EXPECT_GT(held, 0);
  auto h = full->forward_stages(0, 2, tokens(1, 8));
  EXPECT_TRUE(torch::allclose(part->forward_stages(2, 4, h), full->forward_stages(2, 4, h)));
  EXPECT_THROW(part->forward_stages(0, 2, tokens(1, 8)), Error);
}

// A pipeline rank with virtual stages (ABI 1.10) holds several ranges: only their parameters,
// initialised as in the whole model, and each range runs as the whole model's.
TEST(Model, AModelHoldingTwoChunksHoldsOnlyTheirStagesAndRunsEachAsTheWholeModel) {
  auto config = preset_config("tiny");
  config.num_hidden_layers = 4;  // stages: embed, blocks 0-3 (1-4), head (5)
  ModelOptions whole_options;
  LlamaForCausalLM full(config, whole_options);
  init_weights(*full, 13, 0.05);
  ModelOptions options;
  options.stages = StageSet({StageRange{0, 2}, StageRange{3, 4}});  // embed + block 0, block 2
  LlamaForCausalLM part(config, options);
  init_weights(*part, 13, 0.05);
  EXPECT_TRUE(part->holds_stage(1));
  EXPECT_FALSE(part->holds_stage(2));
  EXPECT_TRUE(part->holds_stage(3));
  EXPECT_FALSE(part->holds_stage(5));
  EXPECT_EQ(part->held_stages().size(), 2u);
  std::set<std::string> names;
  auto full_params = full->named_parameters();
  for (auto& item : part->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), full_params[item.key()])) << item.key();
    names.insert(item.key());
  }
  EXPECT_TRUE(names.count("model.embed_tokens.weight"));
  EXPECT_TRUE(names.count("model.layers.0.mlp.up_proj.weight"));
  EXPECT_TRUE(names.count("model.layers.2.mlp.up_proj.weight"));
  EXPECT_FALSE(names.count("model.layers.1.mlp.up_proj.weight"));
  EXPECT_FALSE(names.count("model.layers.3.mlp.up_proj.weight"));
  EXPECT_FALSE(names.count("model.norm.weight"));
  EXPECT_EQ(parameter_specs(config, part->held_stages()).size(), names.size());
  const auto x = tokens(1, 8);
  EXPECT_TRUE(torch::equal(part->forward_stages(0, 2, x), full->forward_stages(0, 2, x)));
  const auto h = full->forward_stages(0, 3, x);
  EXPECT_TRUE(torch::equal(part->forward_stages(3, 4, h), full->forward_stages(3, 4, h)));
  EXPECT_THROW(part->forward_stages(1, 4, full->forward_stages(0, 1, x)), Error);  // spans the gap
  EXPECT_THROW(part->forward_stages(4, 5, h), Error);
  // Ranges must ascend with a gap: adjacent ones are one range, overlapping ones no layout at all.
  options.stages = StageSet({StageRange{0, 2}, StageRange{2, 4}});
  EXPECT_THROW(LlamaForCausalLM(config, options), Error);
  options.stages = StageSet({StageRange{3, 4}, StageRange{0, 2}});
  EXPECT_THROW(LlamaForCausalLM(config, options), Error);
  // A tied embedding held by stage 0 and the head is one parameter.
  config.tie_word_embeddings = true;
  options.stages = StageSet({StageRange{0, 1}, StageRange{5, 6}});
  LlamaForCausalLM ends(config, options);
  int64_t embeddings = 0;
  for (auto& item : ends->named_parameters()) embeddings += item.key() == "model.embed_tokens.weight" ? 1 : 0;
  EXPECT_EQ(embeddings, 1);
  EXPECT_EQ(parameter_specs(config, ends->held_stages()).size(), 2u);  // the embedding and the final norm
}

// The split backward of zero-bubble schedules (weight_grad.h): under DeferWeightGradients the
// backward leaves the linear weights without gradients and everything else with its usual one;
// the queue's run() then gives the linear weights theirs. Together: the plain backward's gradients,
// in fp32 and with activation checkpointing, and with LoRA (whose frozen base defers nothing).
TEST(Model, ASplitBackwardGivesThePlainBackwardsGradients) {
  for (const bool checkpointing : {false, true}) {
    ModelOptions options;
    options.deferrable_weight_grads = true;
    options.activation_checkpointing = checkpointing;
    auto plain = tiny_model(5), split = tiny_model(5, options);
    const auto x = tokens(2, 16), y = tokens(2, 16, 2);
    plain->loss(plain->forward(x), y).backward();
    const auto loss = split->loss(split->forward(x), y);
    WeightGradQueue queue;
    {
      const DeferWeightGradients defer(queue);
      loss.backward();
    }
    EXPECT_GT(queue.size(), 0u);
    EXPECT_GT(queue.bytes(), 0);
    for (auto& item : split->named_parameters()) {
      const bool linear = item.key().find("_proj.weight") != std::string::npos || item.key() == "lm_head.weight";
      EXPECT_EQ(item.value().grad().defined(), !linear) << item.key() << " checkpointing " << checkpointing;
    }
    queue.run();
    EXPECT_TRUE(queue.empty());
    auto reference = plain->named_parameters();
    for (auto& item : split->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_TRUE(torch::allclose(item.value().grad(), reference[item.key()].grad(), 1e-5, 1e-6))
          << item.key() << " checkpointing " << checkpointing;
    }
  }
  // LoRA: the base weights are frozen, so nothing is deferred and the adapters get their gradients at once.
  ModelOptions options;
  options.deferrable_weight_grads = true;
  auto lora = tiny_model(5, options);
  LoraConfig config;
  config.spec.r = 4;
  config.spec.alpha = 8;
  config.target_modules = {"q_proj", "v_proj"};
  apply_lora(*lora, config, 3);
  WeightGradQueue queue;
  {
    const DeferWeightGradients defer(queue);
    lora->loss(lora->forward(tokens(2, 16)), tokens(2, 16, 2)).backward();
  }
  EXPECT_TRUE(queue.empty());
  for (auto& item : lora->named_parameters()) {
    if (item.value().requires_grad()) {
      EXPECT_TRUE(item.value().grad().defined()) << item.key();
    }
  }
}

TEST(Model, ActivationCheckpointingGivesIdenticalGradients) {
  auto x = tokens(2, 16);
  auto y = tokens(2, 16, 2);
  auto grads = [&](bool checkpointing) {
    ModelOptions options;
    options.activation_checkpointing = checkpointing;
    auto model = tiny_model(3, options);
    model->train();
    auto loss = cross_entropy(model->forward(x), y);
    loss.backward();
    std::vector<torch::Tensor> g;
    for (auto& p : model->parameters()) g.push_back(p.grad().clone());
    return std::make_pair(loss.item<double>(), g);
  };
  auto [loss_a, ga] = grads(false);
  auto [loss_b, gb] = grads(true);
  EXPECT_DOUBLE_EQ(loss_a, loss_b);
  ASSERT_EQ(ga.size(), gb.size());
  for (size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(torch::allclose(ga[i], gb[i], 1e-6, 1e-7)) << i;
}

// The LM head left to the loss (model.chunked_loss: the final norm's output, then the head and its
// cross-entropy in row chunks) gives the loss, the per-token losses and every parameter's gradient
// of logits-then-cross_entropy: a trained head (full fine-tuning, untied and tied to the embedding)
// and a frozen one under LoRA; a head with an adapter, a classifier or chunked_loss = false keep
// the logits.
TEST(Model, TheChunkedHeadLossEqualsTheLossOfTheLogits) {
  const auto x = tokens(2, 16);
  auto y = tokens(2, 16, 2);
  y.index_put_({0, torch::indexing::Slice(0, 5)}, kIgnoreTarget);
  for (const bool tied : {false, true}) {
    for (const bool lora : {false, true}) {
      auto config = preset_config("tiny");
      config.tie_word_embeddings = tied;
      const auto run = [&](bool chunked) {
        LlamaForCausalLM model(config);
        init_weights(*model, 5, 0.05);
        if (lora) apply_lora(*model, LoraConfig{{4, 8.0, 0.0}, {"q_proj", "v_proj", "down_proj"}, std::nullopt}, 1);
        model->train();
        torch::Tensor loss, per_token;
        if (chunked) {
          EXPECT_TRUE(model->fuses_head_loss());
          const auto hidden = model->forward_stages(0, model->num_stages(), x, {}, /*head=*/false);
          EXPECT_EQ(hidden.size(-1), config.hidden_size);
          loss = model->head_loss(hidden, y, &per_token);
        } else {
          const auto logits = model->forward(x);
          loss = model->loss(logits, y);
          per_token = model->token_losses(logits, y);
        }
        loss.backward();
        std::map<std::string, torch::Tensor> grads;
        for (const auto& item : model->named_parameters()) {
          if (item.value().grad().defined()) grads[item.key()] = item.value().grad().clone();
        }
        return std::tuple{loss.item<double>(), per_token.detach(), grads};
      };
      const auto [loss_a, tokens_a, grads_a] = run(false);
      const auto [loss_b, tokens_b, grads_b] = run(true);
      EXPECT_NEAR(loss_a, loss_b, 1e-6 * loss_a) << tied << lora;
      EXPECT_TRUE(torch::allclose(tokens_a, tokens_b, 1e-5, 1e-6)) << tied << lora;
      ASSERT_EQ(grads_a.size(), grads_b.size()) << tied << lora;
      EXPECT_GT(grads_a.size(), 0u);
      for (const auto& [name, g] : grads_a) {
        EXPECT_TRUE(torch::allclose(g, grads_b.at(name), 1e-4, 1e-6)) << name << " tied " << tied << " lora " << lora;
      }
    }
  }
  ModelOptions keep;
  keep.chunked_loss = false;
  EXPECT_FALSE(tiny_model(7, keep)->fuses_head_loss());
  auto untied = preset_config("tiny");
  untied.tie_word_embeddings = false;
  LlamaForCausalLM adapted(untied);
  adapted->lm_head->add_lora({4, 8.0, 0.0}, 1);
  EXPECT_FALSE(adapted->fuses_head_loss());
  EXPECT_THROW(adapted->forward_stages(0, adapted->num_stages(), x, {}, /*head=*/false), Error);
}

// Packed rows (data.packing): several sequences in one row, each with positions 0, 1, ... of its own,
// compute what each computes alone (its RoPE positions, attention to its own tokens only), with and
// without activation checkpointing; without the positions the row is one sequence and differs.
TEST(Model, PackedRowsComputeEachSequenceAsItsOwn) {
  const std::vector<torch::Tensor> parts = {tokens(1, 5, 1), tokens(1, 7, 2), tokens(1, 4, 3)};
  // Row 0: parts 0, 1, 2 (16 tokens); row 1: parts 1 and 0, then 4 padding tokens (position 0 each).
  const auto row1 = torch::cat({parts[1], parts[0], torch::zeros({1, 4}, torch::kLong)}, 1);
  const auto x = torch::cat({torch::cat({parts[0], parts[1], parts[2]}, 1), row1});
  std::vector<int64_t> p0, p1;
  for (int64_t n : {5, 7, 4}) for (int64_t t = 0; t < n; ++t) p0.push_back(t);
  for (int64_t n : {7, 5}) for (int64_t t = 0; t < n; ++t) p1.push_back(t);
  for (int k = 0; k < 4; ++k) p1.push_back(0);
  const auto positions = torch::stack({torch::tensor(p0), torch::tensor(p1)});
  for (const bool checkpointing : {false, true}) {
    ModelOptions options;
    options.activation_checkpointing = checkpointing;
    auto model = tiny_model(3, options);
    model->train();
    const auto packed = model->forward_stages(0, model->num_stages(), x, positions);
    const auto alone = [&](int i) { return model->forward(parts[static_cast<size_t>(i)]).detach(); };
    const auto slice = [&](int64_t row, int64_t start, int64_t n) { return packed.detach()[row].narrow(0, start, n); };
    EXPECT_TRUE(torch::allclose(slice(0, 0, 5), alone(0)[0], 1e-5, 1e-5)) << checkpointing;
    EXPECT_TRUE(torch::allclose(slice(0, 5, 7), alone(1)[0], 1e-5, 1e-5)) << checkpointing;
    EXPECT_TRUE(torch::allclose(slice(0, 12, 4), alone(2)[0], 1e-5, 1e-5)) << checkpointing;
    EXPECT_TRUE(torch::allclose(slice(1, 0, 7), alone(1)[0], 1e-5, 1e-5)) << checkpointing;
    EXPECT_TRUE(torch::allclose(slice(1, 7, 5), alone(0)[0], 1e-5, 1e-5)) << checkpointing;
    // The gradients of a loss over the packed row equal those of the same loss over the parts alone.
    const auto targets = tokens(2, 16, 9);
    model->zero_grad();
    cross_entropy_sum(packed.narrow(1, 0, 12), targets.narrow(1, 0, 12)).backward();
    std::vector<torch::Tensor> packed_grads;
    for (auto& p : model->parameters()) packed_grads.push_back(p.grad().clone());
    model->zero_grad();
    const auto part_loss = [&](int i, int64_t row, int64_t start, int64_t n) {
      return cross_entropy_sum(model->forward(parts[static_cast<size_t>(i)]), targets[row].narrow(0, start, n).unsqueeze(0));
    };
    (part_loss(0, 0, 0, 5) + part_loss(1, 0, 5, 7) + part_loss(1, 1, 0, 7) + part_loss(0, 1, 7, 5)).backward();
    size_t i = 0;
    for (auto& p : model->parameters()) {
      EXPECT_TRUE(torch::allclose(packed_grads[i], p.grad(), 1e-4, 1e-6)) << checkpointing << " parameter " << i;
      ++i;
    }
  }
  // Without the positions, the second part attends to the first and sits at positions 5..11.
  auto model = tiny_model(3);
  const auto whole = model->forward(x).detach();
  EXPECT_FALSE(torch::allclose(whole[0].narrow(0, 5, 7), model->forward(parts[1]).detach()[0], 1e-3, 1e-3));
}

TEST(Model, Bf16ComputeStaysCloseToFp32) {
  auto model = tiny_model();
  auto x = tokens(2, 16);
  auto y = tokens(2, 16, 3);
  const double fp32 = cross_entropy(model->forward(x), y).item<double>();
  model->set_compute_dtype(torch::kBFloat16);
  auto logits = model->forward(x);
  EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
  const double bf16 = cross_entropy(logits, y).item<double>();
  EXPECT_NEAR(bf16, fp32, 0.02 * fp32);
  // Gradients reach the fp32 masters.
  cross_entropy(logits, y).backward();
  EXPECT_EQ(model->parameters().front().grad().scalar_type(), torch::kFloat32);
}

TEST(Model, TiedEmbeddingsShareOneTensor) {
  auto config = preset_config("small");
  LlamaForCausalLM model(config);
  EXPECT_TRUE(model->lm_head.is_empty());
  EXPECT_EQ(model->head_weight().data_ptr(), model->model->embed_tokens->weight.data_ptr());
}

TEST(Weights, SaveAndLoadRoundTripInHfLayout) {
  const auto dir = temp_dir("roundtrip");
  auto model = tiny_model(5);
  save_pretrained(*model, dir);
  auto file = SafetensorsFile::open(dir + "/model.safetensors");
  EXPECT_TRUE(file->contains("model.embed_tokens.weight"));
  EXPECT_TRUE(file->contains("model.layers.1.self_attn.k_proj.weight"));
  EXPECT_TRUE(file->contains("model.layers.0.post_attention_layernorm.weight"));
  EXPECT_TRUE(file->contains("model.norm.weight"));
  EXPECT_TRUE(file->contains("lm_head.weight"));
  auto config = load_hf_config(dir + "/config.json");
  LlamaForCausalLM loaded(config);
  load_weights(*loaded, dir);
  auto x = tokens(1, 10);
  EXPECT_TRUE(torch::equal(model->forward(x), loaded->forward(x)));
}

TEST(Weights, ShardedSaveLoadsBack) {
  const auto dir = temp_dir("sharded");
  auto model = tiny_model(6);
  save_pretrained(*model, dir, torch::kFloat32, /*max_shard_bytes=*/64 * 1024);
  EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));
  LlamaForCausalLM loaded(preset_config("tiny"));
  load_weights(*loaded, dir);
  auto x = tokens(1, 10);
  EXPECT_TRUE(torch::equal(model->forward(x), loaded->forward(x)));
}

TEST(Weights, Bf16SaveConvertsOnLoad) {
  const auto dir = temp_dir("bf16");
  auto model = tiny_model(6);
  save_pretrained(*model, dir, torch::kBFloat16);
  LlamaForCausalLM loaded(load_hf_config(dir + "/config.json"));
  load_weights(*loaded, dir);
  auto a = model->named_parameters()["model.norm.weight"];
  auto b = loaded->named_parameters()["model.layers.0.mlp.up_proj.weight"];
  EXPECT_EQ(b.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(b, model->named_parameters()["model.layers.0.mlp.up_proj.weight"]
                                  .to(torch::kBFloat16).to(torch::kFloat32)));
  EXPECT_TRUE(torch::equal(a, loaded->named_parameters()["model.norm.weight"]));
}

TEST(Weights, MissingTensorAndShapeMismatchAreNamed) {
  const auto dir = temp_dir("bad");
  auto model = tiny_model();
  auto state = hf_state(*model);
  state.erase(state.begin() + 3);
  const std::string missing = hf_state(*model)[3].first;
  save_safetensors(dir + "/model.safetensors", state);
  try {
    load_weights(*model, dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  auto other = hf_state(*model);
  other[0].second = torch::zeros({3, 3});
  save_safetensors(dir + "/model.safetensors", other);
  try {
    load_weights(*model, dir);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shape"), std::string::npos) << e.what();
  }
}

TEST(Lora, OnlyAdaptersTrainAndStartAsIdentity) {
  auto model = tiny_model();
  auto x = tokens(2, 8);
  auto before = model->forward(x).detach();
  LoraConfig lora;
  lora.spec = {4, 8.0, 0.0};
  EXPECT_EQ(apply_lora(*model, lora, 1), 2 * 4);  // 2 layers x q,k,v,o
  EXPECT_TRUE(torch::equal(model->forward(x), before));  // B = 0
  auto trainable = trainable_parameters(*model);
  ASSERT_EQ(trainable.size(), 16u);
  for (auto& [name, p] : trainable) {
    EXPECT_TRUE(name.find("lora_A.weight") != std::string::npos || name.find("lora_B.weight") != std::string::npos) << name;
  }
  EXPECT_THROW(apply_lora(*tiny_model(), LoraConfig{{4, 8, 0}, {"qproj"}, std::nullopt}, 1), Error);
}

// model.cache_frozen_casts: LoRA on every projection of a bf16-computing model over an fp32 frozen
// base gives the same bits with the base's casts kept between steps as with them made in each
// forward (loss, per-token losses, every adapter gradient; logits and the chunked head; with
// dropout from the same seeds), across steps whose weights change, and after the base changes
// (merge_lora, an in-place write) the cache follows it. Each layer's and the head's copy exist
// only while caching is on.
TEST(Lora, CachedFrozenCastsGiveTheUncachedBits) {
  const auto x = tokens(2, 16), y = tokens(2, 16, 2);
  for (const double dropout : {0.0, 0.1}) {
    for (const bool chunked : {false, true}) {
      SCOPED_TRACE("dropout " + std::to_string(dropout) + " chunked " + std::to_string(chunked));
      const auto run = [&](bool cache) {
        auto model = tiny_model(5);
        model->set_compute_dtype(torch::kBFloat16);
        LoraConfig lora;
        lora.spec = {4, 8.0, dropout};
        lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
        apply_lora(*model, lora, 2);
        model->set_cache_frozen_casts(cache);
        model->train();
        torch::manual_seed(17);  // the dropout seeds
        std::vector<torch::Tensor> out;
        for (int step = 0; step < 2; ++step) {
          torch::Tensor loss;
          if (chunked) {
            loss = model->head_loss(model->forward_stages(0, model->num_stages(), x, {}, /*head=*/false), y);
          } else {
            loss = model->loss(model->forward(x), y);
          }
          loss.backward();
          out.push_back(loss.detach());
          torch::NoGradGuard no_grad;
          for (auto& [name, p] : trainable_parameters(*model)) {
            out.push_back(p.grad().clone());
            p.add_(p.grad(), -0.5);  // a step, so the next one's adapters differ
            p.grad().zero_();
          }
        }
        int64_t cached = 0;
        for (auto& module : model->modules()) {
          if (const auto* linear = module->as<LinearImpl>()) cached += linear->holds_cached_cast();
        }
        EXPECT_EQ(cached > 0, cache);  // o_proj and down_proj take theirs alone
        model->drop_frozen_casts();      // a write no version counter sees: made again from the weights
        for (auto& module : model->modules()) {
          if (const auto* linear = module->as<LinearImpl>()) {
            EXPECT_FALSE(linear->holds_cached_cast());
          }
        }
        model->eval();
        torch::NoGradGuard no_grad;
        out.push_back(model->forward(x));
        merge_lora(*model);  // the base changes in place: the cache is made again
        out.push_back(model->forward(x));
        for (auto& p : model->parameters()) {
          if (p.dim() == 2) p.mul_(1.5);
        }
        out.push_back(model->forward(x));
        return out;
      };
      const auto fresh = run(false), kept = run(true);
      ASSERT_EQ(fresh.size(), kept.size());
      for (size_t i = 0; i < fresh.size(); ++i) EXPECT_TRUE(torch::equal(fresh[i], kept[i])) << i;
      EXPECT_FALSE(torch::equal(fresh[fresh.size() - 2], fresh.back()));  // the last write changed the model
    }
  }
}

TEST(Lora, MergeComputesTheSameFunctionAndAdaptersRoundTrip) {
  auto model = tiny_model();
  LoraConfig lora;
  lora.spec = {4, 8.0, 0.0};
  lora.target_modules = {"q_proj", "v_proj", "down_proj"};
  apply_lora(*model, lora, 2);
  {
    torch::NoGradGuard g;
    for (auto& [name, p] : trainable_parameters(*model)) p.normal_(0, 0.05);
  }
  auto x = tokens(2, 8);
  auto adapted = model->forward(x).detach();
  const auto dir = temp_dir("lora");
  save_lora_adapter(*model, lora, dir, "tiny");
  auto file = SafetensorsFile::open(dir + "/adapter_model.safetensors");
  EXPECT_TRUE(file->contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
  EXPECT_TRUE(file->contains("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"));
  EXPECT_NE(read_file(dir + "/adapter_config.json").find("\"peft_type\": \"LORA\""), std::string::npos);

  auto fresh = tiny_model();
  apply_lora(*fresh, lora, 99);
  load_lora_adapter(*fresh, dir);
  EXPECT_TRUE(torch::allclose(fresh->forward(x), adapted, 1e-6, 1e-6));

  merge_lora(*model);
  EXPECT_TRUE(trainable_parameters(*model).empty());  // the adapters are gone; the base stays frozen
  for (auto& item : model->named_parameters()) EXPECT_EQ(item.key().find("lora_"), std::string::npos);
  EXPECT_TRUE(torch::allclose(model->forward(x), adapted, 1e-5, 1e-5));
}

}  // namespace

}  // namespace weft

namespace weft {
namespace {

// LlamaForSequenceClassification: `score` replaces the LM head and the loss pools each row at its
// labeled position (its last token); cross-entropy, or squared error for one output (regression).
TEST(Model, ClassificationHeadPoolsAtTheLabeledPosition) {
  auto config = preset_config("tiny");
  config.num_labels = 3;
  LlamaForCausalLM model(config);
  init_weights(*model, 5, 0.05);
  EXPECT_TRUE(model->lm_head.is_empty());
  ASSERT_FALSE(model->score.is_empty());
  EXPECT_EQ(model->score->weight.sizes(), (std::vector<int64_t>{3, config.hidden_size}));
  EXPECT_EQ(config.parameter_count(), [&] {
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    return n;
  }());
  const auto tokens = torch::randint(0, 256, {2, 6}, torch::kLong);
  const auto logits = model->forward(tokens);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 6, 3}));
  const int64_t u = kIgnoreTarget;
  const auto targets = torch::tensor(std::vector<int64_t>{u, u, u, 2, u, u, u, u, u, u, u, 0}, torch::kLong).reshape({2, 6});
  const auto pooled = torch::stack({logits[0][3], logits[1][5]});
  const auto expected = torch::nn::functional::cross_entropy(pooled, torch::tensor({2, 0}, torch::kLong));
  EXPECT_NEAR(model->loss(logits, targets).item<double>(), expected.item<double>(), 1e-6);
  EXPECT_TRUE(torch::allclose(model->labeled_rows(logits, targets).first, pooled));
  // A position after the labeled one does not change the row's output (causal attention: padding is harmless).
  auto padded = tokens.clone();
  padded[0][4] = 1;
  padded[0][5] = 1;
  EXPECT_TRUE(torch::allclose(model->forward(padded)[0][3], logits[0][3], 1e-6, 1e-6));

  config.num_labels = 1;  // regression: the score's bits as a double
  LlamaForCausalLM regression(config);
  init_weights(*regression, 5, 0.05);
  const auto out = regression->forward(tokens);
  auto bits = torch::full({2, 6}, u, torch::kLong);
  const auto scores = torch::tensor({1.5, -0.25}, torch::kFloat64);
  bits[0][3] = scores.view(torch::kLong)[0];
  bits[1][5] = scores.view(torch::kLong)[1];
  const double mse = (std::pow(out[0][3][0].item<double>() - 1.5, 2) + std::pow(out[1][5][0].item<double>() + 0.25, 2)) / 2;
  EXPECT_NEAR(regression->loss(out, bits).item<double>(), mse, 1e-5);
}

// A classifier's config.json is transformers' LlamaForSequenceClassification's, and reads back.
TEST(ModelConfig, ClassifierConfigRoundTrips) {
  auto config = preset_config("tiny");
  config.num_labels = 2;
  config.labels = {"negative", "positive"};
  config.pad_token_id = 257;
  const auto text = to_hf_config_json(config);
  EXPECT_NE(text.find("LlamaForSequenceClassification"), std::string::npos);
  const auto back = parse_hf_config(text, "config.json");
  EXPECT_EQ(back.num_labels, 2);
  EXPECT_EQ(back.labels, config.labels);
  EXPECT_EQ(back.pad_token_id, std::optional<int64_t>(257));
  EXPECT_EQ(parse_hf_config(to_hf_config_json(preset_config("tiny")), "c").num_labels, 0);
}

}  // namespace
}  // namespace weft
