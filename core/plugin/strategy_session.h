// One loaded strategy plugin instance for this process: the library, the PluginHost that serves
// it and the plugin's weft_strategy, with C++ calls that throw weft::Error naming the plugin.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <toml++/toml.h>
#include <weft/strategy.h>

#include "core/plugin/host_api.h"
#include "core/plugin/library.h"

namespace weft {

class StrategySession {
 public:
  // Loads the plugin and creates its instance (the plugin validates its config and the world
  // size here). Throws weft::Error on any refusal, before the model is built.
  StrategySession(const std::string& path_or_name, toml::table plugin_config, Communicator& communicator);
  ~StrategySession();  // destroys the instance; the library stays loaded
  StrategySession(const StrategySession&) = delete;
  StrategySession& operator=(const StrategySession&) = delete;

  const PluginLibrary& library() const { return *library_; }
  PluginHost& host() { return *host_; }

  // The plugin's placement for this rank (one-process layout when it has no plan slot).
  weft_model_plan plan(int64_t num_stages);
  void setup();
  // Runs the step's forward/backward; returns the step's mean loss.
  double train_step(const weft_step_info& step);
  bool has_eval_step() const { return library_->api().eval_step != nullptr; }
  // Sum of token losses and the token count of one held-out batch over all ranks.
  std::pair<double, int64_t> eval_step(const weft_step_info& step);
  // The global squared grad norm from this rank's local one.
  double global_grad_norm_sq(double local_sq);
  // Tensor parallelism: how this rank holds each parameter (whole without a shard_parameter
  // slot), and the communication at the model's comm points (nothing without a comm_point slot).
  bool has_shard_parameter() const { return library_->api().shard_parameter != nullptr; }
  weft_shard shard_parameter(const weft_parameter_info& info);
  bool has_comm_point() const { return library_->api().comm_point != nullptr; }
  void comm_point(weft_comm_point point, weft_direction direction, int64_t layer, DLTensor& tensor);

 private:
  void check(weft_status* status, const char* what) const;

  std::shared_ptr<PluginLibrary> library_;
  std::unique_ptr<PluginHost> host_;
  weft_strategy* instance_ = nullptr;
};

}  // namespace weft
