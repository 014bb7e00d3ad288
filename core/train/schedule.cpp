#include "core/train/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/util/error.h"

namespace weft {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) return peak_lr * static_cast<double>(step + 1) / warmup_steps;
  if (kind == "constant") return peak_lr;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - warmup_steps) / decay_steps);
  const double min_lr = peak_lr * min_lr_ratio;
  if (kind == "linear") return peak_lr + (min_lr - peak_lr) * progress;
  WEFT_CHECK(kind == "cosine", "unknown learning-rate schedule '{}'", kind);
  return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace weft
