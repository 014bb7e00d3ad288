#include "core/util/torch_profiler.h"

#include <set>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "core/util/error.h"

namespace weft {

void TorchProfiler::start(bool cuda) {
  WEFT_CHECK(!running_, "log.torch_profile: a profile is already being recorded");
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  std::set<ActivityType> activities{ActivityType::CPU};
  if (cuda) activities.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  running_ = true;
}

void TorchProfiler::stop_and_save(const std::string& path) {
  if (!running_) return;
  running_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  WEFT_CHECK(result != nullptr, "log.torch_profile: the profiler returned no result");
  result->save(path);
}

}  // namespace weft
