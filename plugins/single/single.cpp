// single.so: the one-process reference strategy. Its step is exactly the host's own: for each
// gradient-accumulation micro-batch, forward over all stages, the mean loss scaled by
// 1 / micro-batches, backward; gradients are left for the host's optimizer. Every other
// strategy is checked against it (`trainer check`).
#include <string>

#include <weft/strategy.hpp>

namespace {

class Single : public weft::sdk::Strategy {
 public:
  explicit Single(weft::sdk::Host host) : Strategy(host) {
    const int32_t world_size = host.world().size();
    if (world_size != 1) {
      throw weft::sdk::Error(WEFT_STATUS_BAD_CONFIG,
                             "single runs on one process, but the world has " + std::to_string(world_size) +
                                 " ranks (use ddp for data parallelism)");
    }
  }

  double train_step(const weft_step_info& step) override { return single_process_train_step(step); }
};

}  // namespace

WEFT_STRATEGY(Single, "single", "1.0.0", "one process: the reference step every strategy is checked against")
