#include "core/plugin/strategy_session.h"

#include <fmt/format.h>

#include "core/plugin/status.h"
#include "core/util/error.h"

namespace weft {

StrategySession::StrategySession(const std::string& path_or_name, toml::table plugin_config,
                                 Communicator& communicator)
    : library_(PluginLibrary::load(path_or_name)) {
  host_ = std::make_unique<PluginHost>(library_->name(), std::move(plugin_config), communicator);
  weft_strategy* instance = nullptr;
  check(library_->api().create(host_->api(), host_->handle(), &instance), "create");
  WEFT_CHECK(instance != nullptr, "plugin {}: create returned no instance", library_->name());
  instance_ = instance;
}

StrategySession::~StrategySession() {
  if (instance_) library_->api().destroy(instance_);
}

void StrategySession::check(weft_status* status, const char* what) const {
  throw_if_error(status, fmt::format("plugin {} ({}): {}", library_->name(), library_->path(), what));
}

weft_model_plan StrategySession::plan(int64_t num_stages) {
  weft_model_plan plan{};
  plan.struct_size = sizeof(weft_model_plan);
  plan.first_stage = 0;
  plan.last_stage = num_stages;
  plan.data_parallel_size = 1;
  plan.data_parallel_rank = 0;
  if (library_->api().plan) check(library_->api().plan(instance_, &plan), "plan");
  WEFT_CHECK(0 <= plan.first_stage && plan.first_stage < plan.last_stage && plan.last_stage <= num_stages,
             "plugin {}: plan chose stages [{}, {}) of a {}-stage model", library_->name(), plan.first_stage,
             plan.last_stage, num_stages);
  WEFT_CHECK(plan.data_parallel_size >= 1 && 0 <= plan.data_parallel_rank &&
                 plan.data_parallel_rank < plan.data_parallel_size,
             "plugin {}: plan chose data-parallel rank {} of {}", library_->name(), plan.data_parallel_rank,
             plan.data_parallel_size);
  return plan;
}

void StrategySession::setup() {
  if (library_->api().setup) check(library_->api().setup(instance_), "setup");
}

double StrategySession::train_step(const weft_step_info& step) {
  double loss = 0.0;
  check(library_->api().train_step(instance_, &step, &loss), "train_step");
  return loss;
}

std::pair<double, int64_t> StrategySession::eval_step(const weft_step_info& step) {
  double sum = 0.0;
  int64_t tokens = 0;
  check(library_->api().eval_step(instance_, &step, &sum, &tokens), "eval_step");
  return {sum, tokens};
}

double StrategySession::global_grad_norm_sq(double local_sq) {
  if (!library_->api().global_grad_norm_sq) return local_sq;
  double global = local_sq;
  check(library_->api().global_grad_norm_sq(instance_, local_sq, &global), "global_grad_norm_sq");
  return global;
}

weft_shard StrategySession::shard_parameter(const weft_parameter_info& info) {
  weft_shard shard{0, 1, 0};
  if (!has_shard_parameter()) return shard;
  check(library_->api().shard_parameter(instance_, &info, &shard), "shard_parameter");
  WEFT_CHECK(shard.parts >= 1 && 0 <= shard.index && shard.index < shard.parts && 0 <= shard.dim &&
                 shard.dim < info.ndim,
             "plugin {}: shard_parameter({}) returned dim {}, part {} of {}", library_->name(), info.name, shard.dim,
             shard.index, shard.parts);
  return shard;
}

void StrategySession::comm_point(weft_comm_point point, weft_direction direction, int64_t layer, DLTensor& tensor) {
  if (!has_comm_point()) return;
  check(library_->api().comm_point(instance_, point, direction, layer, &tensor), "comm_point");
}

}  // namespace weft
