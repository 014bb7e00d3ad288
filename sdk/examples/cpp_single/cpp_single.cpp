// cpp_single: the one-process reference strategy written with the C++ SDK (weft/strategy.hpp).
// train_step: for each micro-batch: batch -> forward(all stages) -> loss(scale 1/M) -> backward;
// returns the mean loss. Every other slot is left to the host's defaults.
#include <string>

#include <weft/strategy.hpp>

namespace {

class SingleProcess : public weft::sdk::Strategy {
 public:
  explicit SingleProcess(weft::sdk::Host host) : Strategy(host) {
    const int32_t world_size = host.world().size();
    if (world_size != 1) {
      throw weft::sdk::Error(WEFT_STATUS_BAD_CONFIG,
                             "cpp_single runs on one process, not " + std::to_string(world_size));
    }
    log_every_ = host.config_int("log_every", 0);
  }

  double train_step(const weft_step_info& step) override {
    const weft::sdk::Host& h = host();
    const int64_t stages = h.model_num_stages();
    const double scale = 1.0 / step.micro_batches;
    double loss_sum = 0.0;
    for (int32_t m = 0; m < step.micro_batches; ++m) {
      weft::sdk::Batch batch = h.batch(m);
      weft::sdk::Activation logits = h.forward(0, stages, batch.inputs);
      weft::sdk::Loss loss = h.loss(logits, batch.targets, scale);
      h.backward(loss.loss);
      loss_sum += loss.value;
    }  // each micro-batch's activations (and its graph) are released here
    const double mean_loss = loss_sum / step.micro_batches;
    if (log_every_ > 0 && step.step % log_every_ == 0) {
      WEFT_LOG_DEBUG(h, "step %lld: mean loss %.4f over %d micro-batches",
                     static_cast<long long>(step.step), mean_loss, step.micro_batches);
    }
    return mean_loss;
  }

 private:
  int64_t log_every_ = 0;
};

}  // namespace

WEFT_STRATEGY(SingleProcess, "cpp_single", "1.0.0",
              "one process: the reference step, written with the C++ SDK")
