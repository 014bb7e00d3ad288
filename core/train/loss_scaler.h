// Dynamic loss scaling for fp16 training (the semantics of PyTorch's torch.amp.GradScaler, with
// its defaults): the loss is multiplied by `scale` before backward so that small fp16 gradients do
// not underflow; the optimizer sees the gradients divided by it again. A step whose gradients hold
// an inf or NaN (on any rank: the global gradient norm decides) is skipped and the scale halves;
// after `growth_interval` finite steps in a row it doubles. Disabled (fp32, bf16) it is 1 and never
// skips.
#pragma once

#include <cstdint>

namespace weft {

struct LossScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  explicit LossScaler(bool enabled, LossScalerOptions options = {});

  bool enabled() const { return enabled_; }
  // What to multiply the loss by in this step's backward (1 when disabled).
  double scale() const { return enabled_ ? scale_ : 1.0; }
  // After the step's backward: `finite` says whether every gradient was finite. Returns whether the
  // optimizer may step (false: skip this step), and updates the scale.
  bool update(bool finite);
  int64_t skipped_steps() const { return skipped_; }
  int64_t finite_streak() const { return streak_; }

  // For checkpoints: the scale and the streak of finite steps towards the next growth.
  void restore(double scale, int64_t streak);

 private:
  bool enabled_;
  LossScalerOptions options_;
  double scale_;
  int64_t streak_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace weft
