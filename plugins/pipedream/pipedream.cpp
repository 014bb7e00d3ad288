// pipedream.so - PipeDream's one-forward-one-backward pipeline (Narayanan et al. 2019).
//   mode = "flush" (default): 1F1B with a flush (PipeDream-Flush / DAPPLE): after stages - p - 1
//          warm-up forwards, stage p alternates one forward and one backward, so at most
//          min(stages - p, M) micro-batches are in flight (GPipe holds M), then one synchronous
//          optimizer step: the same gradients as GPipe and as the one-process step.
//   mode = "async": PipeDream's original schedule without a flush, with weight stashing; every
//          step is one minibatch and stage p's backward lags S - 1 - p steps behind its forward
//          (semantics in async_pipeline.hpp). Needs train.grad_accum_steps = 1; ignores
//          plugin.microbatches. Not equal to the one-process run by design (stale weights), so
//          it is checked by its own tests, not by the conformance check.
// Everything else is plugins/pipeline (see pipeline_strategy.hpp), including plugin.schedule:
// "interleaved1f1b" (with plugin.chunks) runs Megatron's virtual pipeline in flush mode.
#include <memory>
#include <string>

#include <weft/strategy.hpp>

#include "async_pipeline.hpp"
#include "pipeline_strategy.hpp"

namespace {

using weft::sdk::Error;

std::string checked_mode(const weft::sdk::Host& host) {
  const std::string mode = host.config_string("mode", "flush");
  if (mode != "flush" && mode != "async") {
    throw Error(WEFT_STATUS_BAD_CONFIG, "pipedream: plugin.mode must be \"flush\" or \"async\", got \"" + mode + "\"");
  }
  return mode;
}

class PipeDream : public weft::pipeline::PipelineStrategy {
 public:
  explicit PipeDream(weft::sdk::Host host) : PipelineStrategy(host, "pipedream", "1f1b"), mode_(checked_mode(host)) {
    if (mode_ == "async" && schedule_name() != "1f1b") {
      throw Error(WEFT_STATUS_BAD_CONFIG, "pipedream: mode \"async\" runs its own 1F1B schedule without a flush; "
                                          "plugin.schedule = \"" + schedule_name() + "\" needs mode \"flush\"");
    }
  }

  void setup() override {
    PipelineStrategy::setup();
    if (mode_ == "async") async_ = std::make_unique<weft::pipeline::AsyncPipeline>(host(), world(), placement());
  }

  double train_step(const weft_step_info& step) override {
    if (!async_) return PipelineStrategy::train_step(step);
    if (step.micro_batches != 1) {
      throw Error(WEFT_STATUS_BAD_CONFIG, "pipedream: mode \"async\" runs one minibatch per step; set "
                                          "train.grad_accum_steps = 1 (it is " + std::to_string(step.micro_batches) + ")");
    }
    const double local = async_->step(step.step, step.rows_per_micro_batch, step.stage_tokens);
    finish_gradients();
    const double loss = sum_over(world(), {placement().is_last() ? local : 0.0})[0] / placement().replicas;
    host().report_metric("stashed_versions", static_cast<double>(async_->peak_stashed()));
    host().report_metric("stash_weight_staleness", async_->last_weight_staleness());
    host().report_metric("stash_recompute_difference", async_->last_recompute_difference());
    return loss;
  }

 private:
  std::string mode_;
  std::unique_ptr<weft::pipeline::AsyncPipeline> async_;
};

}  // namespace

WEFT_STRATEGY(PipeDream, "pipedream", "1.1.0", "PipeDream 1F1B pipeline parallelism (flush, or async with weight stashing)")
