// A Chrome/Perfetto trace of one process (trainer --trace FILE): nested spans per thread,
// recorded only when enabled (a disabled tracer costs one atomic load per call), written as the
// JSON trace-event format ("X" complete events, µs timestamps on the machine's monotonic clock)
// with the rank as process id, so the files of a machine's ranks line up when opened together.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace weft {

class Tracer {
 public:
  // The process's tracer.
  static Tracer& instance();

  // Starts recording; `path` is written by write(). `rank` labels the process in the trace.
  void enable(const std::string& path, int rank);
  bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }

  // Opens a span on the calling thread (strings copied); end() closes its innermost open span.
  // Unbalanced end() calls are ignored.
  void begin(const std::string& category, const std::string& name);
  void end();
  // A finished span [start, start + seconds) on the calling thread.
  void complete(const std::string& category, const std::string& name,
                std::chrono::steady_clock::time_point start, double seconds);

  // Writes every finished span to the path given to enable() (replacing it). Returns the path,
  // or "" when not enabled. Throws weft::Error if the file cannot be written.
  std::string write();

  // The path of rank `rank`'s file for a user-given FILE: FILE itself for a one-process run,
  // else FILE with ".rank<r>" before its extension (out.json -> out.rank1.json).
  static std::string rank_path(const std::string& file, int rank, int world);

 private:
  struct Event {
    std::string category, name;
    double start_us, duration_us;
    int thread;
  };
  double micros_since_start(std::chrono::steady_clock::time_point t) const;
  int thread_index();

  std::atomic<bool> enabled_{false};
  std::string path_;
  int rank_ = 0;
  std::mutex mutex_;
  std::vector<Event> events_;
  int next_thread_ = 0;
};

// Opens a span for the lifetime of the object when tracing is on.
class TraceSpan {
 public:
  TraceSpan(const char* category, const std::string& name) : on_(Tracer::instance().enabled()) {
    if (on_) Tracer::instance().begin(category, name);
  }
  ~TraceSpan() {
    if (on_) Tracer::instance().end();
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  bool on_;
};

}  // namespace weft
