// The host's step for ABI 2 plugins, and the host services they find by name. The step is an
// sdk::Strategy over the host's own step services (core/plugin/step/step.hpp), whose
// methods the strategy session calls; the ABI 2 plugin behind it gives its layout, placements and
// hooks, and the collectives those lower to are placement_collectives.h's.
#include "core/plugin/abi2.h"
#include "core/plugin/abi2_context.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include "core/plugin/step/step.hpp"

#include "core/model/parallel.h"
#include "core/plugin/host_services.h"
#include "core/plugin/abi2_slices.h"
#include "core/plugin/placement_collectives.h"
#include "core/plugin/replicas.h"
#include "core/plugin/step_program.h"
#include "core/util/error.h"


namespace weft {
namespace {


// --- the host's services, by name ---

weft_status* service_status_create(weft_status_code code, const char* message) {
  return status_create(code, message ? message : "");
}
void service_log(weft_host_context* c, weft_log_level level, const char* message) { c->host.log(level, message); }
void service_world(weft_host_context* c, int32_t* rank, int32_t* size) {
  const sdk::Group world = c->group != nullptr ? sdk::Group(c->group) : c->host.world();
  if (rank) *rank = world.rank();
  if (size) *size = world.size();
}
weft_host* settings_of(weft_host_context* c) { return c->settings != nullptr ? c->settings : c->host.handle(); }
weft_status* service_config_int(weft_host_context* c, const char* key, int64_t fallback, int64_t* out) {
  return host::config_int(settings_of(c), key, fallback, out);
}
weft_status* service_config_float(weft_host_context* c, const char* key, double fallback, double* out) {
  return host::config_float(settings_of(c), key, fallback, out);
}
weft_status* service_config_bool(weft_host_context* c, const char* key, int32_t fallback, int32_t* out) {
  return host::config_bool(settings_of(c), key, fallback, out);
}
weft_status* service_config_string(weft_host_context* c, const char* key, const char* fallback, const char** out) {
  return host::config_string(settings_of(c), key, fallback, out);
}
weft_status* service_config_int_list(weft_host_context* c, const char* key, int64_t* out, int32_t capacity, int32_t* count) {
  return host::config_int_list(settings_of(c), key, out, capacity, count);
}

// Since 2.1: the parameters, collectives over the plugin's dimension and metrics, for hooks.
int64_t service_parameter_count(weft_host_context* c) {
  try {
    return c->host.parameter_count();
  } catch (...) {
    return 0;
  }
}
weft_status* service_parameter(weft_host_context* c, int64_t index, weft_parameter_desc* desc, DLTensor* data) {
  if (desc == nullptr || data == nullptr) return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_parameter: desc or data is NULL");
  const int64_t count = service_parameter_count(c);
  if (index < 0 || index >= count) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT,
                                fmt::format("weft_parameter: index {} is not one of the {} parameters", index, count).c_str());
  }
  if (desc->struct_size < offsetof(weft_parameter_desc, trainable) + sizeof desc->trainable) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_parameter: desc->struct_size is smaller than ABI 2.0's");
  }
  weft_status* status = host::parameter_info(c->host.handle(), index, &c->info);
  if (status == nullptr) status = host::parameter_data(c->host.handle(), index, data);
  if (status != nullptr) return status;
  weft_parameter_desc whole{};
  whole.struct_size = std::min<uint32_t>(desc->struct_size, sizeof whole);
  whole.name = c->info.name;
  whole.ndim = c->info.ndim;
  whole.shape = c->info.shape;
  whole.trainable = c->info.trainable;
  std::memcpy(desc, &whole, whole.struct_size);
  return nullptr;
}
bool collective_dtype(const DLTensor& t) {
  return t.dtype.lanes == 1 && ((t.dtype.code == kDLFloat && (t.dtype.bits == 32 || t.dtype.bits == 64 || t.dtype.bits == 16)) ||
                                (t.dtype.code == kDLBfloat && t.dtype.bits == 16));
}
// A contiguous tensor as one dimension (the collectives split dimension 0 over the ranks).
DLTensor flat_view(const DLTensor& t, int64_t (&shape_and_stride)[2]) {
  return sdk::flat_part(t, 0, sdk::detail::elements_of(t), shape_and_stride);
}
// A collective's status, or its wait's: it returns when done.
weft_status* waited(weft_host_context* c, weft_status* status, weft_work** work) {
  if (status != nullptr) return status;
  status = host::work_wait(c->host.handle(), *work);
  host::work_release(c->host.handle(), *work);
  return status;
}
weft_status* service_all_reduce(weft_host_context* c, DLTensor* tensor, weft_reduce_op op) {
  if (tensor == nullptr) return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_all_reduce: tensor is NULL");
  if (!collective_dtype(*tensor)) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_all_reduce: the tensor is not fp32, fp64, bf16 or fp16");
  }
  weft_work* work = nullptr;
  return waited(c, host::all_reduce(c->host.handle(), c->group, tensor, op, &work), &work);
}
// Since 2.3: all-gather and reduce-scatter over the plugin's dimension (sequence parallelism).
weft_status* service_all_gather(weft_host_context* c, DLTensor* output, const DLTensor* input) {
  if (output == nullptr || input == nullptr || !collective_dtype(*output) || !collective_dtype(*input)) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT,
                                "weft_all_gather: an output and an input of fp32, fp64, bf16 or fp16 are required");
  }
  int64_t out_shape[2], in_shape[2];
  DLTensor out = flat_view(*output, out_shape);
  const DLTensor in = flat_view(*input, in_shape);
  weft_work* work = nullptr;
  return waited(c, host::all_gather(c->host.handle(), c->group, &out, &in, &work), &work);
}
weft_status* service_reduce_scatter(weft_host_context* c, DLTensor* output, const DLTensor* input) {
  if (output == nullptr || input == nullptr || !collective_dtype(*output) || !collective_dtype(*input)) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT,
                                "weft_reduce_scatter: an output and an input of fp32, fp64, bf16 or fp16 are required");
  }
  int64_t out_shape[2], in_shape[2];
  DLTensor out = flat_view(*output, out_shape);
  const DLTensor in = flat_view(*input, in_shape);
  weft_work* work = nullptr;
  return waited(c, host::reduce_scatter(c->host.handle(), c->group, &out, &in, WEFT_REDUCE_SUM, &work), &work);
}
// Since 2.4: all-to-all and point-to-point transfers over the plugin's dimension (context parallelism).
weft_group* dimension_group(weft_host_context* c) { return c->group != nullptr ? c->group : c->host.world().get(); }
weft_status* service_all_to_all(weft_host_context* c, DLTensor* output, const DLTensor* input) {
  if (output == nullptr || input == nullptr || output->ndim < 1 || input->ndim < 1) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_all_to_all: an output and an input [size, ...] are required");
  }
  weft_work* work = nullptr;
  return waited(c, host::all_to_all(c->host.handle(), dimension_group(c), output, input, &work), &work);
}
weft_status* service_send(weft_host_context* c, const DLTensor* tensor, int32_t peer, int32_t tag, weft_transfer** out) {
  if (tensor == nullptr || out == nullptr) return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_send: a tensor and an output are required");
  weft_work* work = nullptr;
  weft_status* status = host::send(c->host.handle(), dimension_group(c), tensor, peer, tag, &work);
  *out = reinterpret_cast<weft_transfer*>(work);
  return status;
}
weft_status* service_recv(weft_host_context* c, DLTensor* tensor, int32_t peer, int32_t tag, weft_transfer** out) {
  if (tensor == nullptr || out == nullptr) return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_recv: a tensor and an output are required");
  weft_work* work = nullptr;
  weft_status* status = host::recv(c->host.handle(), dimension_group(c), tensor, peer, tag, &work);
  *out = reinterpret_cast<weft_transfer*>(work);
  return status;
}
weft_status* service_transfer_wait(weft_host_context* c, weft_transfer* transfer) {
  if (transfer == nullptr) return nullptr;
  auto* work = reinterpret_cast<weft_work*>(transfer);
  return waited(c, nullptr, &work);
}
// Since 2.3: the model's configuration by its config.json name.
weft_status* service_model_config_int(weft_host_context* c, const char* key, int64_t* out) {
  const PluginHost::State& state = *c->host.handle()->state;
  if (key == nullptr || out == nullptr) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, "weft_model_config_int: a key and an output are required");
  }
  if (state.model_config == nullptr) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT,
                                "weft_model_config_int: the model's configuration is known from weft_place on");
  }
  const ModelConfig& m = *state.model_config;
  const std::map<std::string, int64_t> values = {
      {"hidden_size", m.hidden_size},
      {"num_attention_heads", m.num_attention_heads},
      {"num_key_value_heads", m.num_key_value_heads},
      {"intermediate_size", m.intermediate_size},
      {"vocab_size", m.vocab_size},
      {"num_hidden_layers", m.num_hidden_layers},
      {"tie_word_embeddings", m.tie_word_embeddings ? 1 : 0},
  };
  const auto it = values.find(key);
  if (it == values.end()) {
    std::vector<std::string> keys;
    for (const auto& [k, v] : values) keys.push_back(k);
    return status_create(WEFT_STATUS_INVALID_ARGUMENT,
                                fmt::format("weft_model_config_int: no key \"{}\" (the host has: {})", key,
                                            fmt::join(keys, ", ")).c_str());
  }
  *out = it->second;
  return nullptr;
}
weft_status* service_state_tensor(weft_host_context* c, const char* name, DLDataType dtype, int32_t ndim,
                                  const int64_t* shape, DLTensor* out, int32_t* restored) {
  const auto refuse = [](const std::string& message) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, ("weft_state_tensor: " + message).c_str());
  };
  if (name == nullptr || *name == '\0' || out == nullptr) return refuse("a name and an output view are required");
  if (ndim < 0 || (ndim > 0 && shape == nullptr)) return refuse(fmt::format("'{}': no shape for {} dimensions", name, ndim));
  std::optional<at::ScalarType> type;
  if (dtype.lanes == 1 && dtype.code == kDLFloat && dtype.bits == 32) type = at::kFloat;
  if (dtype.lanes == 1 && dtype.code == kDLFloat && dtype.bits == 64) type = at::kDouble;
  if (dtype.lanes == 1 && dtype.code == kDLInt && dtype.bits == 32) type = at::kInt;
  if (dtype.lanes == 1 && dtype.code == kDLInt && dtype.bits == 64) type = at::kLong;
  if (!type) return refuse(fmt::format("'{}': the dtype is not fp32, fp64, int32 or int64", name));
  std::vector<int64_t> sizes(shape, shape + ndim);
  for (int64_t size : sizes) {
    if (size < 0) return refuse(fmt::format("'{}': a negative size", name));
  }
  try {
    PluginHost::State& state = *c->host.handle()->state;
    for (const auto& [made, tensor] : state.plugin_state) {
      if (made == name) return refuse(fmt::format("'{}' was made already", name));
    }
    at::Tensor tensor = at::zeros(sizes, at::TensorOptions().dtype(*type).device(state.device));
    int32_t from_checkpoint = 0;
    const auto saved = state.restored_state.find(name);
    if (saved != state.restored_state.end()) {
      if (saved->second.sizes() != tensor.sizes() || saved->second.scalar_type() != tensor.scalar_type()) {
        return refuse(fmt::format("'{}' is {} [{}] in the checkpoint, {} [{}] here", name,
                                  c10::toString(saved->second.scalar_type()), fmt::join(saved->second.sizes(), ", "),
                                  c10::toString(tensor.scalar_type()), fmt::join(tensor.sizes(), ", ")));
      }
      tensor.copy_(saved->second);
      state.restored_state.erase(saved);
      from_checkpoint = 1;
    }
    state.plugin_state.emplace_back(name, tensor);
    *out = DLTensor{};
    out->data = tensor.data_ptr();
    out->device = tensor.is_cuda() ? DLDevice{kDLCUDA, tensor.device().index()} : DLDevice{kDLCPU, 0};
    out->ndim = ndim;
    out->dtype = dtype;
    out->shape = const_cast<int64_t*>(state.plugin_state.back().second.sizes().data());
    out->strides = nullptr;
    if (restored) *restored = from_checkpoint;
    return nullptr;
  } catch (const std::exception& e) {
    return status_create(WEFT_STATUS_INTERNAL, fmt::format("weft_state_tensor: {}", e.what()).c_str());
  }
}
void service_report_metric(weft_host_context* c, const char* name, double value) {
  if (name == nullptr) return;
  if (weft_status* status = host::report_metric(c->host.handle(), name, value)) status_release(status);
}

template <class F>
weft_proc as_proc(F* function) {
  return reinterpret_cast<weft_proc>(function);
}

weft_proc host_proc_address(const char* name) {
  static const std::map<std::string, weft_proc> services = {
      {"weft_status_create", as_proc(&service_status_create)},
      {"weft_log", as_proc(&service_log)},
      {"weft_world", as_proc(&service_world)},
      {"weft_config_int", as_proc(&service_config_int)},
      {"weft_config_float", as_proc(&service_config_float)},
      {"weft_config_bool", as_proc(&service_config_bool)},
      {"weft_config_string", as_proc(&service_config_string)},
      {"weft_config_int_list", as_proc(&service_config_int_list)},
      {"weft_parameter_count", as_proc(&service_parameter_count)},
      {"weft_parameter", as_proc(&service_parameter)},
      {"weft_all_reduce", as_proc(&service_all_reduce)},
      {"weft_report_metric", as_proc(&service_report_metric)},
      {"weft_state_tensor", as_proc(&service_state_tensor)},
      {"weft_all_gather", as_proc(&service_all_gather)},
      {"weft_reduce_scatter", as_proc(&service_reduce_scatter)},
      {"weft_model_config_int", as_proc(&service_model_config_int)},
      {"weft_all_to_all", as_proc(&service_all_to_all)},
      {"weft_send", as_proc(&service_send)},
      {"weft_recv", as_proc(&service_recv)},
      {"weft_transfer_wait", as_proc(&service_transfer_wait)},
  };
  if (name == nullptr) return nullptr;
  const auto it = services.find(name);
  return it == services.end() ? nullptr : it->second;
}

using Owner = Abi2Instance;

// The host's step for plugins that own one dimension each, without a pipeline: data parallelism
// (its layout splits rows; REPLICATE, LOCAL and FLAT_SHARD placements), context parallelism (its
// layout splits sequences; a hook at the attention), tensor parallelism (SLICE placements, PARTIAL
// gradients, hooks at the model's points), or several on a mesh dp x cp x tp (the session's plugin
// owns tp, else cp; the others compose with it: rank = (dp coordinate x cp + cp coordinate) x tp + tp
// coordinate, each plugin's dimension its mesh slice, the data-parallel one's dp x cp flattened).
class HostStep : public sdk::Strategy {
 public:
  HostStep(sdk::Host host, const Abi2Plugin& plugin) : Strategy(host) {
    const PluginHost::State& state = *host.handle()->state;
    const sdk::Group world = host.world();
    const uint32_t owns = plugin.table.mesh_dimensions;
    if (world.size() > 1 && owns == 0) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                  fmt::format("{} owns no mesh dimension, so it runs on one process, but the world has {} ranks",
                              plugin.table.name, world.size()));
    }
    const bool composed = state.abi2_data_parallel != nullptr || state.abi2_context_parallel != nullptr;
    const bool tensor = owns == (1u << WEFT_MESH_TP), context = owns == (1u << WEFT_MESH_CP);
    if (composed) {
      make_mesh_slices(state.abi2_mesh[1], state.abi2_mesh[2], state.abi2_mesh[3]);
    } else if (tensor) {
      tp_group_ = world;
    } else {
      dp_group_ = cp_group_ = world;
    }
    // The session's plugin first, then the context-parallel and the data-parallel ones composed with it.
    const auto open = [&](const Abi2Plugin& p, sdk::Group group, weft_host* settings) {
      owners_.push_back(std::make_unique<Owner>(host, p, group.get(), settings));
      Owner& o = *owners_.back();
      check(o, p.table.create(&o.services, &o.instance), settings != nullptr ? "create" : nullptr);  // the session names it
      return &o;
    };
    Owner* main = open(plugin, tensor ? tp_group_ : context ? cp_group_ : dp_group_, nullptr);
    (tensor ? tp_ : context ? cp_ : dp_) = main;
    if (state.abi2_context_parallel != nullptr) {
      cp_ = open(*state.abi2_context_parallel, cp_group_, state.abi2_context_parallel_settings);
    }
    // Composed with a context-parallel plugin, the data-parallel plugin's placements span dp x cp (the
    // ranks that split the same rows' sequences hold replicas of the parameters, as torchtitan's
    // dp_shard_cp); without one, the context-parallel plugin's placements run there.
    if (state.abi2_data_parallel != nullptr) {
      dp_ = open(*state.abi2_data_parallel, dp_group_, state.abi2_data_parallel_settings);
    } else if (cp_ != nullptr) {
      dp_ = cp_;
    }
    if (tp_ != nullptr) slices_ = std::make_unique<TensorSlices>(host, *tp_, tp_group_);
    for (const auto& o : owners_) {
      read_layout(*o, o.get() == tp_ ? WEFT_MESH_TP : o.get() == cp_ ? WEFT_MESH_CP : o.get() == dp_ ? WEFT_MESH_DP : -1);
    }
    if (composed) {
      const std::string with = tp_ != nullptr ? "tensor-parallel " + tp_->name() : "context-parallel " + cp_->name();
      const auto refuse = [&](const Owner& o, const std::string& what) {
        throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                         fmt::format("{} composed with {}: {}, which this host (ABI 2.{}) does not execute in a "
                                     "composition yet",
                                     o.name(), &o == cp_ && tp_ != nullptr ? "tensor-parallel " + tp_->name() : with, what,
                                     WEFT_PLUGIN_ABI_MINOR));
      };
      if (dp_ != cp_) {
        if (dp_->layout.batch_split != WEFT_SPLIT_ROWS) refuse(*dp_, "its weft_layout does not split the rows");
        if (dp_->layout.shard_group_size > 0 && dp_->layout.shard_group_size < dp_group_.size()) {
          refuse(*dp_, "its weft_layout shards over groups of the dimension (shard_group_size)");
        }
        if (dp_->proc("weft_hooks") != nullptr) refuse(*dp_, "it provides weft_hooks");
      }
      if (cp_ != nullptr && dp_ != cp_ && cp_->proc("weft_place") != nullptr) refuse(*cp_, "it provides weft_place");
    }
    if (cp_ != nullptr) sequences_ = std::make_unique<SequenceSplit>(*cp_, cp_group_, hooks_);
    make_shard_groups();
  }

  // The layout of `o`, which owns `dimension` here, checked against what this step runs.
  void read_layout(Owner& o, int32_t dimension) {
    weft_layout& l = o.layout;
    l.struct_size = sizeof l;
    l.dimension = dimension;
    l.batch_split = WEFT_SPLIT_NONE;
    l.reduce_bucket_bytes = kAbi2DefaultBucketBytes;
    l.shard_group_size = 0;
    if (auto fn = reinterpret_cast<weft_layout_fn>(o.proc("weft_layout"))) check(o, fn(o.instance, &l), "weft_layout");
    const bool sequence = l.batch_split == WEFT_SPLIT_SEQUENCE || l.batch_split == WEFT_SPLIT_SEQUENCE_BALANCED;
    if (l.batch_split != WEFT_SPLIT_NONE && l.batch_split != WEFT_SPLIT_ROWS && !sequence) {
      throw sdk::Error(WEFT_STATUS_UNSUPPORTED, fmt::format("{}: weft_layout's batch split {} is not one this host executes "
                                                       "(WEFT_SPLIT_NONE, WEFT_SPLIT_ROWS, WEFT_SPLIT_SEQUENCE, "
                                                       "WEFT_SPLIT_SEQUENCE_BALANCED)",
                                                       o.name(), l.batch_split));
    }
    if (sequence != (dimension == WEFT_MESH_CP)) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                       sequence ? fmt::format("{}: its weft_layout splits sequences, which a plugin that owns the "
                                              "context-parallel dimension does (its mesh_dimensions lack WEFT_MESH_CP)",
                                              o.name())
                                : fmt::format("{} owns the context-parallel dimension, but its weft_layout does not split "
                                              "sequences (WEFT_SPLIT_SEQUENCE or WEFT_SPLIT_SEQUENCE_BALANCED)",
                                              o.name()));
    }
    if (dimension == WEFT_MESH_TP && l.batch_split != WEFT_SPLIT_NONE) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG, fmt::format("{} owns the tensor-parallel dimension, whose ranks take the same "
                                                           "rows, but its weft_layout splits the batch",
                                                           o.name()));
    }
    if (dimension != WEFT_MESH_TP && l.sequence_parallel != 0) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG, fmt::format("{}: weft_layout.sequence_parallel is for a plugin that owns the "
                                                           "tensor-parallel dimension",
                                                           o.name()));
    }
    check_shard_options(o.name(), l);
    if (o.proc("weft_schedule") != nullptr) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                       fmt::format("{} provides weft_schedule but does not own the pipeline dimension (its mesh_dimensions "
                                   "lack WEFT_MESH_PP)", o.name()));
    }
  }

  // The mesh dp x cp x tp's slices of this rank (rank = (dp coordinate x cp + cp coordinate) x tp + tp
  // coordinate): the tp slice, the cp slice, and dp x cp flattened (where gradients are averaged and
  // FLAT_SHARD placements shard). Collective: every rank makes every group, in the same order.
  void make_mesh_slices(int32_t dp, int32_t cp, int32_t tp) {
    const sdk::Host h = host();
    const int32_t rank = h.world().rank();
    dp = std::max(dp, 1);
    cp = std::max(cp, 1);
    tp = std::max(tp, 1);
    if (dp * cp * tp != h.world().size()) {
      throw sdk::Error(WEFT_STATUS_INTERNAL,
                       fmt::format("a mesh dp {} x cp {} x tp {} over {} ranks", dp, cp, tp, h.world().size()));
    }
    const int32_t x = rank / tp, t = rank % tp;  // x = dp coordinate x cp + cp coordinate
    for (int32_t y = 0; y < dp * cp; ++y) {
      std::vector<int32_t> members;
      for (int32_t u = 0; u < tp; ++u) members.push_back(y * tp + u);
      sdk::Group made = h.create_group(members);
      if (x == y) tp_group_ = made;
    }
    for (int32_t u = 0; u < tp; ++u) {
      std::vector<int32_t> members;
      for (int32_t y = 0; y < dp * cp; ++y) members.push_back(y * tp + u);
      sdk::Group made = h.create_group(members);
      if (t == u) dp_group_ = made;
    }
    if (cp == 1) return;
    for (int32_t d = 0; d < dp; ++d) {
      for (int32_t u = 0; u < tp; ++u) {
        std::vector<int32_t> members;
        for (int32_t c = 0; c < cp; ++c) members.push_back((d * cp + c) * tp + u);
        sdk::Group made = h.create_group(members);
        if (x / cp == d && t == u) cp_group_ = made;
      }
    }
  }
  int32_t context_ranks() const { return cp_ != nullptr ? cp_group_.size() : 1; }

  // FLAT_SHARD placements shard over groups of weft_layout.shard_group_size consecutive ranks of the
  // dimension (0 or its size: the whole dimension), replicated across the groups. Collective.
  void make_shard_groups() {
    if (dp_ == nullptr) return;
    const sdk::Group world = dp_group_;
    const int32_t n = replicas();
    int32_t k = dp_->layout.shard_group_size;
    if (k <= 0 || k >= n) k = n;
    if (n % k != 0) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                       fmt::format("{}: weft_layout's shard group of {} ranks does not divide the dimension's {}",
                                   dp_->name(), dp_->layout.shard_group_size, n));
    }
    shard_group_ = world;
    host().handle()->state->flat_shard_group = shard_group_.get()->group;
    if (k == n) return;
    const int32_t rank = world.rank();
    for (int32_t g = 0; g < n / k; ++g) {  // every rank makes every group, in the same order
      std::vector<int32_t> members;
      for (int32_t j = 0; j < k; ++j) members.push_back(g * k + j);
      sdk::Group made = host().create_group(members);
      if (rank / k == g) shard_group_ = made;
    }
    for (int32_t j = 0; j < k; ++j) {
      std::vector<int32_t> members;
      for (int32_t g = 0; g < n / k; ++g) members.push_back(g * k + j);
      sdk::Group made = host().create_group(members);
      if (rank % k == j) replica_group_ = made;
    }
    // The checkpoint's gather of the optimizer state goes over the group the ranges cover.
    host().handle()->state->flat_shard_group = shard_group_.get()->group;
  }
  int32_t shard_ranks() const { return shard_group_.get() != nullptr ? shard_group_.size() : 1; }
  int32_t shard_rank() const { return shard_group_.get() != nullptr ? shard_group_.rank() : 0; }

  ~HostStep() override {
    reducer_.reset();
    slices_.reset();
    gatherer_.reset();
    state_gatherer_.reset();
  }

  void plan(weft_model_plan& plan) override {
    if (replicas() > 1 && dp_->layout.batch_split == WEFT_SPLIT_ROWS) {  // dp x cp flattened: rank = d x cp + c
      plan.data_parallel_size = dp_group_.size() / context_ranks();
      plan.data_parallel_rank = dp_group_.rank() / context_ranks();
    }
    if (sequences_) sequences_->plan(plan);  // each rank its share of every sequence of its rows
    if (tp_ != nullptr && tp_->layout.sequence_parallel != 0 && tp_group_.size() > 1) {  // Megatron's, inside the tp group
      plan.sequence_parallel_size = tp_group_.size();
      plan.sequence_parallel_rank = tp_group_.rank();
    }
  }

  // The host's plan is the replicated one. FLAT_SHARD placements (asked of weft_place before the model
  // is built) keep 1 / N of their share: the optimizer state's; the gradients' beside the whole ones
  // (which accumulate over the micro-batches and live until their bucket starts); the parameters'
  // beside the stages gathered at once (the current and the prefetched one, and stage 0 through the
  // step with a tied embedding). The reducer's all-reduce buckets are the gradients' own memory.
  void memory_plan(weft_memory_plan& plan) override {
    // Context parallelism: each rank keeps its share of every sequence's activations (all-to-alls: the core's
    // share of the heads over the whole sequence is as large; the plugin's core: the host's estimate
    // counts a blockwise core's output and log-sum-exp, not the probabilities). The plugins' own buffers
    // (key/value blocks a plugin's own core passes around) are theirs to say ("weft_memory").
    plan.activation_bytes /= context_ranks();
    const int32_t compute_bytes = host().model_info().compute_dtype.bits / 8;
    for (const auto& o : owners_) plan.buffer_bytes += abi2_plugin_memory(*o, plan, plan.seq_len / context_ranks(), compute_bytes);
    if (replicas() <= 1) return;
    const sdk::Host h = host();
    const int64_t stages = h.model_num_stages() > 0 ? h.model_num_stages() : h.model_info().num_layers + 2;
    const Abi2ShardShares shares = abi2_shard_shares(h, dp_->name(), reinterpret_cast<weft_place_fn>(dp_->proc("weft_place")),
                                                     dp_->instance, {{0, stages}});
    const double n = shard_ranks();
    const auto part = [n](int64_t bytes, double share) {
      return static_cast<int64_t>(static_cast<double>(bytes) * (1.0 - share) + static_cast<double>(bytes) * share / n);
    };
    const int64_t gradients = plan.gradient_bytes;
    plan.optimizer_bytes = part(plan.optimizer_bytes, shares.optimizer_state);
    const double sharded_gradient = std::max(shares.gradient, shares.optimizer_state);  // stage 1 keeps a range too
    plan.gradient_bytes = gradients + static_cast<int64_t>(static_cast<double>(gradients) * sharded_gradient / n);
    if (shares.parameter > 0.0) {
      // Whole stages in the compute dtype where the layout asks (their gradients too, and the forward
      // then makes no weight copies); all of them from the forward to the backward where it keeps them.
      const bool compute = dp_->layout.shard_compute_dtype != 0;
      int64_t largest = 0, first = 0, all = 0, whole_gradients = 0, copies = 0;
      for (int64_t s = 0; s < stages; ++s) {
        const weft_stage_memory m = h.stage_memory(s);
        const int64_t bytes = compute ? m.compute_parameter_bytes : m.parameter_bytes;
        if (s == 0) first = bytes;
        largest = std::max(largest, bytes);
        all += bytes;
        whole_gradients += compute ? m.compute_trainable_bytes : m.trainable_bytes;
        if (compute) copies += m.weight_copy_bytes;
      }
      const bool tied = h.model_info().tie_word_embeddings != 0;
      const int64_t whole =
          dp_->layout.shard_keep_after_forward != 0 ? all : std::min<int64_t>(all, 2 * largest + (tied ? first : 0));
      plan.parameter_bytes = part(plan.parameter_bytes, shares.parameter) +
                             static_cast<int64_t>(static_cast<double>(whole) * shares.parameter);
      if (compute) {
        plan.gradient_bytes += static_cast<int64_t>(static_cast<double>(whole_gradients - gradients) * shares.parameter);
        plan.activation_bytes = std::max<int64_t>(0, plan.activation_bytes - copies);
      }
    }
    // An all-reduce bucket holds its gradients themselves (each REPLICATE gradient a view of it, the
    // reducer's keep_gradients_in_buckets): nothing beside them. A reduce-scatter bucket takes the
    // place of the whole gradients it frees, beside its row.
    plan.buffer_bytes += static_cast<int64_t>(static_cast<double>(gradients) * shares.gradient / n);
  }

  // The optimizer state's placement FLAT_SHARD: the host's optimizer keeps and updates this rank's
  // flat range of the parameter (ranges of ceil(n / N) elements in rank order, the last shorter or
  // empty), and after its step each parameter is gathered whole again. Asked once
  // per parameter after setup.
  weft_flat_shard flat_shard(int64_t index) override { return range_of(index); }
  weft_flat_shard range_of(int64_t index) const {
    const int64_t elements = element_count(host().parameter_data(index));
    const bool parameter = is_parameter_shard(index);
    if (!parameter && !std::binary_search(state_shards_.begin(), state_shards_.end(), index)) {
      return weft_flat_shard{0, elements, 0u, 0u};
    }
    weft_flat_shard range = flat_range(elements, shard_ranks(), shard_rank(), parameter);
    if (parameter && dp_->layout.shard_compute_dtype != 0) range.flags |= WEFT_FLAT_SHARD_COMPUTE_DTYPE;
    return range;
  }
  bool is_parameter_shard(int64_t index) const {
    return std::binary_search(parameter_shards_.begin(), parameter_shards_.end(), index);
  }

  // The optimizer state FLAT_SHARD: the host's optimizer reads this rank's range of each averaged
  // gradient from the parameter's gradient shard.
  void shard_gradients() const { copy_gradient_ranges(host(), state_shards_, grad_shards_, shard_ranks(), shard_rank()); }


  // The optimizer state FLAT_SHARD: each rank's updated range into every rank's whole parameter
  // (not for a parameter FLAT_SHARD, whose range is its master copy), model stage by stage in
  // [N, width] groups.
  void gather_state_shards() const {
    if (state_gatherer_) state_gatherer_->refresh_all();
  }

  double global_grad_norm_sq(double local_sq) override {
    // Sharded, the host's norm covers this rank's ranges of the (averaged, equal) gradients: the
    // ranks' ranges cover each element once. Whole, every rank already has the whole norm.
    // Sharded over groups of the dimension: each group's ranges cover every element once, and the groups hold
    // the same averaged gradients.
    if (slices_) {  // each slice and range once: summed over the world, the replicas' whole gradients over dp
      const auto [ranges, whole] = slices_->norm_shares(state_shards_);
      std::vector<double> share{ranges, whole};
      if (host().world().size() > 1) all_reduce(share, host().world());
      return share[0] + share[1] / replicas();
    }
    if (!shards_state_ || replicas() <= 1) return local_sq;
    std::vector<double> sum{local_sq};
    all_reduce(sum, shard_group_);
    return sum[0];
  }

  void setup() override {
    const sdk::Host h = host();
    const int64_t count = h.parameter_count();
    h.handle()->state->local_parameters.clear();
    std::vector<GradientReducer::Reduced> reduced;
    std::vector<int64_t> replicated;  // every parameter, when there are replicas: they start equal
    for (int64_t i = 0; i < count; ++i) {
      const weft_parameter_info info = h.parameter_info(i);
      DLTensor data = h.parameter_data(i);
      if (slices_) slices_->place(i, info);
      if (dp_ == nullptr) continue;
      const weft_parameter_layout where = abi2_placement(*dp_, info);
      check_abi2_placement(dp_->name(), info, where);
      if (owners_.size() > 1 && where.parameter.kind == WEFT_PLACE_LOCAL) {
        throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                         fmt::format("{} composed with {}: it places {} LOCAL, which this host (ABI 2.{}) does not "
                                     "execute in a composition yet",
                                     dp_->name(), tp_ != nullptr ? "tensor-parallel " + tp_->name() : "context-parallel " + cp_->name(),
                                     info.name, WEFT_PLUGIN_ABI_MINOR));
      }
      if (where.optimizer_state.kind == WEFT_PLACE_FLAT_SHARD && info.trainable && replicas() > 1) {
        state_shards_.push_back(i);  // this rank's optimizer keeps its range of the parameter's state
      }
      const bool local = where.gradient.kind == WEFT_PLACE_LOCAL;
      if (where.parameter.kind == WEFT_PLACE_LOCAL && replicas() > 1) {
        h.handle()->state->local_parameters.emplace_back(info.name);  // checkpoints keep each rank's
      }
      if (where.parameter.kind == WEFT_PLACE_FLAT_SHARD && replicas() > 1) {
        if (data.dtype.code != kDLFloat || data.dtype.bits != 32) {
          throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                           fmt::format("{} places parameter {} FLAT_SHARD, but it is not fp32 (this host shards fp32 "
                                       "parameters; model.frozen_dtype = \"fp32\" keeps a frozen base so)",
                                       dp_->name(), info.name));
        }
        parameter_shards_.push_back(i);  // whole only around its stage's uses
        parameter_stages_.emplace_back(i, info.stage);
      }
      if (replicas() > 1) {
        replicated.push_back(i);
        if (info.trainable && !local) {
          if (data.dtype.code != kDLFloat || data.dtype.bits != 32) {
            throw sdk::Error(WEFT_STATUS_UNSUPPORTED, fmt::format("{}: parameter {} is not fp32", dp_->name(), info.name));
          }
          const bool scatter = where.gradient.kind == WEFT_PLACE_FLAT_SHARD;
          reduced.push_back({i, scatter});
          if (scatter) grad_shards_.push_back(i);  // reduce-scattered into this rank's range
        }
      }
    }
    make_replicas_equal(h, dp_group_, replicated);
    shards_state_ = !state_shards_.empty();
    std::vector<std::pair<int64_t, int64_t>> state_stages;  // optimizer state FLAT_SHARD, parameter whole
    for (int64_t index : state_shards_) {
      if (!is_parameter_shard(index)) state_stages.emplace_back(index, h.parameter_info(index).stage);
    }
    if (!state_stages.empty()) {
      state_gatherer_ = std::make_unique<ParameterGatherer>(h, shard_group_, h.model_num_stages(), state_stages,
                                                            std::max<int64_t>(1, dp_->layout.reduce_bucket_bytes));
    }
    if (!parameter_shards_.empty()) {
      gatherer_ = std::make_unique<ParameterGatherer>(h, shard_group_, h.model_num_stages(), parameter_stages_,
                                                      std::max<int64_t>(1, dp_->layout.reduce_bucket_bytes));
      tied_ = h.model_info().tie_word_embeddings != 0;
      first_trainable_stage_ = h.model_num_stages();
      stage_trainable_.assign(static_cast<size_t>(h.model_num_stages()), {});
      for (int64_t i = 0; i < count; ++i) {
        const weft_parameter_info info = h.parameter_info(i);
        if (!info.trainable) continue;
        first_trainable_stage_ = std::min(first_trainable_stage_, info.stage);
        stage_trainable_.at(static_cast<size_t>(info.stage)).push_back(i);
      }
    }
    for (const auto& owner : owners_) {
      Owner* o = owner.get();
      if (o == cp_) continue;  // registered at creation
      std::vector<std::string> published = {"train.begin", "step.end"};  // the step's, and the model's to tp
      if (o == tp_) published.insert(published.end(), comm_point_names().begin(), comm_point_names().end());
      abi2_register_hooks(*o, published, hooks_);
    }
    if (!reduced.empty()) {
      std::vector<int64_t> stage_of;  // staged: each stage's buckets start after that stage's backward
      if (gatherer_) {
        for (int64_t i = 0; i < count; ++i) stage_of.push_back(h.parameter_info(i).stage);
      }
      reducer_ = std::make_unique<GradientReducer>(h, dp_group_, shard_group_, replica_group_, reduced,
                                                   std::max<int64_t>(1, dp_->layout.reduce_bucket_bytes), stage_of);
      reducer_->set_explicit(gatherer_ != nullptr);
      reducer_->keep_gradients_in_buckets();
    }
    GradientReducer* whole_partial = slices_ ? slices_->make_reducers(tp_->layout.reduce_bucket_bytes) : nullptr;
    // Which reducer starts its buckets during the last backward (it holds the host's gradient-ready
    // callback): data parallelism's; alone, tensor parallelism's over the whole dimension. PARTIAL
    // sums and data parallelism's reduction apply to the same gradients one after the other: the
    // sums first where the reduction reduce-scatters (it frees the whole gradients), else after it.
    tp_first_ = reducer_ != nullptr && slices_ && slices_->sums() && !grad_shards_.empty();
    armed_ = reducer_ != nullptr ? (tp_first_ ? nullptr : reducer_.get()) : whole_partial;
    if (armed_ != nullptr) armed_->claim_ready_callback();
  }

  double train_step(const weft_step_info& step) override {
    if (!began_) {
      began_ = true;
      run_hooks("train.begin", step.step);
    }
    step_ = step.step;
    const sdk::Host h = host();
    const int64_t stages = h.model_num_stages();
    const int M = step.micro_batches;
    // Parameters FLAT_SHARD: each model stage is a chunk, whole only between its GATHER and RELEASE.
    const int chunks = gatherer_ ? static_cast<int>(stages) : 1;
    const int first_trained = gatherer_ ? static_cast<int>(first_trainable_stage_) : 0;
    if (program_micro_batches_ != M) {
      const ProgramShape shape{M, chunks, first_trained, gatherer_ != nullptr};
      StepProgram program = gatherer_ ? sharded_program(shape, tied_, dp_->layout.shard_keep_after_forward != 0)
                                      : one_chunk_program(M);
      if (reducer_ || (slices_ && slices_->sums())) program = lower_reductions(program, {first_trained});
      verify_program(program, shape);
      program_ = std::move(program);
      program_micro_batches_ = M;
      WEFT_LOG_DEBUG(host(), "%s: step program %s", name().c_str(), describe(program_).c_str());
    }
    // Chunk c runs model stages [c, c + 1) (sharded) or all of them.
    const auto first_stage = [&](int c) { return gatherer_ ? static_cast<int64_t>(c) : 0; };
    const auto end_stage = [&](int c) { return gatherer_ ? static_cast<int64_t>(c) + 1 : stages; };
    const double scale = 1.0 / M;
    struct Pass {  // a micro-batch from its first forward to its last backward
      sdk::Batch batch;
      std::vector<sdk::Activation> inputs, outputs;  // inputs[c]: chunk c's input as a leaf (c > 0)
      sdk::Loss loss;
    };
    std::map<int, Pass> passes;
    double loss_sum = 0.0;
    try {
      if (gatherer_) {
        if (!resting_) gatherer_->release_all();  // whole since the last materialisation (a save, setup)
        resting_ = true;
      }
      for (const StepAction& a : program_) {
        switch (a.kind) {
          case StepKind::kForward: {
            Pass& pass = passes[a.micro_batch];
            const auto c = static_cast<size_t>(a.chunk);
            if (a.chunk == 0) {
              pass.batch = h.batch(a.micro_batch);
              pass.inputs.resize(static_cast<size_t>(chunks));
              pass.outputs.resize(static_cast<size_t>(chunks));
              pass.outputs[0] = h.forward(first_stage(0), end_stage(0), pass.batch.inputs);
            } else {
              pass.inputs[c] = h.activation_from_tensor(h.activation_view(pass.outputs[c - 1]), true);
              h.share_layout(pass.inputs[c], pass.batch.inputs);
              pass.outputs[c] = h.forward(first_stage(a.chunk), end_stage(a.chunk), pass.inputs[c]);
            }
            if (a.chunk + 1 == chunks) {
              pass.loss = h.loss(pass.outputs[c], pass.batch.targets, scale);
              loss_sum += pass.loss.value;
            }
            break;
          }
          case StepKind::kBackward: {
            // The last micro-batch's backwards make the gradients final: buckets start as they fill.
            const bool final = a.micro_batch + 1 == M;
            if (final && a.chunk + 1 == chunks && armed_) armed_->arm();
            auto it = passes.find(a.micro_batch);
            Pass& pass = it->second;
            const auto c = static_cast<size_t>(a.chunk);
            if (a.chunk + 1 == chunks) {
              h.backward(pass.loss.loss);
              pass.loss.loss.reset();
            } else {
              sdk::Activation grad = h.activation_grad(pass.inputs[c + 1]);
              h.backward(pass.outputs[c], grad);
              pass.inputs[c + 1].reset();
            }
            pass.outputs[c].reset();  // its graph is spent
            if (gatherer_ && reducer_) {  // explicit readiness: the chunk's gradients are final for this micro-batch
              for (int64_t index : stage_trainable_[c]) reducer_->ready(index);
            }
            if (a.chunk == first_trained) {
              passes.erase(it);
              if (final && armed_) armed_->disarm();
            }
            break;
          }
          case StepKind::kReduce:
            start_reductions();
            break;
          case StepKind::kOptimizerStep:
            finish_reductions();  // the host's optimizer runs when train_step returns
            shard_gradients();
            break;
          case StepKind::kGather:
            gatherer_->gather(a.chunk);
            break;
          case StepKind::kPrefetch:
            gatherer_->prefetch(a.chunk);
            break;
          case StepKind::kRelease:
            gatherer_->release(a.chunk);
            break;
        }
      }
    } catch (...) {
      if (armed_) armed_->disarm();
      if (reducer_) reducer_->abandon();
      if (slices_) slices_->abandon();
      throw;
    }
    if (const GradientReducer* shown = reducer_ ? reducer_.get() : armed_) {  // metrics.jsonl: plugin.reduce_buckets,
      h.report_metric("reduce_buckets", static_cast<double>(shown->buckets()));  // plugin.reduce_buckets_in_backward
      h.report_metric("reduce_buckets_in_backward", static_cast<double>(shown->started_in_backward()));
    }
    if (replicas() <= 1) return loss_sum / step.micro_batches;
    std::vector<double> sum{loss_sum};
    all_reduce(sum);
    return sum[0] / (static_cast<double>(step.micro_batches) * replicas());
  }

  // REDUCE: data parallelism's reduction and the PARTIAL sums, in the order setup chose.
  void start_reductions() {
    const bool sums = slices_ && slices_->sums();
    if (tp_first_) {
      slices_->start(armed_);
      slices_->finish();
      reducer_->start_all();
      return;
    }
    if (reducer_) {
      if (reducer_.get() == armed_) {
        reducer_->start_rest();
      } else {
        reducer_->start_all();
      }
      if (sums) return;  // the sums start after its finish
    }
    if (sums) slices_->start(armed_);
  }
  // OPTIMIZER_STEP: every reduction complete.
  void finish_reductions() {
    if (reducer_) reducer_->finish();
    if (tp_first_ || !slices_ || !slices_->sums()) return;
    if (reducer_) slices_->start(nullptr);
    slices_->finish();
  }

  sdk::EvalResult eval_step(const weft_step_info& step) override {
    const sdk::Host h = host();
    const int64_t stages = h.model_num_stages();
    std::vector<double> sums{0.0, 0.0};  // loss sum, tokens
    for (int32_t m = 0; m < std::max(1, step.micro_batches); ++m) {
      sdk::Batch batch = h.batch(m);
      const DLTensor inputs = h.activation_view(batch.inputs);
      if (inputs.ndim > 0 && inputs.shape[0] == 0) {  // no rows for this rank
        if (gatherer_) staged_eval_gathers();          // its shards still take part in the others' gathers
        continue;
      }
      sdk::Activation logits = gatherer_ ? staged_eval_forward(batch)
                                         : h.forward(0, stages, batch.inputs, WEFT_FORWARD_NO_GRAD);
      sdk::Loss loss = h.loss(logits, batch.targets, 1.0);
      sums[0] += loss.value * static_cast<double>(loss.tokens);
      sums[1] += static_cast<double>(loss.tokens);
    }
    if (replicas() > 1) all_reduce(sums);
    sdk::EvalResult result;
    result.loss_sum = sums[0];
    result.tokens = static_cast<int64_t>(sums[1] + 0.5);
    return result;
  }

  // Evaluation with parameters FLAT_SHARD: each model stage gathered for its forward and, if the
  // parameters were at rest, released after it (with tied embeddings, stage 0 through the pass).
  sdk::Activation staged_eval_forward(const sdk::Batch& batch) {
    const sdk::Host h = host();
    const int64_t S = gatherer_->stages();
    const bool was_resting = resting_;
    if (tied_) gatherer_->gather(0);
    sdk::Activation out;
    for (int64_t s = 0; s < S; ++s) {
      gatherer_->gather(s);
      if (was_resting) gatherer_->prefetch(s + 1);
      out = s == 0 ? h.forward(0, 1, batch.inputs, WEFT_FORWARD_NO_GRAD)
                   : h.forward(s, s + 1, out, WEFT_FORWARD_NO_GRAD);
      if (was_resting && !(tied_ && s == 0)) gatherer_->release(s);
    }
    if (was_resting && tied_) gatherer_->release(0);
    return out;
  }

  // staged_eval_forward's collectives without its compute: a rank with no rows of a held-out batch
  // (the last batch of an uneven split) gathers and releases as the ranks with rows do.
  void staged_eval_gathers() {
    const int64_t S = gatherer_->stages();
    const bool was_resting = resting_;
    if (tied_) gatherer_->gather(0);
    for (int64_t s = 0; s < S; ++s) {
      gatherer_->gather(s);
      if (was_resting) gatherer_->prefetch(s + 1);
      if (was_resting && !(tied_ && s == 0)) gatherer_->release(s);
    }
    if (was_resting && tied_) gatherer_->release(0);
  }

  // Every parameter whole (a checkpoint, an evaluation, generation) or back to its ranges.
  void materialize_parameters(bool whole) override {
    if (!gatherer_) return;
    if (whole) {
      gatherer_->gather_all();
      resting_ = false;
    } else {
      gatherer_->release_all();
      resting_ = true;
    }
  }

  void after_optimizer_step() override {
    gather_state_shards();
    run_hooks("step.end", step_ + 1);
  }

  // Context parallelism's points: the all-to-alls around the attention core, or the core in the plugin.
  void context_exchange(int64_t layer, weft_direction direction, const DLTensor& send, DLTensor& recv) override {
    sequences_->exchange(step_, layer, direction, send, recv);
  }
  void context_attention(const weft_attention_call& call) override { sequences_->attention(step_, call); }

 private:
  void run_hooks(const char* point, int64_t step) { abi2_run_step_hooks(hooks_, point, step); }

 protected:
  // At the model's point `point` (the tensor-parallel dimension's hooks): `tensor` combined in place,
  // or filled from `source` where the point moves tokens.
  void run_model_hooks(const std::string& point, bool backward, int64_t layer, DLTensor& tensor, const DLTensor* source) {
    abi2_run_model_hooks(hooks_, point, backward, layer, tensor, source, step_);
  }
  std::string name() const { return owners_.front()->name(); }
  // The ranks whose gradients are averaged and losses combined: the rows' or the sequences' split.
  int32_t replicas() const {
    return dp_ != nullptr && dp_->layout.batch_split != WEFT_SPLIT_NONE ? dp_group_.size() : 1;
  }
  // A status from `o` becomes an Error naming it and the function (`what`, unless null).
  void check(const Owner& o, weft_status* status, const char* what) const { abi2_check(o, status, what); }
  void all_reduce(std::vector<double>& values) const { all_reduce(values, dp_group_); }
  void all_reduce(std::vector<double>& values, sdk::Group group) const {
    int64_t shape_and_stride[2];
    DLTensor view = cpu_vector_view(values.data(), static_cast<int64_t>(values.size()), DLDataType{kDLFloat, 64, 1},
                                    shape_and_stride);
    host().all_reduce(group, view, WEFT_REDUCE_SUM).wait();
  }


  // The session's plugin, and the data-parallel one composed with a tensor-parallel one; which owns
  // which dimension, and this rank's slice of each (alone: the world).
  std::vector<std::unique_ptr<Owner>> owners_;  // the session's plugin first
  Owner* dp_ = nullptr;  // whose placements run over dp_group_ (composed without a data-parallel plugin: cp_)
  Owner* cp_ = nullptr;
  Owner* tp_ = nullptr;
  sdk::Group dp_group_, cp_group_, tp_group_;  // dp_group_: dp x cp flattened (without cp: the dp slice)
  std::unique_ptr<GradientReducer> reducer_;  // data parallelism's (REPLICATE, FLAT_SHARD gradients)
  std::vector<int64_t> state_shards_;  // parameters whose optimizer state this rank holds a range of, ascending
  std::vector<int64_t> grad_shards_;   // of those, the ones whose gradient is reduce-scattered, ascending
  std::vector<int64_t> parameter_shards_;  // parameters placed FLAT_SHARD, ascending
  std::vector<std::pair<int64_t, int64_t>> parameter_stages_;  // (parameter, its model stage) of those
  std::unique_ptr<ParameterGatherer> gatherer_;  // when there are any
  std::unique_ptr<ParameterGatherer> state_gatherer_;  // the whole parameters of FLAT_SHARD optimizer states
  sdk::Group shard_group_;    // what FLAT_SHARD placements shard over: the dimension, or a group of it
  sdk::Group replica_group_;  // with groups: this rank's peers at the same position of the other groups
  bool tied_ = false;     // the head is the embedding: stage 0 stays whole through a step
  bool resting_ = false;  // every FLAT_SHARD parameter released
  int64_t first_trainable_stage_ = 0;
  std::vector<std::vector<int64_t>> stage_trainable_;  // each model stage's trainable parameters
  bool shards_state_ = false;
  StepProgram program_;
  int32_t program_micro_batches_ = 0;
  std::vector<Abi2Hook> hooks_;  // in registration order
  std::unique_ptr<TensorSlices> slices_;  // the tensor-parallel dimension's slices and PARTIAL sums
  GradientReducer* armed_ = nullptr;  // the reducer whose buckets start during the last backward
  bool tp_first_ = false;  // the PARTIAL sums before data parallelism's reduce-scatter (else after its reduction)
  bool began_ = false;
  std::unique_ptr<SequenceSplit> sequences_;  // the context-parallel dimension's split and attention hooks
  int64_t step_ = 0;  // the current step (weft_step_info.step)
};

// A plugin that owns the tensor-parallel dimension: the host's step, and what the model asks of it
// before it is built (each weight's slice, from weft_place) and at its points (the plugin's hooks).
// It runs the model's points; the step of a plugin without slices does not, so the model skips them.
class TensorStep : public HostStep {
 public:
  using HostStep::HostStep;

  bool runs_model_points() const override { return true; }

  weft_shard shard_parameter(const weft_parameter_info& info) override {
    const ParameterShard slice = slices_->shard(info);
    return weft_shard{slice.dim, slice.parts, slice.index};
  }

  void setup() override {
    HostStep::setup();
    abi2_check_sequence_hooks(*tp_, hooks_, tp_group_.size());
  }

  void comm_point(weft_comm_point point, weft_direction direction, int64_t layer, DLTensor& tensor) override {
    run_model_hooks(comm_point_name(static_cast<CommPoint>(point)), direction == WEFT_BACKWARD, layer, tensor, nullptr);
  }
  void sequence_region(weft_comm_point point, weft_direction direction, int64_t layer, const DLTensor& input,
                       DLTensor& output) override {
    run_model_hooks(comm_point_name(static_cast<CommPoint>(point)), direction == WEFT_BACKWARD, layer, output, &input);
  }
};

}  // namespace

weft_proc abi2_host_proc_address(const char* name) { return host_proc_address(name); }

void check_shard_options(const std::string& plugin, const weft_layout& layout) {
  for (const auto& [field, value] : {std::pair<const char*, int32_t>{"shard_compute_dtype", layout.shard_compute_dtype},
                                     {"shard_keep_after_forward", layout.shard_keep_after_forward}}) {
    if (value != 0 && value != 1) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG, fmt::format("{}: weft_layout's {} = {} (0 or 1)", plugin, field, value));
    }
  }
}

Abi2ShardShares abi2_shard_shares(const sdk::Host& host, const std::string& plugin, weft_place_fn place,
                                  weft_plugin_instance* instance, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  Abi2ShardShares shares;
  const PluginHost::State& state = *host.handle()->state;
  if (place == nullptr || state.model_config == nullptr) return shares;
  double total = 0.0;
  for (const auto& [first, last] : ranges) {
    for (auto& [name, shape] : parameter_specs(*state.model_config, first, last)) {
      weft_parameter_desc desc{};
      desc.struct_size = sizeof desc;
      desc.name = name.c_str();
      desc.ndim = static_cast<int32_t>(shape.size());
      desc.shape = shape.data();
      desc.trainable = 1;
      weft_parameter_layout where{};
      if (weft_status* status = place(instance, &desc, &where)) {
        const weft_status_code code = status_code(status);
        const std::string message = status_message(status);
        status_release(status);
        throw sdk::Error(code, fmt::format("{} (weft_place, for the memory plan): {}", plugin, message));
      }
      double n = 1.0;
      for (int64_t d : shape) n *= static_cast<double>(d);
      total += n;
      if (where.parameter.kind == WEFT_PLACE_FLAT_SHARD) shares.parameter += n;
      if (where.gradient.kind == WEFT_PLACE_FLAT_SHARD) shares.gradient += n;
      if (where.optimizer_state.kind == WEFT_PLACE_FLAT_SHARD) shares.optimizer_state += n;
    }
  }
  if (total > 0.0) {
    shares.parameter /= total;
    shares.gradient /= total;
    shares.optimizer_state /= total;
  }
  return shares;
}

const char* abi2_placement_name(int32_t kind) {
  switch (kind) {
    case WEFT_PLACE_REPLICATE: return "REPLICATE";
    case WEFT_PLACE_LOCAL: return "LOCAL";
    case WEFT_PLACE_SLICE: return "SLICE";
    case WEFT_PLACE_FLAT_SHARD: return "FLAT_SHARD";
    default: return "an unknown placement";
  }
}

void check_abi2_placement(const std::string& plugin, const weft_parameter_info& info, const weft_parameter_layout& where) {
  const auto refuse = [&](const char* what, int32_t kind, const char* executes) {
    throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                     fmt::format("{} places the {} of {} as {}, which this host (ABI 2.{}) does not execute{}", plugin,
                                 what, info.name, abi2_placement_name(kind), WEFT_PLUGIN_ABI_MINOR, executes));
  };
  const bool local = where.parameter.kind == WEFT_PLACE_LOCAL || where.gradient.kind == WEFT_PLACE_LOCAL ||
                     where.optimizer_state.kind == WEFT_PLACE_LOCAL;
  for (const auto& [what, p] : {std::pair<const char*, weft_placement>{"parameter", where.parameter},
                                {"gradient", where.gradient},
                                {"optimizer state", where.optimizer_state}}) {
    const bool state = std::string(what) == "optimizer state";
    if (local && p.kind != WEFT_PLACE_LOCAL) {
      refuse(what, p.kind, " beside LOCAL (a parameter, its gradient and its optimizer state are LOCAL together)");
    }
    const bool gradient = std::string(what) == "gradient";
    if (p.kind == WEFT_PLACE_REPLICATE || p.kind == WEFT_PLACE_LOCAL || (state && p.kind == WEFT_PLACE_FLAT_SHARD)) {
      continue;
    }
    if (std::string(what) == "parameter" && p.kind == WEFT_PLACE_FLAT_SHARD) {
      if (info.trainable && where.gradient.kind != WEFT_PLACE_FLAT_SHARD) {
        refuse("gradient", where.gradient.kind,
               " under a FLAT_SHARD parameter (its range is the optimizer's master copy: place the gradient and "
               "the optimizer state FLAT_SHARD too)");
      }
      continue;
    }
    if (gradient && p.kind == WEFT_PLACE_FLAT_SHARD) {
      if (where.optimizer_state.kind != WEFT_PLACE_FLAT_SHARD) {
        refuse("optimizer state", where.optimizer_state.kind,
               " under a FLAT_SHARD gradient (the optimizer updates the range the gradient's reduction gives: "
               "place the optimizer state FLAT_SHARD too)");
      }
      continue;
    }
    refuse(what, p.kind, " yet (REPLICATE, LOCAL, FLAT_SHARD)");
  }
}

Abi2Plugin validate_abi2_table(const weft_plugin& table, const std::string& path) {
  WEFT_CHECK(table.abi_major == WEFT_PLUGIN_ABI_MAJOR, "plugin {} is built for weft ABI {}.x, this host speaks {}.{}",
             path, table.abi_major, WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR);
  WEFT_CHECK(table.struct_size >= sizeof(weft_plugin), "plugin {}: its table's struct_size {} is smaller than ABI 2.0's ({})",
             path, table.struct_size, sizeof(weft_plugin));
  std::vector<std::string> missing;
  if (!table.create) missing.push_back("create");
  if (!table.destroy) missing.push_back("destroy");
  if (!table.get_proc_address) missing.push_back("get_proc_address");
  WEFT_CHECK(missing.empty(), "plugin {}: required function(s) are NULL: {}", path, fmt::join(missing, ", "));
  WEFT_CHECK(table.name && *table.name, "plugin {}: its table has no name", path);
  WEFT_CHECK(table.version && *table.version, "plugin {}: its table has no version", path);
  const uint32_t dp = 1u << WEFT_MESH_DP, pp = 1u << WEFT_MESH_PP, tp = 1u << WEFT_MESH_TP, cp = 1u << WEFT_MESH_CP;
  WEFT_CHECK(table.mesh_dimensions == 0 || table.mesh_dimensions == dp || table.mesh_dimensions == pp ||
                 table.mesh_dimensions == tp || table.mesh_dimensions == cp,
             "plugin {} offers mesh dimensions {:#x}; an ABI 2 plugin on this host (ABI 2.{}) owns one of the "
             "data-parallel dimension ({:#x}), the pipeline dimension ({:#x}), the tensor-parallel dimension ({:#x}) "
             "and the context-parallel dimension ({:#x})",
             path, table.mesh_dimensions, WEFT_PLUGIN_ABI_MINOR, dp, pp, tp, cp);
  Abi2Plugin plugin;
  plugin.path = path;
  plugin.table = table;
  return plugin;
}

std::unique_ptr<sdk::Strategy> create_abi2_step(const Abi2Plugin& plugin, sdk::Host host) {
  if (plugin.table.mesh_dimensions == (1u << WEFT_MESH_PP)) return create_abi2_pipeline_step(host, plugin);
  if (plugin.table.mesh_dimensions == (1u << WEFT_MESH_TP)) return std::make_unique<TensorStep>(host, plugin);
  return std::make_unique<HostStep>(host, plugin);
}

}  // namespace weft
