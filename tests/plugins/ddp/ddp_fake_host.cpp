#include "plugins/ddp/ddp_fake_host.h"

namespace {

std::map<const weft_host*, DdpFakeHost*>& registry() {
  static std::map<const weft_host*, DdpFakeHost*> hosts;
  return hosts;
}
DdpFakeHost& fake_of(const weft_host* host) { return *registry().at(host); }

// The base fake's table, for the slots that wrap it.
const weft_host_api& base_api() {
  static const weft_host_api api = make_fake_host_api();
  return api;
}

weft_status* config_float(weft_host* host, const char* key, double fallback, double* out) {
  const auto& floats = fake_of(host).floats;
  const auto found = floats.find(key);
  if (found == floats.end()) return base_api().config_float(host, key, fallback, out);
  *out = found->second;
  return nullptr;
}

DLTensor flat_view(std::vector<float>& values, int64_t* size) {
  DLTensor view{};
  view.data = values.data();
  view.device = {kDLCPU, 0};
  view.ndim = 1;
  view.dtype = {kDLFloat, 32, 1};
  view.shape = size;
  view.strides = nullptr;
  return view;
}

weft_status* parameter_data(weft_host* host, int64_t index, DLTensor* out) {
  DdpFakeHost& fake = fake_of(host);
  *out = flat_view(fake.data.at(index), &host->parameters.at(index).size);
  return nullptr;
}

weft_status* parameter_grad(weft_host* host, int64_t index, DLTensor* out) {
  DdpFakeHost& fake = fake_of(host);
  if (!fake.grad_defined.at(index)) {
    return base_api().status_create(WEFT_STATUS_INVALID_ARGUMENT, "fake: no gradient yet");
  }
  return base_api().parameter_grad(host, index, out);
}

weft_status* set_grad_ready_callback(weft_host* host, weft_grad_ready_fn callback, void* user) {
  DdpFakeHost& fake = fake_of(host);
  fake.callback = callback;
  fake.callback_user = user;
  return nullptr;
}

weft_status* broadcast(weft_host* host, weft_group*, DLTensor* tensor, int32_t root,
                       weft_work** out) {
  DdpFakeHost& fake = fake_of(host);
  int64_t parameter = -1;
  for (size_t i = 0; i < fake.data.size(); ++i) {
    if (fake.data[i].data() == tensor->data) parameter = static_cast<int64_t>(i);
  }
  fake.broadcast_parameters.push_back(parameter);
  fake.broadcast_roots.push_back(root);
  return base_api().barrier(host, nullptr, out);  // a fresh work handle
}

weft_status* all_reduce(weft_host* host, weft_group* group, DLTensor* tensor, weft_reduce_op op,
                        weft_work** out) {
  DdpFakeHost& fake = fake_of(host);
  if (fake.fail_all_reduce) {
    return base_api().status_create(WEFT_STATUS_COMMUNICATION, "fake: link down");
  }
  int64_t elements = 1;
  for (int32_t d = 0; d < tensor->ndim; ++d) elements *= tensor->shape[d];
  fake.all_reduce_log.push_back({elements, fake.backward_calls, fake.in_backward});
  return base_api().all_reduce(host, group, tensor, op, out);
}

weft_status* backward(weft_host* host, weft_activation* output, weft_activation* grad_output) {
  DdpFakeHost& fake = fake_of(host);
  weft_status* status = base_api().backward(host, output, grad_output);  // records the scale
  if (status != nullptr) return status;
  ++fake.backward_calls;
  fake.in_backward = true;
  for (size_t i = host->parameters.size(); i-- > 0;) {
    FakeParameter& parameter = host->parameters[i];
    if (!parameter.trainable || !fake.produces_grad[i]) continue;
    if (!fake.grad_defined[i]) parameter.grad.assign(static_cast<size_t>(parameter.size), 0.0f);
    fake.grad_defined[i] = true;
    for (size_t k = 0; k < parameter.grad.size(); ++k) {
      parameter.grad[k] += static_cast<float>(output->scale) * fake.grad_per_backward[i][k];
    }
    if (fake.callback != nullptr) fake.callback(fake.callback_user, static_cast<int64_t>(i));
  }
  fake.in_backward = false;
  return nullptr;
}

// Inputs of eval_rows rows; anything else is a 1-element placeholder.
weft_status* activation_view(weft_host* host, weft_activation* activation, DLTensor* out) {
  DdpFakeHost& fake = fake_of(host);
  static int64_t placeholder_shape[2] = {1, 1};
  static thread_local int64_t shape[2];
  DLTensor view{};
  view.device = {kDLCPU, 0};
  view.ndim = 2;
  view.dtype = {kDLInt, 64, 1};
  if (activation->what.rfind("inputs", 0) == 0) {
    shape[0] = fake.eval_rows;
    shape[1] = fake.eval_seq_len;
    view.shape = shape;
  } else {
    view.shape = placeholder_shape;
  }
  view.data = nullptr;  // the plugin only looks at the shape
  *out = view;
  return nullptr;
}

}  // namespace

DdpFakeHost::DdpFakeHost() : api(make_fake_host_api()) {
  registry()[&host] = this;
  api.config_float = config_float;
  api.parameter_data = parameter_data;
  api.parameter_grad = parameter_grad;
  api.set_grad_ready_callback = set_grad_ready_callback;
  api.broadcast = broadcast;
  api.all_reduce = all_reduce;
  api.backward = backward;
  api.activation_view = activation_view;
}

DdpFakeHost::~DdpFakeHost() { registry().erase(&host); }

void DdpFakeHost::add_parameter(const std::string& name, bool trainable, std::vector<float> values,
                                std::vector<float> grads, bool produces) {
  const auto size = static_cast<int64_t>(values.size());
  host.parameters.push_back({name, trainable, {}, size});
  data.push_back(std::move(values));
  grad_per_backward.push_back(std::move(grads));
  produces_grad.push_back(produces);
  grad_defined.push_back(false);
}
