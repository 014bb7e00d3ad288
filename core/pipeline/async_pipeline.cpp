#include "async_pipeline.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <cstring>
#include <string>

#include "dl_views.hpp"
#include "reductions.hpp"

namespace weft {
namespace pipeline {
using weft::sdk::Activation;
using weft::sdk::Error;
using weft::sdk::TraceSpan;
using weft::sdk::Work;

AsyncPipeline::AsyncPipeline(const weft::sdk::Host& host, weft::sdk::Group world,
                             const weft::pipeline::Placement& placement)
    : host_(host), world_(world), placement_(placement) {
  for (int64_t i = 0; i < host.parameter_count(); ++i) {
    const weft_parameter_info info = host.parameter_info(i);
    if (!info.trainable) continue;
    const DLTensor data = host.parameter_data(i);
    if (!weft::plugins::is_fp32(data)) {
      throw Error(WEFT_STATUS_UNSUPPORTED, std::string("asynchronous pipeline: parameter ") + info.name + " is not fp32");
    }
    trainable_.push_back(i);
  }
}

int32_t AsyncPipeline::peer(bool next) const {
  return placement_.rank_of(placement_.stage + (next ? 1 : -1), placement_.replica);
}

std::vector<weft::sdk::Buffer> AsyncPipeline::read_weights() const {
  std::vector<weft::sdk::Buffer> out;
  out.reserve(trainable_.size());
  for (int64_t index : trainable_) {
    const DLTensor data = host_.parameter_data(index);
    out.push_back(host_.buffer({weft::plugins::element_count(data)}, data.dtype));
    DLTensor copy = out.back().view();
    host_.copy(copy, data);
  }
  return out;
}

void AsyncPipeline::write_weights(const std::vector<weft::sdk::Buffer>& weights) const {
  for (size_t k = 0; k < trainable_.size(); ++k) {
    DLTensor data = host_.parameter_data(trainable_[k]);
    host_.copy(data, weights[k].view());
  }
}

double AsyncPipeline::distance(const std::vector<weft::sdk::Buffer>& a, const std::vector<weft::sdk::Buffer>& b) const {
  double squares = 0.0;
  for (size_t k = 0; k < a.size(); ++k) {
    weft::sdk::Buffer difference = host_.buffer({a[k].elements()}, a[k].view().dtype);
    DLTensor d = difference.view();
    host_.copy(d, a[k].view());
    host_.add(d, b[k].view(), -1.0);
    squares += host_.squared_norm(d);
  }
  return std::sqrt(squares);
}

void AsyncPipeline::post_gradient_receive(int64_t minibatch, int64_t rows, int64_t stage_tokens) {
  gradient_buffer_ = host_.buffer({rows, stage_tokens, placement_.hidden_size}, DLDataType{kDLFloat, 32, 1});
  DLTensor view = gradient_buffer_.view();
  gradient_work_ = host_.recv(world_, view, peer(/*next=*/true), async_tag(minibatch, true));
  gradient_minibatch_ = minibatch;
}

void AsyncPipeline::backward(int64_t minibatch, std::vector<Work>& sends) {
  auto it = stash_.find(minibatch);
  if (it == stash_.end() || gradient_minibatch_ != minibatch) {
    throw Error(WEFT_STATUS_INTERNAL, "asynchronous pipeline: no stashed forward or gradient for minibatch " +
                                          std::to_string(minibatch));
  }
  {
    TraceSpan wait(host_, "recv", "recv G" + std::to_string(minibatch));
    gradient_work_.wait();
  }
  gradient_work_ = Work();
  Activation grad = host_.activation_from_tensor(gradient_buffer_.view(), /*requires_grad=*/false);
  gradient_buffer_.reset();
  InFlight& flight = it->second;
  TraceSpan span(host_, "backward", "B" + std::to_string(minibatch));
  const auto current = read_weights();
  last_staleness_ = distance(current, flight.weights);
  write_weights(flight.weights);  // the weights minibatch `minibatch` was forwarded with
  Activation input = placement_.is_first()
                         ? std::move(flight.input)
                         : host_.activation_from_tensor(host_.activation_view(flight.input), /*requires_grad=*/true);
  if (!placement_.is_first()) host_.share_layout(input, flight.input);
  {
    Activation output = host_.forward(placement_.first_model_stage, placement_.last_model_stage, input);
    last_recompute_difference_ = std::abs(host_.squared_norm(host_.activation_view(output)) - flight.output_squares);
    host_.backward(output, grad);
  }
  write_weights(current);
  if (!placement_.is_first()) {
    pending_input_grad_ = host_.activation_grad(input);
    DLTensor data = host_.activation_view(pending_input_grad_);
    sends.push_back(host_.send(world_, data, peer(/*next=*/false), async_tag(minibatch, true)));
  }
  stash_.erase(it);
}

double AsyncPipeline::step(int64_t t, int64_t rows, int64_t stage_tokens) {
  last_staleness_ = 0.0;
  last_recompute_difference_ = 0.0;
  std::vector<Work> sends;
  double loss_value = 0.0;
  // Forward of minibatch t.
  weft::sdk::Batch batch = host_.batch(0);
  Activation input;
  weft::sdk::Buffer received;
  if (placement_.is_first()) {
    input = std::move(batch.inputs);
  } else {
    received = host_.buffer({rows, stage_tokens, placement_.hidden_size}, DLDataType{kDLFloat, 32, 1});
    DLTensor view = received.view();
    TraceSpan wait(host_, "recv", "recv A" + std::to_string(t));
    host_.recv(world_, view, peer(/*next=*/false), async_tag(t, false)).wait();
    input = host_.activation_from_tensor(view, /*requires_grad=*/placement_.is_last());
    host_.share_layout(input, batch.inputs);  // packed rows' positions
  }
  if (placement_.is_last()) {
    // Forward and backward of minibatch t at once, with the current weights.
    {
      TraceSpan span(host_, "forward", "F" + std::to_string(t));
      Activation logits = host_.forward(placement_.first_model_stage, placement_.last_model_stage, input);
      weft::sdk::Loss loss = host_.loss(logits, batch.targets, 1.0);
      loss_value = loss.value;
      TraceSpan back(host_, "backward", "B" + std::to_string(t));
      host_.backward(loss.loss);
    }
    if (!placement_.is_first()) {
      pending_input_grad_ = host_.activation_grad(input);
      DLTensor data = host_.activation_view(pending_input_grad_);
      sends.push_back(host_.send(world_, data, peer(/*next=*/false), async_tag(t, true)));
    }
  } else {
    Activation output;
    {
      TraceSpan span(host_, "forward", "F" + std::to_string(t));
      output = host_.forward(placement_.first_model_stage, placement_.last_model_stage, input, WEFT_FORWARD_NO_GRAD);
    }
    DLTensor data = host_.activation_view(output);
    sends.push_back(host_.send(world_, data, peer(/*next=*/true), async_tag(t, false)));
    InFlight flight;
    flight.output_squares = host_.squared_norm(data);
    flight.input = std::move(input);
    flight.weights = read_weights();
    stash_.emplace(t, std::move(flight));
    peak_stashed_ = std::max(peak_stashed_, stash_.size());
    // Backward of minibatch t - delay, whose gradient arrived from the next stage last step.
    if (t - delay() >= 0) backward(t - delay(), sends);
    // Post the receive of next step's gradient (minibatch t + 1 - delay).
    if (t + 1 - delay() >= 0) post_gradient_receive(t + 1 - delay(), rows, stage_tokens);
    TraceSpan flush(host_, "send", "flush sends");
    for (const Work& w : sends) w.wait();
    return 0.0;
  }
  TraceSpan flush(host_, "send", "flush sends");
  for (const Work& w : sends) w.wait();
  return loss_value;
}

}  // namespace pipeline
}  // namespace weft
