// The host services for logging, tracing, per-step metrics and communication accounting.
#include "core/plugin/host_services.h"

#include <spdlog/spdlog.h>

#include "core/util/trace.h"

namespace weft {
namespace host {

void log_line(weft_host* host, weft_log_level level, const char* message) {
  try {
    const auto& s = state_of(host);
    static const spdlog::level::level_enum levels[] = {spdlog::level::trace, spdlog::level::debug,
                                                       spdlog::level::info, spdlog::level::warn,
                                                       spdlog::level::err};
    const int index = std::clamp(static_cast<int>(level), 0, 4);
    spdlog::log(levels[index], "[{}] {}", s.plugin_name, message ? message : "");
  } catch (...) {
  }
}

void trace_begin(weft_host*, const char* category, const char* name) {
  if (!Tracer::instance().enabled()) return;
  try {
    Tracer::instance().begin(category ? category : "plugin", name ? name : "");
  } catch (...) {
  }
}

void trace_end(weft_host*) {
  if (!Tracer::instance().enabled()) return;
  try {
    Tracer::instance().end();
  } catch (...) {
  }
}

weft_status* report_metric(weft_host* host, const char* name, double value) {
  return guarded([&] {
    WEFT_CHECK(name != nullptr && *name != '\0', "report_metric: empty name");
    const std::string key(name);
    for (char c : key) {
      WEFT_CHECK((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_',
                 "report_metric: name '{}' must be [a-z0-9_]+", key);
    }
    state_of(host).step_metrics[key] = value;
  });
}

// Adds the time since `start` to the time this rank spent blocked on communication.
void add_wait_time(weft_host* host, std::chrono::steady_clock::time_point start) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  auto& s = state_of(host);
  std::lock_guard<std::mutex> lock(s.comm_mutex);
  s.comm.wait_seconds += seconds;
}

}  // namespace host
}  // namespace weft
