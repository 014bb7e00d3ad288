// Where a run stands (trainer_state.json in a checkpoint): step, data position, early stopping,
// the data's identity. Read back from untrusted files: from_json and validate are the parser
// (fuzzed by fuzz/checkpoint_state.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

namespace weft {

struct TrainerState {
  int64_t global_step = 0;     // optimizer steps completed
  int64_t epoch = 0;           // epoch of the next step (0-based)
  int64_t step_in_epoch = 0;   // index of the next step within its epoch
  double best_eval_loss = std::numeric_limits<double>::infinity();
  int64_t best_step = -1;
  int64_t evals_since_best = 0;
  double epoch_seconds = 0;    // time already spent in the current epoch
  int64_t epoch_tokens = 0;    // tokens already processed in the current epoch
  std::string data_identity;   // train sequences / seq_len / tokens: must match on resume
  bool early_stopped = false;
  double loss_scale = 0;          // fp16: the dynamic loss scale to go on with (0: none saved)
  int64_t loss_scale_streak = 0;  // fp16: finite steps since the scale last changed

  nlohmann::json to_json() const;
  static TrainerState from_json(const nlohmann::json& j, const std::string& origin);
  // The JSON text of a trainer_state.json. Throws weft::Error naming `origin` when it is not
  // valid JSON or lacks a field.
  static TrainerState parse(const std::string& text, const std::string& origin);
  // A checkpoint's state is untrusted input: throws weft::Error naming `origin` unless every value
  // is in range and the position is one a run with `steps_per_epoch` steps per epoch and `epochs`
  // epochs can be at (global_step = epoch * steps_per_epoch + step_in_epoch).
  void validate(int64_t steps_per_epoch, int64_t epochs, const std::string& origin) const;
};

}  // namespace weft
