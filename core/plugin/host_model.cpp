// The host services for the model and the step: parameters and their gradients, batches, forward, loss, backward and activations, the model's shape and stage timings.
#include "core/plugin/host_services.h"

#include <chrono>
#include <mutex>

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include "core/data/loader.h"
#include "core/model/profile.h"

namespace weft {
static_assert(kIgnoreTarget == kUnlabeledTarget, "the model ignores the targets the data leaves unlabeled");
namespace host {
namespace {

// Adds the wall time of its scope to the forward or backward seconds of `s` (on the CPU only).
class ComputeTimer {
 public:
  ComputeTimer(State& s, bool backward)
      : s_(s), backward_(backward), timed_(s.device.is_cpu()), start_(std::chrono::steady_clock::now()) {}
  ~ComputeTimer() {
    if (!timed_) return;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::lock_guard<std::mutex> lock(s_.compute_mutex);
    (backward_ ? s_.compute.backward_seconds : s_.compute.forward_seconds) += seconds;
    s_.compute.timed = true;
  }

 private:
  State& s_;
  bool backward_, timed_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace


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

ParameterEntry& parameter_at(State& s, int64_t index) {
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
    info.dtype = sdk::to_dl_dtype(p.tensor.scalar_type());
    *out = info;
  });
}

weft_status* parameter_data(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_data: null output");
    auto& s = state_of(host);
    const auto& tensor = parameter_at(s, index).tensor;
    // The plugin may write a frozen weight through this view, which no version counter sees: the
    // model's kept casts of frozen weights (model.cache_frozen_casts) are made again from it.
    if (!tensor.requires_grad() && s.model != nullptr) s.model->drop_frozen_casts();
    *out = sdk::to_dl_view(tensor);
  });
}

weft_status* parameter_grad(weft_host* host, int64_t index, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "parameter_grad: null output");
    const auto& p = parameter_at(state_of(host), index);
    const auto& grad = p.tensor.grad();
    WEFT_CHECK(grad.defined(), "parameter '{}' has no gradient yet (before the first backward of the step, or "
               "released)", p.name);
    *out = sdk::to_dl_view(grad);
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
        [state, index](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& inputs) {
          // A split backward's input pass reaches a deferred weight with no gradient: ready later.
          if (inputs.empty() || !inputs[0].defined()) return outputs;
          if (state->grad_ready) state->grad_ready(state->grad_ready_user, index);
          return outputs;
        }));
    s.grad_accumulators.push_back(std::move(accumulator));
  }
}



weft_status* batch(weft_host* host, int32_t micro_batch, int32_t split, int32_t splits,
                   weft_activation** inputs, weft_activation** targets) {
  return guarded([&] {
    WEFT_CHECK(inputs && targets, "batch: null outputs");
    auto& s = state_of(host);
    WEFT_CHECK(splits >= 1 && 0 <= split && split < splits, "batch: split {} of {} is invalid", split, splits);
    Batch b;
    std::vector<int64_t> sequences;  // evaluation: the index of each row's sequence
    if (s.train_loader) {
      WEFT_CHECK(0 <= micro_batch && micro_batch < s.micro_batches, "batch: micro-batch {} outside [0, {})",
                 micro_batch, s.micro_batches);
      b = s.train_loader->batch(s.epoch, s.index * s.micro_batches + micro_batch);
    } else {
      WEFT_CHECK(s.eval_loader != nullptr, "batch: called outside a step");
      WEFT_CHECK(micro_batch == 0, "batch: an evaluation step has one micro-batch");
      sequences = s.eval_loader->sequence_indices(s.index);
      b = make_batch(s.eval_loader->sequences(), sequences);
    }
    const int64_t rows = b.inputs.size(0);
    WEFT_CHECK(rows % splits == 0, "batch: {} rows cannot be split into {} equal parts", rows, splits);
    const int64_t part = rows / splits;
    if (!sequences.empty()) {
      sequences = std::vector<int64_t>(sequences.begin() + split * part, sequences.begin() + (split + 1) * part);
    }
    auto rows_inputs = b.inputs.narrow(0, split * part, part), rows_targets = b.targets.narrow(0, split * part, part);
    const auto rows_positions = b.positions.defined() ? b.positions.narrow(0, split * part, part) : at::Tensor();
    if (const int64_t prompt = s.model != nullptr ? s.model->options().prompt_tokens : 0; prompt > 0) {
      WEFT_CHECK(!rows_positions.defined(), "prompt tuning with packed rows (data.packing) is not supported");
      // Prompt tuning: the virtual tokens' slots (-1..-P) before each row, their targets ignored.
      const auto slots = -torch::arange(1, prompt + 1, torch::kLong).expand({part, prompt});
      rows_inputs = torch::cat({slots, rows_inputs}, 1);
      rows_targets = torch::cat({torch::full({part, prompt}, kIgnoreTarget, torch::kLong), rows_targets}, 1);
    }
    if (s.context.size > 1) {  // context parallelism: this rank's tokens of every row, in its layout
      const auto positions = s.context.positions(rows_inputs.size(1));
      rows_inputs = rows_inputs.index_select(1, positions);
      rows_targets = rows_targets.index_select(1, positions);
    }
    *inputs = new_activation(rows_inputs.contiguous().to(s.device));
    if (rows_positions.defined()) (*inputs)->positions = rows_positions.contiguous().to(s.device);
    *targets = new_activation(rows_targets.contiguous().to(s.device), std::move(sequences));
  });
}

weft_status* forward(weft_host* host, int64_t first, int64_t last, weft_activation* input, uint32_t flags,
                     weft_activation** output) {
  return guarded([&] {
    WEFT_CHECK(output, "forward: null output");
    auto& s = state_of(host);
    WEFT_CHECK(s.model != nullptr, "forward: the model is not built yet");
    WEFT_CHECK((flags & ~(WEFT_FORWARD_NO_GRAD | WEFT_FORWARD_RECOMPUTE)) == 0, "forward: unknown flags {:#x}", flags);
    const ComputeTimer timer(s, /*backward=*/false);
    const auto& x = tensor_of(input);
    const auto& positions = input->positions;  // packed rows: passed on to the next stage's input
    // Not where a plugin releases the head's parameters between its stage's forward and the loss
    // (a releasable flat shard): there the head runs in the forward.
    const auto head_resident = [&] {
      const auto* head = s.model->head_weight().unsafeGetTensorImpl();
      return std::none_of(s.parameters.begin(), s.parameters.end(), [&](const ParameterEntry& p) {
        return p.releasable && p.tensor.unsafeGetTensorImpl() == head;
      });
    };
    // The LM head is left to loss(), which runs it with the cross-entropy in row chunks.
    const bool head = !(last == s.model->num_stages() && s.model->fuses_head_loss() && head_resident());
    torch::Tensor y;
    if (flags & WEFT_FORWARD_NO_GRAD) {
      torch::NoGradGuard no_grad;
      y = s.model->forward_stages(first, last, x, positions, head);
    } else {
      const bool was = s.model->options().activation_checkpointing;
      if (flags & WEFT_FORWARD_RECOMPUTE) s.model->set_activation_checkpointing(true);
      try {
        y = s.model->forward_stages(first, last, x, positions, head);
      } catch (...) {
        s.model->set_activation_checkpointing(was);
        throw;
      }
      s.model->set_activation_checkpointing(was);
    }
    if (head) {
      *output = new_activation(std::move(y));
    } else {
      *output = new_activation(torch::Tensor());
      (*output)->head_input = std::move(y);
      (*output)->head = [model = s.model](const at::Tensor& h) { return model->head_logits(h); };
    }
    (*output)->positions = positions;
  });
}

weft_status* loss(weft_host* host, weft_activation* logits, weft_activation* targets, double scale,
                  weft_activation** loss_out, double* value_out, int64_t* tokens_out) {
  return guarded([&] {
    const auto& t = tensor_of(targets);
    auto& s = state_of(host);
    WEFT_CHECK(s.model != nullptr, "loss: the model is not built yet");
    const ComputeTimer timer(s, /*backward=*/false);
    WEFT_CHECK(logits != nullptr, "loss: null logits");
    // A deferred head (forward() left it to the loss): its product and the cross-entropy in row chunks.
    const bool deferred = !logits->tensor.defined() && logits->head_input.defined();
    if (!s.model->config().classification()) ++(deferred ? s.chunked_head_losses : s.logits_head_losses);
    at::Tensor mean;
    if (s.sequence_loss_sums.defined() && !targets->sequences.empty()) {
      // Evaluation that records each sequence's loss: per-token losses once, summed per row.
      // (classification: one labeled position per row, whose head outputs are recorded too)
      const bool classify = s.model->config().classification();
      at::Tensor token_losses;
      if (deferred) {
        s.model->head_loss(logits->head_input, t, &token_losses);
      } else {
        token_losses = s.model->token_losses(tensor_of(logits), t);
      }
      const auto tokens = token_losses.reshape({t.size(0), classify ? 1 : -1}).to(torch::kCPU, torch::kFloat64);
      const auto rows = torch::tensor(targets->sequences, torch::kLong);
      s.sequence_loss_sums.index_add_(0, rows, tokens.sum(1));
      if (classify && s.sequence_outputs.defined()) {
        s.sequence_outputs.index_add_(0, rows, s.model->labeled_rows(tensor_of(logits), t).first.to(torch::kCPU, torch::kFloat64));
      }
      // Context parallelism: this rank summed 1/size of each sequence's tokens, so it counts as
      // 1/size of a computation (the world's sums then hold each sequence once).
      s.sequence_counts.index_add_(0, rows, torch::full({rows.size(0)}, 1.0 / static_cast<double>(s.context.size),
                                                        torch::kFloat64));
      mean = tokens.mean();  // in float64, as the per-sequence sums
    } else {
      mean = deferred ? s.model->head_loss(logits->head_input, t)
                      : s.model->loss(tensor_of(logits), t);  // vocabulary-parallel: shards combined at comm points
    }
    // Classification counts its labeled positions (one per sequence), language modelling the targets
    // its loss counts: every position of text, the trained ones of chat data.
    const bool classify = s.model->config().classification();
    const int64_t counted = classify || s.masked_targets ? (t != kIgnoreTarget).sum().item<int64_t>() : t.numel();
    double value = mean.item<double>();
    if (!classify && s.masked_targets) {
      if (s.train_loader != nullptr) {  // the step's token-weighted mean (State::loss_weight)
        mean = mean * s.loss_weight;
        value *= s.loss_weight;
      } else {  // evaluation sums value x tokens: the mean over the counted targets
        value = counted > 0 ? value * static_cast<double>(t.numel()) / static_cast<double>(counted) : 0.0;
      }
    }
    if (loss_out) *loss_out = new_activation(mean * (scale * s.loss_scale));
    if (value_out) *value_out = value;
    if (tokens_out) *tokens_out = counted;
  });
}

namespace {

// Back-propagates from a scalar `output` (no gradient) or from `output` with `grad_output`,
// timed as this rank's backward compute; an `output` that needs no gradient takes none.
void run_backward(State& s, weft_activation* output, weft_activation* grad_output, const char* what) {
  const ComputeTimer timer(s, /*backward=*/true);
  const auto& out = tensor_of(output);
  // Nothing before it trains (a pipeline part holding a frozen embedding alone): nothing to do.
  if (grad_output != nullptr && !out.requires_grad()) return;
  if (grad_output == nullptr) {
    WEFT_CHECK(out.numel() == 1, "{} without a gradient needs a scalar output", what);
    out.backward();
  } else {
    torch::autograd::backward({out}, {tensor_of(grad_output)});
  }
}

}  // namespace

weft_status* backward(weft_host* host, weft_activation* output, weft_activation* grad_output) {
  return guarded([&] { run_backward(state_of(host), output, grad_output, "backward"); });
}

weft_status* backward_input(weft_host* host, weft_activation* output, weft_activation* grad_output,
                            weft_weight_pass** pass_out) {
  return guarded([&] {
    WEFT_CHECK(pass_out != nullptr, "backward_input: null pass_out");
    auto& s = state_of(host);
    WEFT_CHECK(s.model != nullptr && s.model->options().deferrable_weight_grads,
               "backward_input: the plan did not ask for a split backward (weft_model_plan.split_backward = 1)");
    auto pass = std::make_unique<weft_weight_pass>();
    {
      const DeferWeightGradients defer(pass->queue);
      run_backward(s, output, grad_output, "backward_input");
    }
    *pass_out = pass.release();
  });
}

weft_status* backward_weight(weft_host* host, weft_weight_pass* pass) {
  std::unique_ptr<weft_weight_pass> owned(pass);
  return guarded([&] {
    WEFT_CHECK(owned != nullptr, "backward_weight: null pass");
    const ComputeTimer timer(state_of(host), /*backward=*/true);
    owned->queue.run();
  });
}

void weight_pass_release(weft_host*, weft_weight_pass* pass) { delete pass; }

weft_status* activation_view(weft_host*, weft_activation* activation, DLTensor* out) {
  return guarded([&] {
    WEFT_CHECK(out, "activation_view: null output");
    WEFT_CHECK(activation != nullptr && (activation->tensor.defined() || activation->head_input.defined()),
               "activation_view: empty activation");
    tensor_of(activation);  // a deferred head's logits, made
    auto& t = activation->tensor;
    if (!t.is_contiguous()) t = t.contiguous();
    *out = sdk::to_dl_view(t);  // t, not a detached copy: the view points into its sizes and strides
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

weft_status* activation_from_tensor(weft_host* host, const DLTensor* data, int32_t requires_grad, weft_activation** out) {
  return guarded([&] {
    WEFT_CHECK(data && out, "activation_from_tensor: null argument");
    auto copy = sdk::from_dl_view(*data).to(state_of(host).device, /*non_blocking=*/false, /*copy=*/true);
    if (requires_grad) copy.set_requires_grad(true);
    *out = new_activation(copy);
  });
}

weft_status* activation_share_layout(weft_host*, weft_activation* to, const weft_activation* from) {
  return guarded([&] {
    WEFT_CHECK(to != nullptr && from != nullptr, "activation_share_layout: null activation");
    to->positions = from->positions;
  });
}

void activation_release(weft_host*, weft_activation* activation) { delete activation; }

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

weft_status* profile_stages(weft_host* host, int64_t rows, int32_t repeats, double* seconds_out, int64_t count) {
  return guarded([&] {
    auto& s = state_of(host);
    WEFT_CHECK(s.model_config != nullptr, "profile_stages: the model's shape is known from plan on");
    const int64_t stages = s.model_config->num_hidden_layers + 2;
    WEFT_CHECK(seconds_out != nullptr && count == stages, "profile_stages: count must be {} (the model's stages)",
               stages);
    WEFT_CHECK(repeats >= 1 && rows >= 0, "profile_stages: repeats must be >= 1 and rows >= 0");
    const auto dtype = sdk::from_dl_dtype(s.model_info.compute_dtype);
    const auto seconds = profile_stage_seconds(*s.model_config, dtype, rows > 0 ? rows : std::max<int64_t>(s.batch_rows, 1),
                                               std::max<int64_t>(s.seq_len, 1), repeats);
    std::copy(seconds.begin(), seconds.end(), seconds_out);
  });
}

}  // namespace host
}  // namespace weft
