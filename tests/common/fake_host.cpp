#include "common/fake_host.h"

#include <utility>

#include <weft/strategy.hpp>

namespace {

weft_status* create_status(weft_status_code code, const char* message) {
  ++fake_status_counts().created;
  return new weft_status{code, message};
}
weft_status_code status_code(const weft_status* status) { return status->code; }
const char* status_message(const weft_status* status) { return status->message.c_str(); }
void release_status(weft_status* status) {
  if (status == nullptr) return;
  ++fake_status_counts().released;
  delete status;
}

void log(weft_host* host, weft_log_level level, const char* message) {
  host->logs.emplace_back(level, message);
}

template <class Map, class T>
weft_status* read_config(const Map& map, const char* key, T fallback, T* out) {
  if (std::string(key) == "wrong_type") {
    return create_status(WEFT_STATUS_BAD_CONFIG, "plugin.wrong_type: expected another type");
  }
  auto found = map.find(key);
  *out = found == map.end() ? fallback : static_cast<T>(found->second);
  return nullptr;
}
weft_status* config_int(weft_host* host, const char* key, int64_t fallback, int64_t* out) {
  return read_config(host->ints, key, fallback, out);
}
weft_status* config_float(weft_host* host, const char* key, double fallback, double* out) {
  return read_config(host->ints, key, fallback, out);
}
weft_status* config_bool(weft_host* host, const char* key, int32_t fallback, int32_t* out) {
  return read_config(host->bools, key, fallback, out);
}
weft_status* config_string(weft_host* host, const char* key, const char* fallback,
                           const char** out) {
  if (std::string(key) == "wrong_type") {
    return create_status(WEFT_STATUS_BAD_CONFIG, "plugin.wrong_type: expected another type");
  }
  auto found = host->strings.find(key);
  *out = found == host->strings.end() ? fallback : found->second.c_str();
  return nullptr;
}

weft_group* group_world(weft_host* host) { return &host->world; }
int32_t group_rank(const weft_group* group) { return group->rank; }
int32_t group_size(const weft_group* group) { return group->size; }

weft_work* new_work(weft_host* host) {
  auto* work = new weft_work{host->fail_wait};
  host->live_works.insert(work);
  return work;
}
// SUM over the group as if every other rank held peer_value everywhere (contiguous fp32/fp64).
weft_status* all_reduce(weft_host* host, weft_group* group, DLTensor* tensor, weft_reduce_op op,
                        weft_work** out) {
  ++host->all_reduces;
  if (op != WEFT_REDUCE_SUM) return create_status(WEFT_STATUS_UNSUPPORTED, "fake: SUM only");
  int64_t count = 1;
  for (int32_t d = 0; d < tensor->ndim; ++d) count *= tensor->shape[d];
  const double added = (group->size - 1) * host->peer_value;
  char* data = static_cast<char*>(tensor->data) + tensor->byte_offset;
  for (int64_t i = 0; i < count; ++i) {
    if (tensor->dtype.bits == 32) reinterpret_cast<float*>(data)[i] += static_cast<float>(added);
    if (tensor->dtype.bits == 64) reinterpret_cast<double*>(data)[i] += added;
  }
  *out = new_work(host);
  return nullptr;
}
weft_status* barrier(weft_host* host, weft_group*, weft_work** out) {
  *out = new_work(host);
  return nullptr;
}
weft_status* work_wait(weft_host*, weft_work* work) {
  return work->fail_wait ? create_status(WEFT_STATUS_TIMEOUT, "all_reduce timed out") : nullptr;
}
void work_release(weft_host* host, weft_work* work) {
  ++host->work_releases;
  if (host->live_works.erase(work) == 0) {
    ++host->double_releases;
    return;
  }
  delete work;
}

int64_t model_num_stages(weft_host*) { return 4; }
int64_t parameter_count(weft_host* host) { return static_cast<int64_t>(host->parameters.size()); }
weft_status* parameter_info(weft_host* host, int64_t index, weft_parameter_info* out) {
  const FakeParameter& parameter = host->parameters.at(index);
  weft_parameter_info info{};
  info.name = parameter.name.c_str();
  info.stage = 1;
  info.trainable = parameter.trainable ? 1 : 0;
  info.ndim = 1;
  info.shape = &parameter.size;
  info.dtype = {kDLFloat, 32, 1};
  *out = info;
  return nullptr;
}
weft_status* parameter_grad(weft_host* host, int64_t index, DLTensor* out) {
  FakeParameter& parameter = host->parameters.at(index);
  DLTensor view{};
  view.data = parameter.grad.data();
  view.device = {kDLCPU, 0};
  view.ndim = 1;
  view.dtype = {kDLFloat, 32, 1};
  view.shape = &parameter.size;
  view.strides = &parameter.stride;
  *out = view;
  return nullptr;
}

weft_activation* new_activation(weft_host* host, std::string what, double scale = 0.0) {
  auto* activation = new weft_activation{std::move(what), scale};
  host->live_activations.insert(activation);
  return activation;
}
weft_status* batch(weft_host* host, int32_t micro_batch, int32_t /*split*/, int32_t splits,
                   weft_activation** inputs, weft_activation** targets) {
  host->batches.emplace_back(micro_batch, splits);
  *inputs = new_activation(host, "inputs" + std::to_string(micro_batch));
  *targets = new_activation(host, "targets" + std::to_string(micro_batch));
  return nullptr;
}
weft_status* forward(weft_host* host, int64_t first, int64_t last, weft_activation*,
                     uint32_t flags, weft_activation** out) {
  if (!host->fail_forward.empty()) {
    return create_status(WEFT_STATUS_COMMUNICATION, host->fail_forward.c_str());
  }
  host->forward_ranges.emplace_back(first, last);
  host->forward_flags.push_back(flags);
  *out = new_activation(host, "logits");
  return nullptr;
}
// Losses 1, 2, 3, ... over 10 tokens each.
weft_status* loss(weft_host* host, weft_activation*, weft_activation*, double scale,
                  weft_activation** loss_out, double* value_out, int64_t* tokens_out) {
  host->loss_scales.push_back(scale);
  *loss_out = new_activation(host, "loss", scale);
  *value_out = ++host->loss_calls;
  *tokens_out = 10;
  return nullptr;
}
weft_status* backward(weft_host* host, weft_activation* output, weft_activation*) {
  host->backward_scales.push_back(output->scale);
  return nullptr;
}
void activation_release(weft_host* host, weft_activation* activation) {
  if (activation == nullptr) return;
  ++host->activation_releases;
  if (host->live_activations.erase(activation) == 0) {
    ++host->double_releases;
    return;
  }
  delete activation;
}

weft_status* model_info(weft_host* host, weft_model_info* out) {
  if (out->struct_size < sizeof(weft_model_info)) return create_status(WEFT_STATUS_INVALID_ARGUMENT, "small struct");
  *out = host->model;
  return nullptr;
}

void trace_begin(weft_host* host, const char* category, const char* name) {
  host->trace.push_back(std::string("+") + category + "/" + name);
}

void trace_end(weft_host* host) { host->trace.push_back("-"); }

weft_status* report_metric(weft_host* host, const char* name, double value) {
  host->metrics[name] = value;
  return nullptr;
}

// ABI 1.2, over host memory (the SDK's own CPU fallbacks do the arithmetic).
weft_status* buffer_create(weft_host* host, int32_t ndim, const int64_t* shape, DLDataType dtype, weft_buffer** out,
                           DLTensor* view) {
  auto* buffer = new weft_buffer;
  buffer->shape.assign(shape, shape + ndim);
  int64_t elements = 1;
  for (int64_t extent : buffer->shape) elements *= extent;
  buffer->bytes.assign(static_cast<size_t>(elements) * ((dtype.bits * dtype.lanes + 7) / 8), 0);
  *view = DLTensor{};
  view->data = buffer->bytes.data();
  view->device = DLDevice{kDLCPU, 0};
  view->ndim = ndim;
  view->dtype = dtype;
  view->shape = buffer->shape.data();
  host->live_buffers.insert(buffer);
  *out = buffer;
  return nullptr;
}
void buffer_release(weft_host* host, weft_buffer* buffer) {
  if (buffer == nullptr) return;
  ++host->buffer_releases;
  if (host->live_buffers.erase(buffer) == 0) {
    ++host->double_releases;
    return;
  }
  delete buffer;
}
// The SDK's own boundary (exceptions to statuses), over this fake's status allocator.
template <typename F>
weft_status* as_status(F&& f) {
  static const weft_host_api statuses = [] {
    weft_host_api api{};
    api.status_create = create_status;
    return api;
  }();
  return weft::sdk::detail::guarded(&statuses, std::forward<F>(f));
}
weft_status* tensor_copy(weft_host* host, DLTensor* dst, const DLTensor* src) {
  ++host->copies;
  return as_status([&] { weft::sdk::detail::cpu_copy(*dst, *src); });
}
weft_status* tensor_scale(weft_host* host, DLTensor* tensor, double factor) {
  ++host->scales;
  return as_status([&] { weft::sdk::detail::cpu_scale(*tensor, factor); });
}
weft_status* tensor_add(weft_host* host, DLTensor* dst, const DLTensor* src, double alpha) {
  ++host->adds;
  return as_status([&] { weft::sdk::detail::cpu_add(*dst, *src, alpha); });
}
weft_status* tensor_squared_norm(weft_host* host, const DLTensor* tensor, double* out) {
  ++host->norms;
  return as_status([&] { *out = weft::sdk::detail::cpu_squared_norm(*tensor); });
}

}  // namespace

FakeStatusCounts& fake_status_counts() {
  static FakeStatusCounts counts;
  return counts;
}

weft_host_api make_fake_host_api(uint16_t abi_minor) {
  weft_host_api api{};
  api.header = {static_cast<uint32_t>(sizeof(weft_host_api)), WEFT_ABI_VERSION_MAJOR, abi_minor};
  api.status_create = create_status;
  api.status_code = status_code;
  api.status_message = status_message;
  api.status_release = release_status;
  api.log = log;
  api.config_int = config_int;
  api.config_float = config_float;
  api.config_bool = config_bool;
  api.config_string = config_string;
  api.group_world = group_world;
  api.group_rank = group_rank;
  api.group_size = group_size;
  api.all_reduce = all_reduce;
  api.barrier = barrier;
  api.work_wait = work_wait;
  api.work_release = work_release;
  api.model_num_stages = model_num_stages;
  api.parameter_count = parameter_count;
  api.parameter_info = parameter_info;
  api.parameter_grad = parameter_grad;
  api.batch = batch;
  api.forward = forward;
  api.loss = loss;
  api.backward = backward;
  api.activation_release = activation_release;
  api.model_info = model_info;
  api.trace_begin = trace_begin;
  api.trace_end = trace_end;
  api.report_metric = report_metric;
  api.buffer_create = buffer_create;
  api.buffer_release = buffer_release;
  api.tensor_copy = tensor_copy;
  api.tensor_scale = tensor_scale;
  api.tensor_add = tensor_add;
  api.tensor_squared_norm = tensor_squared_norm;
  return api;
}

std::pair<weft_status_code, std::string> take_status(weft_status* status) {
  if (status == nullptr) return {WEFT_STATUS_OK, ""};
  std::pair<weft_status_code, std::string> result{status->code, status->message};
  release_status(status);
  return result;
}
