#include "core/util/trace.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace weft {
namespace {

struct OpenSpan {
  std::string category, name;
  std::chrono::steady_clock::time_point start;
};

thread_local std::vector<OpenSpan> open_spans;
thread_local int thread_id = -1;

}  // namespace

Tracer& Tracer::instance() {
  static Tracer tracer;
  return tracer;
}

void Tracer::enable(const std::string& path, int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  path_ = path;
  rank_ = rank;
  enabled_.store(true);
}

int Tracer::thread_index() {
  if (thread_id < 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    thread_id = next_thread_++;
  }
  return thread_id;
}

// The monotonic clock's own epoch (boot on Linux), shared by every process of a machine, so
// the traces of local ranks line up.
double Tracer::micros_since_start(std::chrono::steady_clock::time_point t) const {
  return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
}

void Tracer::begin(const std::string& category, const std::string& name) {
  if (!enabled()) return;
  open_spans.push_back({category, name, std::chrono::steady_clock::now()});
}

void Tracer::end() {
  if (!enabled() || open_spans.empty()) return;
  OpenSpan span = std::move(open_spans.back());
  open_spans.pop_back();
  complete(span.category, span.name, span.start,
           std::chrono::duration<double>(std::chrono::steady_clock::now() - span.start).count());
}

void Tracer::complete(const std::string& category, const std::string& name,
                      std::chrono::steady_clock::time_point start, double seconds) {
  if (!enabled()) return;
  const int thread = thread_index();
  Event e{category, name, micros_since_start(start), seconds * 1e6, thread};
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(std::move(e));
}

std::string Tracer::write() {
  if (!enabled()) return "";
  nlohmann::json events = nlohmann::json::array();
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    path = path_;
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank_},
                      {"args", {{"name", "rank " + std::to_string(rank_)}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank_},
                      {"args", {{"sort_index", rank_}}}});
    for (const Event& e : events_) {
      events.push_back({{"name", e.name}, {"cat", e.category}, {"ph", "X"}, {"ts", e.start_us},
                        {"dur", e.duration_us}, {"pid", rank_}, {"tid", e.thread}});
    }
  }
  const std::filesystem::path file(path);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  std::ofstream out(path);
  WEFT_CHECK(out.good(), "cannot write the trace to '{}'", path);
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  WEFT_CHECK(out.good(), "writing the trace to '{}' failed", path);
  return path;
}

std::string Tracer::rank_path(const std::string& file, int rank, int world) {
  if (world <= 1) return file;
  const std::filesystem::path p(file);
  std::filesystem::path out = p.parent_path() / p.stem();
  return out.string() + ".rank" + std::to_string(rank) + p.extension().string();
}

}  // namespace weft
