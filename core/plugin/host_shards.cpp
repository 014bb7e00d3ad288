// The host services for sharded training state (ZeRO / FSDP): the flat shard of
// each parameter a plugin keeps, its master copy and gradient, and whole parameters and gradients
// the plugin frees and brings back; and the per-stage memory estimate behind the memory plan.
#include "core/plugin/host_services.h"

#include <cstring>

namespace weft {
namespace host {
namespace {

ParameterEntry& sharded_parameter(State& s, int64_t index, const char* what) {
  auto& p = parameter_at(s, index);
  WEFT_CHECK(p.sharded, "{}: parameter '{}' is not sharded (the plugin's flat_shard kept it whole)", what, p.name);
  return p;
}

}  // namespace

weft_status* parameter_shard(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_shard: null output");
    *out = sdk::to_dl_view(sharded_parameter(state_of(host), index, "parameter_shard").shard);
  });
}

weft_status* parameter_grad_shard(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_grad_shard: null output");
    const auto& p = sharded_parameter(state_of(host), index, "parameter_grad_shard");
    WEFT_CHECK(p.grad_shard.defined(), "parameter_grad_shard: parameter '{}' is frozen (no gradient)", p.name);
    *out = sdk::to_dl_view(p.grad_shard);
  });
}

weft_status* parameter_grad_release(weft_host* host, int64_t index) {
  return guarded([&] {
    auto& p = parameter_at(state_of(host), index);
    p.tensor.mutable_grad() = at::Tensor();
  });
}

weft_status* parameter_grad_into_buffer(weft_host* host, int64_t index, weft_buffer* buffer, int64_t offset) {
  return guarded([&] {
    WEFT_CHECK(buffer != nullptr, "parameter_grad_into_buffer: null buffer");
    auto& p = parameter_at(state_of(host), index);
    const at::Tensor grad = p.tensor.grad();
    const at::Tensor& flat = buffer->tensor;
    if (!grad.defined() || grad.scalar_type() != flat.scalar_type() || grad.device() != flat.device()) return;
    WEFT_CHECK(flat.dim() == 1 && offset >= 0 && offset + grad.numel() <= flat.numel(),
               "parameter_grad_into_buffer: {} elements at {} do not fit a buffer of {}", grad.numel(), offset,
               flat.numel());
    at::NoGradGuard no_grad;
    auto view = flat.narrow(0, offset, grad.numel()).view(grad.sizes());
    view.copy_(grad);
    p.tensor.mutable_grad() = view;
  });
}

weft_status* parameter_release(weft_host* host, int64_t index) {
  return guarded([&] {
    auto& p = sharded_parameter(state_of(host), index, "parameter_release");
    WEFT_CHECK(p.releasable, "parameter_release: the shard of parameter '{}' is not WEFT_FLAT_SHARD_RELEASABLE",
               p.name);
    if (p.released) return;
    // set_data keeps the tensor's identity (autograd's references, the optimizer's, the module's)
    // and swaps its storage: an empty tensor frees the whole parameter's memory, unless a view
    // saved for backward still holds it (it then dies with that graph).
    p.tensor.set_data(at::empty({0}, p.tensor.options().requires_grad(false)));
    p.released = true;
  });
}

weft_status* parameter_materialize(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_materialize: null output");
    auto& s = state_of(host);
    auto& p = parameter_at(s, index);
    const at::ScalarType dtype = s.materialize_masters ? at::kFloat : p.materialize_dtype;
    if (p.released) {
      p.tensor.set_data(at::empty(p.local_shape, p.tensor.options().dtype(dtype).requires_grad(false)));
      p.released = false;
    } else if (p.tensor.scalar_type() != dtype) {
      torch::NoGradGuard no_grad;
      p.tensor.set_data(p.tensor.detach().to(dtype));  // whole in the other dtype: converted
    }
    *out = sdk::to_dl_view(p.tensor);  // not a detached copy: the view points into its sizes and strides
  });
}

weft_status* stage_memory(weft_host* host, int64_t stage, weft_stage_memory* out) {
  return guarded([&] {
    WEFT_CHECK(out != nullptr, "stage_memory: null output");
    auto& s = state_of(host);
    WEFT_CHECK(!s.stage_memory.empty(), "stage_memory: the memory estimate is made after shard_parameter");
    WEFT_CHECK(0 <= stage && stage < static_cast<int64_t>(s.stage_memory.size()), "stage_memory: stage {} outside [0, {})",
               stage, s.stage_memory.size());
    WEFT_CHECK(out->struct_size >= sizeof(uint32_t), "stage_memory: out->struct_size must be sizeof(weft_stage_memory)");
    const size_t size = std::min<size_t>(out->struct_size, sizeof(weft_stage_memory));
    weft_stage_memory value = s.stage_memory[static_cast<size_t>(stage)];
    value.struct_size = static_cast<uint32_t>(size);
    std::memcpy(out, &value, size);
  });
}

}  // namespace host

void PluginHost::set_stage_memory(std::vector<weft_stage_memory> stages) { state_->stage_memory = std::move(stages); }

void PluginHost::set_flat_shard(int64_t index, const weft_flat_shard& shard) {
  auto& p = host::parameter_at(*state_, index);
  const int64_t numel = p.tensor.numel();
  WEFT_CHECK(shard.begin >= 0 && shard.count >= 0 && shard.begin + shard.count <= numel,
             "flat_shard({}) returned elements [{}, {}) of a parameter with {} elements", p.name, shard.begin,
             shard.begin + shard.count, numel);
  constexpr uint32_t known = WEFT_FLAT_SHARD_RELEASABLE | WEFT_FLAT_SHARD_COMPUTE_DTYPE;
  WEFT_CHECK((shard.flags & ~known) == 0, "flat_shard({}) returned unknown flags {:#x}", p.name, shard.flags);
  WEFT_CHECK(!(shard.flags & WEFT_FLAT_SHARD_COMPUTE_DTYPE) || (shard.flags & WEFT_FLAT_SHARD_RELEASABLE),
             "flat_shard({}): WEFT_FLAT_SHARD_COMPUTE_DTYPE needs WEFT_FLAT_SHARD_RELEASABLE", p.name);
  WEFT_CHECK(!p.released, "flat_shard({}): the parameter is released", p.name);
  if (shard.begin == 0 && shard.count == numel && shard.flags == 0) return;  // whole: not sharded
  WEFT_CHECK(p.tensor.is_contiguous(), "flat_shard({}): the parameter is not contiguous", p.name);
  torch::NoGradGuard no_grad;
  p.sharded = true;
  p.shard_begin = shard.begin;
  p.shard_count = shard.count;
  p.releasable = (shard.flags & WEFT_FLAT_SHARD_RELEASABLE) != 0;
  if ((shard.flags & WEFT_FLAT_SHARD_COMPUTE_DTYPE) && p.local_shape.size() >= 2 && state_->has_model_info) {
    p.materialize_dtype = sdk::from_dl_dtype(state_->model_info.compute_dtype);
  }
  at::Tensor view = p.tensor.detach().reshape({-1}).narrow(0, shard.begin, shard.count);
  p.shard = p.releasable ? view.clone() : view;
  if (p.tensor.requires_grad()) {
    p.grad_shard = at::zeros({shard.count}, p.tensor.options().dtype(at::kFloat).requires_grad(false));
    p.shard.mutable_grad() = p.grad_shard;  // what the optimizer and clipping read
  }
}

std::vector<PluginHost::TrainingTensor> PluginHost::training_tensors() const {
  std::vector<TrainingTensor> tensors;
  for (const auto& p : state_->parameters) {
    if (!p.tensor.requires_grad()) continue;
    tensors.push_back({p.name, p.sharded ? p.shard : p.tensor, p.shape.size() >= 2});
  }
  return tensors;
}

std::pair<int64_t, int64_t> PluginHost::parameter_and_gradient_bytes() const {
  int64_t parameters = 0, gradients = 0;
  for (const auto& p : state_->parameters) {
    if (!p.released) parameters += static_cast<int64_t>(p.tensor.nbytes());
    if (p.releasable) parameters += static_cast<int64_t>(p.shard.nbytes());
    if (p.tensor.grad().defined()) gradients += static_cast<int64_t>(p.tensor.grad().nbytes());
    if (p.grad_shard.defined()) gradients += static_cast<int64_t>(p.grad_shard.nbytes());
  }
  return {parameters, gradients};
}

std::vector<PluginHost::ShardedTensor> PluginHost::trainable_shards() const {
  std::vector<ShardedTensor> out;
  for (const auto& p : state_->parameters) {
    if (!p.tensor.requires_grad()) continue;
    ShardedTensor t{p.name, p.tensor, at::Tensor(), 0, p.tensor.numel(), false};
    if (p.sharded) {
      t.shard = p.shard;
      t.begin = p.shard_begin;
      t.count = p.shard_count;
      t.own_storage = p.releasable;
    }
    out.push_back(std::move(t));
  }
  return out;
}

bool PluginHost::sharded() const {
  for (const auto& p : state_->parameters) {
    if (p.sharded) return true;
  }
  return false;
}

bool PluginHost::releases_parameters() const {
  for (const auto& p : state_->parameters) {
    if (p.releasable) return true;
  }
  return false;
}

void PluginHost::set_materialize_masters(bool masters) { state_->materialize_masters = masters; }

void PluginHost::zero_grad_shards() {
  torch::NoGradGuard no_grad;
  for (auto& p : state_->parameters) {
    if (p.grad_shard.defined()) p.grad_shard.zero_();
  }
}

}  // namespace weft
