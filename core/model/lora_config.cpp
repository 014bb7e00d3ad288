// PEFT's adapter_config.json, read back, LoRA's and AdaLoRA's (untrusted input: fuzzed by
// fuzz/adapter_config.cpp).
#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/model/adalora.h"
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

std::string adapter_peft_type(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  WEFT_CHECK(std::filesystem::is_regular_file(path), "{}: no adapter config (is {} an adapter directory?)", path, dir);
  try {
    return nlohmann::json::parse(read_file(path)).value("peft_type", std::string("LORA"));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not an adapter config ({})", path, e.what());
  }
}

AdaLoraConfig read_adalora_adapter_config(const std::string& dir, RankPattern* pattern) {
  const std::string path = dir + "/adapter_config.json";
  WEFT_CHECK(std::filesystem::is_regular_file(path), "{}: no adapter config (is {} an AdaLoRA adapter directory?)",
             path, dir);
  AdaLoraConfig config;
  RankPattern read;
  try {
    const auto j = nlohmann::json::parse(read_file(path));
    WEFT_CHECK(j.value("peft_type", std::string()) == "ADALORA", "{}: peft_type is {}, not ADALORA", path,
               j.value("peft_type", std::string("LORA")));
    WEFT_CHECK(j.at("init_r").is_number_integer() && j.at("target_r").is_number_integer(),
               "{}: init_r and target_r must be integers", path);
    config.spec.r = j.at("init_r").get<int64_t>();
    config.target_r = j.at("target_r").get<int64_t>();
    config.spec.alpha = j.at("lora_alpha").get<double>();
    config.spec.dropout = j.value("lora_dropout", 0.0);
    config.target_modules = j.at("target_modules").get<std::vector<std::string>>();
    // An integer field, or `fallback` where absent or null (a float is refused: its cast could overflow).
    const auto integer = [&](const char* key, int64_t fallback) {
      if (!j.contains(key) || j.at(key).is_null()) return fallback;
      WEFT_CHECK(j.at(key).is_number_integer(), "{}: {} is not an integer", path, key);
      return j.at(key).get<int64_t>();
    };
    config.tinit = integer("tinit", 0);
    config.tfinal = integer("tfinal", 0);
    config.delta_t = integer("deltaT", 1);
    config.total_step = integer("total_step", 0);
    config.beta1 = j.value("beta1", 0.85);
    config.beta2 = j.value("beta2", 0.85);
    config.orth_reg_weight = j.value("orth_reg_weight", 0.5);
    if (j.contains("rank_pattern") && !j.at("rank_pattern").is_null()) {
      for (const auto& [key, flags] : j.at("rank_pattern").items()) {
        std::string layer = key;
        for (const std::string suffix : {".default", ".lora_E"}) {
          if (layer.size() > suffix.size() && layer.compare(layer.size() - suffix.size(), suffix.size(), suffix) == 0) {
            layer.resize(layer.size() - suffix.size());
          }
        }
        read[layer] = flags.get<std::vector<bool>>();
        WEFT_CHECK(static_cast<int64_t>(read[layer].size()) == config.spec.r,
                   "{}: rank_pattern of {} has {} flags, init_r is {}", path, key, read[layer].size(), config.spec.r);
      }
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not an AdaLoRA adapter config ({})", path, e.what());
  }
  WEFT_CHECK(config.spec.r >= 1 && config.spec.alpha > 0 && !config.target_modules.empty(),
             "{}: init_r must be >= 1, lora_alpha > 0 and target_modules not empty", path);
  WEFT_CHECK(config.target_r >= 0 && config.target_r <= config.spec.r && config.tinit >= 0 && config.tfinal >= 0 &&
                 config.delta_t >= 1 && config.total_step >= 0,
             "{}: target_r must lie in [0, init_r], tinit, tfinal and total_step be >= 0 and deltaT >= 1", path);
  if (pattern) *pattern = std::move(read);
  return config;
}

}  // namespace weft
