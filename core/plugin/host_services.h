// The host side of the step services (core/plugin/step/services.h), shared by the files that implement them by concern:
// host_config.cpp (configuration), host_collectives.cpp (process groups and collectives),
// host_model.cpp (the model and the step), host_memory.cpp (plugins' buffers on the device and
// operations on views), host_telemetry.cpp (logging, tracing, metrics, communication
// accounting); host_api.cpp holds PluginHost. Internal to core/plugin.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/torch.h>
#include "core/plugin/step/services.h"
#include <weft/plugin_torch.hpp>
#include "core/plugin/step/step.hpp"

#include "core/dist/mesh.h"
#include "core/dist/process_groups.h"
#include "core/model/llama.h"
#include "core/model/weight_grad.h"
#include "core/plugin/host_api.h"
#include "core/plugin/status.h"
#include "core/util/error.h"

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
  std::vector<int64_t> sequences;  // targets handed out by batch(): the sequence of each row
  // Packed rows: each token's position within its example over whole rows (Batch::positions, on
  // the device), which forward() gives the model and passes on to its output; undefined otherwise.
  at::Tensor positions;
  // The last stage's output when the host leaves the LM head to the loss (a chunked linear +
  // cross-entropy, LlamaForCausalLMImpl::head_loss): `tensor` stays undefined, `head_input` holds the
  // final norm's output and `head` makes the logits from it for whatever else asks (tensor_of).
  at::Tensor head_input;
  std::function<at::Tensor(const at::Tensor&)> head;
};
struct weft_buffer {
  at::Tensor tensor;  // contiguous, on the rank's device; its sizes and strides back the view
};
struct weft_weight_pass {
  weft::WeightGradQueue queue;  // the linear layers' inputs and output gradients (weight_grad.h)
};

namespace weft {

struct Abi2Plugin;  // core/plugin/abi2.h

// A parameter the plugin sees: its name, tensor, owning stage and full (unsharded) shape, and
// the flat shard of its training state this rank keeps.
struct ParameterEntry {
  std::string name;
  at::Tensor tensor;
  int64_t stage = 0;
  std::vector<int64_t> shape;        // the ABI's: the whole parameter, before tensor-parallel slicing
  std::vector<int64_t> local_shape;  // this rank's tensor when it is whole (parameter_materialize)
  // flat_shard: elements [shard_begin, shard_begin + shard_count) of the flattened
  // local tensor. `shard` is the master copy of them (a view into `tensor`, or storage of its own
  // when releasable); `grad_shard` (trainable only) their gradient, which `shard.grad()` refers
  // to so that the optimizer and clipping read it.
  bool sharded = false, releasable = false, released = false;
  // WEFT_FLAT_SHARD_COMPUTE_DTYPE: the dtype parameter_materialize gives the whole
  // parameter outside materialize_parameters(1) (the compute dtype for a matrix, else fp32).
  at::ScalarType materialize_dtype = at::kFloat;
  int64_t shard_begin = 0, shard_count = 0;
  at::Tensor shard, grad_shard;
};

struct PluginHost::State {
  std::string plugin_name;
  toml::table config;
  // The [plugin] keys the plugin asked for, in order, with the value it got (the configured one or
  // its own default): its effective settings (settings_read()).
  std::vector<std::pair<std::string, std::string>> settings;
  void record_setting(const std::string& key, const std::string& value) {
    for (auto& [k, v] : settings) {
      if (k == key) {
        v = value;
        return;
      }
    }
    settings.emplace_back(key, value);
  }
  Communicator* communicator = nullptr;
  weft_host handle{};
  std::vector<std::unique_ptr<weft_group>> groups;
  LlamaForCausalLMImpl* model = nullptr;
  torch::Device device = torch::kCPU;
  // How this rank's loss service computed causal-LM losses: in row chunks from the final norm's
  // output (a deferred head) or from whole logits; counts since the run began.
  int64_t chunked_head_losses = 0, logits_head_losses = 0;
  double loss_scale = 1.0;  // fp16: multiplies the loss handed back for backward (set_loss_scale)  // where the model computes: batches and activations go there
  std::vector<ParameterEntry> parameters;
  // Inside materialize_parameters(1): whole parameters are materialised in fp32.
  bool materialize_masters = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators;
  weft_grad_ready_fn grad_ready = nullptr;
  void* grad_ready_user = nullptr;
  // The current step.
  const BatchLoader* train_loader = nullptr;
  const EvalLoader* eval_loader = nullptr;
  int64_t epoch = 0, index = 0;
  int32_t micro_batches = 0;
  // Training on masked targets (chat data): every counted target of the step weighs alike, as
  // transformers' num_items_in_batch weighs them. The model's loss is a micro-batch's summed token
  // losses over its positions; times (the step's positions / its counted targets, every micro-batch
  // and rank together) it is the step's token-weighted mean once the plugin has averaged its
  // micro-batches and ranks as it does for text. 1 for text, whose every position counts.
  double loss_weight = 1.0;
  bool masked_targets = false;  // the current step's split is masked (PackedSequences::masked)
  // Communication since the last take_comm_stats (collectives may be issued and waited on
  // from the autograd thread, hence the lock).
  std::mutex comm_mutex;
  PluginHost::CommStats comm;
  // Time in the forward/loss and backward services since the last take_compute_stats.
  std::mutex compute_mutex;
  PluginHost::ComputeStats compute;
  // The model's shape (from set_model_info, before the model is built).
  bool has_model_info = false;
  weft_model_info model_info{};
  std::shared_ptr<ModelConfig> model_config;  // for profile_stages
  int64_t seq_len = 0, batch_rows = 0;
  // Context parallelism (the plan's context_parallel_*): batch() hands out this rank's
  // tokens of each row (rank, size and layout only; the model's own split holds the callbacks).
  ContextSplit context;
  // The host's memory estimate per model stage (set_stage_memory, before the model is built).
  std::vector<weft_stage_memory> stage_memory;
  // Values the plugin reported for the current step (report_metric).
  std::map<std::string, double> step_metrics;
  // ABI 2.1: the plugin's state tensors (weft_state_tensor), in the order made, and what a
  // checkpoint held for those not made yet (restore_plugin_state).
  std::vector<std::pair<std::string, at::Tensor>> plugin_state;
  std::map<std::string, at::Tensor> restored_state;
  // ABI 2.1: the parameters placed LOCAL over more than one rank (each rank's own values and
  // optimizer state, which checkpoints keep per rank), by name.
  std::vector<std::string> local_parameters;
  // ABI 2.1: the group the flat shards' ranges cover when it is not the plugin's whole dimension
  // (HSDP's shard group); null otherwise.
  ProcessGroup* flat_shard_group = nullptr;
  // Per-sequence evaluation (record_sequence_losses): each sequence's summed token losses and
  // how many times this rank computed them, by sequence index; undefined when not recording.
  at::Tensor sequence_loss_sums, sequence_counts;
  at::Tensor sequence_outputs;  // classification: each sequence's summed head outputs [sequences, labels]
  // ABI 2 composition: the data-parallel plugin composed with this pipeline plugin on the mesh
  // pp x dp (the pipeline's step executes its layout over the dp dimension), and the host that
  // reads its [plugin] settings; null otherwise. Both are the session's.
  const Abi2Plugin* abi2_data_parallel = nullptr;
  weft_host* abi2_data_parallel_settings = nullptr;
  const Abi2Plugin* abi2_tensor_parallel = nullptr;  // and the tensor-parallel one beside a pipeline
  weft_host* abi2_tensor_parallel_settings = nullptr;
  const Abi2Plugin* abi2_context_parallel = nullptr;  // and the context-parallel one beside tensor parallelism
  weft_host* abi2_context_parallel_settings = nullptr;
  std::array<int32_t, 4> abi2_mesh{};  // with them: the mesh's pp, dp, cp and tp sizes
  // The step skips the model's communication points (an ABI 2 pipeline without tensor parallelism):
  // the session installs no hook there, though its table has the slot.
  bool skips_model_points = false;
};


namespace host {

using State = PluginHost::State;

inline State& state_of(weft_host* host) {
  WEFT_CHECK(host != nullptr && host->state != nullptr, "null weft_host");
  return *host->state;
}

// Counts one operation issued with `payload` bytes (the data this rank contributes or receives).
inline void count_operation(weft_host* host, int64_t payload) {
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
// the plugin) is INVALID_ARGUMENT, CodedError and sdk::Error keep their code, anything else is
// INTERNAL.
template <typename Body>
weft_status* guarded(Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const CodedError& e) {
    return status_create(e.code, e.what());
  } catch (const sdk::Error& e) {  // from the SDK's DLPack helpers
    return status_create(e.code(), e.what());
  } catch (const Error& e) {
    return status_create(WEFT_STATUS_INVALID_ARGUMENT, e.what());
  } catch (...) {
    return status_from_current_exception();
  }
}

inline weft_activation* new_activation(at::Tensor tensor, std::vector<int64_t> sequences = {}) {
  return new weft_activation{std::move(tensor), std::move(sequences), at::Tensor(), at::Tensor(), nullptr};
}

// The activation's tensor (a deferred head's logits made now, once).
inline const at::Tensor& tensor_of(weft_activation* activation) {
  WEFT_CHECK(activation != nullptr, "null weft_activation");
  if (!activation->tensor.defined() && activation->head_input.defined()) {
    activation->tensor = activation->head(activation->head_input);
  }
  WEFT_CHECK(activation->tensor.defined(), "empty weft_activation");
  return activation->tensor;
}

inline ProcessGroup& group_of(weft_group* group) {
  WEFT_CHECK(group != nullptr && group->group != nullptr, "null weft_group");
  WEFT_CHECK(group->group->backend, "this rank is not a member of process group '{}'", group->group->name);
  return *group->group;
}

inline c10d::ReduceOp reduce_op(weft_reduce_op op) {
  switch (op) {
    case WEFT_REDUCE_SUM: return c10d::ReduceOp::SUM;
    case WEFT_REDUCE_PRODUCT: return c10d::ReduceOp::PRODUCT;
    case WEFT_REDUCE_MIN: return c10d::ReduceOp::MIN;
    case WEFT_REDUCE_MAX: return c10d::ReduceOp::MAX;
  }
  fail("unknown reduce op {}", static_cast<int>(op));
}

inline at::Tensor contiguous_view(const DLTensor* dl, const char* what) {
  WEFT_CHECK(dl != nullptr, "{}: null tensor", what);
  auto t = sdk::from_dl_view(*dl);
  WEFT_CHECK(t.is_contiguous(), "{}: tensors must be contiguous", what);
  return t;
}

// Hands `operation` to the plugin as a work handle, counting its bytes.
inline weft_work* new_work(weft_host* host, Operation operation) {
  count_operation(host, operation.bytes);
  return new weft_work{std::move(operation)};
}

inline Communicator& communicator_of(weft_host* host) {
  auto& s = state_of(host);
  WEFT_CHECK(s.communicator != nullptr, "no process groups in this run");
  return *s.communicator;
}

// Adds the time since `start` to the time this rank spent blocked on communication.
void add_wait_time(weft_host* host, std::chrono::steady_clock::time_point start);

// The services are declared in core/plugin/step/services.h (weft::host); these are the helpers they share.
void install_grad_hooks(State& s);  // host_model.cpp
ParameterEntry& parameter_at(State& s, int64_t index);  // host_model.cpp

}  // namespace host
}  // namespace weft
