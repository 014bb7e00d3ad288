// Learning-rate schedules: linear warmup, then cosine or linear decay to lr * min_lr_ratio, or
// constant. A pure function of the step, so resuming needs only the step number.
#pragma once

#include <cstdint>
#include <string>

namespace weft {

struct LrSchedule {
  double peak_lr = 3e-4;
  double min_lr_ratio = 0.1;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  std::string kind = "cosine";  // cosine | linear | constant

  // Learning rate for optimizer step `step` (0-based): warmup ramps (step+1)/warmup * peak.
  double at(int64_t step) const;
};

}  // namespace weft
