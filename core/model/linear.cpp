#include "core/model/linear.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "core/model/gemm.h"
#include "core/model/kernels.h"
#include "core/model/weight_grad.h"
#include "core/util/error.h"

namespace weft {

// ---- base weights -------------------------------------------------------------------------------

namespace {

// A frozen fp32 CPU weight computing in fp32 while oneDNN multiplies fp32 matrices (gemm.h): its
// product goes through frozen_cast_linear, whose products take the process's library, instead of
// autograd's linear (ATen's).
bool frozen_product_routes(const torch::Tensor& weight, torch::Dtype dtype) {
  return !weight.requires_grad() && onednn_multiplies(weight, dtype);
}

}  // namespace

DenseWeight::DenseWeight(torch::nn::Module& owner, int64_t out_features, int64_t in_features)
    : weight(owner.register_parameter("weight", torch::empty({out_features, in_features}))) {}

torch::Tensor DenseWeight::forward(const torch::Tensor& input, torch::Dtype dtype) {
  if (!weight.requires_grad() && (weight.scalar_type() != dtype || frozen_product_routes(weight, dtype))) {
    return frozen_cast_linear(input, weight, dtype);
  }
  if (deferrable() || master_weight_grad_applies(weight, dtype)) {
    return deferrable_linear(input, {weight}, dtype, deferrable());
  }
  return torch::nn::functional::linear(input, weight.to(dtype));
}

void DenseWeight::set_from_whole(const torch::Tensor& whole, const ParameterShard& slice, const torch::Device&) {
  torch::NoGradGuard no_grad;
  weight.copy_(shard_slice(whole, slice));
}

torch::Tensor QuantizedWeight::forward(const torch::Tensor& input, torch::Dtype) {
  return quantized_linear(input, matrix_, int8_options());
}

void QuantizedWeight::set_from_whole(const torch::Tensor& whole, const ParameterShard& slice, const torch::Device& device) {
  torch::NoGradGuard no_grad;
  auto q = quantize_matrix(whole.to(device), config_.format);
  if (!slice.whole()) {
    const auto [start, length] = slice.range(whole.size(slice.dim));
    q = slice_quantized(q, slice.dim, start, length);
  }
  store(std::move(q));
}

void QuantizedWeight::store(QuantizedMatrix q) {
  WEFT_CHECK(q.rows == rows_ && q.cols == cols_, "linear layer [{}, {}]: a quantized weight of [{}, {}]", rows_, cols_,
             q.rows, q.cols);
  prepare(q);
  // Buffers, so that module.to() moves them; registered on the first call, replaced after.
  const std::pair<const char*, torch::Tensor*> parts[] = {
      {"weight_data", &q.data}, {"weight_scale", &q.scale}, {"weight_scale2", &q.scale2}, {"weight_offset", &q.offset}};
  auto buffers = owner_.named_buffers(/*recurse=*/false);  // tensors sharing the module's
  for (const auto& [name, tensor] : parts) {
    if (!tensor->defined()) continue;
    if (auto* existing = buffers.find(name)) {
      existing->set_data(*tensor);
      *tensor = *existing;
    } else {
      *tensor = owner_.register_buffer(name, *tensor);
    }
  }
  matrix_ = std::move(q);
}

void QuantizedWeight::release() {
  for (auto& buffer : owner_.named_buffers(/*recurse=*/false)) {
    buffer.value().set_data(torch::empty({0}, buffer.value().options()));
  }
  matrix_ = QuantizedMatrix{};
}

void Int8Weight::prepare(QuantizedMatrix& q) {
  // On the CPU the forward multiplies in the int8 GEMM where this LibTorch has an exact one.
  if (config().int8_gemm && q.data.device().is_cpu() && cpu_int8_gemm_available()) use_int8_gemm(q);
}

// ---- adapters -----------------------------------------------------------------------------------

namespace {

// The layer's slice of its whole [out, in] shape: (out, in).
std::pair<int64_t, int64_t> local_shape(const LinearSpec& layer) {
  const auto& s = layer.slice;
  const int64_t out = !s.whole() && s.dim == 0 ? s.range(layer.out_features).second : layer.out_features;
  const int64_t in = !s.whole() && s.dim == 1 ? s.range(layer.in_features).second : layer.in_features;
  return {out, in};
}

// `factor`'s slice along `dim` as the layer's slice selects it (whole when the layer is not split
// along `layer_dim`).
torch::Tensor slice_like(const torch::Tensor& factor, const ParameterShard& slice, int32_t layer_dim, int32_t dim) {
  if (slice.whole() || slice.dim != layer_dim) return factor;
  return shard_slice(factor, ParameterShard{dim, slice.parts, slice.index}).contiguous();
}

}  // namespace

torch::Tensor Adapter::forward(const torch::Tensor& input, torch::Dtype dtype, bool training) const {
  const auto h = dropout_ > 0 && training ? fused_dropout(input, dropout_) : input;
  return product(h, dtype) * scale_;
}

LoraAdapter::LoraAdapter(torch::nn::Module& owner, const LinearSpec& layer, const LoraSpec& spec, uint64_t seed)
    : Adapter(spec.alpha / static_cast<double>(spec.r), spec.dropout) {
  WEFT_CHECK(spec.r > 0, "lora.r must be positive, got {}", spec.r);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  // PEFT: A ~ kaiming_uniform(a = sqrt(5)) => U(-1/sqrt(in), 1/sqrt(in)); B = 0.
  const double bound = 1.0 / std::sqrt(static_cast<double>(layer.in_features));
  auto a = torch::empty({spec.r, layer.in_features});
  a.uniform_(-bound, bound, generator);
  A = owner.register_module("lora_A", WeightHolder(slice_like(a, layer.slice, 1, 1)));
  B = owner.register_module("lora_B", WeightHolder(torch::zeros({local_shape(layer).first, spec.r})));
}

torch::Tensor LoraAdapter::product(const torch::Tensor& input, torch::Dtype dtype) const {
  const auto h = torch::nn::functional::linear(input, A->weight.to(dtype));
  return torch::nn::functional::linear(h, B->weight.to(dtype));
}

torch::Tensor LoraAdapter::delta() const { return torch::matmul(B->weight, A->weight) * scale(); }

void LoraAdapter::remove_from(LinearImpl& owner) {
  owner.unregister_module("lora_A");
  owner.unregister_module("lora_B");
  A = nullptr;
  B = nullptr;
}

AdaLoraAdapter::AdaLoraAdapter(torch::nn::Module& owner, const LinearSpec& layer, const LoraSpec& spec, uint64_t seed)
    // PEFT: scaling = lora_alpha, divided by ranknum + 1e-5 with ranknum the initial rank.
    : Adapter(spec.alpha / (static_cast<double>(spec.r) + 1e-5), spec.dropout) {
  WEFT_CHECK(spec.r > 0, "adalora.init_r must be positive, got {}", spec.r);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto a = torch::empty({spec.r, layer.in_features});
  a.normal_(0.0, 0.02, generator);
  auto b = torch::empty({layer.out_features, spec.r});
  b.normal_(0.0, 0.02, generator);
  A = owner.register_parameter("lora_A", slice_like(a, layer.slice, 1, 1));
  E = owner.register_parameter("lora_E", torch::zeros({spec.r, 1}));
  B = owner.register_parameter("lora_B", slice_like(b, layer.slice, 0, 0));
}

torch::Tensor AdaLoraAdapter::product(const torch::Tensor& input, torch::Dtype dtype) const {
  const auto h = torch::nn::functional::linear(input, (A * E).to(dtype));
  return torch::nn::functional::linear(h, B.to(dtype));
}

torch::Tensor AdaLoraAdapter::delta() const { return torch::matmul(B, A * E) * scale(); }

void AdaLoraAdapter::remove_from(LinearImpl& owner) {
  for (const char* name : {"lora_A", "lora_E", "lora_B"}) owner.remove_parameter(name);
  A = E = B = torch::Tensor();
}

// ---- the cast cache ----------------------------------------------------------------------------

bool CastCache::applies(torch::TensorList parts, torch::Dtype dtype) {
  if (parts.empty()) return false;
  for (const auto& p : parts) {
    if (!p.defined() || p.requires_grad() || p.dim() != 2 || p.size(1) != parts[0].size(1) ||
        p.device() != parts[0].device() ||
        c10::elementSize(dtype) > c10::elementSize(p.scalar_type())) {
      return false;
    }
  }
  return parts.size() > 1 || parts[0].scalar_type() != dtype;
}

torch::Tensor CastCache::get(torch::TensorList parts, torch::Dtype dtype) {
  WEFT_CHECK(applies(parts, dtype), "CastCache: the weights are trained, of several devices, or narrower than {}",
             c10::toString(dtype));
  std::vector<Part> key;
  key.reserve(parts.size());
  for (const auto& p : parts) key.push_back({p.unsafeGetTensorImpl(), p.data_ptr(), p._version()});
  if (value_.defined() && dtype == dtype_ && key == key_) return value_;
  value_ = torch::Tensor();  // the old copy goes before the new one is made
  torch::NoGradGuard no_grad;
  if (parts.size() == 1) {
    value_ = parts[0].to(dtype).contiguous();
  } else {
    int64_t rows = 0;
    for (const auto& p : parts) rows += p.size(0);
    value_ = torch::empty({rows, parts[0].size(1)}, parts[0].options().dtype(dtype));
    int64_t row = 0;
    for (const auto& p : parts) {  // cast straight into its rows: no intermediate copy
      value_.narrow(0, row, p.size(0)).copy_(p);
      row += p.size(0);
    }
  }
  key_ = std::move(key);
  dtype_ = dtype;
  return value_;
}

void CastCache::clear() {
  value_ = torch::Tensor();
  key_.clear();
}

// ---- the layer ----------------------------------------------------------------------------------

LinearImpl::LinearImpl(const LinearSpec& spec) : spec_(spec) {
  const auto& s = spec.slice;
  WEFT_CHECK(s.parts >= 1 && 0 <= s.index && s.index < s.parts && (s.dim == 0 || s.dim == 1),
             "linear layer [{}, {}]: invalid slice (dim {}, part {} of {})", spec.out_features, spec.in_features, s.dim,
             s.index, s.parts);
  std::tie(out_features_, in_features_) = local_shape(spec);
  switch (spec.quantize.format) {
    case QuantFormat::kNone: {
      auto dense = std::make_unique<DenseWeight>(*this, out_features_, in_features_);
      weight = dense->weight;
      base_ = std::move(dense);
      break;
    }
    case QuantFormat::kInt8:
      base_ = std::make_unique<Int8Weight>(*this, out_features_, in_features_, spec.quantize);
      break;
    case QuantFormat::kNf4:
      base_ = std::make_unique<Nf4Weight>(*this, out_features_, in_features_, spec.quantize);
      break;
  }
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) {
  if (adapter_ != nullptr && lora_linear_applies({this})) return lora_linear(x, {this});
  const auto input = x.to(compute_dtype_);
  const auto cached = quantized() ? torch::Tensor() : cached_cast({weight});
  auto y = cached.defined() ? torch::nn::functional::linear(input, cached) : base_->forward(input, compute_dtype_);
  if (adapter_ != nullptr) y = y + adapter_->forward(input, compute_dtype_, is_training());
  return y;
}

void LinearImpl::set_weight(const torch::Tensor& whole, const torch::Device& device) {
  WEFT_CHECK(whole.dim() == 2 && whole.size(0) == spec_.out_features && whole.size(1) == spec_.in_features,
             "linear layer [{}, {}]: a weight of shape {} was given", spec_.out_features, spec_.in_features,
             fmt::join(whole.sizes().vec(), "x"));
  base_->set_from_whole(whole, spec_.slice, device);
}

const QuantizedMatrix& LinearImpl::quantized_weight() const {
  WEFT_CHECK(quantized(), "linear layer [{}, {}]: its base weight is not quantized", out_features_, in_features_);
  return static_cast<const QuantizedWeight&>(*base_).matrix();
}

void LinearImpl::add_lora(const LoraSpec& spec, uint64_t generator_seed) {
  WEFT_CHECK(adapter_ == nullptr, "LoRA adapters added twice to one layer");
  adapter_ = std::make_unique<LoraAdapter>(*this, spec_, spec, generator_seed);
  if (weight.defined()) weight.set_requires_grad(false);
}

void LinearImpl::add_adalora(const LoraSpec& spec, uint64_t generator_seed) {
  WEFT_CHECK(adapter_ == nullptr, "LoRA adapters added twice to one layer");
  adapter_ = std::make_unique<AdaLoraAdapter>(*this, spec_, spec, generator_seed);
  if (weight.defined()) weight.set_requires_grad(false);
}

torch::Tensor LinearImpl::adapter_output(const torch::Tensor& input) {
  WEFT_CHECK(adapter_ != nullptr, "adapter_output on a layer without adapters");
  return adapter_->forward(input, compute_dtype_, is_training());
}

void LinearImpl::merge_lora() {
  torch::NoGradGuard no_grad;
  if (quantized()) {  // the base becomes its dequantized values, a plain fp32 parameter
    auto& quantized = static_cast<QuantizedWeight&>(*base_);
    weight = register_parameter("weight", quantized.dense(torch::kFloat32), /*requires_grad=*/false);
    quantized.release();
    base_ = std::make_unique<DenseWeight>(weight);
    spec_.quantize = QuantConfig{};
  }
  if (adapter_ == nullptr) return;
  weight.add_(adapter_->delta().to(weight.device()));
  adapter_->remove_from(*this);
  adapter_.reset();
}

void LinearImpl::set_cache_frozen_casts(bool enabled) {
  cache_casts_ = enabled;
  if (!enabled) cast_cache_.clear();
}

torch::Tensor LinearImpl::cached_cast(torch::TensorList parts) {
  if (!cache_casts_ || !CastCache::applies(parts, compute_dtype_)) return {};
  return cast_cache_.get(parts, compute_dtype_);
}

void set_cache_frozen_casts(torch::nn::Module& module, bool enabled) {
  if (auto* self = module.as<LinearImpl>()) self->set_cache_frozen_casts(enabled);
  for (auto& child : module.modules(/*include_self=*/false)) {
    if (auto* linear = child->as<LinearImpl>()) linear->set_cache_frozen_casts(enabled);
  }
}

void LinearImpl::set_weight_grad_deferrable(bool deferrable) {
  if (auto* dense = dynamic_cast<DenseWeight*>(base_.get())) dense->set_deferrable(deferrable);
}

bool LinearImpl::weight_grad_deferrable() const {
  const auto* dense = dynamic_cast<const DenseWeight*>(base_.get());
  return dense != nullptr && dense->deferrable();
}

void LinearImpl::set_row_absmax_sync(RowAbsmaxSync sync) {
  auto* int8 = dynamic_cast<Int8Weight*>(base_.get());
  if (int8 != nullptr && !spec_.slice.whole() && spec_.slice.dim == 1) int8->set_row_absmax_sync(std::move(sync));
}

namespace {

// lora_linear's node. Inputs: x [..., in] in the compute dtype, each layer's frozen base weight,
// and the adapters' A [r, in] and B [out, r] (of the layers that have one, in order). `layout`
// holds, per layer, its output width and its adapter's index (-1: none); `scales` the adapters'.
class LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               torch::TensorList weights, torch::TensorList cache, torch::TensorList a, torch::TensorList b,
                               std::vector<int64_t> widths, std::vector<int64_t> adapters, std::vector<double> scales,
                               std::vector<double> dropouts, std::vector<int64_t> seeds, int64_t dtype_code) {
    const auto dtype = static_cast<torch::Dtype>(dtype_code);
    const auto x2 = x.reshape({-1, x.size(-1)}).to(dtype).contiguous();
    const auto cached = cache.empty() ? torch::Tensor() : cache[0];
    const auto w = cached.defined() ? cached : stacked(weights, dtype);
    const auto a_all = stacked(a, dtype);
    // Every adapter's x A^T, side by side in one GEMM; a dropped-out adapter's less its dropped
    // elements' terms, scaled by 1 / (1 - p) (the mask's complement, kernels.h): its D(x) A^T.
    auto u = gemm(x2, a_all.t());
    // Each dropped-out adapter's mask (its dropped indices), A^T in fp32 and x's dropped elements
    // (written by the complement's pass), kept for backward.
    std::vector<torch::Tensor> masks(a.size()), ats(a.size()), values(a.size());
    std::vector<DroppedAdapter> dropped;
    for (size_t k = 0, column = 0; k < a.size(); column += static_cast<size_t>(a[k].size(0)), ++k) {
      if (dropouts[k] <= 0) continue;
      masks[k] = dropout_mask_indices(x2.numel(), dropouts[k], static_cast<uint64_t>(seeds[k]));
      ats[k] = transposed_fp32(a[k]);
      values[k] = torch::empty({masks[k].numel()}, x2.options());
      dropped.push_back({masks[k], ats[k], u.narrow(1, static_cast<int64_t>(column), a[k].size(0)),
                         dropout_scale(dropouts[k]), {}, values[k]});
    }
    if (!dropped.empty()) subtract_dropped_products_(x2, dropped);
    // y = x W^T + each adapter's scaled u B^T: the adapters' products first, each written into its
    // slice of y (zeros where a layer has none), then the bases' GEMM adds x W^T over them (beta 1),
    // so the wide output is read once inside that compute-bound GEMM instead of read and written
    // again by a rank-r update after it, which is memory-bound (gate and up's: 2x slower).
    auto y = torch::empty({x2.size(0), w.size(0)}, x2.options());
    int64_t offset = 0, rank_offset = 0;
    for (size_t i = 0; i < widths.size(); ++i) {
      auto slice = y.narrow(1, offset, widths[i]);
      if (adapters[i] >= 0) {
        const auto& bi = b[static_cast<size_t>(adapters[i])];
        const int64_t r = bi.size(1);
        at::addmm_out(slice, slice, u.narrow(1, rank_offset, r), bi.to(dtype).t(), /*beta=*/0.0, scales[i]);
        rank_offset += r;
      } else {
        slice.zero_();
      }
      offset += widths[i];
    }
    gemm_out(y, x2, w.t(), /*accumulate=*/true);
    // A fresh copy of the bases (cast or stacked) is kept for backward as autograd keeps a
    // product's operand; one layer's cast is made again there instead (frozen_cast_linear's way).
    // The cache's copy (model.cache_frozen_casts) lives anyway: kept, never made again.
    const bool recast = !cached.defined() && weights.size() == 1 && weights[0].scalar_type() != dtype;
    ctx->save_for_backward({x2, u, recast ? weights[0] : w});
    std::vector<torch::Tensor> saved_a(a.begin(), a.end()), saved_b(b.begin(), b.end());
    ctx->saved_data["a"] = saved_a;
    ctx->saved_data["b"] = saved_b;
    ctx->saved_data["widths"] = widths;
    ctx->saved_data["adapters"] = adapters;
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["dropouts"] = dropouts;
    ctx->saved_data["masks"] = masks;
    ctx->saved_data["ats"] = ats;
    ctx->saved_data["values"] = values;
    ctx->saved_data["dtype"] = dtype_code;
    ctx->saved_data["weights"] = static_cast<int64_t>(weights.size());
    ctx->saved_data["cached"] = cached.defined();
    auto shape = x.sizes().vec();
    shape.back() = y.size(1);
    return y.view(shape);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &u = saved[1];
    const auto dtype = static_cast<torch::Dtype>(ctx->saved_data["dtype"].toInt());
    const auto w = saved[2].to(dtype);
    const auto a = ctx->saved_data["a"].toTensorVector(), b = ctx->saved_data["b"].toTensorVector();
    const auto widths = ctx->saved_data["widths"].toIntVector(), adapters = ctx->saved_data["adapters"].toIntVector();
    const auto scales = ctx->saved_data["scales"].toDoubleVector();
    const int64_t n_weights = ctx->saved_data["weights"].toInt();
    const auto g = grads[0].reshape({-1, w.size(0)}).to(dtype).contiguous();
    // v = each adapter's scaled g B, side by side as u: x's gradient through A and A's gradient;
    // a dropped-out adapter's also by 1 / (1 - p) (its share: D(v A) for x and v^T D(x) for A, each
    // the dense product of v less the dropped elements' terms, its mask's complement).
    const auto dropouts = ctx->saved_data["dropouts"].toDoubleVector();
    auto v = torch::empty_like(u);
    std::vector<torch::Tensor> grad_a(a.size()), grad_b(b.size());
    int64_t offset = 0, rank_offset = 0;
    for (size_t i = 0; i < widths.size(); ++i) {
      if (adapters[i] >= 0) {
        const auto k = static_cast<size_t>(adapters[i]);
        const int64_t r = b[k].size(1);
        const auto gi = g.narrow(1, offset, widths[i]);
        const auto ui = u.narrow(1, rank_offset, r);
        const double scale = scales[i] * (dropouts[k] > 0 ? dropout_scale(dropouts[k]) : 1.0);
        v.narrow(1, rank_offset, r).copy_(torch::mm(gi, b[k].to(dtype)).mul_(scale));
        grad_b[k] = torch::mm(gi.t(), ui).mul_(scales[i]).to(b[k].scalar_type());
        rank_offset += r;
      }
      offset += widths[i];
    }
    const auto masks = ctx->saved_data["masks"].toTensorVector(), ats = ctx->saved_data["ats"].toTensorVector();
    const auto values = ctx->saved_data["values"].toTensorVector();
    const bool want_x = ctx->needs_input_grad(0);
    torch::Tensor grad_x = want_x ? gemm(g, w) : torch::Tensor();
    std::vector<DroppedAdapter> dropped;
    std::vector<size_t> dropped_k;
    for (size_t k = 0, column = 0; k < a.size(); column += static_cast<size_t>(a[k].size(0)), ++k) {
      if (dropouts[k] <= 0) continue;
      dropped.push_back({masks[k], ats[k], v.narrow(1, static_cast<int64_t>(column), a[k].size(0)), 1.0f, {}, values[k]});
      dropped_k.push_back(k);
    }
    // Where every adapter is dropped out and the CPU multiplies bf16 tiles: x's gradient through
    // the adapters and A's gradients with their masks applied (add_kept_products_ and
    // kept_weight_grads_); else the dense products, which dropped_backward_ corrects.
    const bool all_dropped = !dropped.empty() && dropped.size() == a.size();
    const bool kept_x = want_x && all_dropped && add_kept_products_(grad_x, dropped);
    if (want_x && !kept_x) gemm_out(grad_x, v, stacked(a, dtype), /*accumulate=*/true);
    const bool kept_a = all_dropped && (kept_x || !want_x) && kept_weight_grads_(x2, dropped);
    if (!kept_a) {
      const auto grad_a_all = gemm(v.t(), x2);
      for (size_t k = 0, column = 0, n = 0; k < a.size(); column += static_cast<size_t>(a[k].size(0)), ++k) {
        const auto grad_ak = grad_a_all.narrow(0, static_cast<int64_t>(column), a[k].size(0));
        if (dropouts[k] > 0) {  // A's gradient in fp32 until the dropped terms are taken out
          dropped[n++].grad_a = grad_ak.to(torch::kFloat32).contiguous();
        } else {
          grad_a[k] = grad_ak.to(a[k].scalar_type());
        }
      }
      if (!dropped.empty()) {
        torch::Tensor none;
        dropped_backward_(kept_x ? none : grad_x, x2, dropped);
      }
    }
    for (size_t n = 0; n < dropped.size(); ++n) grad_a[dropped_k[n]] = dropped[n].grad_a.to(a[dropped_k[n]].scalar_type());
    if (want_x) {
      auto shape = grads[0].sizes().vec();
      shape.back() = x2.size(1);
      grad_x = grad_x.view(shape);
    }
    torch::autograd::variable_list out{grad_x};
    for (int64_t i = 0; i < n_weights; ++i) out.emplace_back();  // frozen bases
    if (ctx->saved_data["cached"].toBool()) out.emplace_back();  // their cached cast
    out.insert(out.end(), grad_a.begin(), grad_a.end());
    out.insert(out.end(), grad_b.begin(), grad_b.end());
    for (int i = 0; i < 6; ++i) out.emplace_back();  // widths, adapters, scales, dropouts, seeds, dtype
    return out;
  }

 private:
  static torch::Tensor stacked(torch::TensorList parts, torch::Dtype dtype) {
    if (parts.size() == 1) return parts[0].to(dtype);
    std::vector<torch::Tensor> cast;
    for (const auto& p : parts) cast.push_back(p.to(dtype));  // cast, then stack: half the bytes in bf16
    return torch::cat(cast);
  }
};

}  // namespace

bool lora_linear_applies(const std::vector<LinearImpl*>& layers) {
  if (layers.empty()) return false;
  bool any = false;
  for (auto* layer : layers) {
    if (layer->quantized() || !layer->weight.defined() || layer->weight.requires_grad() ||
        layer->compute_dtype() != layers.front()->compute_dtype()) {
      return false;
    }
    if (!layer->has_lora()) continue;
    const auto* lora = dynamic_cast<const LoraAdapter*>(layer->adapter());
    if (lora == nullptr) return false;
    // Dropout in training: fused_dropout's mask, kept as its dropped indices for backward (a CPU tensor of fp32 or bf16).
    const bool dropped = lora->dropout() > 0 && layer->is_training();
    if (dropped && !seeded_dropout_applies(torch::empty({0}, layer->weight.options().dtype(layer->compute_dtype())))) {
      return false;
    }
    any = true;
  }
  return any;
}

torch::Tensor lora_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers) {
  WEFT_CHECK(lora_linear_applies(layers), "lora_linear: the layers are not frozen dense bases with plain LoRA adapters");
  std::vector<torch::Tensor> weights, a, b;
  std::vector<int64_t> widths, adapters;
  std::vector<double> scales, dropouts;
  std::vector<int64_t> seeds;
  for (auto* layer : layers) {
    weights.push_back(layer->weight);
    widths.push_back(layer->out_features());
    const auto* lora = layer->has_lora() ? dynamic_cast<const LoraAdapter*>(layer->adapter()) : nullptr;
    adapters.push_back(lora != nullptr ? static_cast<int64_t>(a.size()) : -1);
    scales.push_back(lora != nullptr ? lora->scale() : 0.0);
    if (lora != nullptr) {
      a.push_back(lora->A->weight);
      b.push_back(lora->B->weight);
      // Seeds drawn in layer order, as each adapter's fused_dropout would draw them.
      const double p = layer->is_training() ? lora->dropout() : 0.0;
      dropouts.push_back(p);
      seeds.push_back(p > 0 ? static_cast<int64_t>(draw_dropout_seed()) : 0);
    }
  }
  const auto dtype = layers.front()->compute_dtype();
  // The group's cached cast (its first layer keeps it), or none: a list of one tensor or empty
  // (a custom function's input cannot be an undefined tensor).
  std::vector<torch::Tensor> cache;
  if (auto cached = layers.front()->cached_cast(weights); cached.defined()) cache.push_back(std::move(cached));
  return LoraLinearFunction::apply(x.to(dtype), torch::TensorList(weights), torch::TensorList(cache), torch::TensorList(a),
                                   torch::TensorList(b),
                                   widths, adapters, scales, dropouts, seeds, static_cast<int64_t>(dtype));
}

torch::Tensor fused_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers) {
  WEFT_CHECK(!layers.empty(), "fused_linear needs at least one layer");
  if (lora_linear_applies(layers)) return lora_linear(x, layers);
  const auto dtype = layers.front()->compute_dtype();
  const auto input = x.to(dtype);
  std::vector<torch::Tensor> weights, params;
  bool any_adapter = false, deferrable = true, master = true;
  for (auto* layer : layers) {
    WEFT_CHECK(layer->compute_dtype() == dtype, "fused_linear: layers with different compute dtypes");
    if (layer->quantized()) {  // one product per layer: a concatenation would dequantize them all at once
      std::vector<torch::Tensor> outputs;
      for (auto* l : layers) outputs.push_back(l->forward(input));
      return torch::cat(outputs, -1);
    }
    params.push_back(layer->weight);
    any_adapter = any_adapter || layer->has_lora();
    deferrable = deferrable && layer->weight_grad_deferrable();
    master = master && master_weight_grad_applies(layer->weight, dtype);
  }
  const auto cached = deferrable || master ? torch::Tensor() : layers.front()->cached_cast(params);
  if (!deferrable && !master && !cached.defined()) {
    for (const auto& p : params) weights.push_back(p.to(dtype));  // cast, then concatenate: half the bytes in bf16
  }
  bool frozen = !deferrable && !master && !cached.defined();
  for (const auto& p : params) frozen = frozen && frozen_product_routes(p, dtype);
  const auto stacked_weights = [&] { return weights.size() == 1 ? weights[0] : torch::cat(weights); };
  auto y = deferrable || master ? deferrable_linear(input, params, dtype, deferrable)
           : cached.defined()   ? torch::nn::functional::linear(input, cached)
           : frozen             ? frozen_cast_linear(input, stacked_weights(), dtype)
                                : torch::nn::functional::linear(input, stacked_weights());
  if (!any_adapter) return y;
  std::vector<torch::Tensor> parts;
  int64_t offset = 0;
  for (auto* layer : layers) {
    const int64_t width = layer->out_features();
    auto part = y.narrow(-1, offset, width);
    parts.push_back(layer->has_lora() ? part + layer->adapter_output(input) : part);
    offset += width;
  }
  return torch::cat(parts, -1);
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
      if (n == w.size(0)) {
        gemm_out(y, x2, w.to(dtype).t());
      } else {
        y.narrow(1, r, n).copy_(gemm(x2, w.narrow(0, r, n).to(dtype).t()));
      }
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
    const bool whole = chunk_rows >= w.size(0);  // one product: written, not added to zeros
    auto gx = whole ? torch::empty({g.size(0), w.size(1)}, g.options()) : torch::zeros({g.size(0), w.size(1)}, g.options());
    for (int64_t r = 0; r < w.size(0); r += chunk_rows) {
      const int64_t n = std::min(chunk_rows, w.size(0) - r);
      gemm_out(gx, g.narrow(1, r, n), w.narrow(0, r, n).to(g.scalar_type()), /*accumulate=*/!whole);
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


}  // namespace weft
