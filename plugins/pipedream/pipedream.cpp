// pipedream.so - PipeDream's one-forward-one-backward schedule (Narayanan et al. 2019).
//   mode = "flush" (default): 1F1B with a flush (PipeDream-Flush / DAPPLE): after stages - p - 1
//          warm-up forwards, stage p alternates one forward and one backward, so at most
//          min(stages - p, M) micro-batches are in flight (GPipe holds M), then one synchronous
//          optimizer step: the same gradients as GPipe and as the one-process step.
// Everything but the schedule is plugins/pipeline (see pipeline_strategy.hpp).
#include <string>

#include <weft/strategy.hpp>

#include "pipeline_strategy.hpp"

namespace {

std::string checked_mode(const weft::sdk::Host& host) {
  const std::string mode = host.config_string("mode", "flush");
  if (mode != "flush") {
    throw weft::sdk::Error(WEFT_STATUS_BAD_CONFIG,
                           "pipedream: plugin.mode must be \"flush\", got \"" + mode + "\"");
  }
  return mode;
}

class PipeDream : public weft::pipeline::PipelineStrategy {
 public:
  explicit PipeDream(weft::sdk::Host host) : PipelineStrategy(host, "pipedream", "1f1b"), mode_(checked_mode(host)) {}

 private:
  std::string mode_;
};

}  // namespace

WEFT_STRATEGY(PipeDream, "pipedream", "1.0.0", "PipeDream 1F1B pipeline parallelism (with flush)")
