#include "core/train/loss_scaler.h"

#include "core/util/error.h"

namespace weft {

LossScaler::LossScaler(bool enabled, LossScalerOptions options)
    : enabled_(enabled), options_(options), scale_(options.init_scale) {
  WEFT_CHECK(options_.init_scale > 0 && options_.growth_factor > 1 && options_.backoff_factor > 0 &&
                 options_.backoff_factor < 1 && options_.growth_interval >= 1,
             "loss scaler: init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1 needed");
}

bool LossScaler::update(bool finite) {
  if (!enabled_) return true;
  if (!finite) {
    scale_ *= options_.backoff_factor;
    streak_ = 0;
    ++skipped_;
    return false;
  }
  if (++streak_ == options_.growth_interval) {
    scale_ *= options_.growth_factor;
    streak_ = 0;
  }
  return true;
}

void LossScaler::restore(double scale, int64_t streak) {
  WEFT_CHECK(scale > 0 && streak >= 0 && streak < options_.growth_interval,
             "loss scaler state out of range: scale {} (must be > 0), streak {} (must be in [0, {}))", scale, streak,
             options_.growth_interval);
  scale_ = scale;
  streak_ = streak;
}

}  // namespace weft
