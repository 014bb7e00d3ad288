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

}  // namespace weft::testing
