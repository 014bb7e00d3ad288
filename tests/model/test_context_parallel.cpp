// Ulysses context parallelism inside the model (core/model/parallel.h's ContextSplit), in one
// process: `parts` model replicas run in threads, each on its slice of every sequence's tokens,
// exchanging q/k/v and the attention output through an in-memory all-to-all. Their logits,
// concatenated along the sequence, must equal the whole model's on whole sequences, and the
// mean of their gradients (each rank's loss is the mean over its tokens) the whole model's
// gradient: with GQA kv heads that split evenly, kv heads fewer than the parts (repeated), and
// the exchange's own inverse property.
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/model/llama.h"
#include "core/model/parallel.h"
#include "core/model/weights.h"

namespace {

using weft::ModelConfig;
using weft::ContextSplit;

// An all-to-all between `size` threads: chunk j of rank i's send lands in chunk i of rank j's recv.
class ThreadAllToAll {
 public:
  explicit ThreadAllToAll(int size) : size_(size), slots_(static_cast<size_t>(size)) {}
  void run(int rank, const torch::Tensor& send, torch::Tensor& recv) {
    std::unique_lock<std::mutex> lock(mutex_);
    wait_for_all(lock, [&] { slots_[static_cast<size_t>(rank)] = send.clone(); });
    for (int i = 0; i < size_; ++i) recv[i].copy_(slots_[static_cast<size_t>(i)][rank]);
    wait_for_all(lock, [] {});  // nobody overwrites a slot before every rank has read it
  }

 private:
  template <typename Arrive>
  void wait_for_all(std::unique_lock<std::mutex>& lock, Arrive arrive) {
    const int generation = generation_;
    arrive();
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0, generation_ = 0;
  std::vector<torch::Tensor> slots_;
};

std::shared_ptr<const ContextSplit> thread_split(ThreadAllToAll& exchange, int rank, int size) {
  auto split = std::make_shared<ContextSplit>();
  split->rank = rank;
  split->size = size;
  split->all_to_all = [&exchange, rank](int64_t, bool, torch::Tensor& send, torch::Tensor& recv) {
    exchange.run(rank, send, recv);
  };
  return split;
}

struct Result {
  torch::Tensor logits, loss;
  std::map<std::string, torch::Tensor> grads;
};

Result run(weft::LlamaForCausalLMImpl& model, const torch::Tensor& tokens, const torch::Tensor& targets) {
  Result r;
  r.logits = model.forward_stages(0, model.num_stages(), tokens);
  r.loss = model.loss(r.logits, targets);
  r.loss.backward();
  for (auto& item : model.named_parameters()) r.grads[item.key()] = item.value().grad().clone();
  return r;
}

void expect_matches_whole_model(int parts, int64_t kv_heads) {
  at::set_num_threads(1);
  ModelConfig config = weft::preset_config("tiny");  // hidden 64, 4 heads, 512 vocab
  config.num_hidden_layers = 2;
  config.num_key_value_heads = kv_heads;
  weft::LlamaForCausalLM whole(config);
  weft::init_weights(*whole, 11, 0.05);
  torch::manual_seed(3);
  const int64_t seq = 16, local = seq / parts;
  const auto tokens = torch::randint(0, config.vocab_size, {2, seq}, torch::kLong);
  const auto targets = torch::randint(0, config.vocab_size, {2, seq}, torch::kLong);
  const Result expected = run(*whole, tokens, targets);

  ThreadAllToAll exchange(parts);
  std::vector<weft::LlamaForCausalLM> replicas;
  for (int rank = 0; rank < parts; ++rank) {
    weft::ModelOptions options;
    options.context = thread_split(exchange, rank, parts);
    replicas.emplace_back(config, options);
    weft::init_weights(*replicas.back(), 11, 0.05);
  }
  std::vector<Result> results(static_cast<size_t>(parts));
  std::vector<std::string> errors(static_cast<size_t>(parts));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < parts; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        results[rank] = run(*replicas[rank], tokens.narrow(1, rank * local, local), targets.narrow(1, rank * local, local));
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ASSERT_TRUE(e.empty()) << e;

  std::vector<torch::Tensor> logits;
  double loss = 0;
  for (const auto& r : results) {
    logits.push_back(r.logits);
    loss += r.loss.item<double>() / parts;
  }
  EXPECT_TRUE(torch::allclose(torch::cat(logits, 1), expected.logits, 1e-5, 1e-6));
  EXPECT_NEAR(loss, expected.loss.item<double>(), 1e-6);
  for (const auto& [name, grad] : expected.grads) {
    torch::Tensor mean = torch::zeros_like(grad);
    for (const auto& r : results) mean += r.grads.at(name) / parts;
    EXPECT_TRUE(torch::allclose(mean, grad, 1e-4, 1e-6))
        << name << ": largest difference " << (mean - grad).abs().max().item<double>();
  }
}

TEST(ContextParallel, TwoPartsMatchTheWholeModel) { expect_matches_whole_model(2, 2); }
TEST(ContextParallel, FourPartsMatchTheWholeModel) { expect_matches_whole_model(4, 4); }
TEST(ContextParallel, KvHeadsFewerThanPartsAreRepeated) { expect_matches_whole_model(4, 2); }
TEST(ContextParallel, MultiQueryAttentionOverTwoParts) { expect_matches_whole_model(2, 1); }

// The two exchanges are each other's inverse, and a position ends where Ulysses puts it.
TEST(ContextParallel, TheExchangesAreInverse) {
  const int parts = 2;
  ThreadAllToAll exchange(parts);
  const auto whole = torch::arange(2 * 4 * 6 * 3, torch::kFloat32).reshape({2, 4, 6, 3});  // [B, H, S, D]
  std::vector<torch::Tensor> heads(parts), back(parts);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < parts; ++rank) {
    threads.emplace_back([&, rank] {
      auto split = thread_split(exchange, rank, parts);
      heads[rank] = weft::sequence_to_heads(whole.narrow(2, rank * 3, 3), *split, 0);
      back[rank] = weft::heads_to_sequence(heads[rank], *split, 0);
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < parts; ++rank) {
    EXPECT_TRUE(torch::equal(heads[rank], whole.narrow(1, rank * 2, 2))) << "rank " << rank << "'s heads";
    EXPECT_TRUE(torch::equal(back[rank], whole.narrow(2, rank * 3, 3))) << "rank " << rank << "'s tokens";
  }
}

TEST(ContextParallel, HeadsThatDoNotSplitAreRefused) {
  ModelConfig config = weft::preset_config("tiny");
  config.num_hidden_layers = 1;
  ThreadAllToAll exchange(3);
  weft::ModelOptions options;
  options.context = thread_split(exchange, 0, 3);
  try {  // refused where the model is built, before any compute
    weft::LlamaForCausalLM model(config, options);
    ADD_FAILURE() << "4 heads split over 3 processes";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("4 attention heads cannot be split over 3"), std::string::npos) << e.what();
  }
}

}  // namespace
