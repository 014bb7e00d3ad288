// LlamaForCausalLM as a sequence of stages, so strategies can run any contiguous part of it.
//
// Stage numbering (S = num_hidden_layers + 2 stages in all):
//   stage 0          token embedding            tokens [B, T] (int64) -> hidden [B, T, C]
//   stage 1 .. L     decoder block i = stage-1   hidden -> hidden
//   stage L + 1      final norm + LM head        hidden -> logits [B, T, V] (compute dtype)
// The loss is separate (cross_entropy), computed from the last stage's logits.
//
// A model may be built with only some stages materialised (a pipeline rank builds only its own:
// one range, or several with virtual stages); parameter names are always the full model's HF names, e.g. "model.layers.7.mlp.up_proj.weight",
// so checkpoints and initialisation do not depend on which stages a process holds.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include "core/model/config.h"
#include "core/model/layers.h"
#include "core/model/parallel.h"

namespace weft {

struct StageRange {
  int64_t first = 0;  // first stage held
  int64_t last = -1;  // one past the last stage held; -1 = through the end
};

// The stages a process holds: one range, or several disjoint ones in ascending order (a
// pipeline rank's virtual stages, stage_chunks). Default: every stage.
struct StageSet {
  std::vector<StageRange> ranges{StageRange{}};
  StageSet() = default;
  StageSet(StageRange range) : ranges{range} {}  // NOLINT(google-explicit-constructor): one range is a set
  explicit StageSet(std::vector<StageRange> r) : ranges(std::move(r)) {}
  // The ranges with -1 resolved against `num_stages`; throws weft::Error unless they are
  // non-empty, ascending, disjoint, not adjacent and within [0, num_stages).
  std::vector<StageRange> resolved(int64_t num_stages) const;
  // Whether `stage` is in one of the ranges (resolved against num_stages).
  bool holds(int64_t stage, int64_t num_stages) const;
  // "[0, 3)" or "[0, 2) + [5, 7)".
  std::string describe(int64_t num_stages) const;
};

struct ModelOptions {
  torch::Dtype compute_dtype = torch::kFloat32;  // kFloat32 or kBFloat16
  bool activation_checkpointing = false;         // recompute each decoder block in backward
  StageSet stages;                               // which stages this process materialises
  // Tensor parallelism: the slice of each weight this process holds (parallel.h) and the hook
  // the model calls at Megatron's communication points (none: a whole model).
  ShardMap shards;
  std::shared_ptr<const CommHook> comm;
  // Context parallelism (parallel.h ContextSplit): forward() takes this process's tokens of each sequence
  // and the attention core exchanges them (none, or size 1: whole sequences).
  std::shared_ptr<const ContextSplit> context;
  // Megatron sequence parallelism inside the tensor-parallel group (parallel.h SequenceShards):
  // between the regions the residual stream holds this process's tokens; the regions'
  // entries all-gather and their exits reduce-scatter through it instead of `comm` (none, or size
  // 1: whole sequences). Needs a vocabulary-parallel embedding and whole sequences otherwise;
  // cached decoding ignores it.
  std::shared_ptr<const SequenceShards> sequence_parallel;
  // How the decoder blocks' linear weights are stored (quantize.h; model.quantize and
  // model.int8_threshold): quantized layers are frozen and hold no `weight` parameter (set them
  // with load_weights / init_weights).
  QuantConfig quantize;
  // The linear layers' trainable weights may have their gradients deferred (weight_grad.h): a
  // plugin that splits backward passes (split_backward, zero-bubble schedules).
  bool deferrable_weight_grads = false;
  // Prompt tuning (prompt_tuning.h): each row's inputs begin with this many virtual-token slots
  // (ids -1..-P), which the embedding stage takes from model.prompt_embeddings.
  int64_t prompt_tokens = 0;
  // The host may defer the LM head to the loss, which computes it with its cross-entropy in row
  // chunks (linear_cross_entropy.h) where fuses_head_loss() allows; false: logits always (model.chunked_loss).
  bool chunked_loss = true;
};

// What a process's slices amount to, checked against the Megatron layout: local head counts,
// MLP width and the vocabulary range of the embedding / LM head, and the slices themselves (q_proj's,
// k_proj's and gate_proj's rows, the vocabulary's), which the blocks' and the head's layers hold.
struct LocalShape {
  int64_t heads = 0, kv_heads = 0, intermediate = 0;
  int64_t vocab_start = 0, vocab = 0;
  ParameterShard q, kv, mlp, vocab_slice;
};
// Throws weft::Error naming the parameter and the problem when `shards` is not a layout the
// model can run (a split that does not divide the heads, a norm split, a transposed split...).
LocalShape local_shape(const ModelConfig& config, const ShardMap& shards, const std::vector<StageRange>& held);
// The parameters (HF names and shapes) of the stages in `held` (parallel.h parameter_specs per range).
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_specs(const ModelConfig& config,
                                                                          const std::vector<StageRange>& held);

class LlamaBackboneImpl : public torch::nn::Module {
 public:
  LlamaBackboneImpl(const ModelConfig& config, const StageSet& held, const LocalShape& local, const CommHook* comm,
                    QuantConfig quantize = {});
  torch::nn::Embedding embed_tokens{nullptr};  // present when stage 0 (or a tied head) is held
  std::shared_ptr<torch::nn::Module> layers;   // children "i" -> DecoderBlock for held blocks
  RMSNorm norm{nullptr};                       // present when the last stage is held
  std::map<int64_t, DecoderBlock> blocks;      // held blocks by layer index
  torch::Tensor prompt_embeddings;             // prompt tuning: [P, hidden] (prompt_tuning.h), else undefined
};
TORCH_MODULE(LlamaBackbone);

// The model stage that owns a parameter, from its HF name: 0 for the embedding (also the
// tied head's weight) and a prompt-tuning embedding, 1 + i for "model.layers.<i>.*", num_layers + 1
// for the norm and head.
int64_t stage_of_parameter(const std::string& name, int64_t num_layers);

class LlamaForCausalLMImpl : public torch::nn::Module {
 public:
  LlamaForCausalLMImpl(const ModelConfig& config, const ModelOptions& options = {});

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  int64_t num_stages() const { return config_.num_hidden_layers + 2; }
  // The stages this model holds (resolved: ascending, disjoint ranges).
  const std::vector<StageRange>& held_stages() const { return held_; }
  bool holds_stage(int64_t stage) const;
  bool holds_every_stage() const { return held_.size() == 1 && held_[0].first == 0 && held_[0].last == num_stages(); }

  // Runs stages [first, last) on `input` (tokens if first == 0, else hidden states).
  // `positions` (packed rows, int64 [B, S] over whole rows even when this process holds a share of
  // each: Batch::positions): each token's position within its example, which the blocks' RoPE and
  // attention follow (TokenLayout); undefined: one sequence per row.
  // Throws weft::Error if a stage in the range is not held by this model.
  // `head` false (fuses_head_loss() models only): the last stage stops at the final norm, whose
  // output head_logits() or head_loss() take.
  torch::Tensor forward_stages(int64_t first, int64_t last, const torch::Tensor& input,
                               const torch::Tensor& positions = {}, bool head = true);
  // Full model: tokens -> logits. Requires all stages.
  torch::Tensor forward(const torch::Tensor& tokens);
  // Incremental decoding (inference, no autograd; requires all stages): logits for `tokens`
  // [B, T] at positions cache[0].length() onwards, appending every layer's keys and values to
  // `cache` (one entry per layer, created on the first call). Equals forward() on the whole
  // sequence so far, position by position.
  torch::Tensor forward_cached(const torch::Tensor& tokens, std::vector<LayerKvCache>& cache);

  void set_compute_dtype(torch::Dtype dtype);
  void set_activation_checkpointing(bool enabled) { options_.activation_checkpointing = enabled; }
  // Keep the frozen weights' compute-dtype copies between steps (model.cache_frozen_casts: every
  // linear layer's, CastCache, and a frozen LM head's); off drops them.
  void set_cache_frozen_casts(bool enabled);
  // Drops the kept casts (caching stays as it is): the next forward makes them again. For writers
  // that bypass ATen's version counters (a plugin writing through a parameter's DLTensor view).
  void drop_frozen_casts();

  // The LM head weight: lm_head.weight, or the embedding when tied.
  torch::Tensor head_weight() const;
  // This process's slices (whole model: heads = config heads, vocab = [0, vocab_size)).
  const LocalShape& local_shape() const { return local_; }
  bool vocab_parallel() const { return local_.vocab != config_.vocab_size; }
  // Mean cross-entropy of this model's logits (the last stage's output) against targets:
  // cross_entropy, or vocab_parallel_cross_entropy when the vocabulary is split. Classification:
  // the mean over the labeled positions of cross-entropy, or of the squared error (regression).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;
  // Each target token's cross-entropy (fp32, flattened), the vocabulary's shards combined too;
  // classification: each labeled position's loss, in row order.
  torch::Tensor token_losses(const torch::Tensor& logits, const torch::Tensor& targets) const;

  // Whether the LM head's product and the loss may be one chunked pass over the final norm's output
  // (options().chunked_loss, a causal LM whose whole vocabulary and every token of its rows are
  // here, a dense head without an adapter).
  bool fuses_head_loss() const;
  // The last stage's logits from the final norm's output `hidden` [B, T, hidden].
  torch::Tensor head_logits(const torch::Tensor& hidden);
  // loss(head_logits(hidden), targets) without the whole logits (linear_cross_entropy_sum); with
  // `token_losses`, also what token_losses() would give, outside the graph.
  torch::Tensor head_loss(const torch::Tensor& hidden, const torch::Tensor& targets,
                          torch::Tensor* token_losses = nullptr) const;

  // Sequence classification (config.num_labels > 0): the logits of every position, the rows whose
  // target is not kIgnoreTarget (each sequence's last token), and those targets.
  std::pair<torch::Tensor, torch::Tensor> labeled_rows(const torch::Tensor& logits, const torch::Tensor& targets) const;

  LlamaBackbone model{nullptr};
  Linear lm_head{nullptr};  // absent when tie_word_embeddings or classifying
  Linear score{nullptr};    // sequence classification's head [num_labels, hidden] (HF "score.weight")

 private:
  // `shard_tokens`: with options().tensor_sequence, stage 0 returns this process's tokens and the
  // last stage takes them (false: whole sequences, for cached decoding).
  torch::Tensor run_stage(int64_t stage, const torch::Tensor& input, bool shard_tokens = true,
                          const TokenLayout* layout = nullptr, bool head = true);

  ModelConfig config_;
  ModelOptions options_;
  std::vector<StageRange> held_;
  LocalShape local_;
  RotaryEmbedding rope_;
  // The head's weight for the compute dtype: a frozen head's cached copy (set_cache_frozen_casts),
  // else head_weight() as it is.
  torch::Tensor head_weight_to_compute() const;
  bool cache_casts_ = false;
  mutable CastCache head_cast_;
};
TORCH_MODULE(LlamaForCausalLM);

// Targets of a classification batch: every position holds kIgnoreTarget but the one the head is
// pooled at (the sequence's last token), which holds the class id, or for regression
// (num_labels = 1) the bits of the score as a double (targets.view(kFloat64)); -100's bits are a
// NaN, so no score is mistaken for it.
constexpr int64_t kIgnoreTarget = -100;

// Mean cross-entropy over all target tokens (fp32 math). logits [B, T, V], targets [B, T].
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets);
// Summed cross-entropy (for token-weighted evaluation across batches and ranks).
torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets);

// Runs `block` so that its activations are recomputed in backward instead of stored
// (activation checkpointing). Gradients of the block's parameters accumulate as usual; dropout
// masks are reproduced by restoring the CPU RNG state.
torch::Tensor checkpointed_block(DecoderBlockImpl& block, const RotaryEmbedding& rope, const torch::Tensor& x,
                                 const TokenLayout* layout = nullptr);

}  // namespace weft
