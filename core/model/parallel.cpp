#include "core/model/parallel.h"

#include <cmath>

#include <torch/torch.h>

#include "core/util/error.h"

namespace weft {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CommFunction : public torch::autograd::Function<CommFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const CommHook* hook, int64_t point,
                               int64_t layer) {
    ctx->saved_data["hook"] = reinterpret_cast<int64_t>(hook);
    ctx->saved_data["point"] = point;
    ctx->saved_data["layer"] = layer;
    torch::Tensor y = x.clone();
    (*hook)(static_cast<CommPoint>(point), /*backward=*/false, layer, y);
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* hook = reinterpret_cast<const CommHook*>(ctx->saved_data["hook"].toInt());
    torch::Tensor g = grads[0].contiguous().clone();
    (*hook)(static_cast<CommPoint>(ctx->saved_data["point"].toInt()), /*backward=*/true,
            ctx->saved_data["layer"].toInt(), g);
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// sum_over_slices' sum: `flat` is the segments' values one after the other; the hook sums them
// with the slices' lengths appended, and each segment is divided by its repetition.
struct SliceSumFunction : public torch::autograd::Function<SliceSumFunction> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& flat, const CommHook* hook,
                               const std::vector<int64_t>& sizes, const std::vector<int64_t>& locals,
                               const std::vector<int64_t>& wholes) {
    const int64_t segments = static_cast<int64_t>(sizes.size());
    auto buffer = torch::cat({flat.detach().to(torch::kFloat32),
                              torch::tensor(locals, torch::kLong).to(torch::kFloat32).to(flat.device())})
                      .contiguous();
    (*hook)(CommPoint::kAdapterSum, /*backward=*/false, -1, buffer);
    const auto counts = buffer.narrow(0, flat.numel(), segments).cpu();
    auto out = buffer.narrow(0, 0, flat.numel()).clone();
    int64_t offset = 0;
    for (int64_t i = 0; i < segments; ++i) {
      const double repeat = counts[i].item<double>() / static_cast<double>(wholes[static_cast<size_t>(i)]);
      WEFT_CHECK(repeat >= 1.0 && repeat == std::round(repeat),
                 "adapter sums over split layers: the slices add up to {} of {} rows; the strategy's group holds "
                 "another split",
                 counts[i].item<double>(), wholes[static_cast<size_t>(i)]);
      if (repeat > 1.0) out.narrow(0, offset, sizes[static_cast<size_t>(i)]).div_(repeat);
      offset += sizes[static_cast<size_t>(i)];
    }
    return out.to(flat.scalar_type());
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Megatron sequence parallelism's two collectives along dim 1 of [B, s, ...], through the
// [size, B, s, ...] layout the hook takes.
torch::Tensor gather_tokens(const SequenceShards& shards, CommPoint point, int64_t layer, const torch::Tensor& x,
                            bool backward) {
  auto sizes = x.sizes().vec();
  sizes.insert(sizes.begin(), shards.size);
  torch::Tensor gathered = torch::empty(sizes, x.options());
  shards.collective(point, backward, layer, x.contiguous(), gathered);
  auto out = gathered.transpose(0, 1);  // [B, size, s, ...]
  auto merged = x.sizes().vec();
  merged[1] *= shards.size;
  return out.reshape(merged);
}

torch::Tensor scatter_tokens(const SequenceShards& shards, CommPoint point, int64_t layer, const torch::Tensor& x,
                             bool backward) {
  WEFT_CHECK(x.dim() >= 2 && x.size(1) % shards.size == 0,
             "sequence parallelism: {} tokens cannot be split over {} processes", x.dim() >= 2 ? x.size(1) : 0,
             shards.size);
  auto split = x.sizes().vec();
  split[1] /= shards.size;
  split.insert(split.begin() + 1, shards.size);  // [B, size, s, ...]
  torch::Tensor input = x.reshape(split).transpose(0, 1).contiguous();
  auto local = x.sizes().vec();
  local[1] /= shards.size;
  torch::Tensor out = torch::empty(local, x.options());
  shards.collective(point, backward, layer, input, out);
  return out;
}

// Into a region (gather: all-gather forward; backward reduce-scatter, or this process's slice
// where the region computes the same on every process) or out of one (reduce-scatter forward,
// all-gather backward).
struct SequenceRegion : public torch::autograd::Function<SequenceRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const SequenceShards* shards,
                               int64_t point, int64_t layer, bool gather, bool replicated) {
    ctx->saved_data["shards"] = reinterpret_cast<int64_t>(shards);
    ctx->saved_data["point"] = point;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["gather"] = gather;
    ctx->saved_data["replicated"] = replicated;
    const auto at = static_cast<CommPoint>(point);
    return gather ? gather_tokens(*shards, at, layer, x, /*backward=*/false)
                  : scatter_tokens(*shards, at, layer, x, /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* shards = reinterpret_cast<const SequenceShards*>(ctx->saved_data["shards"].toInt());
    const auto point = static_cast<CommPoint>(ctx->saved_data["point"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    torch::Tensor g;
    if (!ctx->saved_data["gather"].toBool()) {
      g = gather_tokens(*shards, point, layer, grads[0], /*backward=*/true);
    } else if (ctx->saved_data["replicated"].toBool()) {
      const int64_t local = grads[0].size(1) / shards->size;
      g = grads[0].narrow(1, shards->rank * local, local).contiguous();
    } else {
      g = scatter_tokens(*shards, point, layer, grads[0], /*backward=*/true);
    }
    return {g, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// release_gathered's autograd node: the forward frees the gathered input's memory (its storage
// keeps its size, dtype and device and holds no bytes); the backward allocates it again from the
// same allocator and fills it with the all-gather of the kept local shard.
struct RegatherFence : public torch::autograd::Function<RegatherFence> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& output, const torch::Tensor& local,
                               const torch::Tensor& gathered, const SequenceShards* shards, int64_t point,
                               int64_t layer) {
    ctx->saved_data["shards"] = reinterpret_cast<int64_t>(shards);
    ctx->saved_data["point"] = point;
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["local"] = local;
    ctx->saved_data["gathered"] = gathered;  // the storage handle: its bytes go below
    const auto nbytes = static_cast<int64_t>(gathered.storage().nbytes());
    ctx->saved_data["nbytes"] = nbytes;
    c10::StorageImpl* storage = gathered.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, gathered.device()));
    storage->set_nbytes(0);
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* shards = reinterpret_cast<const SequenceShards*>(ctx->saved_data["shards"].toInt());
    const auto point = static_cast<CommPoint>(ctx->saved_data["point"].toInt());
    const torch::Tensor local = ctx->saved_data["local"].toTensor();
    const torch::Tensor gathered = ctx->saved_data["gathered"].toTensor();
    const auto nbytes = static_cast<size_t>(ctx->saved_data["nbytes"].toInt());
    {
      torch::NoGradGuard no_grad;
      c10::StorageImpl* storage = gathered.storage().unsafeGetStorageImpl();
      storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
      storage->set_nbytes(nbytes);
      // A tensor of its own over the same bytes: writing through it leaves the saved tensors'
      // version counters alone (autograd sees the values it saved).
      torch::Tensor alias = torch::empty({0}, gathered.options());
      alias.set_(gathered.storage(), gathered.storage_offset(), gathered.sizes(), gathered.strides());
      alias.copy_(gather_tokens(*shards, point, ctx->saved_data["layer"].toInt(), local, /*backward=*/false));
    }
    return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The Ulysses all-to-all: to_heads maps [B, Hx, s, D] -> [B, Hx / n, n * s, D], otherwise the
// inverse. `backward` is passed to the hook (which direction autograd is in).
torch::Tensor exchange(const torch::Tensor& x, const ContextSplit& split, int64_t layer, bool to_heads,
                       bool backward) {
  const int64_t n = split.size, batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3);
  torch::Tensor send;
  if (to_heads) {
    WEFT_CHECK(heads % n == 0, "context parallelism: {} heads cannot be split over {} processes", heads, n);
    send = x.reshape({batch, n, heads / n, tokens, dim}).permute({1, 0, 2, 3, 4}).contiguous();
  } else {
    WEFT_CHECK(tokens % n == 0, "context parallelism: {} tokens cannot be split over {} processes", tokens, n);
    send = x.reshape({batch, heads, n, tokens / n, dim}).permute({2, 0, 1, 3, 4}).contiguous();
  }
  torch::Tensor recv = torch::empty_like(send);
  split.all_to_all(layer, backward, send, recv);
  // recv[i]: from process i: to_heads: its tokens for this process's heads; else: its heads
  // for this process's tokens.
  if (to_heads) return recv.permute({1, 2, 0, 3, 4}).reshape({batch, heads / n, n * tokens, dim});
  return recv.permute({1, 0, 2, 3, 4}).reshape({batch, n * heads, tokens / n, dim});
}

struct SequenceExchange : public torch::autograd::Function<SequenceExchange> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const ContextSplit* split,
                               int64_t layer, bool to_heads) {
    ctx->saved_data["split"] = reinterpret_cast<int64_t>(split);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["to_heads"] = to_heads;
    return exchange(x, *split, layer, to_heads, /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* split = reinterpret_cast<const ContextSplit*>(ctx->saved_data["split"].toInt());
    const bool to_heads = ctx->saved_data["to_heads"].toBool();
    return {exchange(grads[0], *split, ctx->saved_data["layer"].toInt(), !to_heads, /*backward=*/true),
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// Ring attention's core: the caller's split.attention computes the output and log-sum-exp in
// the forward and the three gradients in the backward; out and lse are kept for the backward.
struct SequenceAttention : public torch::autograd::Function<SequenceAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const ContextSplit* split, int64_t layer) {
    ctx->saved_data["split"] = reinterpret_cast<int64_t>(split);
    ctx->saved_data["layer"] = layer;
    const auto f32 = q.options().dtype(torch::kFloat32);
    ContextAttentionTensors t;
    t.q = q.contiguous();
    t.k = k.contiguous();
    t.v = v.contiguous();
    t.out = torch::empty(q.sizes(), f32);
    t.lse = torch::empty({q.size(0), q.size(1), q.size(2)}, f32);
    split->attention(layer, /*backward=*/false, t);
    ctx->save_for_backward({t.q, t.k, t.v, t.out, t.lse});
    return t.out.to(q.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* split = reinterpret_cast<const ContextSplit*>(ctx->saved_data["split"].toInt());
    const auto saved = ctx->get_saved_variables();
    ContextAttentionTensors t{saved[0], saved[1], saved[2], saved[3], saved[4], grads[0].contiguous(), {}, {}, {}};
    t.grad_q = torch::zeros(t.q.sizes(), t.out.options());
    t.grad_k = torch::zeros(t.k.sizes(), t.out.options());
    t.grad_v = torch::zeros(t.v.sizes(), t.out.options());
    split->attention(ctx->saved_data["layer"].toInt(), /*backward=*/true, t);
    return {t.grad_q.to(t.q.scalar_type()), t.grad_k.to(t.k.scalar_type()), t.grad_v.to(t.v.scalar_type()),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

std::vector<std::pair<int64_t, int64_t>> ContextSplit::token_runs(int64_t length) const {
  if (layout == ContextLayout::kContiguous) {
    WEFT_CHECK(length % size == 0, "context parallelism: {} tokens cannot be split over {} processes", length, size);
    return {{rank * (length / size), length / size}};
  }
  WEFT_CHECK(length % (2 * size) == 0,
             "context parallelism (balanced layout): {} tokens cannot be cut into {} equal chunks", length, 2 * size);
  const int64_t chunk = length / (2 * size);
  return {{rank * chunk, chunk}, {(2 * size - 1 - rank) * chunk, chunk}};
}

torch::Tensor ContextSplit::positions(int64_t length) const {
  std::vector<torch::Tensor> parts;
  for (const auto& [start, count] : token_runs(length)) parts.push_back(torch::arange(start, start + count, torch::kLong));
  return torch::cat(parts);
}

torch::Tensor context_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const ContextSplit& split, int64_t layer) {
  WEFT_CHECK(q.dim() == 4 && k.dim() == 4 && split.attention, "context_attention: [B, H, s, D] tensors and an attention");
  return SequenceAttention::apply(q, k, v, &split, layer);
}

torch::Tensor sequence_to_heads(const torch::Tensor& x, const ContextSplit& split, int64_t layer) {
  WEFT_CHECK(x.dim() == 4 && split.all_to_all, "sequence_to_heads: a [B, H, s, D] tensor and an all-to-all");
  return SequenceExchange::apply(x, &split, layer, true);
}

torch::Tensor heads_to_sequence(const torch::Tensor& x, const ContextSplit& split, int64_t layer) {
  WEFT_CHECK(x.dim() == 4 && split.all_to_all, "heads_to_sequence: a [B, h, S, D] tensor and an all-to-all");
  return SequenceExchange::apply(x, &split, layer, false);
}

ParameterShard shard_of(const ShardMap& shards, const std::string& name) {
  // LoRA's factors (".lora_A.weight", ".lora_B.weight") and AdaLoRA's P and Q (".lora_A",
  // ".lora_B"; its Lambda ".lora_E" is whole).
  for (const std::string factor : {".lora_A.weight", ".lora_B.weight", ".lora_A", ".lora_B"}) {
    const auto at = name.rfind(factor);
    if (at == std::string::npos || at + factor.size() != name.size()) continue;
    // An adapter follows its base layer: B [out, r] takes a dim-0 split, A [r, in] a dim-1 split.
    const ParameterShard base = shard_of(shards, name.substr(0, at) + ".weight");
    const int32_t split_dim = factor.rfind(".lora_B", 0) == 0 ? 0 : 1;
    return base.dim == split_dim ? base : ParameterShard{};
  }
  const auto it = shards.find(name);
  return it == shards.end() ? ParameterShard{} : it->second;
}

std::vector<torch::Tensor> sum_over_slices(const CommHook* hook, const std::vector<SliceSum>& parts) {
  std::vector<torch::Tensor> out;
  if (parts.empty()) return out;
  if (hook == nullptr || !*hook) {
    for (const auto& part : parts) out.push_back(part.values);
    return out;
  }
  std::vector<torch::Tensor> flat;
  std::vector<int64_t> sizes, locals, wholes;
  for (const auto& part : parts) {
    WEFT_CHECK(part.local > 0 && part.whole >= part.local, "sum_over_slices: a slice of {} of {} rows", part.local,
               part.whole);
    flat.push_back(part.values.reshape(-1));
    sizes.push_back(part.values.numel());
    locals.push_back(part.local);
    wholes.push_back(part.whole);
  }
  const auto sums = SliceSumFunction::apply(torch::cat(flat), hook, sizes, locals, wholes);
  int64_t offset = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    out.push_back(sums.narrow(0, offset, sizes[i]).view(parts[i].values.sizes()));
    offset += sizes[i];
  }
  return out;
}

const std::vector<std::string>& comm_point_names() {
  static const std::vector<std::string> names = {
      "block.attention.input", "block.attention.output", "block.mlp.input", "block.mlp.output",
      "embedding.output",      "loss.max",               "loss.sum",        "head.input",
      "linear.row_absmax",     "adalora.slice_sums"};
  return names;
}
const std::vector<std::string>& attention_point_names() {
  static const std::vector<std::string> names = {"attention.exchange", "attention.core"};
  return names;
}
const std::string& comm_point_name(CommPoint point) {
  return comm_point_names().at(static_cast<size_t>(point));
}

torch::Tensor comm_point(const CommHook* hook, CommPoint point, int64_t layer, const torch::Tensor& x) {
  if (hook == nullptr || !*hook) return x;
  return CommFunction::apply(x.contiguous(), hook, static_cast<int64_t>(point), layer);
}

torch::Tensor sequence_gather(const SequenceShards& shards, CommPoint point, int64_t layer, const torch::Tensor& x,
                              bool replicated) {
  if (shards.size <= 1) return x;
  return SequenceRegion::apply(x, &shards, static_cast<int64_t>(point), layer, /*gather=*/true, replicated);
}

torch::Tensor sequence_reduce_scatter(const SequenceShards& shards, CommPoint point, int64_t layer,
                                      const torch::Tensor& x) {
  if (shards.size <= 1) return x;
  return SequenceRegion::apply(x, &shards, static_cast<int64_t>(point), layer, /*gather=*/false, /*replicated=*/false);
}

torch::Tensor release_gathered(const SequenceShards& shards, CommPoint point, int64_t layer, const torch::Tensor& output,
                               const torch::Tensor& local, const torch::Tensor& gathered) {
  if (shards.size <= 1 || !torch::GradMode::is_enabled() || !gathered.requires_grad() || !output.requires_grad()) {
    return output;
  }
  return RegatherFence::apply(output, local.detach(), gathered.detach(), &shards, static_cast<int64_t>(point), layer);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_specs(const ModelConfig& c, int64_t first,
                                                                          int64_t last) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs;
  const int64_t final_stage = c.num_hidden_layers + 1;
  const bool head = first <= final_stage && final_stage < last;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  if (first == 0 || (head && c.tie_word_embeddings && !c.classification())) specs.push_back({"model.embed_tokens.weight", {c.vocab_size, c.hidden_size}});
  for (int64_t stage = std::max<int64_t>(first, 1); stage < std::min(last, final_stage); ++stage) {
    const std::string p = "model.layers." + std::to_string(stage - 1) + ".";
    specs.push_back({p + "self_attn.q_proj.weight", {q, c.hidden_size}});
    specs.push_back({p + "self_attn.k_proj.weight", {kv, c.hidden_size}});
    specs.push_back({p + "self_attn.v_proj.weight", {kv, c.hidden_size}});
    specs.push_back({p + "self_attn.o_proj.weight", {c.hidden_size, q}});
    specs.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, c.hidden_size}});
    specs.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, c.hidden_size}});
    specs.push_back({p + "mlp.down_proj.weight", {c.hidden_size, c.intermediate_size}});
    specs.push_back({p + "input_layernorm.weight", {c.hidden_size}});
    specs.push_back({p + "post_attention_layernorm.weight", {c.hidden_size}});
  }
  if (head) {
    specs.push_back({"model.norm.weight", {c.hidden_size}});
    if (c.classification()) {
      specs.push_back({"score.weight", {c.num_labels, c.hidden_size}});
    } else if (!c.tie_word_embeddings) {
      specs.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}});
    }
  }
  return specs;
}

torch::Tensor shard_slice(const torch::Tensor& full, const ParameterShard& shard) {
  if (shard.whole()) return full;
  const auto [start, length] = shard.range(full.size(shard.dim));
  return full.narrow(shard.dim, start, length);
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets,
                                           int64_t vocab_start, const CommHook* hook) {
  return vocab_parallel_token_losses(logits, targets, vocab_start, hook).mean();
}

torch::Tensor vocab_parallel_token_losses(const torch::Tensor& logits, const torch::Tensor& targets,
                                          int64_t vocab_start, const CommHook* hook) {
  const int64_t vocab = logits.size(-1);
  auto x = logits.reshape({-1, vocab}).to(torch::kFloat32);
  auto t = targets.reshape({-1});
  // Per-token max over every shard (a constant for autograd: the loss does not depend on it).
  auto max = std::get<0>(x.detach().max(-1)).contiguous();
  if (hook && *hook) (*hook)(CommPoint::kLossMax, false, -1, max);
  auto shifted = x - max.unsqueeze(1);
  // Local sums of exp() and the target's logit (0 on shards that do not hold it), combined.
  auto local = t - vocab_start;
  auto mine = (local >= 0) & (local < vocab);
  auto index = local.clamp(0, vocab - 1).unsqueeze(1);
  auto target_logit = shifted.gather(1, index).squeeze(1) * mine.to(torch::kFloat32);
  auto sums = torch::stack({shifted.exp().sum(1), target_logit});
  sums = comm_point(hook, CommPoint::kLossSum, -1, sums);
  // An ignored target (kIgnoreTarget, outside every shard) adds nothing, as cross_entropy's ignore_index.
  return (sums[0].log() - sums[1]) * (t >= 0).to(torch::kFloat32);
}

}  // namespace weft
