// fuzz_adapter_config: PEFT's adapter_config.json as read_lora_adapter_config reads it (a LoRA
// adapter given as model.adapter) and as read_adalora_adapter_config reads it (an AdaLoRA adapter,
// its rank_pattern included). Any input must give a config or fail with weft::Error naming the file.
#include <cstdint>

#include "core/model/adalora.h"
#include "core/model/lora.h"
#include "core/util/error.h"
#include "scratch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  weft::fuzz::write_file("adapter/adapter_config.json", data, size);
  try {
    (void)weft::read_lora_adapter_config(weft::fuzz::scratch_dir() + "/adapter");
  } catch (const weft::Error&) {
  }
  try {
    weft::RankPattern pattern;
    (void)weft::adapter_peft_type(weft::fuzz::scratch_dir() + "/adapter");
    (void)weft::read_adalora_adapter_config(weft::fuzz::scratch_dir() + "/adapter", &pattern);
  } catch (const weft::Error&) {
  }
  return 0;
}
