// fuzz_config: a config file as weft reads it (TOML, `extends` a base file, overrides), against a
// schema with a key of every kind. Any input must either load or fail with weft::Error: another
// exception, a crash, a leak or undefined behaviour is a finding.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <unistd.h>

#include "core/config/config.h"
#include "core/config/schema.h"
#include "core/util/error.h"

namespace {

const weft::Schema& schema() {
  static const weft::Schema s = [] {
    weft::Schema schema;
    schema.sections = {{"train", "training", false}, {"model", "model", false}, {"data", "data", false},
                       {"plugin", "the plugin's own keys", true}};
    using weft::ValueType;
    schema.entries = {
        {"train.steps", ValueType::Int, int64_t{10}, "steps", {}, 0.0, std::nullopt},
        {"train.lr", ValueType::Float, 1e-3, "learning rate", {}, 0.0, 1.0, true},
        {"train.precision", ValueType::String, std::string("fp32"), "precision", {"fp32", "bf16", "fp16"}},
        {"model.checkpointing", ValueType::Bool, false, "checkpointing"},
        {"data.path", ValueType::StringList, std::vector<std::string>{}, "inputs"},
    };
    return schema;
  }();
  return s;
}

// A base file the input may extend ("base.toml", next to the input's name).
const std::string& directory() {
  static const std::string dir = [] {
    const auto d = std::filesystem::temp_directory_path() / ("weft_fuzz_config_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::ofstream(d / "base.toml") << "[train]\nsteps = 3\nlr = 0.5\n[plugin]\nstage = 3\n";
    return d.string();
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const weft::Config config = weft::load_config_text(schema(), text, directory() + "/main.toml", {"train.steps=4"});
    (void)config.to_toml();
    (void)config.hash();
  } catch (const weft::Error&) {
    // the one clear error bad input gets
  }
  return 0;
}
