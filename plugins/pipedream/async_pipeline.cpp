#include "async_pipeline.hpp"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <cstring>
#include <string>

#include "../common/dl_views.hpp"
#include "../common/reductions.hpp"

namespace weft {
namespace pipedream {
namespace {

// Sum and sum of squares of a contiguous fp32 view, in double.
std::pair<double, double> moments(const DLTensor& view) {
  const float* x = weft::plugins::float_data(view);
  double sum = 0.0;
  for (int64_t i = 0, n = weft::plugins::element_count(view); i < n; ++i) sum += x[i];
  return {sum, weft::plugins::squared_norm(view)};
}

double largest_difference(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double largest = 0.0;
  for (size_t k = 0; k < a.size(); ++k) {
    for (size_t i = 0; i < a[k].size(); ++i) largest = std::max(largest, static_cast<double>(std::abs(a[k][i] - b[k][i])));
  }
  return largest;
}

}  // namespace

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
    if (!weft::plugins::is_contiguous_cpu_fp32(data)) {
      throw Error(WEFT_STATUS_UNSUPPORTED, std::string("pipedream async: parameter ") + info.name + " is not contiguous fp32");
    }
    trainable_.push_back(i);
  }
}

int32_t AsyncPipeline::peer(bool next) const {
  return placement_.replica * placement_.stages + placement_.stage + (next ? 1 : -1);
}

std::vector<std::vector<float>> AsyncPipeline::read_weights() const {
  std::vector<std::vector<float>> out;
  out.reserve(trainable_.size());
  for (int64_t index : trainable_) {
    const DLTensor data = host_.parameter_data(index);
    const float* begin = weft::plugins::float_data(data);
    out.emplace_back(begin, begin + weft::plugins::element_count(data));
  }
  return out;
}

void AsyncPipeline::write_weights(const std::vector<std::vector<float>>& weights) const {
  for (size_t k = 0; k < trainable_.size(); ++k) {
    const DLTensor data = host_.parameter_data(trainable_[k]);
    std::memcpy(weft::plugins::float_data(data), weights[k].data(), weights[k].size() * sizeof(float));
  }
}

void AsyncPipeline::post_gradient_receive(int64_t minibatch, int64_t rows, int64_t seq_len) {
  gradient_shape_ = {rows, seq_len, placement_.hidden_size};
  gradient_buffer_.assign(static_cast<size_t>(rows * seq_len * placement_.hidden_size), 0.0f);
  DLTensor view = weft::plugins::dense_view(gradient_buffer_.data(), gradient_shape_, gradient_strides_);
  gradient_work_ = host_.recv(world_, view, peer(/*next=*/true), async_tag(minibatch, true));
  gradient_minibatch_ = minibatch;
}

void AsyncPipeline::backward(int64_t minibatch, std::vector<Work>& sends) {
  auto it = stash_.find(minibatch);
  if (it == stash_.end() || gradient_minibatch_ != minibatch) {
    throw Error(WEFT_STATUS_INTERNAL, "pipedream async: no stashed forward or gradient for minibatch " +
                                          std::to_string(minibatch));
  }
  {
    TraceSpan wait(host_, "recv", "recv G" + std::to_string(minibatch));
    gradient_work_.wait();
  }
  gradient_work_ = Work();
  DLTensor view = weft::plugins::dense_view(gradient_buffer_.data(), gradient_shape_, gradient_strides_);
  Activation grad = host_.activation_from_tensor(view, /*requires_grad=*/false);
  InFlight& flight = it->second;
  TraceSpan span(host_, "backward", "B" + std::to_string(minibatch));
  const auto current = read_weights();
  last_staleness_ = largest_difference(current, flight.weights);
  write_weights(flight.weights);  // the weights minibatch `minibatch` was forwarded with
  Activation input = placement_.is_first()
                         ? std::move(flight.input)
                         : host_.activation_from_tensor(host_.activation_view(flight.input), /*requires_grad=*/true);
  {
    Activation output = host_.forward(placement_.first_model_stage, placement_.last_model_stage, input);
    const auto [sum, squares] = moments(host_.activation_view(output));
    last_recompute_difference_ = std::max(std::abs(sum - flight.output_sum), std::abs(squares - flight.output_squares));
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

double AsyncPipeline::step(int64_t t, int64_t rows, int64_t seq_len) {
  last_staleness_ = 0.0;
  last_recompute_difference_ = 0.0;
  std::vector<Work> sends;
  double loss_value = 0.0;
  // Forward of minibatch t.
  weft::sdk::Batch batch = host_.batch(0);
  Activation input;
  std::vector<float> received;
  std::vector<int64_t> shape, strides;
  if (placement_.is_first()) {
    input = std::move(batch.inputs);
  } else {
    shape = {rows, seq_len, placement_.hidden_size};
    received.assign(static_cast<size_t>(rows * seq_len * placement_.hidden_size), 0.0f);
    DLTensor view = weft::plugins::dense_view(received.data(), shape, strides);
    TraceSpan wait(host_, "recv", "recv A" + std::to_string(t));
    host_.recv(world_, view, peer(/*next=*/false), async_tag(t, false)).wait();
    input = host_.activation_from_tensor(view, /*requires_grad=*/placement_.is_last());
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
    std::tie(flight.output_sum, flight.output_squares) = moments(data);
    flight.input = std::move(input);
    flight.weights = read_weights();
    stash_.emplace(t, std::move(flight));
    peak_stashed_ = std::max(peak_stashed_, stash_.size());
    // Backward of minibatch t - delay, whose gradient arrived from the next stage last step.
    if (t - delay() >= 0) backward(t - delay(), sends);
    // Post the receive of next step's gradient (minibatch t + 1 - delay).
    if (t + 1 - delay() >= 0) post_gradient_receive(t + 1 - delay(), rows, seq_len);
    TraceSpan flush(host_, "send", "flush sends");
    for (const Work& w : sends) w.wait();
    return 0.0;
  }
  TraceSpan flush(host_, "send", "flush sends");
  for (const Work& w : sends) w.wait();
  return loss_value;
}

}  // namespace pipedream
}  // namespace weft
