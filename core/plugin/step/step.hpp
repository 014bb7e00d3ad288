// core/plugin/step/step.hpp - the host's internal C++ layer over its step services (services.h).
//
// The host's step for ABI 2 plugins (core/plugin/abi2.cpp, abi2_pipeline.cpp) and the pipeline
// runtime (core/pipeline) are written against it: weft::sdk::Host wraps the services, and
// weft::sdk::Strategy is the step whose methods the strategy session calls. Host methods throw
// weft::sdk::Error when a service fails (after copying and releasing the host's status); the
// session turns every exception into a weft::Error naming the plugin (detail::guarded).
#ifndef WEFT_CORE_PLUGIN_STEP_STEP_HPP
#define WEFT_CORE_PLUGIN_STEP_STEP_HPP

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/plugin/step/services.h"

namespace weft {
namespace sdk {

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

// An error with a status code. The step throws it to refuse (the session turns it into a
// weft::Error naming the plugin); Host methods throw it when a host service fails. A code of WEFT_STATUS_OK is stored as
// WEFT_STATUS_INTERNAL (an error always has an error code).
class Error : public std::runtime_error {
 public:
  Error(weft_status_code code, const std::string& message)
      : std::runtime_error(message), code_(code == WEFT_STATUS_OK ? WEFT_STATUS_INTERNAL : code) {}
  weft_status_code code() const noexcept { return code_; }

 private:
  weft_status_code code_;
};

// The name of a status code, e.g. "BAD_CONFIG" (for messages).
inline const char* status_code_name(weft_status_code code) noexcept {
  switch (code) {
    case WEFT_STATUS_OK: return "OK";
    case WEFT_STATUS_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case WEFT_STATUS_UNSUPPORTED: return "UNSUPPORTED";
    case WEFT_STATUS_BAD_CONFIG: return "BAD_CONFIG";
    case WEFT_STATUS_COMMUNICATION: return "COMMUNICATION";
    case WEFT_STATUS_TIMEOUT: return "TIMEOUT";
    case WEFT_STATUS_INTERNAL: return "INTERNAL";
  }
  return "UNKNOWN";
}

// ------------------------------------------------------------------------------------------
// RAII handles
// ------------------------------------------------------------------------------------------

// Owns one weft_activation; releases it (activation_release) when destroyed or reset.
// Move-only; a moved-from or default-constructed Activation holds nothing and releases nothing.
class Activation {
 public:
  Activation() noexcept = default;
  // Adopts `handle` (may be NULL), which `host` created.
  Activation(weft_host* host, weft_activation* handle) noexcept
      : host_(host), handle_(handle) {}
  Activation(Activation&& other) noexcept
      : host_(other.host_), handle_(std::exchange(other.handle_, nullptr)) {}
  Activation& operator=(Activation&& other) noexcept {
    if (this != &other) {
      reset();
      host_ = other.host_;
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  Activation(const Activation&) = delete;
  Activation& operator=(const Activation&) = delete;
  ~Activation() { reset(); }

  weft_activation* get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }
  // Gives up ownership: the caller must release the returned handle.
  weft_activation* release() noexcept { return std::exchange(handle_, nullptr); }
  // Releases the handle now (if any).
  void reset() noexcept {
    if (handle_ != nullptr) ::weft::host::activation_release(host_, std::exchange(handle_, nullptr));
  }

 private:
  weft_host* host_ = nullptr;
  weft_activation* handle_ = nullptr;
};

// Owns one weft_weight_pass (the weight gradients a split backward deferred):
// Host::backward_weight consumes it; the destructor frees one never consumed without computing
// its gradients. Move-only.
class WeightPass {
 public:
  WeightPass() noexcept = default;
  // Adopts `handle` (may be NULL), which `host` created.
  WeightPass(weft_host* host, weft_weight_pass* handle) noexcept
      : host_(host), handle_(handle) {}
  WeightPass(WeightPass&& other) noexcept
      : host_(other.host_), handle_(std::exchange(other.handle_, nullptr)) {}
  WeightPass& operator=(WeightPass&& other) noexcept {
    if (this != &other) {
      reset();
      host_ = other.host_;
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  WeightPass(const WeightPass&) = delete;
  WeightPass& operator=(const WeightPass&) = delete;
  ~WeightPass() { reset(); }

  explicit operator bool() const noexcept { return handle_ != nullptr; }
  // Gives up ownership: the caller must consume or release the returned handle.
  weft_weight_pass* release() noexcept { return std::exchange(handle_, nullptr); }
  // Frees the pass without computing its gradients (if any).
  void reset() noexcept {
    if (handle_ != nullptr) ::weft::host::weight_pass_release(host_, std::exchange(handle_, nullptr));
  }

 private:
  weft_host* host_ = nullptr;
  weft_weight_pass* handle_ = nullptr;
};

// Owns one weft_work (an asynchronous communication). wait() blocks until it completes and
// throws Error if it failed; the destructor releases the handle (the host waits first if it was
// never waited for, ignoring the outcome: call wait() to see errors). Move-only.
class Work {
 public:
  Work() noexcept = default;
  // Adopts `handle` (may be NULL), which `host` created.
  Work(weft_host* host, weft_work* handle) noexcept
      : host_(host), handle_(handle) {}
  Work(Work&& other) noexcept
      : host_(other.host_), handle_(std::exchange(other.handle_, nullptr)) {}
  Work& operator=(Work&& other) noexcept {
    if (this != &other) {
      reset();
      host_ = other.host_;
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  ~Work() { reset(); }

  // Blocks until the communication completes. Throws Error (e.g. WEFT_STATUS_TIMEOUT) on
  // failure, or WEFT_STATUS_INVALID_ARGUMENT on an empty handle. May be called again.
  inline void wait() const;

  weft_work* get() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }
  weft_work* release() noexcept { return std::exchange(handle_, nullptr); }
  void reset() noexcept {
    if (handle_ != nullptr) ::weft::host::work_release(host_, std::exchange(handle_, nullptr));
  }

 private:
  weft_host* host_ = nullptr;
  weft_work* handle_ = nullptr;
};

// Elements [offset, offset + count) of a contiguous view, as a 1-D view of the same memory;
// `shape_and_stride` ({count, 1}) must outlive it.
inline DLTensor flat_part(const DLTensor& t, int64_t offset, int64_t count, int64_t (&shape_and_stride)[2]) noexcept {
  DLTensor part = t;
  shape_and_stride[0] = count;
  shape_and_stride[1] = 1;
  part.ndim = 1;
  part.shape = &shape_and_stride[0];
  part.strides = &shape_and_stride[1];
  part.byte_offset = t.byte_offset + static_cast<uint64_t>(offset) * ((t.dtype.bits * t.dtype.lanes + 7) / 8);
  return part;
}

namespace detail {

inline int64_t elements_of(const DLTensor& t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t.ndim; ++d) n *= t.shape[d];
  return n;
}
}  // namespace detail

// Memory on the rank's device (Host::buffer), zero-filled. Move-only; the memory goes with the
// object.
class Buffer {
 public:
  Buffer() noexcept = default;
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      host_ = other.host_;
      handle_ = std::exchange(other.handle_, nullptr);
      view_ = other.view_;
      other.view_ = DLTensor{};
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  // The whole buffer (contiguous); valid while the Buffer lives.
  const DLTensor& view() const noexcept { return view_; }
  int64_t elements() const noexcept {
    int64_t n = 1;
    for (int32_t d = 0; d < view_.ndim; ++d) n *= view_.shape[d];
    return n;
  }
  // Elements [offset, offset + count) as a 1-D contiguous view; `shape_and_stride` ({count, 1})
  // must outlive it.
  DLTensor part(int64_t offset, int64_t count, int64_t (&shape_and_stride)[2]) const noexcept {
    return flat_part(view_, offset, count, shape_and_stride);
  }
  // The host's buffer (host-internal services take it; null for an empty Buffer).
  weft_buffer* handle() const noexcept { return handle_; }
  void reset() noexcept {
    if (handle_ != nullptr) ::weft::host::buffer_release(host_, std::exchange(handle_, nullptr));
    view_ = DLTensor{};
  }

 private:
  friend class Host;
  weft_host* host_ = nullptr;
  weft_buffer* handle_ = nullptr;
  DLTensor view_{};
};

// A process group. Non-owning: groups are host-owned and live until the run ends, so Group is
// freely copyable.
class Group {
 public:
  Group() noexcept = default;
  explicit Group(weft_group* handle) noexcept : handle_(handle) {}
  weft_group* get() const noexcept { return handle_; }
  // This process's rank in the group, or -1 if it is not a member.
  int32_t rank() const noexcept { return ::weft::host::group_rank(handle_); }
  int32_t size() const noexcept { return ::weft::host::group_size(handle_); }

 private:
  weft_group* handle_ = nullptr;
};

// ------------------------------------------------------------------------------------------
// Host: the services of one PluginHost
// ------------------------------------------------------------------------------------------

// A micro-batch's token ids and targets (int64 [rows, seq_len]), see Host::batch.
struct Batch {
  Activation inputs;
  Activation targets;
};

// The result of Host::loss.
struct Loss {
  Activation loss;     // scalar, scaled, with autograd history: pass it to Host::backward
  double value = 0.0;  // the unscaled mean cross-entropy
  int64_t tokens = 0;  // target tokens it averaged over
};

// A thin, copyable wrapper around the weft_host of one PluginHost: valid for as long as that host
// lives. Every method that calls a fallible host service throws Error with the host's code and
// message when it fails; handles it returns are RAII. The method comments only add to the
// services' comments in services.h.
class Host {
 public:
  explicit Host(weft_host* host) noexcept : host_(host) {}

  weft_host* handle() const noexcept { return host_; }

  // --- statuses ---
  // Throws Error(code, message) if `status` is non-NULL, releasing it first. No-op on NULL.
  void check(weft_status* status) const {
    if (status == nullptr) return;
    const weft_status_code code = ::weft::status_code(status);
    const char* message = ::weft::status_message(status);
    std::string text = message != nullptr ? message : "";
    ::weft::status_release(status);
    throw Error(code, text);
  }

  // --- logging ---
  // Logs one line; never throws.
  void log(weft_log_level level, const char* message) const noexcept {
    ::weft::host::log_line(host_, level, message != nullptr ? message : "");
  }
  void log(weft_log_level level, const std::string& message) const noexcept {
    log(level, message.c_str());
  }

  // --- process groups ---
  Group world() const noexcept { return Group(::weft::host::group_world(host_)); }
  // Collective over the world: every rank calls it with the same list (see services.h).
  Group create_group(const std::vector<int32_t>& world_ranks) const {
    weft_group* out = nullptr;
    check(::weft::host::group_create(host_, world_ranks.data(), static_cast<int32_t>(world_ranks.size()),
                             &out));
    return Group(out);
  }

  // --- collectives: asynchronous; the tensors' memory must outlive the returned Work's wait ---
  Work all_reduce(Group group, DLTensor& tensor, weft_reduce_op op = WEFT_REDUCE_SUM) const {
    weft_work* out = nullptr;
    check(::weft::host::all_reduce(host_, group.get(), &tensor, op, &out));
    return work(out);
  }
  Work reduce_scatter(Group group, DLTensor& output, const DLTensor& input,
                      weft_reduce_op op = WEFT_REDUCE_SUM) const {
    weft_work* out = nullptr;
    check(::weft::host::reduce_scatter(host_, group.get(), &output, &input, op, &out));
    return work(out);
  }
  Work all_gather(Group group, DLTensor& output, const DLTensor& input) const {
    weft_work* out = nullptr;
    check(::weft::host::all_gather(host_, group.get(), &output, &input, &out));
    return work(out);
  }
  Work broadcast(Group group, DLTensor& tensor, int32_t root_group_rank) const {
    weft_work* out = nullptr;
    check(::weft::host::broadcast(host_, group.get(), &tensor, root_group_rank, &out));
    return work(out);
  }
  Work all_to_all(Group group, DLTensor& output, const DLTensor& input) const {
    weft_work* out = nullptr;
    check(::weft::host::all_to_all(host_, group.get(), &output, &input, &out));
    return work(out);
  }
  Work send(Group group, const DLTensor& tensor, int32_t peer_group_rank, int32_t tag) const {
    weft_work* out = nullptr;
    check(::weft::host::send(host_, group.get(), &tensor, peer_group_rank, tag, &out));
    return work(out);
  }
  Work recv(Group group, DLTensor& tensor, int32_t peer_group_rank, int32_t tag) const {
    weft_work* out = nullptr;
    check(::weft::host::recv(host_, group.get(), &tensor, peer_group_rank, tag, &out));
    return work(out);
  }
  // --- model ---
  int64_t model_num_stages() const noexcept { return ::weft::host::model_num_stages(host_); }
  int64_t parameter_count() const noexcept { return ::weft::host::parameter_count(host_); }
  weft_parameter_info parameter_info(int64_t index) const {
    weft_parameter_info out{};
    check(::weft::host::parameter_info(host_, index, &out));
    return out;
  }
  // Views of this rank's master copy / gradient; see services.h for how long they stay valid.
  DLTensor parameter_data(int64_t index) const {
    DLTensor out{};
    check(::weft::host::parameter_data(host_, index, &out));
    return out;
  }
  DLTensor parameter_grad(int64_t index) const {
    DLTensor out{};
    check(::weft::host::parameter_grad(host_, index, &out));
    return out;
  }
  // `user_data` must outlive the registration (unregister with callback = nullptr, e.g. in
  // the strategy's destructor).
  void set_grad_ready_callback(weft_grad_ready_fn callback, void* user_data) const {
    check(::weft::host::set_grad_ready_callback(host_, callback, user_data));
  }

  // --- the step ---
  Batch batch(int32_t micro_batch, int32_t split = 0, int32_t splits = 1) const {
    weft_activation* inputs = nullptr;
    weft_activation* targets = nullptr;
    check(::weft::host::batch(host_, micro_batch, split, splits, &inputs, &targets));
    return Batch{activation(inputs), activation(targets)};
  }
  Activation forward(int64_t first_stage, int64_t last_stage, const Activation& input,
                     uint32_t flags = 0) const {
    weft_activation* out = nullptr;
    check(::weft::host::forward(host_, first_stage, last_stage, input.get(), flags, &out));
    return activation(out);
  }
  Loss loss(const Activation& logits, const Activation& targets, double scale) const {
    weft_activation* out = nullptr;
    double value = 0.0;
    int64_t tokens = 0;
    check(::weft::host::loss(host_, logits.get(), targets.get(), scale, &out, &value, &tokens));
    Loss result;
    result.loss = activation(out);
    result.value = value;
    result.tokens = tokens;
    return result;
  }
  // From a scalar loss.
  void backward(const Activation& loss) const {
    check(::weft::host::backward(host_, loss.get(), nullptr));
  }
  // From a stage output and the gradient received for it.
  void backward(const Activation& output, const Activation& grad_output) const {
    check(::weft::host::backward(host_, output.get(), grad_output.get()));
  }
  // A read-only view, valid while `activation` is not released.
  DLTensor activation_view(const Activation& activation) const {
    DLTensor out{};
    check(::weft::host::activation_view(host_, activation.get(), &out));
    return out;
  }
  Activation activation_grad(const Activation& input) const {
    weft_activation* out = nullptr;
    check(::weft::host::activation_grad(host_, input.get(), &out));
    return activation(out);
  }
  // A received stage input takes the layout of the same micro-batch's batch() inputs (packed rows).
  void share_layout(const Activation& to, const Activation& from) const {
    check(::weft::host::activation_share_layout(host_, to.get(), from.get()));
  }
  Activation activation_from_tensor(const DLTensor& data, bool requires_grad) const {
    weft_activation* out = nullptr;
    check(::weft::host::activation_from_tensor(host_, &data, requires_grad ? 1 : 0, &out));
    return activation(out);
  }

  // The model's shape (from plan on).
  weft_model_info model_info() const {
    weft_model_info out{};
    out.struct_size = sizeof(weft_model_info);
    check(::weft::host::model_info(host_, &out));
    return out;
  }
  // Opens / closes a trace span on the calling thread (no-op with tracing off). Prefer TraceSpan.
  void trace_begin(const char* category, const char* name) const noexcept {
    ::weft::host::trace_begin(host_, category, name);
  }
  void trace_end() const noexcept { ::weft::host::trace_end(host_); }
  // Adds a value to this step's metrics ("plugin.<name>").
  void report_metric(const char* name, double value) const { check(::weft::host::report_metric(host_, name, value)); }

  // Seconds per model stage (see services.h); `count` = the number of model stages.
  std::vector<double> profile_stages(int64_t count, int64_t rows = 0, int32_t repeats = 3) const {
    std::vector<double> seconds(static_cast<size_t>(count), 0.0);
    check(::weft::host::profile_stages(host_, rows, repeats, seconds.data(), count));
    return seconds;
  }

  // --- memory where the model is, and operations on views (services.h) ---
  // A zero-filled contiguous buffer of `shape` and `dtype` on the rank's device.
  Buffer buffer(const std::vector<int64_t>& shape, DLDataType dtype) const {
    Buffer buffer;
    buffer.host_ = host_;
    check(::weft::host::buffer_create(host_, static_cast<int32_t>(shape.size()), shape.data(), dtype, &buffer.handle_,
                                      &buffer.view_));
    return buffer;
  }
  // dst = src, element by element (same element count and dtype).
  void copy(DLTensor& dst, const DLTensor& src) const { check(::weft::host::tensor_copy(host_, &dst, &src)); }
  // tensor *= factor (0: zeros).
  void scale(DLTensor& tensor, double factor) const { check(::weft::host::tensor_scale(host_, &tensor, factor)); }
  // dst += alpha * src.
  void add(DLTensor& dst, const DLTensor& src, double alpha) const {
    check(::weft::host::tensor_add(host_, &dst, &src, alpha));
  }
  // Sum of squares in fp64.
  double squared_norm(const DLTensor& tensor) const {
    double out = 0.0;
    check(::weft::host::tensor_squared_norm(host_, &tensor, &out));
    return out;
  }

  // --- sharded training state (services.h) ---
  // This rank's master copy of the parameter's shard (1-D).
  DLTensor parameter_shard(int64_t index) const { return view(::weft::host::parameter_shard, index); }
  // The gradient of the parameter's shard (1-D fp32; zero at the start of a step).
  DLTensor parameter_grad_shard(int64_t index) const { return view(::weft::host::parameter_grad_shard, index); }
  // Frees the parameter's whole gradient.
  void release_parameter_grad(int64_t index) const { check(::weft::host::parameter_grad_release(host_, index)); }
  // Frees the whole parameter (a RELEASABLE shard).
  void release_parameter(int64_t index) const { check(::weft::host::parameter_release(host_, index)); }
  // Whole storage again, contents undefined until the caller fills it; returns its view.
  DLTensor materialize_parameter(int64_t index) const { return view(::weft::host::parameter_materialize, index); }

  // The host's estimate for model stage `stage` as this rank would hold it (from memory_plan on).
  weft_stage_memory stage_memory(int64_t stage) const {
    weft_stage_memory out{};
    out.struct_size = sizeof(weft_stage_memory);
    check(::weft::host::stage_memory(host_, stage, &out));
    return out;
  }

  // The split backward of zero-bubble schedules (needs plan.split_backward = 1): the input
  // gradients now (from a scalar loss, or from a stage output with its received gradient), the
  // linear weights' gradients later, from the returned pass.
  WeightPass backward_input(const Activation& loss) const {
    weft_weight_pass* pass = nullptr;
    check(::weft::host::backward_input(host_, loss.get(), nullptr, &pass));
    return WeightPass(host_, pass);
  }
  WeightPass backward_input(const Activation& output, const Activation& grad_output) const {
    weft_weight_pass* pass = nullptr;
    check(::weft::host::backward_input(host_, output.get(), grad_output.get(), &pass));
    return WeightPass(host_, pass);
  }
  // Computes and accumulates the pass's weight gradients; consumes it.
  void backward_weight(WeightPass& pass) const { check(::weft::host::backward_weight(host_, pass.release())); }

  // The gradient of parameter `index` this step left: false (out untouched) where the parameter
  // has no gradient this step.
  bool step_gradient(int64_t index, DLTensor& out) const {
    DLTensor view{};
    weft_status* status = ::weft::host::parameter_grad(host_, index, &view);
    if (status != nullptr && ::weft::status_code(status) == WEFT_STATUS_INVALID_ARGUMENT) {
      ::weft::status_release(status);
      return false;
    }
    check(status);
    out = view;
    return true;
  }

  // Adopts raw handles this host created.
  Activation activation(weft_activation* handle) const noexcept {
    return Activation(host_, handle);
  }
  Work work(weft_work* handle) const noexcept { return Work(host_, handle); }

 private:
  DLTensor view(weft_status* (*service)(weft_host*, int64_t, DLTensor*), int64_t index) const {
    DLTensor out{};
    check(service(host_, index, &out));
    return out;
  }

  weft_host* host_;
};

// A trace span for the lifetime of the object (Host::trace_begin / trace_end).
class TraceSpan {
 public:
  TraceSpan(const Host& host, const char* category, const char* name) noexcept : host_(host) {
    host_.trace_begin(category, name);
  }
  TraceSpan(const Host& host, const char* category, const std::string& name) noexcept
      : TraceSpan(host, category, name.c_str()) {}
  ~TraceSpan() { host_.trace_end(); }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Host host_;
};

inline void Work::wait() const {
  if (handle_ == nullptr) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "wait on an empty Work");
  Host(host_).check(::weft::host::work_wait(host_, handle_));
}

// Logging, printf-style: WEFT_LOG_INFO(host(), "step %lld: loss %.4f", s, loss). `host` is a
// weft::sdk::Host; messages longer than 1023 bytes are truncated.
namespace detail {
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 3, 4)))
#endif
inline void log_printf(const Host& host, weft_log_level level, const char* format, ...) noexcept {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  const int written = std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  host.log(level, written < 0 ? format : buffer);
}
}  // namespace detail

#define WEFT_LOG_DEBUG(host, ...) ::weft::sdk::detail::log_printf((host), WEFT_LOG_DEBUG, __VA_ARGS__)
#define WEFT_LOG_INFO(host, ...) ::weft::sdk::detail::log_printf((host), WEFT_LOG_INFO, __VA_ARGS__)

// ------------------------------------------------------------------------------------------
// Strategy: the base class of C++ plugins
// ------------------------------------------------------------------------------------------

// The result of Strategy::eval_step.
struct EvalResult {
  double loss_sum = 0.0;  // sum of token losses over the global batch
  int64_t tokens = 0;     // target tokens over the global batch
};

// The host's step: one per process, made by create_abi2_step (core/plugin/abi2.h) over the
// session's Host; the constructor validates the layout and the world size (throwing
// Error(BAD_CONFIG, ...)). The strategy session calls these methods from one thread at a time.
class Strategy {
 public:
  explicit Strategy(Host host) noexcept : host_(host) {}
  virtual ~Strategy() = default;
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  const Host& host() const noexcept { return host_; }

  // Which stages this rank holds, its data-parallel coordinates and its sequence splits; `plan`
  // arrives pre-filled with the one-process layout. Default: leave it (the one-process layout).
  virtual void plan(weft_model_plan& plan) { (void)plan; }
  // How this rank holds a parameter. Default: the whole tensor.
  virtual weft_shard shard_parameter(const weft_parameter_info& info) {
    (void)info;
    return weft_shard{0, 1, 0};
  }
  // After the model is built and its weights loaded. Default: nothing.
  virtual void setup() {}
  // One training step: its micro-batches' forward and backward passes, gradients left for the
  // optimizer. Returns the step's mean loss.
  virtual double train_step(const weft_step_info& step) = 0;
  // One evaluation batch: its summed token loss and token count over the ranks that share it.
  virtual EvalResult eval_step(const weft_step_info& step) = 0;
  // The global squared gradient norm from this rank's share. Default: local_sq.
  virtual double global_grad_norm_sq(double local_sq) { return local_sq; }
  // Communication at a fixed point of the model, in place. Default: nothing.
  virtual void comm_point(weft_comm_point point, weft_direction direction, int64_t layer,
                          DLTensor& tensor) {
    (void)point;
    (void)direction;
    (void)layer;
    (void)tensor;
  }
  // --- sharded training state (services.h) ---
  // Which elements of parameter `index` this rank keeps. Default: all of them, no flags.
  virtual weft_flat_shard flat_shard(int64_t index) {
    const DLTensor data = host_.parameter_data(index);
    return weft_flat_shard{0, detail::elements_of(data), 0u, 0u};
  }
  // After every optimizer step. Collective. Default: nothing.
  virtual void after_optimizer_step() {}
  // Parameters whole (true) or back to the plugin's layout (false). Collective. Default: nothing.
  virtual void materialize_parameters(bool whole) { (void)whole; }
  // Adjusts this rank's memory plan (pre-filled by the host). Not collective. Default: nothing.
  virtual void memory_plan(weft_memory_plan& plan) { (void)plan; }
  // --- sequence parallelism (services.h) ---
  // The all-to-all between the ranks that split the same sequences. Default: refuses (only a
  // plugin whose plan splits sequences is asked).
  virtual void context_exchange(int64_t layer, weft_direction direction, const DLTensor& send, DLTensor& recv) {
    (void)layer;
    (void)direction;
    (void)send;
    (void)recv;
    throw Error(WEFT_STATUS_UNSUPPORTED, "context_exchange: this plugin does not split sequences");
  }
  // --- ring attention (services.h) ---
  // The attention core over this rank's queries (weft_attention_call). Default: refuses (only a
  // plugin whose plan chose WEFT_CONTEXT_ATTENTION_PLUGIN is asked).
  virtual void context_attention(const weft_attention_call& call) {
    (void)call;
    throw Error(WEFT_STATUS_UNSUPPORTED, "context_attention: this plugin does not run the attention core");
  }
  // --- Megatron sequence parallelism (services.h) ---
  // The all-gather (output has one more dimension than input) or reduce-scatter (input has one
  // more) over the tensor-sequence group at `point`. Default: refuses (only a plugin whose plan
  // chose sequence_parallel_size > 1 is asked).
  virtual void sequence_region(weft_comm_point point, weft_direction direction, int64_t layer, const DLTensor& input,
                               DLTensor& output) {
    (void)point;
    (void)direction;
    (void)layer;
    (void)input;
    (void)output;
    throw Error(WEFT_STATUS_UNSUPPORTED, "sequence_region: this plugin does not split sequences between regions");
  }
  // Whether the model runs comm_point and sequence_region at its points (a step whose plugin
  // hooks them); without, the model skips them. Default: false.
  virtual bool runs_model_points() const { return false; }

 private:
  Host host_;
};

namespace detail {

// Runs `body`, turning every exception into a host status (NULL on success).
template <class Body>
weft_status* guarded(Body&& body) noexcept {
  try {
    body();
    return nullptr;
  } catch (const Error& e) {
    return ::weft::status_create(e.code(), e.what());
  } catch (const std::exception& e) {
    return ::weft::status_create(WEFT_STATUS_INTERNAL, e.what());
  } catch (...) {
    return ::weft::status_create(WEFT_STATUS_INTERNAL, "unknown exception");
  }
}

}  // namespace detail
}  // namespace sdk
}  // namespace weft

#endif  // WEFT_CORE_PLUGIN_STEP_STEP_HPP
