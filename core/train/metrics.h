// Run metrics: one JSON object per line (steps, evaluations, epochs, the final summary), and the
// terminal progress display.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace weft {

// Appends JSON lines to a file (created with its directory; kept across resumes). Each line is
// flushed so a crashed run keeps everything up to its last step.
class MetricsWriter {
 public:
  // Empty path: discard. append = false starts the file afresh (a new run); true continues it
  // (a resumed run).
  explicit MetricsWriter(const std::string& path, bool append = true);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  // Writes `record` with "type" set to `type` and "time" (seconds since the epoch).
  void write(const std::string& type, nlohmann::json record);

 private:
  std::FILE* file_ = nullptr;
};

// A progress bar with ETA for a terminal, or a log line every N steps otherwise.
class Progress {
 public:
  // mode: auto (bar on a terminal, lines otherwise), bar, lines, off.
  Progress(const std::string& mode, int64_t log_every);
  // Steps count over the whole run, as evaluations and checkpoints do ("step 500/596 epoch 2/2");
  // `epoch_end`: the global step that ends this epoch; `done`: the steps done before it starts (a
  // resumed run's). The ETA is the rest of the run at the rate measured since the first call.
  void start_epoch(int64_t epoch, int64_t epochs, int64_t epoch_end, int64_t total_steps, int64_t done);
  // `done`: the optimizer steps done so far, this one included.
  void update(int64_t done, double loss, double lr, double tokens_per_s);
  void message(const std::string& text);  // a log line that does not break the bar
  void finish_epoch();

 private:
  bool bar_ = false, lines_ = false;
  int64_t log_every_ = 10;
  int64_t epoch_ = 0, epochs_ = 0, epoch_end_ = 0, total_ = 0, first_step_ = 0;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_;
  bool bar_open_ = false;
};

// Peak resident set size of this process, in MiB.
double peak_rss_mib();

std::string format_duration(double seconds);

}  // namespace weft
