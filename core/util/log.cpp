#include "core/util/log.h"

#include "core/util/error.h"

namespace weft {

void set_log_level(const std::string& level) {
  const auto parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") {
    fail("unknown log level '{}' (use trace, debug, info, warn, error or off)", level);
  }
  spdlog::set_level(parsed);
}

}  // namespace weft
