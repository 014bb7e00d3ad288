#include "core/plugin/abi2_slices.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/plugin/host_services.h"

namespace weft {

void abi2_check(const Abi2Instance& o, weft_status* status, const char* what) {
  if (status == nullptr) return;
  const weft_status_code code = status_code(status);
  const std::string message = status_message(status);
  status_release(status);
  throw sdk::Error(code, what ? fmt::format("{} ({}): {}", o.name(), what, message) : message);
}

weft_parameter_layout abi2_placement(const Abi2Instance& o, const weft_parameter_info& info) {
  weft_parameter_layout where{};
  if (const auto place = reinterpret_cast<weft_place_fn>(o.proc("weft_place"))) {
    const weft_parameter_desc desc = abi2_parameter_desc(info);
    abi2_check(o, place(o.instance, &desc, &where), "weft_place");
  }
  return where;
}

void abi2_register_hooks(Abi2Instance& o, const std::vector<std::string>& published, std::vector<Abi2Hook>& out) {
  const auto fn = reinterpret_cast<weft_hooks_fn>(o.proc("weft_hooks"));
  if (fn == nullptr) return;
  int32_t count = 0;
  const weft_hook* hooks = fn(o.instance, &count);
  if (count > 0 && hooks == nullptr) {
    throw sdk::Error(WEFT_STATUS_INVALID_ARGUMENT, fmt::format("{}: weft_hooks gave {} hooks but no array", o.name(), count));
  }
  for (int32_t k = 0; k < count; ++k) {
    const weft_hook& hook = hooks[k];
    const std::string point = hook.point ? hook.point : "";
    if (std::find(published.begin(), published.end(), point) == published.end()) {
      throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                       fmt::format("{} registers a hook at \"{}\", a point this host (ABI 2.{}) does not publish "
                                   "(it publishes: {})",
                                   o.name(), point, WEFT_PLUGIN_ABI_MINOR, fmt::join(published, ", ")));
    }
    if (hook.fn == nullptr) {
      throw sdk::Error(WEFT_STATUS_INVALID_ARGUMENT, fmt::format("{}: its hook at \"{}\" is NULL", o.name(), point));
    }
    out.push_back({point, hook.fn, &o});
  }
}

int64_t abi2_plugin_memory(const Abi2Instance& o, const weft_memory_plan& plan, int64_t tokens, int32_t compute_bytes) {
  const auto fn = reinterpret_cast<weft_memory_fn>(o.proc("weft_memory"));
  if (fn == nullptr) return 0;
  weft_memory_request request{};
  request.struct_size = sizeof request;
  request.rows_per_micro_batch = plan.rows_per_micro_batch;
  request.tokens = tokens;
  request.compute_bytes = compute_bytes;
  int64_t bytes = 0;
  abi2_check(o, fn(o.instance, &request, &bytes), "weft_memory");
  if (bytes < 0) throw sdk::Error(WEFT_STATUS_INVALID_ARGUMENT, fmt::format("{}: weft_memory gave {} bytes", o.name(), bytes));
  return bytes;
}

namespace {

// An event of step `step`, its point's name set per hook by run_at.
weft_hook_event event_of(int64_t step) {
  weft_hook_event event{};
  event.struct_size = sizeof event;
  event.step = step;
  return event;
}

// Every hook at `point`, in registration order, given `event`.
void run_at(const std::vector<Abi2Hook>& hooks, const std::string& point, weft_hook_event event) {
  for (const Abi2Hook& hook : hooks) {
    if (hook.point != point) continue;
    event.point = hook.point.c_str();
    abi2_check(*hook.owner, hook.fn(hook.owner->instance, &event), hook.point.c_str());
  }
}

}  // namespace

void abi2_run_step_hooks(const std::vector<Abi2Hook>& hooks, const char* point, int64_t step) {
  run_at(hooks, point, event_of(step));
}

void abi2_run_model_hooks(const std::vector<Abi2Hook>& hooks, const std::string& point, bool backward, int64_t layer,
                          DLTensor& tensor, const DLTensor* source, int64_t step) {
  weft_hook_event event = event_of(step);
  event.backward = backward ? 1 : 0;
  event.layer = layer;
  event.tensor = &tensor;
  event.source = source;
  run_at(hooks, point, event);
}

SequenceSplit::SequenceSplit(Abi2Instance& cp, sdk::Group group, std::vector<Abi2Hook>& hooks)
    : cp_(cp), group_(group), hooks_(hooks) {
  std::vector<std::string> published = {"train.begin", "step.end"};
  published.insert(published.end(), attention_point_names().begin(), attention_point_names().end());
  abi2_register_hooks(cp, published, hooks);
  const auto count = [&](const std::string& point) {
    return std::count_if(hooks.begin(), hooks.end(), [&](const Abi2Hook& h) { return h.owner == &cp && h.point == point; });
  };
  const auto exchanges = count("attention.exchange"), cores = count("attention.core");
  const auto refuse = [&](const std::string& why) {
    throw sdk::Error(WEFT_STATUS_BAD_CONFIG, fmt::format("{} splits sequences but {}", cp.name(), why));
  };
  if (exchanges == 0 && cores == 0) {
    refuse("hooks neither \"attention.exchange\" (all-to-alls around the core) nor \"attention.core\" (its own "
           "attention core): the attention needs every token");
  }
  if (exchanges > 0 && cores > 0) refuse("hooks both \"attention.exchange\" and \"attention.core\" (one of them)");
  if (cores > 1) refuse(fmt::format("has {} hooks at \"attention.core\", which one computes", cores));
  plugin_attention_ = cores == 1;
  if (!plugin_attention_ && cp.layout.batch_split == WEFT_SPLIT_SEQUENCE_BALANCED) {
    refuse("asks for the balanced split (WEFT_SPLIT_SEQUENCE_BALANCED) with \"attention.exchange\", whose all-to-alls "
           "move contiguous shares: the balanced split needs its own attention core (\"attention.core\")");
  }
}

void SequenceSplit::plan(weft_model_plan& plan) const {
  if (group_.size() <= 1) return;
  plan.context_parallel_size = group_.size();
  plan.context_parallel_rank = group_.rank();
  plan.context_parallel_layout =
      cp_.layout.batch_split == WEFT_SPLIT_SEQUENCE_BALANCED ? WEFT_CONTEXT_BALANCED : WEFT_CONTEXT_CONTIGUOUS;
  plan.context_parallel_attention = plugin_attention_ ? WEFT_CONTEXT_ATTENTION_PLUGIN : WEFT_CONTEXT_ATTENTION_EXCHANGE;
}

void SequenceSplit::exchange(int64_t step, int64_t layer, weft_direction direction, const DLTensor& send,
                             DLTensor& recv) const {
  abi2_run_model_hooks(hooks_, "attention.exchange", direction == WEFT_BACKWARD, layer, recv, &send, step);
}

void SequenceSplit::attention(int64_t step, const weft_attention_call& call) const {
  weft_attention_core core{};
  core.struct_size = sizeof core;
  core.scale = call.scale;
  core.q = call.q;
  core.k = call.k;
  core.v = call.v;
  core.out = call.out;
  core.lse = call.lse;
  core.grad_out = call.grad_out;
  core.grad_q = call.grad_q;
  core.grad_k = call.grad_k;
  core.grad_v = call.grad_v;
  weft_hook_event event = event_of(step);
  event.backward = call.direction == WEFT_BACKWARD ? 1 : 0;
  event.layer = call.layer;
  event.attention = &core;
  run_at(hooks_, "attention.core", event);
}

void abi2_check_sequence_hooks(const Abi2Instance& tp, const std::vector<Abi2Hook>& hooks, int32_t ranks) {
  if (tp.layout.sequence_parallel == 0 || ranks <= 1) return;
  std::vector<std::string> missing;
  for (CommPoint p : {CommPoint::kEmbeddingOutput, CommPoint::kAttentionInput, CommPoint::kAttentionOutput,
                      CommPoint::kMlpInput, CommPoint::kMlpOutput, CommPoint::kHeadInput}) {
    const std::string& point = comm_point_name(p);
    const bool hooked = std::any_of(hooks.begin(), hooks.end(), [&](const Abi2Hook& h) { return h.point == point && h.owner == &tp; });
    if (!hooked) missing.push_back(point);
  }
  if (!missing.empty()) {
    throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                     fmt::format("{} asks for sequence parallelism (weft_layout.sequence_parallel) but has no hook at {}, "
                                 "where the tokens move",
                                 tp.name(), fmt::join(missing, ", ")));
  }
}

ParameterShard TensorSlices::slice_of(const std::string& parameter, int32_t ndim, const weft_parameter_layout& where) const {
  const int32_t size = group_.size();
  const auto refuse = [&](const char* what, int32_t kind, const std::string& why) {
    throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                     fmt::format("{} places the {} of {} as {}, which this host (ABI 2.{}) does not execute on the "
                                 "tensor-parallel dimension ({})",
                                 tp_.name(), what, parameter, abi2_placement_name(kind), WEFT_PLUGIN_ABI_MINOR, why));
  };
  const weft_placement p = where.parameter;
  if (p.kind != WEFT_PLACE_SLICE && p.kind != WEFT_PLACE_REPLICATE) {
    refuse("parameter", p.kind, "a parameter is SLICE or REPLICATE there");
  }
  ParameterShard shard;
  if (p.kind == WEFT_PLACE_SLICE) {
    const int32_t parts = where.slice_parts > 0 ? where.slice_parts : size;
    if (p.dim < 0 || p.dim >= ndim || parts < 1 || size % parts != 0) {
      throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                       fmt::format("{} places {} as SLICE along dimension {} in {} parts, which a tensor of {} "
                                   "dimensions over {} ranks cannot be (the parts divide the ranks)",
                                   tp_.name(), parameter, p.dim, parts, ndim, size));
    }
    shard = ParameterShard{p.dim, parts, group_.rank() * parts / size};
  }
  const weft_placement g = where.gradient, o = where.optimizer_state;
  if (g.kind != WEFT_PLACE_PARTIAL && (g.kind != p.kind || (p.kind == WEFT_PLACE_SLICE && g.dim != p.dim))) {
    refuse("gradient", g.kind, "a gradient is placed as its parameter, or PARTIAL");
  }
  if (o.kind != p.kind || (p.kind == WEFT_PLACE_SLICE && o.dim != p.dim)) {
    refuse("optimizer state", o.kind, "an optimizer state is placed as its parameter");
  }
  return shard;
}

void TensorSlices::place(int64_t index, const weft_parameter_info& info) {
  const weft_parameter_layout where = abi2_placement(tp_, info);
  const ParameterShard asked = slice_of(info.name, info.ndim, where);
  const PluginHost::State& state = *host_.handle()->state;
  const ParameterShard held = state.model != nullptr ? shard_of(state.model->options().shards, info.name) : ParameterShard{};
  const auto describe = [](const ParameterShard& s) {
    return s.whole() ? std::string("whole") : fmt::format("sliced along dimension {} in {} parts", s.dim, s.parts);
  };
  if (asked.parts != held.parts || (!asked.whole() && asked.dim != held.dim)) {
    throw sdk::Error(WEFT_STATUS_BAD_CONFIG,
                     fmt::format("{} places {} {}, but the model holds it {} (a LoRA factor follows its base layer: "
                                 "lora_B sliced along 0 under a column-sliced layer, lora_A along 1 under a row-sliced "
                                 "one, the other factor whole)",
                                 tp_.name(), info.name, describe(asked), describe(held)));
  }
  if (!info.trainable) return;
  const int32_t size = group_.size();
  trainable_.push_back(index);
  copies_.push_back(static_cast<double>(size / asked.parts));
  if (where.gradient.kind == WEFT_PLACE_PARTIAL && asked.parts < size) partial_[asked.parts].push_back(index);
}

GradientReducer* TensorSlices::make_reducers(int64_t bucket_bytes) {
  const int32_t size = group_.size(), rank = host_.world().rank();
  const int32_t base = rank - group_.rank();  // the group's first rank
  const int32_t groups = host_.world().size() / size;
  GradientReducer* whole = nullptr;
  for (const auto& [parts, indices] : partial_) {  // ascending parts: the whole group (1) first
    sdk::Group group = group_;
    if (parts > 1) {
      const int32_t sharing = size / parts;
      for (int32_t d = 0; d < groups; ++d) {  // every rank makes every group, in the same order
        for (int32_t g = 0; g < parts; ++g) {
          std::vector<int32_t> members;
          for (int32_t j = 0; j < sharing; ++j) members.push_back(d * size + g * sharing + j);
          sdk::Group made = host_.create_group(members);
          if (d * size == base && group_.rank() / sharing == g) group = made;
        }
      }
    }
    std::vector<GradientReducer::Reduced> reduced;
    for (int64_t index : indices) reduced.push_back({index, false});
    auto reducer = std::make_unique<GradientReducer>(host_, group, group, sdk::Group(), reduced, std::max<int64_t>(1, bucket_bytes));
    reducer->set_sum(true);
    if (parts == 1) whole = reducer.get();
    reducers_.push_back(std::move(reducer));
    sums_.emplace_back(group, indices);
  }
  return whole;
}

void TensorSlices::sum_now(const std::vector<int64_t>& indices) {
  std::vector<sdk::Work> work;
  for (const auto& [group, partial] : sums_) {
    for (int64_t index : indices) {
      DLTensor grad{};
      if (!std::binary_search(partial.begin(), partial.end(), index) || !host_.step_gradient(index, grad)) continue;
      work.push_back(host_.all_reduce(group, grad, WEFT_REDUCE_SUM));
    }
  }
  for (const sdk::Work& w : work) w.wait();
}

void TensorSlices::start(const GradientReducer* armed) {
  for (auto& reducer : reducers_) {
    if (reducer.get() == armed) {
      reducer->start_rest();
    } else {
      reducer->start_all();
    }
  }
}

void TensorSlices::finish() {
  for (auto& reducer : reducers_) reducer->finish();
}

void TensorSlices::abandon() noexcept {
  for (auto& reducer : reducers_) reducer->abandon();
}

std::pair<double, double> TensorSlices::norm_shares(const std::vector<int64_t>& flat_sharded, int64_t skip) const {
  double ranges = 0.0, whole = 0.0;
  for (size_t k = 0; k < trainable_.size(); ++k) {
    const int64_t index = trainable_[k];
    if (index == skip) continue;
    if (std::binary_search(flat_sharded.begin(), flat_sharded.end(), index)) {
      ranges += host_.squared_norm(host_.parameter_grad_shard(index)) / copies_[k];
    } else {
      whole += host_.squared_norm(host_.parameter_grad(index)) / copies_[k];
    }
  }
  return {ranges, whole};
}

}  // namespace weft
