// Tensor parallelism inside the model (Megatron-LM): which slice of each weight this process
// holds, and the communication points the model calls so that a strategy plugin can combine
// the slices' partial results.
//
// A parameter's shard is the slice [index * n / parts, (index + 1) * n / parts) along `dim` of
// its full tensor (parts == 1: whole). The model supports the Megatron layout: q/k/v and
// gate/up column-parallel (dim 0), o and down row-parallel (dim 1), embedding and LM head
// vocabulary-parallel (dim 0), norms whole; k/v may also be split into fewer parts than q (ranks
// that share a kv head hold the same kv slice, and each gets a partial gradient of it, from its
// own query heads: the plugin sums those over the sharing ranks). Anything else is refused when
// the model is built.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "core/model/config.h"

namespace weft {

struct ParameterShard {
  int32_t dim = 0;
  int32_t parts = 1;
  int32_t index = 0;
  bool whole() const { return parts == 1; }
  // [start, start + length) of a dimension of `size` elements.
  std::pair<int64_t, int64_t> range(int64_t size) const {
    const int64_t start = index * size / parts, end = (index + 1) * size / parts;
    return {start, end - start};
  }
};

// By HF parameter name; names not present are whole.
using ShardMap = std::map<std::string, ParameterShard>;
// The shard of parameter `name`. LoRA adapters ("<base>.lora_A.weight" [r, in],
// "<base>.lora_B.weight" [out, r]; AdaLoRA's "<base>.lora_A", "<base>.lora_B" alike) follow their
// base layer: a column-parallel base (dim 0) splits lora_B along dim 0 and keeps lora_A whole; a
// row-parallel base (dim 1) splits lora_A along dim 1 and keeps lora_B whole; AdaLoRA's
// "<base>.lora_E" [r, 1] is whole. The whole factor's gradient is then a partial sum (this rank's
// share), which the strategy sums over the ranks holding the base's other slices.
ParameterShard shard_of(const ShardMap& shards, const std::string& name);

// Where the model calls the communication hook (the C ABI's weft_comm_point, same order).
enum class CommPoint {
  kAttentionInput = 0,   // before q/k/v: identity forward, all-reduce backward (Megatron's f)
  kAttentionOutput = 1,  // after o_proj: all-reduce forward, identity backward (Megatron's g)
  kMlpInput = 2,
  kMlpOutput = 3,
  kEmbeddingOutput = 4,  // after a vocabulary-parallel lookup: all-reduce forward
  kLossMax = 5,          // per-token max of the local logits: all-reduce(max) forward
  kLossSum = 6,          // per-token sums of the local logits' terms: all-reduce forward
  kHeadInput = 7,        // before a vocabulary-parallel LM head: identity forward, all-reduce
                         // backward (the hidden state's gradient sums over the vocabulary)
  kRowAbsMax = 8,        // per-token absmax of a row-parallel int8 layer's input columns
                         // (int8_linear): all-reduce(max) forward; never backward
  kAdapterSum = 9,       // sums over the slices of split layers' AdaLoRA factors (sum_over_slices):
                         // all-reduce forward; never backward
};

// The points by name, as plugins of ABI 2 register hooks at them (weft/plugin.h, "weft_hooks"):
// "block.attention.input", ..., in CommPoint order. A new point is a new name here.
const std::vector<std::string>& comm_point_names();
const std::string& comm_point_name(CommPoint point);
// The attention's points for context parallelism (ContextSplit's all_to_all and attention, below):
// "attention.exchange" (Ulysses' all-to-alls), "attention.core" (the core computed elsewhere).
const std::vector<std::string>& attention_point_names();

// Communicates in place on `tensor` at `point` of decoder block `layer` (-1 outside blocks),
// in the forward or the backward direction. Throws on failure.
using CommHook = std::function<void(CommPoint point, bool backward, int64_t layer, torch::Tensor& tensor)>;

// y = x with the hook applied to (a copy of) x in the forward pass and to the incoming
// gradient in the backward pass. Without a hook, x itself.
torch::Tensor comm_point(const CommHook* hook, CommPoint point, int64_t layer, const torch::Tensor& x);

// Megatron sequence parallelism (Korthikanti et al. 2022) inside a tensor-parallel group of
// `size` processes: between the tensor-parallel regions (embedding output, residual stream, norms)
// process `rank` holds tokens [rank * L / size, (rank + 1) * L / size) of every sequence; an
// all-gather along the sequence enters each region (in place of f) and a reduce-scatter leaves it
// (in place of g's all-reduce). `collective(point, backward, layer, input, output)`: all-gather
// when output is [size, ...input] (slice i from process i), reduce-scatter (sum of every process's
// slice `rank`) when input is [size, ...output]; every process of the group calls it in the same
// order (sequence_region).
struct SequenceShards {
  int64_t rank = 0;
  int64_t size = 1;
  std::function<void(CommPoint point, bool backward, int64_t layer, const torch::Tensor& input, torch::Tensor& output)>
      collective;
};

// x [B, s, ...] (this process's tokens) -> [B, size * s, ...] (every token), with autograd: the
// backward reduce-scatters the gradient, the partial sums of the region's column-parallel layers.
// `replicated` (a whole head after the region, computing the same on every process): the backward
// takes this process's slice of the gradient instead, with no communication.
torch::Tensor sequence_gather(const SequenceShards& shards, CommPoint point, int64_t layer, const torch::Tensor& x,
                              bool replicated = false);
// x [B, L, ...] (a region's partial sums over every token) -> [B, L / size, ...]: the sum over the
// group of this process's tokens, with autograd (the backward all-gathers the gradient).
torch::Tensor sequence_reduce_scatter(const SequenceShards& shards, CommPoint point, int64_t layer,
                                      const torch::Tensor& x);

// Megatron's saved local shard: `gathered` is sequence_gather(shards, point, layer, local) and
// `output` what the region computed from it (whose backward nodes saved `gathered` for their
// weight gradients). Returns `output`, with autograd; until the backward reaches it the memory of
// `gathered` is released (every tensor sharing it sees none) and only `local` is kept; the backward
// gathers `local` again into that memory (the region's all-gather, FORWARD direction, called a
// second time) before the region's own backward nodes run. Outside training (no grad, or
// `gathered` needs none) returns `output` unchanged. Saves (size - 1) / size of a region input.
torch::Tensor release_gathered(const SequenceShards& shards, CommPoint point, int64_t layer, const torch::Tensor& output,
                               const torch::Tensor& local, const torch::Tensor& gathered);

// One sum over a split factor's slices: `values` (any shape) sums over this process's `local` of
// the `whole` rows or columns the factor has along its split dimension.
struct SliceSum {
  torch::Tensor values;
  int64_t local = 0;
  int64_t whole = 0;
};

// The sums over all slices, in one hook call at CommPoint::kAdapterSum (layer -1): every process
// holding a slice of these layers must call it with the same segments in the same order. The hook
// sums over a group in which a slice may repeat (kv heads shared by several processes): the
// slices' lengths travel with the values, and each segment is divided by how often its slices were
// counted. Differentiable: the gradient reaches each process's values unchanged, the gradient of
// its own slice (the hook is not called in the backward). Without parts, nothing; without a hook,
// the values themselves.
std::vector<torch::Tensor> sum_over_slices(const CommHook* hook, const std::vector<SliceSum>& parts);

// Sequence (context) parallelism, Ulysses style: each of `size` processes holds tokens
// [rank * s, (rank + 1) * s) of every sequence. Everything but the attention core runs on those
// local tokens (RoPE at their global positions); around the core an all-to-all turns the
// token-split q, k, v [B, H, s, D] into head-split ones over the whole sequence [B, H / size,
// size * s, D], and a second one turns the core's output back. `all_to_all(layer, backward,
// send, recv)`: send and recv are [size, ...] with equal chunks; chunk j of send goes to process
// j, chunk i of recv came from process i (every process of the group calls it in the same
// order). The all-to-all's backward is the inverse all-to-all.
//
// Ring attention instead (`attention` set): each process keeps its queries and the attention
// core is `attention(layer, backward, tensors)` over them (ContextAttentionTensors; the caller
// moves key/value blocks between the processes and computes, e.g. with plugins/context_parallel/blockwise_attention.hpp), wrapped
// in an autograd function by context_attention(). Tokens may then lie in the balanced layout.
enum class ContextLayout {
  kContiguous = 0,  // process r of N: tokens [r L / N, (r + 1) L / N)
  kBalanced = 1,    // 2N equal chunks; process r: chunk r, then chunk 2N - 1 - r
};

// The tensors of one call of ContextSplit::attention (ABI weft_attention_call): this process's
// q [B, H, s, D], k, v [B, Hkv, s, D]; out fp32 [B, H, s, D] and lse fp32 [B, H, s] (written in
// the forward, read in the backward); in the backward grad_out and the zeroed fp32 grad_q,
// grad_k, grad_v to fill.
struct ContextAttentionTensors {
  torch::Tensor q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v;
};

struct ContextSplit {
  int64_t rank = 0;
  int64_t size = 1;
  ContextLayout layout = ContextLayout::kContiguous;
  std::function<void(int64_t layer, bool backward, torch::Tensor& send, torch::Tensor& recv)> all_to_all;
  std::function<void(int64_t layer, bool backward, ContextAttentionTensors& tensors)> attention;

  // This process's tokens of a sequence of `length` tokens, as (first position, count) runs in
  // the order they are held.
  std::vector<std::pair<int64_t, int64_t>> token_runs(int64_t length) const;
  // Their global positions, in order (int64, on the CPU).
  torch::Tensor positions(int64_t length) const;
};

// Ring attention's core over this process's tokens: q [B, H, s, D], k, v [B, Hkv, s, D] (RoPE
// applied) -> [B, H, s, D] in q's dtype, with autograd (split.attention in both directions).
torch::Tensor context_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const ContextSplit& split, int64_t layer);

// x [B, Hx, s, D] (this process's tokens, every head; Hx divisible by split.size) ->
// [B, Hx / size, size * s, D] (every token, this process's heads: rank r holds heads
// [r * Hx / size, (r + 1) * Hx / size)), with autograd (the backward is heads_to_sequence).
torch::Tensor sequence_to_heads(const torch::Tensor& x, const ContextSplit& split, int64_t layer);
// The inverse: [B, h, size * s, D] -> [B, size * h, s, D].
torch::Tensor heads_to_sequence(const torch::Tensor& x, const ContextSplit& split, int64_t layer);

// Every parameter of model stages [first, last) with its full shape, by HF name (without LoRA
// adapters), so a plugin can be asked how to shard each before anything is allocated.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_specs(const ModelConfig& config, int64_t first,
                                                                          int64_t last);

// The slice of `full` that `shard` selects (a view).
torch::Tensor shard_slice(const torch::Tensor& full, const ParameterShard& shard);

// Mean cross-entropy of vocabulary-sharded logits [.., V / parts] whose shard starts at
// `vocab_start`, against global target ids, never gathering the full logits: the per-token max
// and the sums of exp() and of the target logit are combined over the shards through the hook
// (kLossMax, kLossSum). Equals cross_entropy(full logits) when every shard runs it.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_start, const CommHook* hook);
// The same per target token (flattened), before the mean.
torch::Tensor vocab_parallel_token_losses(const torch::Tensor& logits, const torch::Tensor& targets,
                                          int64_t vocab_start, const CommHook* hook);

}  // namespace weft
