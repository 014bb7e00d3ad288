// fuzz_checkpoint_state: a checkpoint's trainer_state.json (TrainerState::parse, then validate
// against a run of 10 steps per epoch and 3 epochs, as resuming does). Any input must be accepted
// or fail with weft::Error naming the file.
#include <cstdint>
#include <string>

#include "core/train/trainer_state.h"
#include "core/util/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto state = weft::TrainerState::parse(text, "trainer_state.json");
    state.validate(/*steps_per_epoch=*/10, /*epochs=*/3, "trainer_state.json");
    (void)state.to_json().dump();
  } catch (const weft::Error&) {
  }
  return 0;
}
