#include "core/plugin/host_api.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include "core/data/loader.h"
#include "core/model/llama.h"
#include "core/model/weights.h"
#include "core/plugin/dlpack_view.h"
#include "core/plugin/process_groups.h"
#include "core/plugin/status.h"
#include "core/util/error.h"
#include "core/util/trace.h"

// The C handle types of the ABI, defined by the host.
struct weft_host {
  weft::PluginHost::State* state;
};
struct weft_group {
  weft::ProcessGroup* group;
};
struct weft_work {
  weft::Operation operation;  // keeps its tensors alive until the work is released
  bool waited = false;
};
struct weft_activation {
  at::Tensor tensor;
};

namespace weft {

struct ParameterEntry {
  std::string name;
  at::Tensor tensor;
  int64_t stage = 0;
  std::vector<int64_t> shape;
};

struct PluginHost::State {
  std::string plugin_name;
  toml::table config;
  Communicator* communicator = nullptr;
  weft_host handle{};
  std::vector<std::unique_ptr<weft_group>> groups;
  LlamaForCausalLMImpl* model = nullptr;
  std::vector<ParameterEntry> parameters;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators;
  weft_grad_ready_fn grad_ready = nullptr;
  void* grad_ready_user = nullptr;
  // The current step.
  const BatchLoader* train_loader = nullptr;
  const EvalLoader* eval_loader = nullptr;
  int64_t epoch = 0, index = 0;
  int32_t micro_batches = 0;
  // Communication since the last take_comm_stats (collectives may be issued and waited on
  // from the autograd thread, hence the lock).
  std::mutex comm_mutex;
  PluginHost::CommStats comm;
  // The model's shape (from set_model_info, before the model is built).
  bool has_model_info = false;
  weft_model_info model_info{};
  std::shared_ptr<ModelConfig> model_config;  // for profile_stages
  int64_t seq_len = 0, batch_rows = 0;
  // Values the plugin reported for the current step (report_metric).
  std::map<std::string, double> step_metrics;
};

namespace {

using State = PluginHost::State;

State& state_of(weft_host* host) {
  WEFT_CHECK(host != nullptr && host->state != nullptr, "null weft_host");
  return *host->state;
}

// Counts one operation issued with `payload` bytes (the data this rank contributes or receives).
void count_operation(weft_host* host, int64_t payload) {
  auto& s = state_of(host);
  std::lock_guard<std::mutex> lock(s.comm_mutex);
  ++s.comm.operations;
  s.comm.bytes += payload;
}

// An error with a specific status code (communication failures and timeouts).
class CodedError : public std::runtime_error {
 public:
  CodedError(weft_status_code code, const std::string& message) : std::runtime_error(message), code(code) {}
  weft_status_code code;
};

// Runs `body`, turning any exception into a status for the plugin: weft::Error (bad input from
// the plugin) is INVALID_ARGUMENT, CodedError keeps its code, anything else is INTERNAL.
template <typename Body>
weft_status* guarded(Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const CodedError& e) {
    return status_create(e.code, e.what());
  } catch (const Error& e) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, e.what());
  } catch (...) {
    return status_from_current_exception();
  }
}

weft_activation* new_activation(at::Tensor tensor) { return new weft_activation{std::move(tensor)}; }

const at::Tensor& tensor_of(weft_activation* activation) {
  WEFT_CHECK(activation != nullptr && activation->tensor.defined(), "null or empty weft_activation");
  return activation->tensor;
}

ProcessGroup& group_of(weft_group* group) {
  WEFT_CHECK(group != nullptr && group->group != nullptr, "null weft_group");
  WEFT_CHECK(group->group->backend, "this rank is not a member of process group '{}'", group->group->name);
  return *group->group;
}

c10d::ReduceOp reduce_op(weft_reduce_op op) {
  switch (op) {
    case WEFT_REDUCE_SUM: return c10d::ReduceOp::SUM;
    case WEFT_REDUCE_PRODUCT: return c10d::ReduceOp::PRODUCT;
    case WEFT_REDUCE_MIN: return c10d::ReduceOp::MIN;
    case WEFT_REDUCE_MAX: return c10d::ReduceOp::MAX;
  }
  fail("unknown reduce op {}", static_cast<int>(op));
}

at::Tensor contiguous_view(const DLTensor* dl, const char* what) {
  WEFT_CHECK(dl != nullptr, "{}: null tensor", what);
  auto t = tensor_from_dl(*dl);
  WEFT_CHECK(t.is_contiguous(), "{}: tensors must be contiguous", what);
  return t;
}

// Hands `operation` to the plugin as a work handle, counting its bytes.
weft_work* new_work(weft_host* host, Operation operation) {
  count_operation(host, operation.bytes);
  return new weft_work{std::move(operation)};
}

Communicator& communicator_of(weft_host* host) {
  auto& s = state_of(host);
  WEFT_CHECK(s.communicator != nullptr, "no process groups in this run");
  return *s.communicator;
}

// --- status and logging -----------------------------------------------------------------

void log_line(weft_host* host, weft_log_level level, const char* message) {
  try {
    const auto& s = state_of(host);
    static const spdlog::level::level_enum levels[] = {spdlog::level::trace, spdlog::level::debug,
                                                       spdlog::level::info, spdlog::level::warn,
                                                       spdlog::level::err};
    const int index = std::clamp(static_cast<int>(level), 0, 4);
    spdlog::log(levels[index], "[{}] {}", s.plugin_name, message ? message : "");
  } catch (...) {
  }
}

// --- configuration ----------------------------------------------------------------------

template <typename T>
weft_status* config_value(weft_host* host, const char* key, T fallback, T* out, const char* type_name) {
  return guarded([&] {
    WEFT_CHECK(key && out, "config: null key or output");
    const auto& s = state_of(host);
    const auto* node = s.config.get(key);
    if (!node) {
      *out = fallback;
      return;
    }
    if constexpr (std::is_same_v<T, double>) {
      if (auto v = node->value<double>()) {
        *out = *v;
        return;
      }
    } else if constexpr (std::is_same_v<T, int32_t>) {
      if (auto v = node->value<bool>()) {
        *out = *v ? 1 : 0;
        return;
      }
    } else {
      if (auto v = node->value<int64_t>()) {
        *out = *v;
        return;
      }
    }
    throw Error(fmt::format("config key 'plugin.{}' must be {}", key, type_name));
  });
}

weft_status* config_int(weft_host* h, const char* key, int64_t fallback, int64_t* out) {
  return config_value<int64_t>(h, key, fallback, out, "an integer");
}
weft_status* config_float(weft_host* h, const char* key, double fallback, double* out) {
  return config_value<double>(h, key, fallback, out, "a number");
}
weft_status* config_bool(weft_host* h, const char* key, int32_t fallback, int32_t* out) {
  return config_value<int32_t>(h, key, fallback, out, "a boolean");
}
weft_status* config_string(weft_host* host, const char* key, const char* fallback, const char** out) {
  return guarded([&] {
    WEFT_CHECK(key && out, "config: null key or output");
    auto& s = state_of(host);
    auto* node = s.config.get(key);
    if (!node) {
      *out = fallback;
      return;
    }
    const auto* str = node->as_string();
    WEFT_CHECK(str != nullptr, "config key 'plugin.{}' must be a string", key);
    *out = str->get().c_str();  // lives in the config table for the run
  });
}

// --- process groups and collectives ----------------------------------------------------

weft_group* wrap_group(State& s, ProcessGroup& group) {
  for (auto& g : s.groups) {
    if (g->group == &group) return g.get();
  }
  s.groups.push_back(std::make_unique<weft_group>(weft_group{&group}));
  return s.groups.back().get();
}

weft_group* group_world(weft_host* host) {
  try {
    auto& s = state_of(host);
    return wrap_group(s, s.communicator->world());
  } catch (...) {
    return nullptr;
  }
}
int32_t group_rank(const weft_group* group) { return group && group->group ? group->group->rank : -1; }
int32_t group_size(const weft_group* group) { return group && group->group ? group->group->size : 0; }

weft_status* group_create(weft_host* host, const int32_t* ranks, int32_t count, weft_group** out) {
  return guarded([&] {
    WEFT_CHECK(ranks && count > 0 && out, "group_create: empty rank list");
    auto& s = state_of(host);
    auto& group = s.communicator->create_group(std::vector<int32_t>(ranks, ranks + count));
    *out = wrap_group(s, group);
  });
}

weft_status* all_reduce(weft_host* host, weft_group* group, DLTensor* tensor, weft_reduce_op op, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "all_reduce: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).all_reduce(g, contiguous_view(tensor, "all_reduce"), reduce_op(op)));
  });
}

weft_status* reduce_scatter(weft_host* host, weft_group* group, DLTensor* output, const DLTensor* input,
                            weft_reduce_op op, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "reduce_scatter: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).reduce_scatter(g, contiguous_view(output, "reduce_scatter output"),
                                                                contiguous_view(input, "reduce_scatter input"),
                                                                reduce_op(op)));
  });
}

weft_status* all_gather(weft_host* host, weft_group* group, DLTensor* output, const DLTensor* input, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "all_gather: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).all_gather(g, contiguous_view(output, "all_gather output"),
                                                            contiguous_view(input, "all_gather input")));
  });
}

weft_status* broadcast(weft_host* host, weft_group* group, DLTensor* tensor, int32_t root, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "broadcast: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).broadcast(g, contiguous_view(tensor, "broadcast"), root));
  });
}

weft_status* all_to_all(weft_host* host, weft_group* group, DLTensor* output, const DLTensor* input, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "all_to_all: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).all_to_all(g, contiguous_view(output, "all_to_all output"),
                                                            contiguous_view(input, "all_to_all input")));
  });
}

weft_status* send(weft_host* host, weft_group* group, const DLTensor* tensor, int32_t peer, int32_t tag, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "send: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).send(g, contiguous_view(tensor, "send"), peer, tag));
  });
}

weft_status* recv(weft_host* host, weft_group* group, DLTensor* tensor, int32_t peer, int32_t tag, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "recv: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).recv(g, contiguous_view(tensor, "recv"), peer, tag));
  });
}

weft_status* barrier(weft_host* host, weft_group* group, weft_work** work) {
  return guarded([&] {
    WEFT_CHECK(work, "barrier: null work output");
    auto& g = group_of(group);
    *work = new_work(host, communicator_of(host).barrier(g));
  });
}

// Adds the time since `start` to the time this rank spent blocked on communication.
void add_wait_time(weft_host* host, std::chrono::steady_clock::time_point start) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto& s = state_of(host);
  std::lock_guard<std::mutex> lock(s.comm_mutex);
  s.comm.wait_seconds += seconds;
}

weft_status* work_wait(weft_host* host, weft_work* work) {
  return guarded([&] {
    WEFT_CHECK(work != nullptr, "work_wait: null work");
    if (work->waited) return;
    const auto start = std::chrono::steady_clock::now();
    try {
      communicator_of(host).wait(work->operation);
    } catch (const CommError& e) {
      throw CodedError(e.timed_out() ? WEFT_STATUS_TIMEOUT : WEFT_STATUS_COMMUNICATION, e.what());
    }
    add_wait_time(host, start);
    if (Tracer::instance().enabled()) {
      Tracer::instance().complete("wait", "wait " + work->operation.name, start,
                                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    work->waited = true;
  });
}

void work_release(weft_host* host, weft_work* work) {
  if (!work) return;
  if (!work->waited) status_release(work_wait(host, work));
  delete work;
}

// --- model ------------------------------------------------------------------------------

int64_t model_num_stages(weft_host* host) {
  try {
    auto& s = state_of(host);
    return s.model ? s.model->num_stages() : 0;
  } catch (...) {
    return 0;
  }
}

int64_t parameter_count(weft_host* host) {
  try {
    return static_cast<int64_t>(state_of(host).parameters.size());
  } catch (...) {
    return 0;
  }
}

const ParameterEntry& parameter_at(State& s, int64_t index) {
  WEFT_CHECK(0 <= index && index < static_cast<int64_t>(s.parameters.size()),
             "parameter index {} outside [0, {})", index, s.parameters.size());
  return s.parameters[static_cast<size_t>(index)];
}

weft_status* parameter_info(weft_host* host, int64_t index, weft_parameter_info* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_info: null output");
    const auto& p = parameter_at(state_of(host), index);
    weft_parameter_info info{};
    info.name = p.name.c_str();
    info.stage = p.stage;
    info.trainable = p.tensor.requires_grad() ? 1 : 0;
    info.ndim = static_cast<int32_t>(p.shape.size());
    info.shape = p.shape.data();
    info.dtype = dl_view(p.tensor).dtype;
    *out = info;
  });
}

weft_status* parameter_data(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_data: null output");
    *out = dl_view(parameter_at(state_of(host), index).tensor);
  });
}

weft_status* parameter_grad(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_grad: null output");
    const auto& p = parameter_at(state_of(host), index);
    const auto& grad = p.tensor.grad();
    WEFT_CHECK(grad.defined(), "parameter '{}' has no gradient yet (before the first backward of the step)", p.name);
    *out = dl_view(grad);
  });
}

weft_status* set_grad_ready_callback(weft_host* host, weft_grad_ready_fn callback, void* user_data) {
  return guarded([&] {
    auto& s = state_of(host);
    s.grad_ready = callback;
    s.grad_ready_user = user_data;
  });
}

// Installs one post-accumulation hook per trainable parameter; each calls the plugin's
// callback (if any) with the parameter's index.
void install_grad_hooks(State& s) {
  s.grad_accumulators.clear();
  for (size_t i = 0; i < s.parameters.size(); ++i) {
    const auto& tensor = s.parameters[i].tensor;
    if (!tensor.requires_grad()) continue;
    auto accumulator = torch::autograd::impl::grad_accumulator(tensor);
    const auto index = static_cast<int64_t>(i);
    State* state = &s;
    accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [state, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (state->grad_ready) state->grad_ready(state->grad_ready_user, index);
          return outputs;
        }));
    s.grad_accumulators.push_back(std::move(accumulator));
  }
}


// --- the step ---------------------------------------------------------------------------

weft_status* batch(weft_host* host, int32_t micro_batch, int32_t split, int32_t splits,
                   weft_activation** inputs, weft_activation** targets) {
  return guarded([&] {
    WEFT_CHECK(inputs && targets, "batch: null outputs");
    auto& s = state_of(host);
    WEFT_CHECK(splits >= 1 && 0 <= split && split < splits, "batch: split {} of {} is invalid", split, splits);
    Batch b;
    if (s.train_loader) {
      WEFT_CHECK(0 <= micro_batch && micro_batch < s.micro_batches, "batch: micro-batch {} outside [0, {})",
                 micro_batch, s.micro_batches);
      b = s.train_loader->batch(s.epoch, s.index * s.micro_batches + micro_batch);
    } else {
      WEFT_CHECK(s.eval_loader != nullptr, "batch: called outside a step");
      WEFT_CHECK(micro_batch == 0, "batch: an evaluation step has one micro-batch");
      b = s.eval_loader->batch(s.index);
    }
    const int64_t rows = b.inputs.size(0);
    WEFT_CHECK(rows % splits == 0, "batch: {} rows cannot be split into {} equal parts", rows, splits);
    const int64_t part = rows / splits;
    *inputs = new_activation(b.inputs.narrow(0, split * part, part));
    *targets = new_activation(b.targets.narrow(0, split * part, part));
  });
}

weft_status* forward(weft_host* host, int64_t first, int64_t last, weft_activation* input, uint32_t flags,
                     weft_activation** output) {
  return guarded([&] {
    WEFT_CHECK(output, "forward: null output");
    auto& s = state_of(host);
    WEFT_CHECK(s.model != nullptr, "forward: the model is not built yet");
    WEFT_CHECK((flags & ~(WEFT_FORWARD_NO_GRAD | WEFT_FORWARD_RECOMPUTE)) == 0, "forward: unknown flags {:#x}", flags);
    const auto& x = tensor_of(input);
    if (flags & WEFT_FORWARD_NO_GRAD) {
      torch::NoGradGuard no_grad;
      *output = new_activation(s.model->forward_stages(first, last, x));
    } else if (flags & WEFT_FORWARD_RECOMPUTE) {
      const bool was = s.model->options().activation_checkpointing;
      s.model->set_activation_checkpointing(true);
      try {
        *output = new_activation(s.model->forward_stages(first, last, x));
      } catch (...) {
        s.model->set_activation_checkpointing(was);
        throw;
      }
      s.model->set_activation_checkpointing(was);
    } else {
      *output = new_activation(s.model->forward_stages(first, last, x));
    }
  });
}

weft_status* loss(weft_host* host, weft_activation* logits, weft_activation* targets, double scale,
                  weft_activation** loss_out, double* value_out, int64_t* tokens_out) {
  return guarded([&] {
    const auto& t = tensor_of(targets);
    auto& s = state_of(host);
    // A vocabulary-parallel model combines its shards' partial sums (comm points).
    auto mean = s.model ? s.model->loss(tensor_of(logits), t) : cross_entropy(tensor_of(logits), t);
    const double value = mean.item<double>();
    if (loss_out) *loss_out = new_activation(mean * scale);
    if (value_out) *value_out = value;
    if (tokens_out) *tokens_out = t.numel();
  });
}

weft_status* backward(weft_host*, weft_activation* output, weft_activation* grad_output) {
  return guarded([&] {
    const auto& out = tensor_of(output);
    if (grad_output == nullptr) {
      WEFT_CHECK(out.numel() == 1, "backward without a gradient needs a scalar output");
      out.backward();
    } else {
      torch::autograd::backward({out}, {tensor_of(grad_output)});
    }
  });
}

weft_status* activation_view(weft_host*, weft_activation* activation, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "activation_view: null output");
    auto& t = activation->tensor;
    WEFT_CHECK(t.defined(), "activation_view: empty activation");
    if (!t.is_contiguous()) t = t.contiguous();
    *out = dl_view(t.detach());
  });
}

weft_status* activation_grad(weft_host*, weft_activation* input, weft_activation** out) {
  return guarded([&] {
    WEFT_CHECK(out, "activation_grad: null output");
    const auto& grad = tensor_of(input).grad();
    WEFT_CHECK(grad.defined(), "activation_grad: the activation received no gradient");
    *out = new_activation(grad);
  });
}

weft_status* activation_empty(weft_host*, int32_t ndim, const int64_t* shape, DLDataType dtype, weft_activation** out) {
  return guarded([&] {
    WEFT_CHECK(out && ndim >= 0 && (shape || ndim == 0), "activation_empty: bad arguments");
    DLTensor probe{};
    probe.dtype = dtype;
    probe.ndim = 0;
    probe.device = {kDLCPU, 0};
    float dummy = 0;
    probe.data = &dummy;
    const auto type = tensor_from_dl(probe).scalar_type();
    *out = new_activation(torch::empty(std::vector<int64_t>(shape, shape + ndim), torch::TensorOptions().dtype(type)));
  });
}

weft_status* activation_from_tensor(weft_host*, const DLTensor* data, int32_t requires_grad, weft_activation** out) {
  return guarded([&] {
    WEFT_CHECK(data && out, "activation_from_tensor: null argument");
    auto copy = tensor_from_dl(*data).clone();
    if (requires_grad) copy.set_requires_grad(true);
    *out = new_activation(copy);
  });
}

void activation_release(weft_host*, weft_activation* activation) { delete activation; }

// --- since 1.1 ---------------------------------------------------------------------------

weft_status* model_info(weft_host* host, weft_model_info* out) {
  return guarded([&] {
    WEFT_CHECK(out != nullptr, "model_info: null output");
    auto& s = state_of(host);
    WEFT_CHECK(s.has_model_info, "model_info: the model's shape is known from plan on, not in create");
    WEFT_CHECK(out->struct_size >= offsetof(weft_model_info, num_layers),
               "model_info: out->struct_size ({}) must be set to sizeof(weft_model_info)", out->struct_size);
    const size_t size = std::min<size_t>(out->struct_size, sizeof(weft_model_info));
    weft_model_info info = s.model_info;
    info.struct_size = static_cast<uint32_t>(size);
    std::memcpy(out, &info, size);
  });
}

void trace_begin(weft_host*, const char* category, const char* name) {
  if (!Tracer::instance().enabled()) return;
  try {
    Tracer::instance().begin(category ? category : "plugin", name ? name : "");
  } catch (...) {
  }
}

void trace_end(weft_host*) {
  if (!Tracer::instance().enabled()) return;
  try {
    Tracer::instance().end();
  } catch (...) {
  }
}

weft_status* report_metric(weft_host* host, const char* name, double value) {
  return guarded([&] {
    WEFT_CHECK(name != nullptr && *name != '\0', "report_metric: empty name");
    const std::string key(name);
    for (char c : key) {
      WEFT_CHECK((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_',
                 "report_metric: name '{}' must be [a-z0-9_]+", key);
    }
    state_of(host).step_metrics[key] = value;
  });
}

weft_status* config_int_list(weft_host* host, const char* key, int64_t* out, int32_t capacity, int32_t* count_out) {
  return guarded([&] {
    WEFT_CHECK(key && count_out && capacity >= 0 && (capacity == 0 || out), "config_int_list: invalid arguments");
    auto& s = state_of(host);
    auto* node = s.config.get(key);
    if (!node) {
      *count_out = 0;
      return;
    }
    const auto* array = node->as_array();
    WEFT_CHECK(array != nullptr, "config key 'plugin.{}' must be an array of integers", key);
    std::vector<int64_t> values;
    for (const auto& element : *array) {
      const auto* value = element.as_integer();
      WEFT_CHECK(value != nullptr, "config key 'plugin.{}' must be an array of integers", key);
      values.push_back(value->get());
    }
    for (int32_t i = 0; i < capacity && i < static_cast<int32_t>(values.size()); ++i) out[i] = values[i];
    *count_out = static_cast<int32_t>(values.size());
  });
}

// The median of `repeats` timings of `body` after one warm-up run.
template <typename Body>
double median_seconds(int32_t repeats, Body&& body) {
  body();
  std::vector<double> times;
  for (int32_t r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

weft_status* profile_stages(weft_host* host, int64_t rows, int32_t repeats, double* seconds_out, int64_t count) {
  return guarded([&] {
    auto& s = state_of(host);
    WEFT_CHECK(s.model_config != nullptr, "profile_stages: the model's shape is known from plan on");
    const ModelConfig& config = *s.model_config;
    const int64_t layers = config.num_hidden_layers;
    WEFT_CHECK(seconds_out != nullptr && count == layers + 2, "profile_stages: count must be {} (the model's stages)",
               layers + 2);
    WEFT_CHECK(repeats >= 1 && rows >= 0, "profile_stages: repeats must be >= 1 and rows >= 0");
    if (rows == 0) rows = std::max<int64_t>(s.batch_rows, 1);
    const int64_t seq = std::max<int64_t>(s.seq_len, 1);
    ModelOptions options;
    options.compute_dtype = s.model_info.compute_dtype.code == kDLBfloat ? torch::kBFloat16 : torch::kFloat32;
    torch::manual_seed(0);
    const auto tokens = torch::randint(0, config.vocab_size, {rows, seq}, torch::kLong);
    const auto hidden = [&] { return torch::randn({rows, seq, config.hidden_size}).requires_grad_(true); };
    // Embedding and one block.
    options.stages = StageRange{0, 2};
    LlamaForCausalLM front(config, options);
    init_weights(*front, 0, 0.02);
    const double embed = median_seconds(repeats, [&] { front->forward_stages(0, 1, tokens).sum().backward(); });
    const double block = median_seconds(repeats, [&] {
      auto x = hidden();
      front->forward_stages(1, 2, x).sum().backward();
    });
    // Norm, head and loss.
    options.stages = StageRange{layers + 1, layers + 2};
    LlamaForCausalLM back(config, options);
    init_weights(*back, 0, 0.02);
    const auto targets = torch::randint(0, config.vocab_size, {rows, seq}, torch::kLong);
    const double head = median_seconds(repeats, [&] {
      auto x = hidden();
      cross_entropy(back->forward_stages(layers + 1, layers + 2, x), targets).backward();
    });
    seconds_out[0] = embed;
    for (int64_t i = 1; i <= layers; ++i) seconds_out[i] = block;
    seconds_out[layers + 1] = head;
  });
}

weft_host_api make_table() {
  weft_host_api t{};
  t.header = {static_cast<uint32_t>(sizeof(weft_host_api)), WEFT_ABI_VERSION_MAJOR, WEFT_ABI_VERSION_MINOR};
  t.status_create = status_create;
  t.status_code = status_code;
  t.status_message = status_message;
  t.status_release = status_release;
  t.log = log_line;
  t.config_int = config_int;
  t.config_float = config_float;
  t.config_bool = config_bool;
  t.config_string = config_string;
  t.group_world = group_world;
  t.group_rank = group_rank;
  t.group_size = group_size;
  t.group_create = group_create;
  t.all_reduce = all_reduce;
  t.reduce_scatter = reduce_scatter;
  t.all_gather = all_gather;
  t.broadcast = broadcast;
  t.all_to_all = all_to_all;
  t.send = send;
  t.recv = recv;
  t.barrier = barrier;
  t.work_wait = work_wait;
  t.work_release = work_release;
  t.model_num_stages = model_num_stages;
  t.parameter_count = parameter_count;
  t.parameter_info = parameter_info;
  t.parameter_data = parameter_data;
  t.parameter_grad = parameter_grad;
  t.set_grad_ready_callback = set_grad_ready_callback;
  t.batch = batch;
  t.forward = forward;
  t.loss = loss;
  t.backward = backward;
  t.activation_view = activation_view;
  t.activation_grad = activation_grad;
  t.activation_empty = activation_empty;
  t.activation_from_tensor = activation_from_tensor;
  t.activation_release = activation_release;
  t.model_info = model_info;
  t.trace_begin = trace_begin;
  t.trace_end = trace_end;
  t.report_metric = report_metric;
  t.config_int_list = config_int_list;
  t.profile_stages = profile_stages;
  return t;
}

const weft_host_api kHostApi = make_table();

}  // namespace

PluginHost::PluginHost(std::string plugin_name, toml::table plugin_config, Communicator& communicator)
    : state_(std::make_unique<State>()) {
  state_->plugin_name = std::move(plugin_name);
  state_->config = std::move(plugin_config);
  state_->communicator = &communicator;
  state_->handle.state = state_.get();
}

PluginHost::~PluginHost() = default;

const weft_host_api* PluginHost::api() const { return &kHostApi; }

weft_host* PluginHost::handle() { return &state_->handle; }

void PluginHost::set_model_info(const ModelConfig& config, bool bf16, int64_t seq_len, int64_t batch_rows) {
  state_->model_config = std::make_shared<ModelConfig>(config);
  state_->seq_len = seq_len;
  state_->batch_rows = batch_rows;
  weft_model_info& i = state_->model_info;
  i = weft_model_info{};
  i.struct_size = sizeof(weft_model_info);
  i.num_layers = static_cast<int32_t>(config.num_hidden_layers);
  i.hidden_size = config.hidden_size;
  i.intermediate_size = config.intermediate_size;
  i.num_attention_heads = static_cast<int32_t>(config.num_attention_heads);
  i.num_key_value_heads = static_cast<int32_t>(config.num_key_value_heads);
  i.head_dim = config.head_dim;
  i.vocab_size = config.vocab_size;
  i.tie_word_embeddings = config.tie_word_embeddings ? 1 : 0;
  i.compute_dtype = bf16 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 32, 1};
  state_->has_model_info = true;
}

std::map<std::string, double> PluginHost::take_step_metrics() {
  std::map<std::string, double> taken;
  taken.swap(state_->step_metrics);
  return taken;
}

void PluginHost::set_model(LlamaForCausalLMImpl* model) {
  auto& s = *state_;
  s.model = model;
  s.parameters.clear();
  if (!model) return;
  const int64_t layers = model->config().num_hidden_layers;
  for (auto& item : model->named_parameters()) {
    ParameterEntry entry;
    entry.name = item.key();
    entry.tensor = item.value();
    entry.stage = stage_of_parameter(entry.name, layers);
    entry.shape = item.value().sizes().vec();  // the full shape (the ABI's), not the local slice
    const ParameterShard shard = shard_of(model->options().shards, entry.name);
    if (!shard.whole()) entry.shape[shard.dim] *= shard.parts;
    s.parameters.push_back(std::move(entry));
  }
  install_grad_hooks(s);
}

void PluginHost::begin_train_step(const BatchLoader* loader, int64_t epoch, int64_t index, int32_t micro_batches) {
  state_->train_loader = loader;
  state_->eval_loader = nullptr;
  state_->epoch = epoch;
  state_->index = index;
  state_->micro_batches = micro_batches;
}

void PluginHost::begin_eval_step(const EvalLoader* loader, int64_t index) {
  state_->train_loader = nullptr;
  state_->eval_loader = loader;
  state_->index = index;
  state_->micro_batches = 1;
}

void PluginHost::end_step() {
  state_->train_loader = nullptr;
  state_->eval_loader = nullptr;
}

PluginHost::CommStats PluginHost::take_comm_stats() {
  std::lock_guard<std::mutex> lock(state_->comm_mutex);
  const CommStats taken = state_->comm;
  state_->comm = CommStats{};
  return taken;
}

int64_t PluginHost::parameter_count() const { return static_cast<int64_t>(state_->parameters.size()); }

}  // namespace weft
