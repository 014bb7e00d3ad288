#include "core/model/layers.h"

#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include <torch/torch.h>

#include "core/model/kernels.h"
#include "core/model/weight_grad.h"
#include "core/util/error.h"

namespace weft {

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, QuantConfig quantize)
    : in_features_(in_features), out_features_(out_features), quantize_(quantize) {
  int8_.threshold = quantize_.int8_threshold;
  if (!quantized()) weight = register_parameter("weight", torch::empty({out_features, in_features}));
}

void LinearImpl::set_weight(const torch::Tensor& value, const torch::Device& device) {
  WEFT_CHECK(value.dim() == 2 && value.size(0) == out_features_ && value.size(1) == in_features_,
             "linear layer [{}, {}]: a weight of shape {} was given", out_features_, in_features_,
             fmt::join(value.sizes().vec(), "x"));
  torch::NoGradGuard no_grad;
  if (!quantized()) {
    weight.copy_(value);
    return;
  }
  store_quantized(quantize_matrix(value.to(device), quantize_.format));
}

void LinearImpl::set_weight_slice_of(const torch::Tensor& whole, const ParameterShard& shard, const torch::Device& device) {
  if (shard.whole()) return set_weight(whole, device);
  WEFT_CHECK(whole.dim() == 2 && shard.dim >= 0 && shard.dim < 2, "linear layer: a slice along dim {} of a {}-d weight",
             shard.dim, whole.dim());
  const auto [start, length] = shard.range(whole.size(shard.dim));
  if (!quantized()) return set_weight(whole.narrow(shard.dim, start, length), device);
  torch::NoGradGuard no_grad;
  if (shard.dim == 1) int8_.row_absmax = row_absmax_sync_;  // a row-parallel slice
  store_quantized(slice_quantized(quantize_matrix(whole.to(device), quantize_.format), shard.dim, start, length));
}

void LinearImpl::store_quantized(QuantizedMatrix q) {
  WEFT_CHECK(q.rows == out_features_ && q.cols == in_features_, "linear layer [{}, {}]: a quantized weight of [{}, {}]",
             out_features_, in_features_, q.rows, q.cols);
  // int8 on the CPU: the forward multiplies in the int8 GEMM where this LibTorch has an exact one.
  if (q.format == QuantFormat::kInt8 && quantize_.int8_gemm && q.data.device().is_cpu() && cpu_int8_gemm_available()) {
    use_int8_gemm(q);
  }
  // Buffers, so that module.to() moves them; registered on the first call, replaced after.
  const std::pair<const char*, torch::Tensor*> parts[] = {
      {"weight_data", &q.data}, {"weight_scale", &q.scale}, {"weight_scale2", &q.scale2}, {"weight_offset", &q.offset}};
  auto buffers = named_buffers(/*recurse=*/false);  // tensors sharing the module's
  for (const auto& [name, tensor] : parts) {
    if (!tensor->defined()) continue;
    if (auto* existing = buffers.find(name)) {
      existing->set_data(*tensor);
      *tensor = *existing;
    } else {
      *tensor = register_buffer(name, *tensor);
    }
  }
  quantized_ = std::move(q);
}

torch::Tensor LinearImpl::dense_weight(torch::Dtype dtype) const {
  return quantized() ? quantized_.dequantize(dtype) : weight.to(dtype);
}

torch::Tensor LinearImpl::base_output(const torch::Tensor& input) {
  if (quantized()) return quantized_linear(input, quantized_, &int8_);
  if (!weight.requires_grad() && weight.scalar_type() != compute_dtype_) {
    return frozen_cast_linear(input, weight, compute_dtype_);
  }
  if (weight_grad_deferrable()) return deferrable_linear(input, {weight}, compute_dtype_);
  return torch::nn::functional::linear(input, weight.to(compute_dtype_));
}

namespace {

int64_t frozen_cast_rows(const torch::Tensor& w, torch::Dtype dtype, int64_t chunk_rows) {
  if (chunk_rows > 0) return chunk_rows;
  const int64_t row_bytes = std::max<int64_t>(1, w.size(1) * static_cast<int64_t>(c10::elementSize(dtype)));
  return std::max<int64_t>(1, (int64_t{64} << 20) / row_bytes);
}

class FrozenCastLinearFunction : public torch::autograd::Function<FrozenCastLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               torch::Dtype dtype, int64_t chunk_rows) {
    ctx->saved_data["w"] = w;  // the stored (frozen, narrow) weight itself: no copy
    ctx->saved_data["rows"] = chunk_rows;
    const auto x2 = x.reshape({-1, x.size(-1)}).to(dtype);
    auto y = torch::empty({x2.size(0), w.size(0)}, x2.options());
    for (int64_t r = 0; r < w.size(0); r += chunk_rows) {
      const int64_t n = std::min(chunk_rows, w.size(0) - r);
      y.narrow(1, r, n).copy_(torch::mm(x2, w.narrow(0, r, n).to(dtype).t()));
    }
    auto shape = x.sizes().vec();
    shape.back() = w.size(0);
    return y.view(shape);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto w = ctx->saved_data["w"].toTensor();
    const int64_t chunk_rows = ctx->saved_data["rows"].toInt();
    const auto g = grads[0].reshape({-1, w.size(0)});
    auto gx = torch::zeros({g.size(0), w.size(1)}, g.options());
    for (int64_t r = 0; r < w.size(0); r += chunk_rows) {
      const int64_t n = std::min(chunk_rows, w.size(0) - r);
      gx.addmm_(g.narrow(1, r, n), w.narrow(0, r, n).to(g.scalar_type()));
    }
    auto shape = grads[0].sizes().vec();
    shape.back() = w.size(1);
    return {gx.view(shape), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor frozen_cast_linear(const torch::Tensor& x, const torch::Tensor& w, torch::Dtype dtype, int64_t chunk_rows) {
  WEFT_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "frozen_cast_linear: input has {} features, the weight is {}",
             x.size(-1), fmt::join(w.sizes().vec(), "x"));
  WEFT_CHECK(!w.requires_grad(), "frozen_cast_linear: the weight is trained (its gradient would be lost)");
  return FrozenCastLinearFunction::apply(x, w, dtype, frozen_cast_rows(w, dtype, chunk_rows));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  const auto input = x.to(compute_dtype_);
  auto y = base_output(input);
  if (has_lora()) y = y + lora_update(input);
  return y;
}

torch::Tensor LinearImpl::lora_update(const torch::Tensor& input) {
  WEFT_CHECK(has_lora(), "lora_update on a layer without LoRA adapters");
  auto h = lora_dropout_ > 0
               ? torch::nn::functional::dropout(
                     input, torch::nn::functional::DropoutFuncOptions().p(lora_dropout_).training(is_training()))
               : input;
  if (has_adalora()) {
    h = torch::nn::functional::linear(h, (ada_A_ * ada_E_).to(compute_dtype_));
    h = torch::nn::functional::linear(h, ada_B_.to(compute_dtype_));
  } else {
    h = torch::nn::functional::linear(h, lora_A_->weight.to(compute_dtype_));
    h = torch::nn::functional::linear(h, lora_B_->weight.to(compute_dtype_));
  }
  return h * lora_scale_;
}

torch::Tensor fused_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers) {
  WEFT_CHECK(!layers.empty(), "fused_linear needs at least one layer");
  const auto dtype = layers.front()->compute_dtype();
  const auto input = x.to(dtype);
  std::vector<torch::Tensor> weights, params;
  bool any_lora = false, deferrable = true;
  for (auto* layer : layers) {
    WEFT_CHECK(layer->compute_dtype() == dtype, "fused_linear: layers with different compute dtypes");
    if (layer->quantized()) {  // one product per layer: a concatenation would dequantize them all at once
      std::vector<torch::Tensor> outputs;
      for (auto* l : layers) outputs.push_back(l->forward(input));
      return torch::cat(outputs, -1);
    }
    weights.push_back(layer->weight.to(dtype));  // cast, then concatenate: half the bytes moved in bf16
    params.push_back(layer->weight);
    any_lora = any_lora || layer->has_lora();
    deferrable = deferrable && layer->weight_grad_deferrable();
  }
  auto y = deferrable ? deferrable_linear(input, params, dtype)
                      : torch::nn::functional::linear(input, weights.size() == 1 ? weights[0] : torch::cat(weights));
  if (!any_lora) return y;
  std::vector<torch::Tensor> parts;
  int64_t offset = 0;
  for (auto* layer : layers) {
    const int64_t width = layer->out_features();
    auto part = y.narrow(-1, offset, width);
    parts.push_back(layer->has_lora() ? part + layer->lora_update(input) : part);
    offset += width;
  }
  return torch::cat(parts, -1);
}

void LinearImpl::add_lora(const LoraSpec& spec, uint64_t generator_seed, const ParameterShard& base) {
  WEFT_CHECK(lora_A_.is_empty(), "LoRA adapters added twice to one layer");
  WEFT_CHECK(spec.r > 0, "lora.r must be positive, got {}", spec.r);
  const bool split_input = !base.whole() && base.dim == 1;
  const int64_t out_features = out_features_;
  const int64_t in_features = in_features_ * (split_input ? base.parts : 1);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(generator_seed);
  // PEFT: A ~ kaiming_uniform(a = sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in)); B = 0.
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  auto a = torch::empty({spec.r, in_features});
  a.uniform_(-bound, bound, generator);
  if (split_input) a = shard_slice(a, ParameterShard{1, base.parts, base.index}).contiguous();
  lora_A_ = register_module("lora_A", WeightHolder(a));
  lora_B_ = register_module("lora_B", WeightHolder(torch::zeros({out_features, spec.r})));
  lora_scale_ = spec.alpha / static_cast<double>(spec.r);
  lora_dropout_ = spec.dropout;
  if (weight.defined()) weight.set_requires_grad(false);
}

void LinearImpl::add_adalora(const LoraSpec& spec, uint64_t generator_seed, const ParameterShard& base) {
  WEFT_CHECK(!has_lora(), "LoRA adapters added twice to one layer");
  WEFT_CHECK(spec.r > 0, "adalora.init_r must be positive, got {}", spec.r);
  const bool split_input = !base.whole() && base.dim == 1, split_output = !base.whole() && base.dim == 0;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(generator_seed);
  auto a = torch::empty({spec.r, in_features_ * (split_input ? base.parts : 1)});
  a.normal_(0.0, 0.02, generator);
  auto b = torch::empty({out_features_ * (split_output ? base.parts : 1), spec.r});
  b.normal_(0.0, 0.02, generator);
  if (split_input) a = shard_slice(a, base).contiguous();
  if (split_output) b = shard_slice(b, base).contiguous();
  adapter_base_ = base;
  ada_A_ = register_parameter("lora_A", a);
  ada_E_ = register_parameter("lora_E", torch::zeros({spec.r, 1}));
  ada_B_ = register_parameter("lora_B", b);
  // PEFT: scaling = lora_alpha, divided by ranknum + 1e-5 with ranknum the initial rank.
  lora_scale_ = spec.alpha / (static_cast<double>(spec.r) + 1e-5);
  lora_dropout_ = spec.dropout;
  if (weight.defined()) weight.set_requires_grad(false);
}

void LinearImpl::merge_lora() {
  torch::NoGradGuard no_grad;
  if (quantized()) {  // the base becomes its dequantized values, a plain fp32 parameter
    weight = register_parameter("weight", quantized_.dequantize(torch::kFloat32), /*requires_grad=*/false);
    for (auto& buffer : named_buffers(/*recurse=*/false)) buffer.value().set_data(torch::empty({0}, buffer.value().options()));
    quantized_ = QuantizedMatrix{};
    quantize_ = QuantFormat::kNone;
  }
  if (has_adalora()) {
    weight.add_(torch::matmul(ada_B_, ada_A_ * ada_E_).to(weight.device()) * lora_scale_);
    for (const char* name : {"lora_A", "lora_E", "lora_B"}) {
      parameters_.erase(name);
    }
    ada_A_ = ada_E_ = ada_B_ = torch::Tensor();
    return;
  }
  if (lora_A_.is_empty()) return;
  weight.add_(torch::matmul(lora_B_->weight, lora_A_->weight).to(weight.device()) * lora_scale_);
  unregister_module("lora_A");
  unregister_module("lora_B");
  lora_A_ = nullptr;
  lora_B_ = nullptr;
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) { return normalize(x, x.scalar_type()); }

torch::Tensor RMSNormImpl::normalize(const torch::Tensor& x, torch::Dtype out_dtype) {
  return fused_rms_norm(x, weight, eps_, out_dtype);
}

RotaryEmbedding::RotaryEmbedding(const ModelConfig& config) {
  const int64_t dim = config.head_dim;
  auto exponents = torch::arange(0, dim, 2, torch::kFloat64) / static_cast<double>(dim);
  auto inv_freq = 1.0 / torch::pow(config.rope_theta, exponents);
  if (config.rope_scaling) {
    // Llama 3: long wavelengths divided by `factor`, short kept, a smooth blend in between.
    const auto& s = *config.rope_scaling;
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_len / s.low_freq_factor;
    const double high_freq_wavelen = old_len / s.high_freq_factor;
    auto accessor = inv_freq.accessor<double, 1>();
    for (int64_t i = 0; i < inv_freq.size(0); ++i) {
      const double freq = accessor[i];
      const double wavelen = 2.0 * M_PI / freq;
      if (wavelen < high_freq_wavelen) continue;
      if (wavelen > low_freq_wavelen) {
        accessor[i] = freq / s.factor;
      } else {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        accessor[i] = (1.0 - smooth) * freq / s.factor + smooth * freq;
      }
    }
  }
  inv_freq_ = inv_freq.to(torch::kFloat32);
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::tables(int64_t start, int64_t seq_len,
                                                                const torch::Device& device) const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->tables.first.defined() && cache_->start == start && cache_->seq_len == seq_len &&
      cache_->device == device) {
    return cache_->tables;
  }
  auto [cos, sin] = compute_tables(start, seq_len);  // on the CPU, in double-checked fp32 as before
  cache_->tables = {cos.to(device), sin.to(device)};
  cache_->start = start;
  cache_->seq_len = seq_len;
  cache_->device = device;
  return cache_->tables;
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::compute_tables(int64_t start, int64_t seq_len) const {
  torch::NoGradGuard no_grad;
  auto positions = torch::arange(start, start + seq_len, torch::kFloat32);
  auto freqs = torch::outer(positions, inv_freq_);
  auto emb = torch::cat({freqs, freqs}, -1);
  return {emb.cos(), emb.sin()};
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto xf = x.to(torch::kFloat32);
  const int64_t half = xf.size(-1) / 2;
  auto x1 = xf.narrow(-1, 0, half);
  auto x2 = xf.narrow(-1, half, half);
  auto rotated = torch::cat({-x2, x1}, -1);
  return (xf * cos + rotated * sin).to(x.scalar_type());
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
                                          /*scale=*/std::nullopt, /*enable_gqa=*/q.size(1) != k.size(1));
}

AttentionImpl::AttentionImpl(const ModelConfig& c) : AttentionImpl(c, c.num_attention_heads, c.num_key_value_heads) {}

AttentionImpl::AttentionImpl(const ModelConfig& c, int64_t heads, int64_t kv_heads, QuantConfig quantize)
    : num_heads_(heads), num_kv_heads_(kv_heads), head_dim_(c.head_dim) {
  q_proj = register_module("q_proj", Linear(c.hidden_size, num_heads_ * head_dim_, quantize));
  k_proj = register_module("k_proj", Linear(c.hidden_size, num_kv_heads_ * head_dim_, quantize));
  v_proj = register_module("v_proj", Linear(c.hidden_size, num_kv_heads_ * head_dim_, quantize));
  o_proj = register_module("o_proj", Linear(num_heads_ * head_dim_, c.hidden_size, quantize));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const RotaryEmbedding& rope) {
  if (context_ != nullptr && context_->size > 1) return forward_context_split(x, rope);
  const int64_t batch = x.size(0), seq = x.size(1);
  // One GEMM for q, k and v; one pass splits the heads and applies RoPE to q and k.
  auto qkv = fused_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  auto [cos, sin] = rope.tables(0, seq, x.device());
  auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, cos, sin);
  auto out = causal_attention(q, k, v);
  return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
}

torch::Tensor AttentionImpl::forward_context_split(const torch::Tensor& x, const RotaryEmbedding& rope) {
  const int64_t batch = x.size(0), seq = x.size(1), parts = context_->size;
  WEFT_CHECK(context_->attention || num_heads_ % parts == 0,
             "context parallelism: {} attention heads cannot be split over {} processes", num_heads_, parts);
  auto qkv = fused_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  // RoPE at the global positions of this process's tokens (one or two runs of the sequence), cut
  // from the whole sequence's tables (cached: the same for every block and step).
  const auto [whole_cos, whole_sin] = rope.tables(0, parts * seq, x.device());
  std::vector<torch::Tensor> cos_runs, sin_runs;
  for (const auto& [start, count] : context_->token_runs(parts * seq)) {
    cos_runs.push_back(whole_cos.narrow(0, start, count));
    sin_runs.push_back(whole_sin.narrow(0, start, count));
  }
  const auto cos = cos_runs.size() == 1 ? cos_runs[0] : torch::cat(cos_runs);
  const auto sin = sin_runs.size() == 1 ? sin_runs[0] : torch::cat(sin_runs);
  auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, cos, sin);
  if (context_->attention) {  // ring attention: this process's queries, key/value blocks moved by the caller
    auto out = context_attention(q, k, v, *context_, layer_);  // [B, H, s, D]
    return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
  }
  WEFT_CHECK(context_->layout == ContextLayout::kContiguous,
             "context parallelism: the all-to-all (Ulysses) needs the contiguous layout");
  if (num_kv_heads_ % parts != 0) {  // GQA with fewer kv heads than processes: one per query head
    k = k.repeat_interleave(num_heads_ / num_kv_heads_, 1);
    v = v.repeat_interleave(num_heads_ / num_kv_heads_, 1);
  }
  q = sequence_to_heads(q, *context_, layer_);
  k = sequence_to_heads(k, *context_, layer_);
  v = sequence_to_heads(v, *context_, layer_);
  auto out = heads_to_sequence(causal_attention(q, k, v), *context_, layer_);  // [B, H, s, D]
  return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
}

torch::Tensor cached_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t start) {
  const int64_t heads = q.size(1), seq = q.size(2), dim = q.size(3), kv_heads = k.size(1), keys = k.size(2);
  WEFT_CHECK(heads % kv_heads == 0 && keys == start + seq, "cached attention: {} heads over {} kv heads, {} keys for "
             "positions {}..{}", heads, kv_heads, keys, start, start + seq - 1);
  const auto kk = k.repeat_interleave(heads / kv_heads, 1), vv = v.repeat_interleave(heads / kv_heads, 1);
  auto scores = torch::matmul(q, kk.transpose(2, 3)).to(torch::kFloat32) / std::sqrt(static_cast<double>(dim));
  // Query i (position start + i) sees keys 0 .. start + i.
  auto future = torch::ones({seq, keys}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(start + 1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  return torch::matmul(scores.softmax(-1).to(v.scalar_type()), vv);
}

torch::Tensor AttentionImpl::forward_cached(const torch::Tensor& x, const RotaryEmbedding& rope, LayerKvCache& cache) {
  const int64_t batch = x.size(0), seq = x.size(1), start = cache.length();
  auto qkv = fused_linear(x, {q_proj.get(), k_proj.get(), v_proj.get()});
  auto [cos, sin] = rope.tables(start, seq, x.device());
  auto [q, k, v] = split_qkv_with_rope(qkv, num_heads_, num_kv_heads_, cos, sin);
  cache.k = cache.k.defined() ? torch::cat({cache.k, k}, 2) : k;
  cache.v = cache.v.defined() ? torch::cat({cache.v, v}, 2) : v;
  auto out = cached_attention(q, cache.k, cache.v, start);
  return o_proj(out.transpose(1, 2).reshape({batch, seq, num_heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const ModelConfig& c) : MlpImpl(c, c.intermediate_size) {}

MlpImpl::MlpImpl(const ModelConfig& c, int64_t intermediate, QuantConfig quantize) {
  gate_proj = register_module("gate_proj", Linear(c.hidden_size, intermediate, quantize));
  up_proj = register_module("up_proj", Linear(c.hidden_size, intermediate, quantize));
  down_proj = register_module("down_proj", Linear(intermediate, c.hidden_size, quantize));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  // One GEMM for gate and up, one fused pass for silu(gate) * up.
  return down_proj(fused_swiglu(fused_linear(x, {gate_proj.get(), up_proj.get()})));
}

DecoderBlockImpl::DecoderBlockImpl(const ModelConfig& c)
    : DecoderBlockImpl(c, BlockShape{c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, {}}, -1, nullptr) {}

DecoderBlockImpl::DecoderBlockImpl(const ModelConfig& c, const BlockShape& shape, int64_t layer, const CommHook* comm)
    : layer_(layer), comm_(comm) {
  self_attn = register_module("self_attn", Attention(c, shape.heads, shape.kv_heads, shape.quantize));
  mlp = register_module("mlp", Mlp(c, shape.intermediate, shape.quantize));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (comm_ != nullptr) {  // row-parallel int8 layers: each token's absmax over the whole row
    auto sync = [comm, layer](torch::Tensor& absmax) { (*comm)(CommPoint::kRowAbsMax, false, layer, absmax); };
    self_attn->o_proj->set_row_absmax_sync(sync);
    mlp->down_proj->set_row_absmax_sync(sync);
  }
}

namespace {

// x + sublayer output, in x's dtype: one kernel that promotes a bf16 output on the fly where x's
// dtype is the wider one (fp32 residual stream), instead of a cast and an add.
torch::Tensor residual_add(const torch::Tensor& x, const torch::Tensor& a) {
  if (c10::promoteTypes(x.scalar_type(), a.scalar_type()) == x.scalar_type()) return x + a;
  return x + a.to(x.scalar_type());
}

}  // namespace

torch::Tensor DecoderBlockImpl::forward(const torch::Tensor& x, const RotaryEmbedding& rope) {
  // The residual stream stays fp32; sublayer outputs (compute dtype) are promoted on add.
  // Norms write their output directly in the compute dtype the projections read.
  // With tensor parallelism, comm points wrap each sublayer: f before (all-reduce backward),
  // g after (all-reduce forward of the row-parallel partial sums).
  const auto dtype = self_attn->q_proj->compute_dtype();
  if (shards_ != nullptr && shards_->size > 1) {  // x holds this process's tokens
    // Each region's gathered input is released after its forward and gathered again in its
    // backward (release_gathered): between the two only this process's tokens are kept.
    const auto a_local = input_layernorm->normalize(x, dtype);
    const auto a_all = sequence_gather(*shards_, CommPoint::kAttentionInput, layer_, a_local);
    auto a = release_gathered(*shards_, CommPoint::kAttentionInput, layer_, self_attn->forward(a_all, rope), a_local, a_all);
    a = sequence_reduce_scatter(*shards_, CommPoint::kAttentionOutput, layer_, a);
    auto h = residual_add(x, a);
    const auto m_local = post_attention_layernorm->normalize(h, dtype);
    const auto m_all = sequence_gather(*shards_, CommPoint::kMlpInput, layer_, m_local);
    auto m = release_gathered(*shards_, CommPoint::kMlpInput, layer_, mlp(m_all), m_local, m_all);
    m = sequence_reduce_scatter(*shards_, CommPoint::kMlpOutput, layer_, m);
    return residual_add(h, m);
  }
  if (comm_ == nullptr || !*comm_) {
    auto h = residual_add(x, self_attn->forward(input_layernorm->normalize(x, dtype), rope));
    return residual_add(h, mlp(post_attention_layernorm->normalize(h, dtype)));
  }
  auto a = comm_point(comm_, CommPoint::kAttentionInput, layer_, input_layernorm->normalize(x, dtype));
  a = comm_point(comm_, CommPoint::kAttentionOutput, layer_, self_attn->forward(a, rope));
  auto h = residual_add(x, a);
  auto m = comm_point(comm_, CommPoint::kMlpInput, layer_, post_attention_layernorm->normalize(h, dtype));
  m = comm_point(comm_, CommPoint::kMlpOutput, layer_, mlp(m));
  return residual_add(h, m);
}

torch::Tensor DecoderBlockImpl::forward_cached(const torch::Tensor& x, const RotaryEmbedding& rope, LayerKvCache& cache) {
  const auto dtype = self_attn->q_proj->compute_dtype();
  auto a = comm_point(comm_, CommPoint::kAttentionInput, layer_, input_layernorm->normalize(x, dtype));
  a = comm_point(comm_, CommPoint::kAttentionOutput, layer_, self_attn->forward_cached(a, rope, cache));
  auto h = residual_add(x, a);
  auto m = comm_point(comm_, CommPoint::kMlpInput, layer_, post_attention_layernorm->normalize(h, dtype));
  m = comm_point(comm_, CommPoint::kMlpOutput, layer_, mlp(m));
  return residual_add(h, m);
}

void set_weight_grads_deferrable(torch::nn::Module& module, bool deferrable) {
  if (auto* self = module.as<LinearImpl>()) self->set_weight_grad_deferrable(deferrable);
  for (auto& child : module.modules(/*include_self=*/false)) {
    if (auto* linear = child->as<LinearImpl>()) linear->set_weight_grad_deferrable(deferrable);
  }
}

void set_compute_dtype(torch::nn::Module& module, torch::Dtype dtype) {
  if (auto* self = module.as<LinearImpl>()) self->set_compute_dtype(dtype);
  for (auto& child : module.modules(/*include_self=*/false)) {
    if (auto* linear = child->as<LinearImpl>()) linear->set_compute_dtype(dtype);
  }
}

}  // namespace weft
