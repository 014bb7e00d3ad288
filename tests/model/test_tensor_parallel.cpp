// Megatron tensor parallelism inside the model (core/model/parallel.h), in one process: two
// shard models run in two threads whose communication hook sums (or maxes) over both, and
// their results must equal the whole model's: logits (gathered over the vocabulary), the loss
// (vocabulary-parallel cross-entropy, never gathering logits), the gradient with respect to the
// input embeddings and every parameter's gradient slice. Also: GQA kv heads split into fewer
// parts than the query heads, tied embeddings, and the refusals of layouts the model cannot run.
#include <unistd.h>

#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/model/adalora.h"
#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/model/parallel.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/hash.h"

namespace tensor_parallel_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

using weft::CommPoint;
using weft::ModelConfig;
using weft::ParameterShard;
using weft::ShardMap;

// An all-reduce between `size` threads of this process.
class ThreadAllReduce {
 public:
  explicit ThreadAllReduce(int size) : size_(size), slots_(static_cast<size_t>(size)) {}
  void run(int rank, torch::Tensor& t, bool max) {
    std::unique_lock<std::mutex> lock(mutex_);
    const int generation = generation_;
    slots_[static_cast<size_t>(rank)] = t.detach().clone();
    if (++arrived_ == size_) {
      result_ = slots_[0].clone();
      for (int r = 1; r < size_; ++r) result_ = max ? torch::maximum(result_, slots_[r]) : result_ + slots_[r];
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    t.copy_(result_);
  }

 private:
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0, generation_ = 0;
  std::vector<torch::Tensor> slots_;
  torch::Tensor result_;
};

// Megatron's f/g and the vocabulary-parallel reductions for thread `rank`.
weft::CommHook megatron_hook(ThreadAllReduce& reduce, int rank) {
  return [&reduce, rank](CommPoint point, bool backward, int64_t, torch::Tensor& t) {
    switch (point) {
      case CommPoint::kAttentionInput:
      case CommPoint::kMlpInput:
      case CommPoint::kHeadInput:
        if (backward) reduce.run(rank, t, false);
        break;
      case CommPoint::kAttentionOutput:
      case CommPoint::kMlpOutput:
      case CommPoint::kEmbeddingOutput:
      case CommPoint::kLossSum:
      case CommPoint::kAdapterSum:
        if (!backward) reduce.run(rank, t, false);
        break;
      case CommPoint::kLossMax:
      case CommPoint::kRowAbsMax:
        if (!backward) reduce.run(rank, t, true);
        break;
    }
  };
}

ModelConfig small_config(bool tied) {
  ModelConfig c = weft::preset_config("tiny");  // hidden 64, 4 heads, 2 kv heads, 512 vocab
  c.num_hidden_layers = 2;
  c.tie_word_embeddings = tied;
  return c;
}

// The Megatron layout for part `index` of `parts` (kv heads split into `kv_parts`).
ShardMap megatron_shards(const ModelConfig& c, int32_t parts, int32_t index, int32_t kv_parts) {
  ShardMap shards;
  const int32_t kv_index = index * kv_parts / parts;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    shards[p + "self_attn.q_proj.weight"] = {0, parts, index};
    shards[p + "self_attn.k_proj.weight"] = {0, kv_parts, kv_index};
    shards[p + "self_attn.v_proj.weight"] = {0, kv_parts, kv_index};
    shards[p + "self_attn.o_proj.weight"] = {1, parts, index};
    shards[p + "mlp.gate_proj.weight"] = {0, parts, index};
    shards[p + "mlp.up_proj.weight"] = {0, parts, index};
    shards[p + "mlp.down_proj.weight"] = {1, parts, index};
  }
  shards["model.embed_tokens.weight"] = {0, parts, index};
  if (!c.tie_word_embeddings) shards["lm_head.weight"] = {0, parts, index};
  return shards;
}

struct Result {
  torch::Tensor logits, loss, hidden_grad;  // hidden_grad: d loss / d (stage 0 output)
  std::map<std::string, torch::Tensor> grads;
};

// Runs the embedding, then the rest with the embeddings as a leaf, so their gradient is seen.
Result run(weft::LlamaForCausalLMImpl& model, const torch::Tensor& tokens, const torch::Tensor& targets) {
  Result r;
  const int64_t stages = model.num_stages();
  auto embedded = model.forward_stages(0, 1, tokens);
  auto leaf = embedded.detach().requires_grad_(true);
  r.logits = model.forward_stages(1, stages, leaf);
  r.loss = model.loss(r.logits, targets);
  r.loss.backward();
  if (embedded.requires_grad()) embedded.backward(leaf.grad());  // frozen under LoRA
  r.hidden_grad = leaf.grad().clone();
  for (auto& item : model.named_parameters()) {
    if (item.value().grad().defined()) r.grads[item.key()] = item.value().grad().clone();  // frozen under LoRA
  }
  return r;
}

// LoRA adapters on every targetable layer of `model`, with B drawn at random (PEFT starts it at
// zero, which would leave A without a gradient) in the whole model's values, sliced.
void add_adapters(weft::LlamaForCausalLMImpl& model, weft::LlamaForCausalLMImpl* whole) {
  weft::LoraConfig lora;
  lora.spec.r = 4;
  lora.spec.alpha = 8;
  lora.target_modules = weft::lora_targetable_modules();
  weft::apply_lora(model, lora, 7);
  torch::NoGradGuard no_grad;
  auto params = model.named_parameters();
  for (auto& item : params) {
    if (item.key().find(".lora_B.") == std::string::npos) continue;
    if (whole == nullptr) {
      auto generator = at::make_generator<at::CPUGeneratorImpl>(weft::hash64(item.key(), 3));
      item.value().normal_(0.0, 0.05, generator);
    } else {
      item.value().copy_(weft::shard_slice(whole->named_parameters()[item.key()],
                                           weft::shard_of(model.options().shards, item.key())));
    }
  }
}

// Megatron sequence parallelism's all-gather and reduce-scatter over `reduce` for thread `rank`
// (a sum in which the other threads' slices are zeros, exact).
std::shared_ptr<const weft::SequenceShards> thread_sequence_shards(ThreadAllReduce& reduce, int32_t rank, int32_t parts) {
  auto shards = std::make_shared<weft::SequenceShards>();
  shards->rank = rank;
  shards->size = parts;
  shards->collective = [&reduce, rank](CommPoint, bool, int64_t, const torch::Tensor& input, torch::Tensor& output) {
    if (output.dim() == input.dim() + 1) {  // all-gather: slice r from rank r
      torch::Tensor gathered = torch::zeros_like(output);
      gathered[rank].copy_(input);
      reduce.run(rank, gathered, false);
      output.copy_(gathered);
    } else {  // reduce-scatter: this rank's slice of the sum
      torch::Tensor sum = input.clone();
      reduce.run(rank, sum, false);
      output.copy_(sum[rank]);
    }
  };
  return shards;
}

// Rank `rank`'s model options among `parts` thread ranks: Megatron's slices, the hook over
// `reduce`, and with `sequence_parallel` the residual stream's tokens split between the threads.
weft::ModelOptions megatron_options(const ModelConfig& config, int32_t parts, int32_t rank, int32_t kv_parts,
                                    ThreadAllReduce& reduce, bool sequence_parallel = false) {
  weft::ModelOptions options;
  options.shards = megatron_shards(config, parts, rank, kv_parts);
  options.comm = std::make_shared<const weft::CommHook>(megatron_hook(reduce, rank));
  if (sequence_parallel) options.sequence_parallel = thread_sequence_shards(reduce, rank, parts);
  return options;
}

bool is_norm(const std::string& name) { return name.find("norm.weight") != std::string::npos; }

// kv_heads: 0 keeps the preset's 2.
// sequence_parallel: the stage-0 output (and so hidden_grad) holds this rank's tokens, and the norms'
// gradients are each rank's tokens' share, summed over the ranks.
void expect_matches_whole_model(bool tied, int32_t parts, int32_t kv_parts, bool lora = false, int64_t kv_heads = 0,
                                bool sequence_parallel = false) {
  torch::manual_seed(3);
  at::set_num_threads(1);
  ModelConfig config = small_config(tied);
  if (kv_heads > 0) config.num_key_value_heads = kv_heads;
  weft::LlamaForCausalLM whole(config);
  weft::init_weights(*whole, 11, 0.05);
  if (lora) add_adapters(*whole, nullptr);
  const auto tokens = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
  const auto targets = torch::randint(0, config.vocab_size, {2, 16}, torch::kLong);
  const Result expected = run(*whole, tokens, targets);

  ThreadAllReduce reduce(parts);
  std::vector<Result> results(static_cast<size_t>(parts));
  std::vector<weft::LlamaForCausalLM> shards;
  for (int32_t rank = 0; rank < parts; ++rank) {
    const weft::ModelOptions options = megatron_options(config, parts, rank, kv_parts, reduce, sequence_parallel);
    shards.emplace_back(config, options);
    weft::init_weights(*shards.back(), 11, 0.05);  // the whole model's values, sliced
    if (!lora) continue;
    add_adapters(*shards.back(), whole.get());
    // Each shard's A starts as its slice of the whole layer's A (same seed, sliced draw).
    for (auto& item : shards.back()->named_parameters()) {
      if (item.key().find(".lora_A.") == std::string::npos) continue;
      const auto want = weft::shard_slice(whole->named_parameters()[item.key()], weft::shard_of(options.shards, item.key()));
      ASSERT_EQ(item.value().sizes(), want.sizes()) << item.key();
      EXPECT_TRUE(torch::equal(item.value(), want)) << item.key() << " rank " << rank;
    }
  }
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(parts));
  for (int32_t rank = 0; rank < parts; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        results[rank] = run(*shards[rank], tokens, targets);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ASSERT_TRUE(e.empty()) << e;

  std::vector<torch::Tensor> logits;
  for (const auto& r : results) logits.push_back(r.logits);
  EXPECT_LT((torch::cat(logits, -1) - expected.logits).abs().max().item<double>(), 1e-6);
  for (int32_t rank = 0; rank < parts; ++rank) {
    const Result& r = results[rank];
    EXPECT_NEAR(r.loss.item<double>(), expected.loss.item<double>(), 1e-6);
    const int64_t tokens_here = tokens.size(1) / (sequence_parallel ? parts : 1);
    const auto hidden_grad = expected.hidden_grad.narrow(1, sequence_parallel ? rank * tokens_here : 0, tokens_here);
    ASSERT_EQ(r.hidden_grad.sizes(), hidden_grad.sizes());
    EXPECT_LT((r.hidden_grad - hidden_grad).abs().max().item<double>(), 1e-6) << "rank " << rank;
    ASSERT_EQ(r.grads.size(), expected.grads.size());
    for (const auto& [name, grad] : r.grads) {
      const ParameterShard shard = weft::shard_of(shards[rank]->options().shards, name);
      // A norm's gradient is complete on every rank. Any other gradient is each rank's share:
      // kv slices shared by several ranks (from their own query heads), the whole factor of a
      // LoRA adapter on a split layer. Summed over the ranks that hold the same slice (what a
      // plugin all-reduces), it is the slice's gradient; a slice held once is complete as is.
      torch::Tensor total = grad.clone();
      for (int32_t other = 0; other < parts && (!is_norm(name) || sequence_parallel); ++other) {
        const ParameterShard theirs = weft::shard_of(shards[other]->options().shards, name);
        if (other != rank && theirs.parts == shard.parts && theirs.index == shard.index) total += results[other].grads.at(name);
      }
      const auto want = weft::shard_slice(expected.grads.at(name), shard);
      ASSERT_EQ(total.sizes(), want.sizes()) << name;
      EXPECT_LT((total - want).abs().max().item<double>(), 1e-6) << name << " rank " << rank;
    }
  }
}

TEST(TensorParallel, TwoShardsMatchTheWholeModel) { expect_matches_whole_model(false, 2, 2); }
TEST(TensorParallel, TwoShardsWithTiedEmbeddings) { expect_matches_whole_model(true, 2, 2); }
TEST(TensorParallel, FourShardsShareKvHeadsInPairs) { expect_matches_whole_model(false, 4, 2); }
TEST(TensorParallel, LoraAdaptersFollowTheirBaseLayersSplit) { expect_matches_whole_model(false, 2, 2, true); }
TEST(TensorParallel, LoraAdaptersWithKvHeadsSharedInPairs) { expect_matches_whole_model(false, 4, 2, true); }
// Multi-query attention: the one kv head is whole on both ranks, each with a share of its gradient.
TEST(TensorParallel, LoraAdaptersWithOneKvHeadOnEveryRank) { expect_matches_whole_model(false, 2, 1, true, 1); }
// Megatron sequence parallelism: between the regions each rank holds its tokens (the embedding's
// reduce-scatter, the norms, the residual stream), the regions all-gather them; the same logits,
// loss and gradients, the norms' summed over the ranks.
TEST(TensorParallel, SequenceParallelTwoShardsMatchTheWholeModel) { expect_matches_whole_model(false, 2, 2, false, 0, true); }
TEST(TensorParallel, SequenceParallelFourShardsWithTiedEmbeddingsAndLora) {
  expect_matches_whole_model(true, 4, 2, true, 0, true);
}

// AdaLoRA on 4 ranks whose kv slices repeat in pairs: P and Q are the whole model's, sliced with
// their layer (Lambda whole), and the orthogonal regulariser, whose split Gram matrices are summed
// at CommPoint::kAdapterSum, is the whole model's on every rank, with each slice's gradient the
// whole gradient's slice (no sum over ranks: the point's backward is the identity).
TEST(TensorParallel, AdaLoraSlicesAndTheirOrthogonalRegularizerAreTheWholeModels) {
  const int32_t parts = 4, kv_parts = 2;
  at::set_num_threads(1);
  const ModelConfig config = small_config(false);
  weft::AdaLoraConfig adalora;
  adalora.spec.r = 4;
  adalora.target_r = 2;
  adalora.target_modules = weft::lora_targetable_modules();
  weft::LlamaForCausalLM whole(config);
  weft::apply_adalora(*whole, adalora, 5);
  {
    torch::NoGradGuard no_grad;  // Lambda starts at 0; give it values so that every term depends on it
    for (auto& item : whole->named_parameters()) {
      if (item.key().find(".lora_E") != std::string::npos) item.value().uniform_(-1, 1);
    }
  }
  const auto expected = weft::adalora_orthogonal_regularization(*whole);
  expected.backward();

  ThreadAllReduce reduce(parts);
  std::vector<weft::LlamaForCausalLM> shards;
  for (int32_t rank = 0; rank < parts; ++rank) {
    const weft::ModelOptions options = megatron_options(config, parts, rank, kv_parts, reduce);
    shards.emplace_back(config, options);
    weft::apply_adalora(*shards.back(), adalora, 5);
    torch::NoGradGuard no_grad;
    int64_t checked = 0;
    for (auto& item : shards.back()->named_parameters()) {
      if (item.key().find(".lora_") == std::string::npos) continue;
      const ParameterShard shard = weft::shard_of(options.shards, item.key());
      if (item.key().find(".lora_E") != std::string::npos) {
        EXPECT_TRUE(shard.whole()) << item.key();
      }
      const auto want = weft::shard_slice(whole->named_parameters()[item.key()], shard);
      if (item.key().find(".lora_E") != std::string::npos) item.value().copy_(want);
      ASSERT_EQ(item.value().sizes(), want.sizes()) << item.key();
      EXPECT_TRUE(torch::equal(item.value(), want)) << item.key() << " rank " << rank;
      checked += shard.whole() ? 0 : 1;
    }
    EXPECT_EQ(checked, 2 * 7 + 1) << "one split factor per adapted layer (7 per block, 2 blocks, the head)";
  }
  std::vector<torch::Tensor> values(static_cast<size_t>(parts));
  std::vector<std::string> errors(static_cast<size_t>(parts));
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < parts; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        values[rank] = weft::adalora_orthogonal_regularization(*shards[rank]);
        values[rank].backward();
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ASSERT_TRUE(e.empty()) << e;
  for (int32_t rank = 0; rank < parts; ++rank) {
    EXPECT_NEAR(values[rank].item<double>(), expected.item<double>(), 1e-6) << "rank " << rank;
    for (auto& item : shards[rank]->named_parameters()) {
      if (item.key().find(".lora_A") == std::string::npos && item.key().find(".lora_B") == std::string::npos) continue;
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      const auto want = weft::shard_slice(whole->named_parameters()[item.key()].grad(),
                                          weft::shard_of(shards[rank]->options().shards, item.key()));
      EXPECT_LT((item.value().grad() - want).abs().max().item<double>(), 1e-6) << item.key() << " rank " << rank;
    }
  }
}

TEST(TensorParallel, EachShardLoadsItsSliceOfACheckpoint) {
  const ModelConfig config = small_config(false);
  weft::LlamaForCausalLM whole(config);
  weft::init_weights(*whole, 5, 0.05);
  const std::string dir = (std::filesystem::temp_directory_path() / ("weft_tp_load_" + std::to_string(::getpid()))).string();
  weft::save_pretrained(*whole, dir, torch::kFloat32);
  for (int32_t rank = 0; rank < 2; ++rank) {
    weft::ModelOptions options;
    options.shards = megatron_shards(config, 2, rank, 2);
    weft::LlamaForCausalLM shard(config, options);
    weft::load_weights(*shard, dir);
    const auto reference = whole->named_parameters();
    for (const auto& item : shard->named_parameters()) {
      const auto want = weft::shard_slice(reference[item.key()], weft::shard_of(options.shards, item.key()));
      ASSERT_EQ(item.value().sizes(), want.sizes()) << item.key();
      EXPECT_TRUE(torch::equal(item.value(), want)) << item.key() << " rank " << rank;
    }
  }
  std::filesystem::remove_all(dir);
}

// Prefill `prefix` tokens, then decode the rest one at a time; returns the logits of every
// position, concatenated.
torch::Tensor decode(weft::LlamaForCausalLMImpl& model, const torch::Tensor& tokens, int64_t prefix) {
  std::vector<weft::LayerKvCache> cache;
  std::vector<torch::Tensor> logits{model.forward_cached(tokens.narrow(1, 0, prefix), cache)};
  for (int64_t t = prefix; t < tokens.size(1); ++t) logits.push_back(model.forward_cached(tokens.narrow(1, t, 1), cache));
  EXPECT_EQ(cache.front().length(), tokens.size(1));
  return torch::cat(logits, 1);
}

TEST(TensorParallel, CachedDecodingEqualsTheFullForwardWholeAndSharded) {
  torch::manual_seed(4);
  at::set_num_threads(1);
  const ModelConfig config = small_config(false);
  weft::LlamaForCausalLM whole(config);
  weft::init_weights(*whole, 9, 0.05);
  const auto tokens = torch::randint(0, config.vocab_size, {2, 12}, torch::kLong);
  torch::Tensor full;
  {
    torch::NoGradGuard no_grad;
    full = whole->forward(tokens);
  }
  EXPECT_LT((decode(*whole, tokens, 5) - full).abs().max().item<double>(), 1e-5);
  // Two shards with their own (head-sharded) caches, in threads, gathered over the vocabulary.
  ThreadAllReduce reduce(2);
  std::vector<weft::LlamaForCausalLM> shards;
  std::vector<torch::Tensor> logits(2);
  for (int32_t rank = 0; rank < 2; ++rank) {
    weft::ModelOptions options;
    options.shards = megatron_shards(config, 2, rank, 2);
    options.comm = std::make_shared<const weft::CommHook>(megatron_hook(reduce, rank));
    shards.emplace_back(config, options);
    weft::init_weights(*shards.back(), 9, 0.05);
  }
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] { logits[rank] = decode(*shards[rank], tokens, 5); });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT((torch::cat(logits, -1) - full).abs().max().item<double>(), 1e-5);
}

TEST(TensorParallel, RefusesLayoutsTheModelCannotRun) {
  const ModelConfig config = small_config(false);
  auto build = [&](ShardMap shards) {
    weft::ModelOptions options;
    options.shards = std::move(shards);
    weft::LlamaForCausalLM model(config, options);
  };
  auto expect_error = [&](ShardMap shards, const std::string& message) {
    try {
      build(std::move(shards));
      FAIL() << "no error; expected: " << message;
    } catch (const weft::Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  ShardMap three = megatron_shards(config, 3, 0, 3);
  expect_error(three, "4 attention heads cannot be split into 3 parts");
  ShardMap eight = megatron_shards(config, 8, 0, 2);
  expect_error(eight, "4 attention heads cannot be split into 8 parts");
  ShardMap transposed = megatron_shards(config, 2, 0, 2);
  transposed["model.layers.0.self_attn.o_proj.weight"] = {0, 2, 0};
  expect_error(transposed, "o/down along dim 1");
  ShardMap norm = megatron_shards(config, 2, 0, 2);
  norm["model.layers.1.input_layernorm.weight"] = {0, 2, 0};
  expect_error(norm, "norms are not split");
  ShardMap unknown;
  unknown["model.layers.9.mlp.up_proj.weight"] = {0, 2, 0};
  expect_error(unknown, "'model.layers.9.mlp.up_proj.weight' is not a parameter this process holds");
}

// Megatron's saved local shard (release_gathered): after a region's forward its gathered input
// holds no memory (also not the view the matmul saved), the backward gathers it again (the
// region's all-gather once more, FORWARD direction) before the region's own backward, and the
// gradients are those of keeping the gathered input. One process standing in for rank 0 of 2: the
// fake all-gather repeats this rank's tokens, the fake reduce-scatter sums the slices.
TEST(TensorParallel, SequenceParallelKeepsOnlyTheLocalTokensOfARegionsInputUntilItsBackward) {
  std::vector<std::pair<bool, bool>> calls;  // {all-gather, backward}
  weft::SequenceShards shards;
  shards.rank = 0;
  shards.size = 2;
  shards.collective = [&calls](CommPoint, bool backward, int64_t, const torch::Tensor& input, torch::Tensor& output) {
    const bool gather = output.dim() == input.dim() + 1;
    calls.emplace_back(gather, backward);
    if (gather) {
      output.copy_(input.unsqueeze(0).expand_as(output));
    } else {
      output.copy_(input.sum(0));
    }
  };
  const auto run = [&](bool release) {
    calls.clear();
    torch::manual_seed(5);
    const auto x = torch::randn({2, 4, 8}).requires_grad_(true);  // [B, s, H]: this rank's tokens
    const auto w = torch::randn({8, 6}).requires_grad_(true);
    const auto local = x * 2.0;  // the norm's output
    const auto gathered = weft::sequence_gather(shards, CommPoint::kAttentionInput, 0, local);
    EXPECT_EQ(gathered.sizes(), (std::vector<int64_t>{2, 8, 8}));
    auto y = torch::matmul(torch::tanh(gathered), w) + torch::matmul(gathered, w);  // saves gathered (and a view of it)
    if (release) {
      y = weft::release_gathered(shards, CommPoint::kAttentionInput, 0, y, local, gathered);
      EXPECT_EQ(gathered.storage().nbytes(), 0u);
    }
    const auto out = weft::sequence_reduce_scatter(shards, CommPoint::kAttentionOutput, 0, y);
    out.pow(2).sum().backward();
    return std::pair{x.grad().clone(), w.grad().clone()};
  };
  const auto [x_kept, w_kept] = run(false);
  EXPECT_EQ(calls, (std::vector<std::pair<bool, bool>>{{true, false}, {false, false}, {true, true}, {false, true}}));
  const auto [x_released, w_released] = run(true);
  // Forward: gather, reduce-scatter; backward: the reduce-scatter's all-gather, the input gathered
  // again (forward direction), the gather's reduce-scatter.
  EXPECT_EQ(calls, (std::vector<std::pair<bool, bool>>{
                       {true, false}, {false, false}, {true, true}, {true, false}, {false, true}}));
  EXPECT_TRUE(torch::equal(x_released, x_kept));
  EXPECT_TRUE(torch::equal(w_released, w_kept));
  // Outside training nothing is released.
  torch::NoGradGuard no_grad;
  const auto local = torch::randn({2, 4, 8});
  const auto gathered = weft::sequence_gather(shards, CommPoint::kAttentionInput, 0, local);
  const auto y = weft::release_gathered(shards, CommPoint::kAttentionInput, 0, gathered * 2.0, local, gathered);
  EXPECT_GT(gathered.storage().nbytes(), 0u);
  EXPECT_TRUE(torch::equal(y, gathered * 2.0));
}

}  // namespace tensor_parallel_test
