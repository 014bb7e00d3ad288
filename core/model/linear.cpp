#include "core/model/linear.h"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "core/model/kernels.h"
#include "core/model/weight_grad.h"
#include "core/util/error.h"

namespace weft {

// ---- base weights -------------------------------------------------------------------------------

DenseWeight::DenseWeight(torch::nn::Module& owner, int64_t out_features, int64_t in_features)
    : weight(owner.register_parameter("weight", torch::empty({out_features, in_features}))) {}

torch::Tensor DenseWeight::forward(const torch::Tensor& input, torch::Dtype dtype) {
  if (!weight.requires_grad() && weight.scalar_type() != dtype) return frozen_cast_linear(input, weight, dtype);
  if (deferrable()) return deferrable_linear(input, {weight}, dtype);
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
  const auto input = x.to(compute_dtype_);
  auto y = base_->forward(input, compute_dtype_);
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

torch::Tensor fused_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers) {
  WEFT_CHECK(!layers.empty(), "fused_linear needs at least one layer");
  const auto dtype = layers.front()->compute_dtype();
  const auto input = x.to(dtype);
  std::vector<torch::Tensor> weights, params;
  bool any_adapter = false, deferrable = true;
  for (auto* layer : layers) {
    WEFT_CHECK(layer->compute_dtype() == dtype, "fused_linear: layers with different compute dtypes");
    if (layer->quantized()) {  // one product per layer: a concatenation would dequantize them all at once
      std::vector<torch::Tensor> outputs;
      for (auto* l : layers) outputs.push_back(l->forward(input));
      return torch::cat(outputs, -1);
    }
    weights.push_back(layer->weight.to(dtype));  // cast, then concatenate: half the bytes moved in bf16
    params.push_back(layer->weight);
    any_adapter = any_adapter || layer->has_lora();
    deferrable = deferrable && layer->weight_grad_deferrable();
  }
  auto y = deferrable ? deferrable_linear(input, params, dtype)
                      : torch::nn::functional::linear(input, weights.size() == 1 ? weights[0] : torch::cat(weights));
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


}  // namespace weft
