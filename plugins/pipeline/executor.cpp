// executor.cpp - one schedule, action by action, through the host.
#include "executor.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#include "../common/dl_views.hpp"

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
  weft::sdk::Buffer activation_buffer, gradient_buffer;  // receive buffers, on the rank's device
  Work activation_work, gradient_work;  // outstanding receives
};

Executor::Executor(const weft::sdk::Host& host, weft::sdk::Group world, const Placement& placement, bool recompute)
    : host_(host), world_(world), placement_(placement), recompute_(recompute) {}

int32_t Executor::peer(bool to_next) const {
  const int32_t base = placement_.replica * placement_.stages;
  return base + placement_.stage + (to_next ? 1 : -1);
}

void Executor::receive(Slot& slot, bool gradient, int32_t micro_batch) {
  weft::sdk::Buffer& buffer = gradient ? slot.gradient_buffer : slot.activation_buffer;
  buffer = host_.buffer({rows_ / splits_, seq_len_, placement_.hidden_size}, DLDataType{kDLFloat, 32, 1});
  DLTensor view = buffer.view();
  Work work = host_.recv(world_, view, peer(/*to_next=*/gradient), transfer_tag(micro_batch, gradient));
  (gradient ? slot.gradient_work : slot.activation_work) = std::move(work);
}

void Executor::forward(Slot& slot, int32_t micro_batch, const Schedule& schedule, RunStats& stats) {
  const std::string name = "F" + std::to_string(micro_batch);
  const int32_t host_micro_batch = micro_batch / splits_;
  const int32_t split = micro_batch % splits_;
  if (placement_.is_first() || placement_.is_last()) {
    weft::sdk::Batch batch = host_.batch(host_micro_batch, split, splits_);
    if (placement_.is_first()) slot.input = std::move(batch.inputs);
    if (placement_.is_last()) slot.targets = std::move(batch.targets);
  }
  if (!placement_.is_first()) {
    {
      TraceSpan wait(host_, "recv", "recv A" + std::to_string(micro_batch));
      slot.activation_work.wait();
    }
    slot.activation_work = Work();
    slot.input = host_.activation_from_tensor(slot.activation_buffer.view(), /*requires_grad=*/train_);
    slot.activation_buffer.reset();  // the host copied it
  }
  const auto start = Clock::now();
  TraceSpan span(host_, "forward", name);
  uint32_t flags = train_ ? (recompute_ ? WEFT_FORWARD_RECOMPUTE : 0u) : WEFT_FORWARD_NO_GRAD;
  Activation out = host_.forward(placement_.first_model_stage, placement_.last_model_stage, slot.input, flags);
  if (placement_.is_last()) {
    weft::sdk::Loss loss = host_.loss(out, slot.targets, train_ ? 1.0 / schedule.micro_batches : 1.0);
    stats.loss_sum += loss.value;
    stats.token_loss_sum += loss.value * static_cast<double>(loss.tokens);
    stats.tokens += loss.tokens;
    slot.output = train_ ? std::move(loss.loss) : Activation();
    slot.targets = Activation();
  } else {
    slot.output = std::move(out);
  }
  if (!train_ && placement_.is_first()) slot.input = Activation();
  stats.compute_seconds += seconds_since(start);
}

void Executor::send(Slot& slot, bool gradient, int32_t micro_batch) {
  const Activation& data = gradient ? slot.input_grad : slot.output;
  if (!data) throw Error(WEFT_STATUS_INTERNAL, "pipeline: nothing to send for micro-batch " + std::to_string(micro_batch));
  DLTensor view = host_.activation_view(data);
  pending_sends_->push_back(host_.send(world_, view, peer(/*to_next=*/!gradient), transfer_tag(micro_batch, gradient)));
}

void Executor::backward(Slot& slot, int32_t micro_batch, RunStats& stats) {
  Activation grad;
  if (!placement_.is_last()) {
    {
      TraceSpan wait(host_, "recv", "recv G" + std::to_string(micro_batch));
      slot.gradient_work.wait();
    }
    slot.gradient_work = Work();
    grad = host_.activation_from_tensor(slot.gradient_buffer.view(), /*requires_grad=*/false);
    slot.gradient_buffer.reset();
  }
  const auto start = Clock::now();
  {
    TraceSpan span(host_, "backward", "B" + std::to_string(micro_batch));
    if (placement_.is_last()) {
      host_.backward(slot.output);
    } else {
      host_.backward(slot.output, grad);
    }
  }
  if (!placement_.is_first()) {
    slot.input_grad = host_.activation_grad(slot.input);
    slot.input = Activation();  // the gradient tensor lives on in input_grad until it is sent
  }
  stats.compute_seconds += seconds_since(start);
}

RunStats Executor::run(const Schedule& schedule, int32_t splits, int64_t rows, int64_t seq_len) {
  if (splits < 1 || rows % splits != 0) {
    throw Error(WEFT_STATUS_INVALID_ARGUMENT, "pipeline: " + std::to_string(rows) + " rows per micro-batch cannot be split into " +
                                                  std::to_string(splits) + " equal pipeline micro-batches");
  }
  if (schedule.chunks != 1) {  // virtual stages need a rank to hold non-contiguous model stages
    throw Error(WEFT_STATUS_UNSUPPORTED, "pipeline: schedule '" + schedule.name + "' has " +
                                             std::to_string(schedule.chunks) +
                                             " virtual stages per rank, which this executor cannot run yet");
  }
  std::vector<Slot> slots(static_cast<size_t>(schedule.micro_batches));
  std::vector<Work> pending_sends;
  slots_ = &slots;
  pending_sends_ = &pending_sends;
  splits_ = splits;
  rows_ = rows;
  seq_len_ = seq_len;
  train_ = schedule.trains;
  RunStats stats;
  int32_t in_flight = 0;
  const auto start = Clock::now();
  const auto& actions = schedule.actions.at(static_cast<size_t>(placement_.stage));
  for (const Action& a : actions) {
    Slot* slot = a.micro_batch >= 0 ? &slots.at(static_cast<size_t>(a.micro_batch)) : nullptr;
    switch (a.kind) {
      case ActionKind::kRecvActivation: receive(*slot, false, a.micro_batch); break;
      case ActionKind::kRecvGradient: receive(*slot, true, a.micro_batch); break;
      case ActionKind::kForward:
        forward(*slot, a.micro_batch, schedule, stats);
        if (train_) stats.peak_in_flight = std::max(stats.peak_in_flight, ++in_flight);
        break;
      case ActionKind::kSendActivation: send(*slot, false, a.micro_batch); break;
      case ActionKind::kBackward: {
        backward(*slot, a.micro_batch, stats);
        --in_flight;
        slot->output = Activation();  // frees the micro-batch's graph; the input stays until its
        if (placement_.is_first()) slot->input = Activation();  // gradient is sent
        break;
      }
      case ActionKind::kSendGradient: send(*slot, true, a.micro_batch); break;
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
  return stats;  // `slots` (and with them the activations sent) are released only now
}

}  // namespace pipeline
}  // namespace weft
