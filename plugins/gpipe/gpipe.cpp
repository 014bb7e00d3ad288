// gpipe.so - GPipe (Huang et al. 2019): the model's layers split into stages on different
// ranks, each step's batch split into micro-batches that stream through them, all forwards then
// all backwards (fill-drain), one synchronous optimizer step per batch. Gradients equal the
// one-process step's. Everything but the schedule is plugins/pipeline (see
// pipeline_strategy.hpp for the configuration, whose plugin.schedule also runs 1F1B or
// interleaved 1F1B here); gpipe adds:
//   recompute  bool, default false: keep only each block's input during the forward and
//              recompute its activations in backward (GPipe's re-materialisation).
#include <weft/strategy.hpp>

#include "pipeline_strategy.hpp"

namespace {

class Gpipe : public weft::pipeline::PipelineStrategy {
 public:
  explicit Gpipe(weft::sdk::Host host) : PipelineStrategy(host, "gpipe", "gpipe") {
    recompute_ = host.config_bool("recompute", false);
  }
};

}  // namespace

WEFT_STRATEGY(Gpipe, "gpipe", "1.0.0", "GPipe pipeline parallelism: fill-drain micro-batches over layer stages")
