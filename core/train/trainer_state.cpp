#include "core/train/trainer_state.h"

#include <cmath>

#include "core/util/error.h"

namespace weft {

nlohmann::json TrainerState::to_json() const {
  return {
      {"global_step", global_step},
      {"epoch", epoch},
      {"step_in_epoch", step_in_epoch},
      {"best_eval_loss", std::isfinite(best_eval_loss) ? nlohmann::json(best_eval_loss) : nlohmann::json(nullptr)},
      {"best_step", best_step},
      {"evals_since_best", evals_since_best},
      {"epoch_seconds", epoch_seconds},
      {"epoch_tokens", epoch_tokens},
      {"data_identity", data_identity},
      {"early_stopped", early_stopped},
      {"loss_scale", loss_scale},
      {"loss_scale_streak", loss_scale_streak},
  };
}

namespace {

// An integer field: a JSON integer (a float such as 7.8e117 would not convert; nlohmann's get would
// cast it, which is undefined behaviour past int64's range).
int64_t integer(const nlohmann::json& j, const char* key, const std::string& origin) {
  const auto& value = j.at(key);
  WEFT_CHECK(value.is_number_integer(), "{}: {} is not an integer", origin, key);
  return value.get<int64_t>();
}

}  // namespace

TrainerState TrainerState::from_json(const nlohmann::json& j, const std::string& origin) {
  TrainerState s;
  try {
    s.global_step = integer(j, "global_step", origin);
    s.epoch = integer(j, "epoch", origin);
    s.step_in_epoch = integer(j, "step_in_epoch", origin);
    if (!j.at("best_eval_loss").is_null()) s.best_eval_loss = j.at("best_eval_loss").get<double>();
    s.best_step = integer(j, "best_step", origin);
    s.evals_since_best = integer(j, "evals_since_best", origin);
    s.epoch_seconds = j.at("epoch_seconds").get<double>();
    s.epoch_tokens = integer(j, "epoch_tokens", origin);
    s.data_identity = j.at("data_identity").get<std::string>();
    s.early_stopped = j.value("early_stopped", false);
    s.loss_scale = j.value("loss_scale", 0.0);  // absent in checkpoints before fp16
    s.loss_scale_streak = j.contains("loss_scale_streak") ? integer(j, "loss_scale_streak", origin) : 0;
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed trainer state ({})", origin, e.what());
  }
  return s;
}

TrainerState TrainerState::parse(const std::string& text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", origin, e.what());
  }
  return from_json(j, origin);
}

void TrainerState::validate(int64_t steps_per_epoch, int64_t epochs, const std::string& origin) const {
  WEFT_CHECK(global_step >= 0 && epoch >= 0 && step_in_epoch >= 0,
             "{}: global_step {}, epoch {} and step_in_epoch {} must not be negative", origin, global_step, epoch,
             step_in_epoch);
  WEFT_CHECK(step_in_epoch <= steps_per_epoch,
             "{}: step_in_epoch {} is past the end of an epoch of {} steps (this run's data and batch settings)",
             origin, step_in_epoch, steps_per_epoch);
  WEFT_CHECK(epoch <= epochs, "{}: the checkpoint is in epoch {} but train.epochs is {}", origin, epoch + 1, epochs);
  WEFT_CHECK(epoch < epochs || step_in_epoch == 0, "{}: step_in_epoch {} in epoch {}, after the last epoch ({})",
             origin, step_in_epoch, epoch + 1, epochs);
  WEFT_CHECK(global_step == epoch * steps_per_epoch + step_in_epoch,
             "{}: global_step {} is not epoch {} x {} steps per epoch + step_in_epoch {} (was the checkpoint made "
             "with another train.batch_size or grad_accum_steps?)",
             origin, global_step, epoch, steps_per_epoch, step_in_epoch);
  WEFT_CHECK(best_step >= -1 && best_step <= global_step, "{}: best_step {} is not between -1 and global_step {}",
             origin, best_step, global_step);
  WEFT_CHECK(evals_since_best >= 0 && epoch_tokens >= 0, "{}: evals_since_best {} and epoch_tokens {} must not be "
             "negative", origin, evals_since_best, epoch_tokens);
  WEFT_CHECK(std::isfinite(epoch_seconds) && epoch_seconds >= 0, "{}: epoch_seconds {} is not a duration", origin,
             epoch_seconds);
  WEFT_CHECK(std::isinf(best_eval_loss) || (std::isfinite(best_eval_loss) && best_eval_loss >= 0),
             "{}: best_eval_loss {} is not a loss", origin, best_eval_loss);
  WEFT_CHECK(std::isfinite(loss_scale) && loss_scale >= 0 && loss_scale_streak >= 0,
             "{}: loss_scale {} and loss_scale_streak {} must be finite and not negative", origin, loss_scale,
             loss_scale_streak);
}

}  // namespace weft
