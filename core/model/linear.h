// A linear layer of the model: a base weight with, optionally, an adapter around it,
//
//   y = base(x) + adapter(x)
//
// The base weight is one of
//   DenseWeight     a parameter `weight` [out, in], trained or frozen (a frozen one may be stored
//                   narrower than it computes: model.frozen_dtype);
//   Int8Weight      LLM.int8's vector-wise int8 (quantize.h), frozen;
//   Nf4Weight       QLoRA's 4-bit NormalFloat, frozen;
// and the adapter, when one is added, one of
//   LoraAdapter     PEFT's LoRA: (alpha / r) B A dropout(x);
//   AdaLoraAdapter  PEFT's AdaLoRA (SVDLinear): (alpha / (r + 1e-5)) B (A * E) dropout(x).
//
// The layer holds one slice of a whole [out, in] layer (parallel.h's ParameterShard, whole unless
// the strategy's layout slices the layer); its base weight is that slice, and its adapter's factors
// are sliced to match. The layer knows nothing else of the strategy: slices come from the layout,
// and communication happens at the points the blocks publish (parallel.h).
//
// Parameter names are PEFT's and HF's: `weight`, `lora_A.weight` / `lora_B.weight` (LoRA),
// `lora_A` / `lora_E` / `lora_B` (AdaLoRA); a quantized base is the buffers weight_data,
// weight_scale, weight_scale2 and weight_offset.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "core/model/parallel.h"
#include "core/model/quantize.h"

namespace weft {

class LinearImpl;

// LoRA adapter settings for one linear layer (PEFT semantics: W x + (alpha / r) B A dropout(x)).
struct LoraSpec {
  int64_t r = 8;
  double alpha = 16.0;
  double dropout = 0.0;
};

// A linear layer: the whole layer's shape, how its base weight is stored, and which slice of it
// this process holds.
struct LinearSpec {
  int64_t in_features = 0, out_features = 0;  // the whole layer's
  QuantConfig quantize;                       // kNone: a DenseWeight
  ParameterShard slice;                       // dim 0 (output rows) or 1 (input columns)
};

// The base weight of a linear layer. Its tensors are registered on the layer (the owner passed to
// its constructor), so that they carry the layer's HF names.
class BaseWeight {
 public:
  virtual ~BaseWeight() = default;
  virtual QuantFormat format() const = 0;
  // x W^T for `input` already in `dtype`.
  virtual torch::Tensor forward(const torch::Tensor& input, torch::Dtype dtype) = 0;
  // The weight in `dtype` (a copy, or the quantized values dequantized).
  virtual torch::Tensor dense(torch::Dtype dtype) const = 0;
  // Sets this slice from `whole`, the whole layer's [out, in] weight (any float dtype), on `device`.
  // A quantized base quantizes the whole weight and keeps its slice, so that every split of a model
  // holds the unsplit model's quantized values.
  virtual void set_from_whole(const torch::Tensor& whole, const ParameterShard& slice, const torch::Device& device) = 0;
};

class DenseWeight : public BaseWeight {
 public:
  DenseWeight(torch::nn::Module& owner, int64_t out_features, int64_t in_features);
  // Takes `weight` (an fp32 parameter of the owner) as it is.
  explicit DenseWeight(torch::Tensor weight) : weight(std::move(weight)) {}
  QuantFormat format() const override { return QuantFormat::kNone; }
  torch::Tensor forward(const torch::Tensor& input, torch::Dtype dtype) override;
  torch::Tensor dense(torch::Dtype dtype) const override { return weight.to(dtype); }
  void set_from_whole(const torch::Tensor& whole, const ParameterShard& slice, const torch::Device& device) override;
  // Whether a trainable weight's gradient is deferred under a DeferWeightGradients scope
  // (weight_grad.h: a split backward's weight half).
  bool deferrable() const { return deferrable_ && weight.requires_grad(); }
  void set_deferrable(bool deferrable) { deferrable_ = deferrable; }

  torch::Tensor weight;  // [out, in], the owner's parameter "weight"

 private:
  bool deferrable_ = false;
};

// A frozen quantized weight (Int8Weight, Nf4Weight): quantized_linear computes its products.
class QuantizedWeight : public BaseWeight {
 public:
  QuantizedWeight(torch::nn::Module& owner, int64_t out_features, int64_t in_features, QuantConfig config)
      : owner_(owner), rows_(out_features), cols_(in_features), config_(config) {}
  QuantFormat format() const override { return config_.format; }
  torch::Tensor forward(const torch::Tensor& input, torch::Dtype dtype) override;
  torch::Tensor dense(torch::Dtype dtype) const override { return matrix_.dequantize(dtype); }
  void set_from_whole(const torch::Tensor& whole, const ParameterShard& slice, const torch::Device& device) override;
  const QuantizedMatrix& matrix() const { return matrix_; }
  // Frees the owner's buffers (merging replaces this base with a DenseWeight).
  void release();

 protected:
  // What the format does with a stored matrix before it computes (Int8Weight: the int8 GEMM).
  virtual void prepare(QuantizedMatrix&) {}
  virtual const Int8LinearOptions* int8_options() const { return nullptr; }
  const QuantConfig& config() const { return config_; }

 private:
  void store(QuantizedMatrix q);

  torch::nn::Module& owner_;
  int64_t rows_, cols_;
  QuantConfig config_;
  QuantizedMatrix matrix_;
};

class Nf4Weight : public QuantizedWeight {
 public:
  Nf4Weight(torch::nn::Module& owner, int64_t out_features, int64_t in_features, QuantConfig config)
      : QuantizedWeight(owner, out_features, in_features, config) {}
};

// On the CPU, where this LibTorch has an exact int8 GEMM (cpu_int8_gemm_available()) and
// model.int8_gemm is on, the forward multiplies with LLM.int8's int8_linear (model.int8_threshold).
class Int8Weight : public QuantizedWeight {
 public:
  Int8Weight(torch::nn::Module& owner, int64_t out_features, int64_t in_features, QuantConfig config)
      : QuantizedWeight(owner, out_features, in_features, config) {
    options_.threshold = config.int8_threshold;
  }
  // For a slice of the input columns (a row-parallel layer) computing with int8_linear: how the
  // rows' absmax over this process's columns becomes the whole row's (CommPoint::kRowAbsMax).
  void set_row_absmax_sync(RowAbsmaxSync sync) { options_.row_absmax = std::move(sync); }

 protected:
  void prepare(QuantizedMatrix& q) override;
  const Int8LinearOptions* int8_options() const override { return &options_; }

 private:
  Int8LinearOptions options_;
};

// An adapter beside a frozen base weight. Its parameters are registered on the layer.
class Adapter {
 public:
  Adapter(double scale, double dropout) : scale_(scale), dropout_(dropout) {}
  virtual ~Adapter() = default;
  // The adapter's term for `input` already in `dtype` (dropout applies in training).
  torch::Tensor forward(const torch::Tensor& input, torch::Dtype dtype, bool training) const;
  // Its update of the layer's weight slice, scaled, [out, in] (fp32): what merging adds.
  virtual torch::Tensor delta() const = 0;
  // Removes its parameters from the layer (after a merge).
  virtual void remove_from(LinearImpl& owner) = 0;
  double scale() const { return scale_; }
  double dropout() const { return dropout_; }

 protected:
  // The unscaled term for a dropped-out input.
  virtual torch::Tensor product(const torch::Tensor& input, torch::Dtype dtype) const = 0;

 private:
  double scale_, dropout_;
};

// Holds one parameter named "weight"; LoRA's lora_A and lora_B, so that their names match PEFT's.
class WeightHolderImpl : public torch::nn::Module {
 public:
  explicit WeightHolderImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor weight;
};
TORCH_MODULE(WeightHolder);

// LoRA: A [r, in] kaiming-uniform from a seed, B [out, r] zeros. On a sliced layer A and B are
// the whole layer's factors sliced like the base (parallel.h's shard_of: a column slice (dim 0)
// splits B's rows, a row slice (dim 1) A's columns), so every split of a model starts from the
// same adapters.
class LoraAdapter : public Adapter {
 public:
  LoraAdapter(torch::nn::Module& owner, const LinearSpec& layer, const LoraSpec& spec, uint64_t seed);
  torch::Tensor delta() const override;
  void remove_from(LinearImpl& owner) override;
  WeightHolder A{nullptr}, B{nullptr};

 protected:
  torch::Tensor product(const torch::Tensor& input, torch::Dtype dtype) const override;
};

// AdaLoRA's SVD form, as PEFT's SVDLinear: P (A [r, in]) and Q (B [out, r]) ~ N(0, 0.02^2) from
// a seed, Lambda (E [r, 1]) zeros; r stays the initial rank however many triplets the rank
// allocator masks (adalora.h). On a sliced layer P and Q are drawn whole and sliced like LoRA's
// factors (E stays whole).
class AdaLoraAdapter : public Adapter {
 public:
  AdaLoraAdapter(torch::nn::Module& owner, const LinearSpec& layer, const LoraSpec& spec, uint64_t seed);
  torch::Tensor delta() const override;
  void remove_from(LinearImpl& owner) override;
  torch::Tensor A, E, B;
  std::vector<bool> keep;  // which triplets the last reallocation kept (empty: all)

 protected:
  torch::Tensor product(const torch::Tensor& input, torch::Dtype dtype) const override;
};

// A compute-dtype copy of frozen weights kept between steps (model.cache_frozen_casts): `parts` cast
// to `dtype` and stacked on dim 0, made on the first get() and made again whenever a part is another
// tensor, holds other storage (moved, resharded, released) or was written in place (its version
// counter: a load, merge_lora). A write that bypasses ATen (raw bytes through a DLTensor view) is
// not seen: the host drops the model's casts where it hands a plugin a frozen weight's view
// (parameter_data). What a product without it makes each step: casts(parts) and the concatenation
// of a fused group, 6 bytes of traffic per fp32 element.
class CastCache {
 public:
  // Whether `parts` are worth caching in `dtype`: frozen, on one device, never wider in `dtype` than
  // stored (a copy no larger than the weights), and not already a single weight in `dtype`.
  static bool applies(torch::TensorList parts, torch::Dtype dtype);
  // The cast (and stacked) parts; applies(parts, dtype) must hold.
  torch::Tensor get(torch::TensorList parts, torch::Dtype dtype);
  void clear();
  bool holds() const { return value_.defined(); }

 private:
  struct Part {
    const void* impl;
    const void* data;
    int64_t version;
    bool operator==(const Part& o) const { return impl == o.impl && data == o.data && version == o.version; }
  };
  std::vector<Part> key_;
  torch::Dtype dtype_ = torch::kFloat32;
  torch::Tensor value_;
};

class LinearImpl : public torch::nn::Module {
 public:
  explicit LinearImpl(const LinearSpec& spec);
  // A whole layer.
  LinearImpl(int64_t in_features, int64_t out_features, QuantConfig quantize = {})
      : LinearImpl(LinearSpec{in_features, out_features, quantize, {}}) {}
  torch::Tensor forward(const torch::Tensor& x);

  // This slice's shape, the whole layer's, and which slice it is.
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  const LinearSpec& spec() const { return spec_; }
  const ParameterShard& slice() const { return spec_.slice; }

  BaseWeight& base() { return *base_; }
  const BaseWeight& base() const { return *base_; }
  bool quantized() const { return base_->format() != QuantFormat::kNone; }
  // Sets the base weight from the whole layer's [out, in] weight (any float dtype) on `device`;
  // this layer keeps its slice.
  void set_weight(const torch::Tensor& whole, const torch::Device& device);
  // The base weight slice in `dtype`.
  torch::Tensor dense_weight(torch::Dtype dtype) const { return base_->dense(dtype); }
  // A quantized base's matrix (quantized() layers only).
  const QuantizedMatrix& quantized_weight() const;

  // Adds an adapter (LoraAdapter or AdaLoraAdapter, from `generator_seed`) and freezes the base.
  void add_lora(const LoraSpec& spec, uint64_t generator_seed);
  void add_adalora(const LoraSpec& spec, uint64_t generator_seed);
  const Adapter* adapter() const { return adapter_.get(); }
  bool has_lora() const { return adapter_ != nullptr; }
  // The adapter as `A` (null when it is absent or another kind).
  template <class A>
  A* adapter_as() {
    return dynamic_cast<A*>(adapter_.get());
  }
  // The adapter's term for `input` already in the compute dtype. Throws weft::Error without one.
  torch::Tensor adapter_output(const torch::Tensor& input);
  // Folds the adapter into the base weight and removes it. A quantized base (with or without an
  // adapter) is dequantized first into a plain fp32 `weight` parameter: the layer is then dense.
  void merge_lora();

  void set_compute_dtype(torch::Dtype dtype) { compute_dtype_ = dtype; }
  torch::Dtype compute_dtype() const { return compute_dtype_; }
  // Keep the frozen base's compute-dtype copy between steps (CastCache; model.cache_frozen_casts).
  // Off drops what is kept.
  void set_cache_frozen_casts(bool enabled);
  // `parts` (this layer's frozen base weight, or the stacked bases of a fused group this layer
  // leads) in the compute dtype from this layer's cache; undefined when caching is off or does
  // not apply (CastCache::applies).
  torch::Tensor cached_cast(torch::TensorList parts);
  bool holds_cached_cast() const { return cast_cache_.holds(); }
  void drop_cached_cast() { cast_cache_.clear(); }
  // Whether a trainable dense weight's gradient may be deferred (DenseWeight::deferrable).
  void set_weight_grad_deferrable(bool deferrable);
  bool weight_grad_deferrable() const;
  // A row slice of an int8 base computing with int8_linear: see Int8Weight::set_row_absmax_sync.
  void set_row_absmax_sync(RowAbsmaxSync sync);
  // Unregisters parameter `name` (an adapter's, when it is removed).
  void remove_parameter(const std::string& name) { parameters_.erase(name); }

  torch::Tensor weight;  // a DenseWeight's parameter; undefined for a quantized base

 private:
  LinearSpec spec_;
  int64_t in_features_, out_features_;
  std::unique_ptr<BaseWeight> base_;
  std::unique_ptr<Adapter> adapter_;
  torch::Dtype compute_dtype_ = torch::kFloat32;
  bool cache_casts_ = false;
  CastCache cast_cache_;
};
TORCH_MODULE(Linear);

// LinearImpl::set_cache_frozen_casts on every linear layer of `module` (itself included).
void set_cache_frozen_casts(torch::nn::Module& module, bool enabled);

// The outputs of several linear layers that read the same x, concatenated on the last dim, from
// one GEMM against their stacked dense weights (plus each layer's adapter term). Equals
// cat({layer(x) ...}, -1) up to rounding order. The layers must share a compute dtype.
torch::Tensor fused_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers);

// Whether lora_linear computes `layers` (sharing their input): dense frozen bases, plain LoRA
// adapters (on some of them at least), one compute dtype; dropout in training on the CPU in fp32
// or bf16 (fused_dropout's hashed masks, kept as the dropped indices for backward).
bool lora_linear_applies(const std::vector<LinearImpl*>& layers);
// The layers' outputs concatenated, as fused_linear gives them, from one autograd node: y = x W^T
// over the stacked bases, x's products with every A in one GEMM, each B's product written into its
// slice of y first and the bases' GEMM added over them (y written once, read once); backward: x's
// gradient from two GEMMs (the bases, then every A), A's gradients from one. No per-layer output,
// sum or concatenation is made, and no zero-filled gradient of a slice. With dropout, each
// adapter's A takes its input through fused_dropout's mask (the seeds drawn in layer order, as the
// adapters' own dropout draws them), kept as its dropped elements' indices (dropout_mask_indices)
// for backward, and taken by its complement: the same GEMMs as without dropout, less the dropped
// elements' terms (subtract_dropped_products_ and dropped_backward_, kernels.h). No dropped copy of
// x is made or kept, and no index is hashed twice.
torch::Tensor lora_linear(const torch::Tensor& x, const std::vector<LinearImpl*>& layers);

// x [..., in] @ w^T in `dtype` for a frozen w [out, in] stored in another dtype (model.frozen_dtype
// = "bf16" under fp32 compute): w is cast `chunk_rows` rows at a time (0: blocks of at most 64 MiB
// in `dtype`), in the forward and again in the backward, which gives x's gradient only. No whole
// cast copy of w is held or saved for backward: for a 128k-vocabulary head that is 1 GiB in fp32.
torch::Tensor frozen_cast_linear(const torch::Tensor& x, const torch::Tensor& w, torch::Dtype dtype,
                                 int64_t chunk_rows = 0);

}  // namespace weft
