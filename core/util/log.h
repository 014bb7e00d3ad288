// Logging: spdlog behind one logger named "weft". Ranks other than 0 prefix their lines later.
#pragma once

#include <string>
#include <spdlog/spdlog.h>

namespace weft {

// Sets the level by name: trace, debug, info, warn, error, off. Throws weft::Error otherwise.
void set_log_level(const std::string& level);

}  // namespace weft
