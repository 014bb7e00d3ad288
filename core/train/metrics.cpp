#include "core/train/metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "core/util/error.h"

namespace weft {

MetricsWriter::MetricsWriter(const std::string& path, bool append) {
  if (path.empty()) return;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  WEFT_CHECK(file_ != nullptr, "cannot open metrics file '{}'", path);
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const std::string& type, nlohmann::json record) {
  if (!file_) return;
  record["type"] = type;
  record["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string line = record.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

Progress::Progress(const std::string& mode, int64_t log_every) : log_every_(log_every) {
  const bool tty = ::isatty(STDERR_FILENO);
  bar_ = mode == "bar" || (mode == "auto" && tty);
  lines_ = mode == "lines" || (mode == "auto" && !tty);
}

void Progress::start_epoch(int64_t epoch, int64_t epochs, int64_t epoch_end, int64_t total_steps, int64_t done) {
  epoch_ = epoch;
  epochs_ = epochs;
  epoch_end_ = epoch_end;
  total_ = total_steps;
  if (!started_) {  // the rate (and so the ETA) over the whole run, evaluations and checkpoints included
    started_ = true;
    start_ = std::chrono::steady_clock::now();
    first_step_ = done;
  }
}

void Progress::update(int64_t done, double loss, double lr, double tokens_per_s) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t run = done - first_step_;
  const double eta = run > 0 ? elapsed / static_cast<double>(run) * static_cast<double>(total_ - done) : 0.0;
  if (bar_) {
    constexpr int kWidth = 28;
    const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : kWidth;
    std::string bar(filled, '=');
    if (filled < kWidth) bar += '>' + std::string(kWidth - filled - 1, ' ');
    fmt::print(stderr, "\rstep {}/{} [{}] epoch {}/{} loss {:.4f} lr {:.2e} {:.0f} tok/s ETA {}   ", done, total_,
               bar, epoch_ + 1, epochs_, loss, lr, tokens_per_s, format_duration(eta));
    std::fflush(stderr);
    bar_open_ = true;
  } else if (lines_ && (done % log_every_ == 0 || done == epoch_end_ || done == total_)) {
    spdlog::info("step {}/{} epoch {}/{} loss {:.4f} lr {:.2e} {:.0f} tok/s ETA {}", done, total_, epoch_ + 1, epochs_,
                 loss, lr, tokens_per_s, format_duration(eta));
  }
}

void Progress::message(const std::string& text) {
  if (bar_open_) {
    fmt::print(stderr, "\n");
    bar_open_ = false;
  }
  spdlog::info("{}", text);
}

void Progress::finish_epoch() {
  if (bar_open_) fmt::print(stderr, "\n");
  bar_open_ = false;
}

double peak_rss_mib() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // Linux reports KiB
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{:02}:{:02}", s / 60, s % 60);
}

}  // namespace weft
