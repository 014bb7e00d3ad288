// Reading a run's metrics.jsonl in tests (the structured output tests assert on).
#pragma once

#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace weft::testing {

// The loss of every "step" record of a metrics.jsonl, in order (empty if the file is missing).
inline std::vector<double> step_losses(const std::string& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line);
    if (record["type"] == "step") out.push_back(record["loss"].get<double>());
  }
  return out;
}

// The summary's state_mib_per_rank[part] ("parameters", "gradients", "optimizer"): each rank's MiB
// between steps (empty if the file or the summary is missing).
inline std::vector<double> state_mib_per_rank(const std::string& metrics, const char* part) {
  std::vector<double> mib;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line);
    if (record["type"] == "summary") mib = record["state_mib_per_rank"][part].get<std::vector<double>>();
  }
  return mib;
}

// The records of one type ("eval", "summary", ...) of a metrics.jsonl, in order.
inline std::vector<nlohmann::json> records_of(const std::string& metrics, const std::string& type) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto record = nlohmann::json::parse(line);
    if (record["type"] == type) out.push_back(std::move(record));
  }
  return out;
}

// The last record of that type (null when there is none).
inline nlohmann::json last_record(const std::string& metrics, const std::string& type) {
  auto all = records_of(metrics, type);
  return all.empty() ? nlohmann::json() : all.back();
}

}  // namespace weft::testing
