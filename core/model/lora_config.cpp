// PEFT's adapter_config.json, read back (untrusted input: fuzzed by fuzz/adapter_config.cpp).
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/model/lora.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {

LoraConfig read_lora_adapter_config(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  WEFT_CHECK(std::filesystem::is_regular_file(path), "{}: no adapter config (is {} a LoRA adapter directory?)", path,
             dir);
  LoraConfig config;
  try {
    const auto j = nlohmann::json::parse(read_file(path));
    WEFT_CHECK(j.value("peft_type", std::string("LORA")) == "LORA", "{}: peft_type is {}, not LORA", path,
               j.value("peft_type", std::string()));
    WEFT_CHECK(j.at("r").is_number_integer(), "{}: r is not an integer", path);  // a float cast is UB
    config.spec.r = j.at("r").get<int64_t>();
    config.spec.alpha = j.at("lora_alpha").get<double>();
    config.spec.dropout = j.value("lora_dropout", 0.0);
    config.target_modules = j.at("target_modules").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not a LoRA adapter config ({})", path, e.what());
  }
  WEFT_CHECK(config.spec.r >= 1 && config.spec.alpha > 0 && !config.target_modules.empty(),
             "{}: r must be >= 1, lora_alpha > 0 and target_modules not empty", path);
  return config;
}

}  // namespace weft
