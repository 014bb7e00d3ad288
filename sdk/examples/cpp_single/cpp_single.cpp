// cpp_single: a one-process strategy written with the C++ SDK (weft/strategy.hpp), out of tree.
// train_step: the SDK's reference step (Strategy::single_process_train_step: for each micro-batch
// batch -> forward(all stages) -> loss(scale 1/M) -> backward; the mean loss), plus a debug log
// line every plugin.log_every steps. Every other slot is left to the host's defaults.
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
    // The SDK's one-process reference step (the host's own: batch -> forward -> loss(1/M) ->
    // backward per micro-batch), then what this example adds: a log line every log_every steps.
    const double mean_loss = single_process_train_step(step);
    if (log_every_ > 0 && step.step % log_every_ == 0) {
      WEFT_LOG_DEBUG(host(), "step %lld: mean loss %.4f over %d micro-batches",
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
