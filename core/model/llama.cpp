#include "core/model/llama.h"

#include <algorithm>
#include <tuple>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/model/kernels.h"
#include "core/model/linear_cross_entropy.h"
#include "core/util/error.h"
#include "core/util/fault_injection.h"

namespace weft {

std::vector<StageRange> StageSet::resolved(int64_t num_stages) const {
  WEFT_CHECK(!ranges.empty(), "a model must hold at least one stage");
  std::vector<StageRange> out;
  for (const StageRange& r : ranges) {
    const StageRange range{r.first, r.last < 0 ? num_stages : r.last};
    WEFT_CHECK(0 <= range.first && range.first < range.last && range.last <= num_stages,
               "stage range [{}, {}) is not within the model's {} stages", range.first, range.last, num_stages);
    WEFT_CHECK(out.empty() || out.back().last < range.first,
               "stage ranges must ascend with a gap between them: [{}, {}) after [{}, {})", range.first, range.last,
               out.back().first, out.back().last);
    out.push_back(range);
  }
  return out;
}

bool StageSet::holds(int64_t stage, int64_t num_stages) const {
  for (const StageRange& r : ranges) {
    if (r.first <= stage && stage < (r.last < 0 ? num_stages : r.last)) return true;
  }
  return false;
}

std::string StageSet::describe(int64_t num_stages) const {
  std::string out;
  for (const StageRange& r : ranges) {
    out += fmt::format("{}[{}, {})", out.empty() ? "" : " + ", r.first, r.last < 0 ? num_stages : r.last);
  }
  return out;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_specs(const ModelConfig& c,
                                                                          const std::vector<StageRange>& held) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> specs;
  for (const StageRange& range : held) {
    for (auto& spec : parameter_specs(c, range.first, range.last)) {
      // A tied embedding is one parameter, whether stage 0 or the head asks for it.
      const bool seen = std::any_of(specs.begin(), specs.end(), [&](const auto& s) { return s.first == spec.first; });
      if (!seen) specs.push_back(std::move(spec));
    }
  }
  return specs;
}

LocalShape local_shape(const ModelConfig& c, const ShardMap& shards, const std::vector<StageRange>& held) {
  LocalShape local{c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, 0, c.vocab_size, {}, {}, {}, {}};
  const auto specs = parameter_specs(c, held);
  for (const auto& [name, shard] : shards) {
    const auto spec = std::find_if(specs.begin(), specs.end(), [&](const auto& s) { return s.first == name; });
    WEFT_CHECK(spec != specs.end(), "tensor parallel: '{}' is not a parameter this process holds", name);
    WEFT_CHECK(shard.parts >= 1 && 0 <= shard.index && shard.index < shard.parts && 0 <= shard.dim &&
                   shard.dim < static_cast<int32_t>(spec->second.size()),
               "tensor parallel: invalid shard of '{}' (dim {}, part {} of {})", name, shard.dim, shard.index,
               shard.parts);
  }
  // Every block must be split the same way; the first held block decides, the others are checked.
  auto shard_for = [&](const std::string& suffix, int64_t layer) {
    return shard_of(shards, "model.layers." + std::to_string(layer) + "." + suffix);
  };
  const int64_t final_stage = c.num_hidden_layers + 1;
  auto held_stage = [&](int64_t stage) {
    return std::any_of(held.begin(), held.end(), [&](const StageRange& r) { return r.first <= stage && stage < r.last; });
  };
  bool first_block = true;
  for (int64_t stage = 1; stage < final_stage; ++stage) {
    if (!held_stage(stage)) continue;
    const int64_t layer = stage - 1;
    const auto q = shard_for("self_attn.q_proj.weight", layer), k = shard_for("self_attn.k_proj.weight", layer),
               v = shard_for("self_attn.v_proj.weight", layer), o = shard_for("self_attn.o_proj.weight", layer);
    const auto gate = shard_for("mlp.gate_proj.weight", layer), up = shard_for("mlp.up_proj.weight", layer),
               down = shard_for("mlp.down_proj.weight", layer);
    WEFT_CHECK((q.whole() || q.dim == 0) && (k.whole() || k.dim == 0) && (v.whole() || v.dim == 0) &&
                   (o.whole() || o.dim == 1) && (gate.whole() || gate.dim == 0) && (up.whole() || up.dim == 0) &&
                   (down.whole() || down.dim == 1),
               "tensor parallel: layer {}: q/k/v/gate/up split along dim 0 and o/down along dim 1 (Megatron)", layer);
    WEFT_CHECK(q.parts == o.parts && q.index == o.index, "tensor parallel: layer {}: q_proj and o_proj must be split alike",
               layer);
    WEFT_CHECK(k.parts == v.parts && k.index == v.index, "tensor parallel: layer {}: k_proj and v_proj must be split alike",
               layer);
    WEFT_CHECK(gate.parts == up.parts && gate.index == up.index && gate.parts == down.parts && gate.index == down.index,
               "tensor parallel: layer {}: gate/up/down must be split alike", layer);
    WEFT_CHECK(c.num_attention_heads % q.parts == 0,
               "tensor parallel: {} attention heads cannot be split into {} parts", c.num_attention_heads, q.parts);
    WEFT_CHECK(c.num_key_value_heads % k.parts == 0,
               "tensor parallel: {} kv heads cannot be split into {} parts", c.num_key_value_heads, k.parts);
    WEFT_CHECK(c.intermediate_size % gate.parts == 0,
               "tensor parallel: intermediate size {} cannot be split into {} parts", c.intermediate_size, gate.parts);
    const int64_t heads = c.num_attention_heads / q.parts, kv_heads = c.num_key_value_heads / k.parts;
    // The local query heads must use exactly the local kv heads (GQA groups intact).
    const int64_t group = c.num_attention_heads / c.num_key_value_heads;
    const int64_t first_head = q.index * heads, first_kv = k.index * kv_heads;
    WEFT_CHECK(first_head / group == first_kv && (first_head + heads - 1) / group == first_kv + kv_heads - 1 &&
                   heads % kv_heads == 0,
               "tensor parallel: layer {}: query heads [{}, {}) need kv heads [{}, {}], this part holds [{}, {})", layer,
               first_head, first_head + heads, first_head / group, (first_head + heads - 1) / group, first_kv,
               first_kv + kv_heads);
    auto same = [](const ParameterShard& a, const ParameterShard& b) {
      return (a.whole() && b.whole()) || (a.dim == b.dim && a.parts == b.parts && a.index == b.index);
    };
    if (first_block) {
      local.heads = heads;
      local.kv_heads = kv_heads;
      local.intermediate = c.intermediate_size / gate.parts;
      local.q = q;
      local.kv = k;
      local.mlp = gate;
      first_block = false;
    }
    WEFT_CHECK(same(q, local.q) && same(k, local.kv) && same(gate, local.mlp),
               "tensor parallel: every layer must be split alike (layer {} differs)", layer);
    for (const char* norm : {"input_layernorm.weight", "post_attention_layernorm.weight"}) {
      WEFT_CHECK(shard_for(norm, layer).whole(), "tensor parallel: norms are not split (layer {})", layer);
    }
  }
  WEFT_CHECK(shard_of(shards, "model.norm.weight").whole(), "tensor parallel: the final norm is not split");
  const auto embed = shard_of(shards, "model.embed_tokens.weight"), head = shard_of(shards, "lm_head.weight");
  const bool head_held = held_stage(final_stage);
  const ParameterShard vocab = !embed.whole() ? embed : head;
  WEFT_CHECK(vocab.whole() || vocab.dim == 0, "tensor parallel: the embedding and LM head split along the vocabulary (dim 0)");
  WEFT_CHECK(embed.whole() || !head_held || c.tie_word_embeddings || c.classification() ||
                 (head.parts == embed.parts && head.index == embed.index),
             "tensor parallel: the embedding and LM head must be split alike");
  WEFT_CHECK(c.vocab_size % vocab.parts == 0, "tensor parallel: vocabulary {} cannot be split into {} parts", c.vocab_size,
             vocab.parts);
  std::tie(local.vocab_start, local.vocab) = vocab.range(c.vocab_size);
  local.vocab_slice = vocab;
  return local;
}

LlamaBackboneImpl::LlamaBackboneImpl(const ModelConfig& c, const StageSet& held, const LocalShape& local,
                                     const CommHook* comm, QuantConfig quantize) {
  const int64_t final_stage = c.num_hidden_layers + 1;
  const int64_t num_stages = final_stage + 1;
  const bool holds_head = held.holds(final_stage, num_stages);
  if (held.holds(0, num_stages) || (holds_head && c.tie_word_embeddings && !c.classification())) {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(local.vocab, c.hidden_size));
  }
  layers = register_module("layers", std::make_shared<torch::nn::Module>());
  const BlockShape shape{local.heads, local.kv_heads, local.intermediate, quantize, local.q, local.kv, local.mlp};
  for (int64_t stage = 1; stage < final_stage; ++stage) {
    if (!held.holds(stage, num_stages)) continue;
    const int64_t index = stage - 1;
    blocks.emplace(index, layers->register_module(std::to_string(index), DecoderBlock(c, shape, index, comm)));
  }
  if (holds_head) norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const ModelConfig& config, const ModelOptions& options)
    : config_(config), options_(options), rope_(config) {
  config_.validate();
  held_ = options.stages.resolved(num_stages());
  local_ = weft::local_shape(config_, options_.shards, held_);
  model = register_module("model", LlamaBackbone(config_, StageSet(held_), local_, options_.comm.get(), options_.quantize));
  if (options_.context != nullptr && options_.context->size > 1) {
    WEFT_CHECK(options_.context->rank >= 0 && options_.context->rank < options_.context->size,
               "context parallelism: rank {} of {}", options_.context->rank, options_.context->size);
    // The all-to-all around attention moves heads: this rank's (after a tensor-parallel split) must
    // divide over the ranks, or the first forward would refuse them after compute started.
    WEFT_CHECK(options_.context->attention || local_.heads % options_.context->size == 0,
               "context parallelism: the model's {} attention heads{} cannot be split over {} ranks by the all-to-all "
               "around attention (\"attention.exchange\"): choose sizes that divide the heads, or a plugin that "
               "computes the attention core itself (\"attention.core\")",
               config_.num_attention_heads,
               local_.heads == config_.num_attention_heads ? "" : fmt::format(", {} per tensor-parallel rank,", local_.heads),
               options_.context->size);
    for (auto& [index, block] : model->blocks) block->self_attn->set_context_split(options_.context.get(), index);
  }
  if (options_.sequence_parallel != nullptr && options_.sequence_parallel->size > 1) {
    const auto& shards = *options_.sequence_parallel;
    WEFT_CHECK(shards.rank >= 0 && shards.rank < shards.size && shards.collective,
               "Megatron sequence parallelism: rank {} of {}", shards.rank, shards.size);
    // Beside context parallelism's split the regions gather this process's share of each sequence, on
    // which the attention's all-to-all or ring works as without context parallelism.
    // Stages may be split (a pipeline passes this process's tokens between them); where the embedding or
    // the LM head is held, it is a vocabulary slice.
    const bool vocab_held = holds_stage(0) || (holds_stage(num_stages() - 1) && !config_.classification());
    WEFT_CHECK(!vocab_held || vocab_parallel(), "Megatron sequence parallelism needs a vocabulary-parallel embedding (its "
               "all-reduce becomes the reduce-scatter into the sequence shards)");
    for (auto& [index, block] : model->blocks) block->set_sequence_shards(&shards);
  }
  const bool holds_head = holds_stage(num_stages() - 1);
  if (holds_head && config_.classification()) {
    score = register_module("score", Linear(config_.hidden_size, config_.num_labels));
  } else if (holds_head && !config_.tie_word_embeddings) {
    lm_head = register_module("lm_head",
                              Linear(LinearSpec{config_.hidden_size, config_.vocab_size, {}, local_.vocab_slice}));
  }
  set_compute_dtype(options_.compute_dtype);
  if (options_.deferrable_weight_grads) set_weight_grads_deferrable(*this, true);
}

void LlamaForCausalLMImpl::set_compute_dtype(torch::Dtype dtype) {
  WEFT_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf,
             "compute dtype must be fp32, bf16 or fp16");
  options_.compute_dtype = dtype;
  weft::set_compute_dtype(*this, dtype);
}

torch::Tensor LlamaForCausalLMImpl::head_weight() const {
  return lm_head.is_empty() ? model->embed_tokens->weight : lm_head->weight;
}

void LlamaForCausalLMImpl::set_cache_frozen_casts(bool enabled) {
  cache_casts_ = enabled;
  if (!enabled) head_cast_.clear();
  weft::set_cache_frozen_casts(*this, enabled);
}

void LlamaForCausalLMImpl::drop_frozen_casts() {
  head_cast_.clear();
  for (auto& module : modules(/*include_self=*/false)) {
    if (auto* linear = module->as<LinearImpl>()) linear->drop_cached_cast();
  }
}

torch::Tensor LlamaForCausalLMImpl::head_weight_to_compute() const {
  auto head = head_weight();
  if (!cache_casts_ || !CastCache::applies({head}, options_.compute_dtype)) return head;
  return head_cast_.get({head}, options_.compute_dtype);
}

torch::Tensor LlamaForCausalLMImpl::run_stage(int64_t stage, const torch::Tensor& input, bool shard_tokens,
                                             const TokenLayout* layout, bool head) {
  const int64_t final_stage = num_stages() - 1;
  const SequenceShards* tokens =
      shard_tokens && options_.sequence_parallel != nullptr && options_.sequence_parallel->size > 1
          ? options_.sequence_parallel.get()
          : nullptr;
  if (stage == 0) {
    WEFT_CHECK(input.scalar_type() == torch::kLong && input.dim() == 2,
               "stage 0 expects int64 token ids [batch, seq], got {} with {} dims",
               std::string(c10::toString(input.scalar_type())), input.dim());
    // The residual stream is fp32: an embedding materialised in the compute dtype (a sharded
    // plugin's WEFT_FLAT_SHARD_COMPUTE_DTYPE) looks up its values and widens them.
    if (options_.prompt_tokens > 0) {  // virtual-token slots (ids < 0) take the prompt's rows
      WEFT_CHECK(model->prompt_embeddings.defined() && !vocab_parallel(),
                 "prompt tuning: the model has no prompt embedding on its (whole) embedding stage");
      const auto slot = input < 0;
      const auto x = model->embed_tokens(input.clamp_min(0)).to(torch::kFloat32);
      const auto rows = (-input - 1).clamp(0, options_.prompt_tokens - 1).reshape({-1});
      const auto prompt = model->prompt_embeddings.index_select(0, rows).view_as(x).to(torch::kFloat32);
      return torch::where(slot.unsqueeze(-1), prompt, x);
    }
    if (!vocab_parallel()) return model->embed_tokens(input).to(torch::kFloat32);
    // This process's rows of the vocabulary; other tokens contribute zeros, summed over shards.
    auto local = input - local_.vocab_start;
    auto mine = ((local >= 0) & (local < local_.vocab)).unsqueeze(-1).to(torch::kFloat32);
    auto rows = model->embed_tokens(local.clamp(0, local_.vocab - 1)) * mine;
    if (tokens != nullptr) return sequence_reduce_scatter(*tokens, CommPoint::kEmbeddingOutput, -1, rows);
    return comm_point(options_.comm.get(), CommPoint::kEmbeddingOutput, -1, rows);
  }
  if (stage < final_stage) {
    auto& block = model->blocks.at(stage - 1);
    if (options_.activation_checkpointing && is_training() && torch::GradMode::is_enabled()) {
      return checkpointed_block(*block, rope_, input, layout);
    }
    return block->forward(input, rope_, layout);
  }
  const auto local = model->norm(input);
  if (!head) {
    WEFT_CHECK(fuses_head_loss(), "the LM head can be left to the loss only where fuses_head_loss()");
    return local;
  }
  auto h = local;
  if (!score.is_empty()) {  // whole on every rank: no communication but the tokens' all-gather
    if (tokens == nullptr) return score(h);
    h = sequence_gather(*tokens, CommPoint::kHeadInput, -1, h, /*replicated=*/true);
    return release_gathered(*tokens, CommPoint::kHeadInput, -1, score(h), local, h);  // Megatron's saved shard
  }
  if (tokens != nullptr) {
    h = sequence_gather(*tokens, CommPoint::kHeadInput, -1, h);
  } else if (vocab_parallel()) {
    h = comm_point(options_.comm.get(), CommPoint::kHeadInput, -1, h);
  }
  const auto logits = head_logits(h);
  return tokens != nullptr ? release_gathered(*tokens, CommPoint::kHeadInput, -1, logits, local, h) : logits;
}

torch::Tensor LlamaForCausalLMImpl::head_logits(const torch::Tensor& h) {
  if (!lm_head.is_empty()) return lm_head->forward(h);
  const auto head = head_weight_to_compute();
  if (!head.requires_grad() && head.scalar_type() != options_.compute_dtype) {  // a bf16-stored frozen head
    return frozen_cast_linear(h, head, options_.compute_dtype);
  }
  return torch::nn::functional::linear(h.to(options_.compute_dtype), head.to(options_.compute_dtype));
}

bool LlamaForCausalLMImpl::fuses_head_loss() const {
  const bool tokens_split = options_.sequence_parallel != nullptr && options_.sequence_parallel->size > 1;
  if (!options_.chunked_loss || config_.classification() || vocab_parallel() || tokens_split ||
      !holds_stage(num_stages() - 1)) {
    return false;
  }
  if (lm_head.is_empty()) return !model->embed_tokens.is_empty();  // tied: the embedding's weight
  return !lm_head->has_lora() && !lm_head->quantized() && lm_head->weight.defined();
}

torch::Tensor LlamaForCausalLMImpl::head_loss(const torch::Tensor& hidden, const torch::Tensor& targets,
                                              torch::Tensor* token_losses) const {
  WEFT_CHECK(fuses_head_loss(), "head_loss: this model's head cannot be fused with its loss");
  WEFT_CHECK(hidden.dim() == 3 && targets.sizes() == hidden.sizes().slice(0, 2),
             "head_loss: hidden states [rows, seq, {}] and targets [rows, seq] expected", config_.hidden_size);
  const double n = static_cast<double>(targets.numel());
  const auto sum = linear_cross_entropy_sum(hidden.reshape({-1, hidden.size(-1)}), head_weight_to_compute(), targets.reshape({-1}),
                                            options_.compute_dtype, kIgnoreTarget, token_losses, 0, 1.0 / n);
  return sum / n;
}

bool LlamaForCausalLMImpl::holds_stage(int64_t stage) const {
  return std::any_of(held_.begin(), held_.end(), [&](const StageRange& r) { return r.first <= stage && stage < r.last; });
}

torch::Tensor LlamaForCausalLMImpl::forward_stages(int64_t first, int64_t last, const torch::Tensor& input,
                                                   const torch::Tensor& positions, bool head) {
  const bool held = std::any_of(held_.begin(), held_.end(),
                                [&](const StageRange& r) { return r.first <= first && first <= last && last <= r.last; });
  WEFT_CHECK(held, "stages [{}, {}) requested but this model holds stages {}", first, last,
             StageSet(held_).describe(num_stages()));
  std::optional<TokenLayout> layout;
  if (positions.defined() && first < num_stages() - 1 && last > 1) {  // some decoder block runs
    const ContextSplit* context = options_.context != nullptr && options_.context->size > 1 ? options_.context.get() : nullptr;
    WEFT_CHECK(positions.dim() == 2 && positions.size(0) == input.size(0), "packed rows: positions of {} rows for {} rows",
               positions.size(0), input.size(0));
    layout = make_token_layout(rope_, positions, context ? context->positions(positions.size(1)) : torch::Tensor(),
                               input.device());
  }
  torch::Tensor x = input;
  for (int64_t stage = first; stage < last; ++stage) {
    x = run_stage(stage, x, /*shard_tokens=*/true, layout ? &*layout : nullptr, head);
    if (fault_injection_armed() && is_training() && torch::GradMode::is_enabled()) {  // the fault tests' points
      fault_point("forward");
      if (x.requires_grad()) x.register_hook([](const torch::Tensor&) { fault_point("backward"); });
    }
  }
  return x;
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& tokens) {
  return forward_stages(0, num_stages(), tokens);
}

torch::Tensor LlamaForCausalLMImpl::forward_cached(const torch::Tensor& tokens, std::vector<LayerKvCache>& cache) {
  WEFT_CHECK(holds_every_stage(), "cached decoding needs every stage of the model");
  torch::NoGradGuard no_grad;
  if (cache.empty()) cache.resize(static_cast<size_t>(config_.num_hidden_layers));
  torch::Tensor x = run_stage(0, tokens, /*shard_tokens=*/false);
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    x = model->blocks.at(layer)->forward_cached(x, rope_, cache[static_cast<size_t>(layer)]);
  }
  return run_stage(num_stages() - 1, x, /*shard_tokens=*/false);
}

int64_t stage_of_parameter(const std::string& name, int64_t num_layers) {
  const std::string layers = "model.layers.";
  if (name.rfind("model.embed_tokens.", 0) == 0 || name == "model.prompt_embeddings") return 0;
  if (name.rfind(layers, 0) == 0) return 1 + std::stoll(name.substr(layers.size()));
  return num_layers + 1;
}

std::pair<torch::Tensor, torch::Tensor> LlamaForCausalLMImpl::labeled_rows(const torch::Tensor& logits,
                                                                        const torch::Tensor& targets) const {
  WEFT_CHECK(config_.classification(), "labeled_rows: the model has no classification head");
  WEFT_CHECK(logits.dim() == 3 && logits.size(-1) == config_.num_labels && targets.sizes() == logits.sizes().slice(0, 2),
             "classification: logits [rows, seq, {}] and targets [rows, seq] expected", config_.num_labels);
  const auto flat = targets.reshape({-1});
  const auto positions = (flat != kIgnoreTarget).nonzero().reshape({-1});
  return {logits.reshape({-1, config_.num_labels}).index_select(0, positions), flat.index_select(0, positions)};
}

namespace {

// Each labeled position's loss, fp32: cross-entropy, or the squared error of a regression head.
torch::Tensor classification_losses(const torch::Tensor& rows, const torch::Tensor& targets, bool regression) {
  if (regression) {
    const auto scores = targets.contiguous().view(torch::kFloat64).to(torch::kFloat32);
    return (rows.select(1, 0).to(torch::kFloat32) - scores).pow(2);
  }
  return torch::nn::functional::cross_entropy(rows.to(torch::kFloat32), targets,
                                              torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
}

}  // namespace

torch::Tensor LlamaForCausalLMImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
  if (config_.classification()) {
    auto [rows, labels] = labeled_rows(logits, targets);
    // A rank with no labeled row (an empty evaluation share) still returns a loss joined to the graph.
    if (rows.size(0) == 0) return logits.sum().to(torch::kFloat32) * 0.0;
    return classification_losses(rows, labels, config_.regression()).mean();
  }
  if (!vocab_parallel()) return cross_entropy(logits, targets);
  return vocab_parallel_cross_entropy(logits, targets, local_.vocab_start, options_.comm.get());
}

torch::Tensor LlamaForCausalLMImpl::token_losses(const torch::Tensor& logits, const torch::Tensor& targets) const {
  if (config_.classification()) {
    auto [rows, labels] = labeled_rows(logits, targets);
    return classification_losses(rows, labels, config_.regression());
  }
  if (vocab_parallel()) {
    return vocab_parallel_token_losses(logits, targets, local_.vocab_start, options_.comm.get());
  }
  const int64_t vocab = logits.size(-1);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, vocab}).to(torch::kFloat32), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
}

torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets) {
  return cross_entropy_sum_of(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return cross_entropy_sum(logits, targets) / static_cast<double>(targets.numel());
}

}  // namespace weft
