// executor.cpp - one schedule, action by action, through the host.
#include "executor.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#include "dl_views.hpp"

namespace weft {
namespace pipeline {

using weft::sdk::Activation;
using weft::sdk::Error;
using weft::sdk::TraceSpan;
using weft::sdk::Work;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

struct Executor::Slot {
  Activation input;    // token ids (stage 0) or the received activation, requiring grad
  Activation targets;  // last stage
  Activation output;   // stage output (to send, and to back-propagate from) or the scaled loss
  Activation input_grad;  // what SEND_GRADIENT sends
  weft::sdk::WeightPass weight_pass;  // a split backward's deferred weight gradients, until its W
  weft::sdk::Buffer activation_buffer, gradient_buffer;  // receive buffers, on the rank's device
  Work activation_work, gradient_work;  // outstanding receives
  int32_t activation_local = -1, gradient_local = -1;  // the tag of a transfer from this rank, to take from local_
};

Executor::Executor(const weft::sdk::Host& host, weft::sdk::Group world, const Placement& placement, bool recompute)
    : host_(host), world_(world), placement_(placement), recompute_(recompute) {}

int32_t Executor::peer(const Action& action, bool to_next) const {
  const int32_t u = placement_.virtual_stage(placement_.stage, action.chunk);
  return placement_.rank_of(placement_.stage_of(to_next ? u + 1 : u - 1), placement_.replica);
}

int32_t Executor::tag(const Action& action, bool gradient, bool to_next) const {
  const int32_t u = placement_.virtual_stage(placement_.stage, action.chunk);
  return transfer_tag(action.micro_batch, to_next ? u : u - 1, placement_.virtual_stages(), gradient);
}

void Executor::receive(Slot& slot, bool gradient, const Action& action) {
  if (peer(action, /*to_next=*/gradient) == world_.rank()) {  // from another chunk of this rank
    (gradient ? slot.gradient_local : slot.activation_local) = tag(action, gradient, /*to_next=*/gradient);
    return;
  }
  weft::sdk::Buffer& buffer = gradient ? slot.gradient_buffer : slot.activation_buffer;
  buffer = host_.buffer({rows_ / splits_, stage_tokens_, placement_.hidden_size}, DLDataType{kDLFloat, 32, 1});
  DLTensor view = buffer.view();
  // Activations come from the previous virtual stage, gradients from the next.
  Work work = host_.recv(world_, view, peer(action, /*to_next=*/gradient), tag(action, gradient, /*to_next=*/gradient));
  (gradient ? slot.gradient_work : slot.activation_work) = std::move(work);
}

void Executor::forward(Slot& slot, const Action& action, const Schedule& schedule, RunStats& stats) {
  const int32_t micro_batch = action.micro_batch, chunk = action.chunk;
  const std::string name = to_string(action);
  const int32_t host_micro_batch = micro_batch / splits_;
  const int32_t split = micro_batch % splits_;
  const bool first = placement_.is_first_virtual(chunk), last = placement_.is_last_virtual(chunk);
  // Every chunk reads the micro-batch: the first its tokens, the last its targets, the others the
  // rows' layout (packed rows' positions), which the received input takes.
  weft::sdk::Batch batch = host_.batch(host_micro_batch, split, splits_);
  if (last) slot.targets = std::move(batch.targets);
  if (first) {
    slot.input = std::move(batch.inputs);
  } else if (slot.activation_local >= 0) {
    slot.input = host_.activation_from_tensor(host_.activation_view(take_local(slot.activation_local, action)),
                                              /*requires_grad=*/train_);
    slot.activation_local = -1;
  } else {
    {
      TraceSpan wait(host_, "recv", "recv A" + name.substr(1));
      slot.activation_work.wait();
    }
    slot.activation_work = Work();
    slot.input = host_.activation_from_tensor(slot.activation_buffer.view(), /*requires_grad=*/train_);
    slot.activation_buffer.reset();  // the host copied it
  }
  if (!first) host_.share_layout(slot.input, batch.inputs);
  const auto start = Clock::now();
  TraceSpan span(host_, "forward", name);
  uint32_t flags = train_ ? (recompute_ ? WEFT_FORWARD_RECOMPUTE : 0u) : WEFT_FORWARD_NO_GRAD;
  const auto& stages = placement_.chunk_stages.at(static_cast<size_t>(chunk));
  Activation out = host_.forward(stages.first, stages.second, slot.input, flags);
  if (last) {
    weft::sdk::Loss loss = host_.loss(out, slot.targets, train_ ? 1.0 / schedule.micro_batches : 1.0);
    stats.loss_sum += loss.value;
    stats.token_loss_sum += loss.value * static_cast<double>(loss.tokens);
    stats.tokens += loss.tokens;
    slot.output = train_ ? std::move(loss.loss) : Activation();
    slot.targets = Activation();
  } else {
    slot.output = std::move(out);
  }
  if (!train_ && first) slot.input = Activation();
  stats.compute_seconds += seconds_since(start);
}

void Executor::send(Slot& slot, bool gradient, const Action& action) {
  const Activation& data = gradient ? slot.input_grad : slot.output;
  if (!data) throw Error(WEFT_STATUS_INTERNAL, "pipeline: nothing to send for " + to_string(action));
  if (peer(action, /*to_next=*/!gradient) == world_.rank()) {  // to another chunk of this rank
    // A copy, as a send would make one (the output stays for this chunk's backward).
    (*local_)[tag(action, gradient, !gradient)] = host_.activation_from_tensor(host_.activation_view(data), false);
    return;
  }
  DLTensor view = host_.activation_view(data);
  pending_sends_->push_back(host_.send(world_, view, peer(action, /*to_next=*/!gradient), tag(action, gradient, !gradient)));
}

void Executor::backward(Slot& slot, const Action& action, RunStats& stats) {
  const bool first = placement_.is_first_virtual(action.chunk), last = placement_.is_last_virtual(action.chunk);
  Activation grad;
  if (!last && slot.gradient_local >= 0) {
    grad = host_.activation_from_tensor(host_.activation_view(take_local(slot.gradient_local, action)),
                                        /*requires_grad=*/false);
    slot.gradient_local = -1;
  } else if (!last) {
    {
      TraceSpan wait(host_, "recv", "recv G" + to_string(action).substr(1));
      slot.gradient_work.wait();
    }
    slot.gradient_work = Work();
    grad = host_.activation_from_tensor(slot.gradient_buffer.view(), /*requires_grad=*/false);
    slot.gradient_buffer.reset();
  }
  const auto start = Clock::now();
  {
    TraceSpan span(host_, "backward", to_string(action));
    if (split_backward_) {  // B: the input gradients now, the weights' at this micro-batch's W
      slot.weight_pass = last ? host_.backward_input(slot.output) : host_.backward_input(slot.output, grad);
    } else if (last) {
      host_.backward(slot.output);
    } else {
      host_.backward(slot.output, grad);
    }
  }
  if (!first) {
    slot.input_grad = host_.activation_grad(slot.input);
    slot.input = Activation();  // the gradient tensor lives on in input_grad until it is sent
  }
  stats.compute_seconds += seconds_since(start);
}

Activation Executor::take_local(int32_t tag, const Action& action) {
  const auto it = local_->find(tag);
  if (it == local_->end()) throw Error(WEFT_STATUS_INTERNAL, "pipeline: " + to_string(action) + " found nothing handed over on this rank");
  Activation data = std::move(it->second);
  local_->erase(it);
  return data;
}

RunStats Executor::run(const Schedule& schedule, int32_t splits, int64_t rows, int64_t stage_tokens,
                       const ChunkHooks& hooks) {
  if (splits < 1 || rows % splits != 0) {
    throw Error(WEFT_STATUS_INVALID_ARGUMENT, "pipeline: " + std::to_string(rows) + " rows per micro-batch cannot be split into " +
                                                  std::to_string(splits) + " equal pipeline micro-batches");
  }
  const int32_t chunks = placement_.chunks();
  if (schedule.chunks != chunks) {
    throw Error(WEFT_STATUS_INTERNAL, "pipeline: schedule '" + schedule.name + "' has " +
                                          std::to_string(schedule.chunks) + " virtual stages per rank, this rank holds " +
                                          std::to_string(chunks));
  }
  std::vector<Slot> slots(static_cast<size_t>(schedule.micro_batches) * static_cast<size_t>(chunks));
  std::vector<Work> pending_sends;
  std::map<int32_t, Activation> local;
  local_ = &local;
  slots_ = &slots;
  pending_sends_ = &pending_sends;
  splits_ = splits;
  rows_ = rows;
  stage_tokens_ = stage_tokens;
  train_ = schedule.trains;
  split_backward_ = schedule.split_backward;
  RunStats stats;
  int32_t in_flight = 0;
  const auto start = Clock::now();
  const auto& actions = schedule.actions.at(static_cast<size_t>(placement_.stage));
  // Each chunk's last backward, where a kReduce follows it and the backward is whole.
  std::vector<int64_t> final_backward(static_cast<size_t>(chunks), -1);
  if (!schedule.split_backward && hooks.final_backward) {
    std::vector<int64_t> last(static_cast<size_t>(chunks), -1);
    for (size_t i = 0; i < actions.size(); ++i) {
      if (actions[i].kind == ActionKind::kBackward) last[static_cast<size_t>(actions[i].chunk)] = static_cast<int64_t>(i);
      if (actions[i].kind == ActionKind::kReduce) final_backward[static_cast<size_t>(actions[i].chunk)] = last[static_cast<size_t>(actions[i].chunk)];
    }
  }
  for (size_t i = 0; i < actions.size(); ++i) {
    const Action& a = actions[i];
    Slot* slot = a.micro_batch >= 0 ? &slots.at(static_cast<size_t>(a.micro_batch) * chunks + a.chunk) : nullptr;
    switch (a.kind) {
      case ActionKind::kRecvActivation: receive(*slot, false, a); break;
      case ActionKind::kRecvGradient: receive(*slot, true, a); break;
      case ActionKind::kForward:
        forward(*slot, a, schedule, stats);
        if (train_) stats.peak_in_flight = std::max(stats.peak_in_flight, ++in_flight);
        break;
      case ActionKind::kSendActivation: send(*slot, false, a); break;
      case ActionKind::kBackward: {
        const bool final = final_backward[static_cast<size_t>(a.chunk)] == static_cast<int64_t>(i);
        if (final) hooks.final_backward(a.chunk, true);
        backward(*slot, a, stats);
        if (final) hooks.final_backward(a.chunk, false);
        --in_flight;
        slot->output = Activation();  // frees the micro-batch's graph; the input stays until its
        if (placement_.is_first_virtual(a.chunk)) slot->input = Activation();  // gradient is sent
        break;
      }
      case ActionKind::kSendGradient: send(*slot, true, a); break;
      case ActionKind::kBackwardWeight: {
        const auto start_w = Clock::now();
        TraceSpan span(host_, "backward", to_string(a));
        host_.backward_weight(slot->weight_pass);
        stats.compute_seconds += seconds_since(start_w);
        break;
      }
      case ActionKind::kReduce:
        if (hooks.reduce) hooks.reduce(a.chunk);
        break;
      case ActionKind::kGather:
        if (hooks.gather) hooks.gather(a.chunk);
        break;
      case ActionKind::kRelease:
        if (hooks.release) hooks.release(a.chunk);
        break;
      case ActionKind::kOptimizerStep: break;
    }
  }
  {
    TraceSpan flush(host_, "send", "flush sends");
    for (const Work& work : pending_sends) work.wait();
  }
  stats.wall_seconds = seconds_since(start);
  if (!train_) stats.peak_in_flight = 1;
  slots_ = nullptr;
  pending_sends_ = nullptr;
  local_ = nullptr;
  return stats;  // `slots` (and with them the activations sent) are released only now
}

}  // namespace pipeline
}  // namespace weft
