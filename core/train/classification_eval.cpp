#include "core/train/classification_eval.h"

#include <cstring>

#include <fmt/format.h>

#include "core/train/task_metrics.h"
#include "core/util/error.h"

namespace weft {
namespace {

std::vector<int64_t> split_classes(const PackedSequences& split, int64_t n) {
  std::vector<int64_t> labels;
  labels.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) labels.push_back(split.target(i));
  return labels;
}

std::string describe(const std::vector<std::pair<std::string, double>>& metrics) {
  std::string out;
  for (const auto& [name, value] : metrics) out += fmt::format("{}{} {:.4f}", out.empty() ? "" : ", ", name, value);
  return out;
}

}  // namespace

void add_task_metrics(EvalResult& eval, const ClassificationData& data, const PackedSequences& split,
                      const std::string& prefix) {
  WEFT_CHECK(eval.outputs.defined() && split.labeled(), "task metrics need a classifier's outputs on labeled data");
  const int64_t n = eval.sequences;
  const auto outputs = eval.outputs.to(torch::kCPU, torch::kFloat64).contiguous();
  TaskMetrics metrics;
  if (data.regression) {
    std::vector<double> labels, predictions;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t bits = split.target(i);
      double score = 0;
      std::memcpy(&score, &bits, sizeof score);
      labels.push_back(score);
      predictions.push_back(outputs[i][0].item<double>());
    }
    metrics = regression_metrics(labels, predictions);
  } else {
    const auto predicted = outputs.argmax(1);
    std::vector<int64_t> predictions(predicted.data_ptr<int64_t>(), predicted.data_ptr<int64_t>() + n);
    metrics = classification_metrics(data.glue_task, split_classes(split, n), predictions,
                                     static_cast<int64_t>(data.labels.size()));
  }
  for (const auto& [name, value] : metrics.values) eval.metrics.emplace_back(prefix + name, value);
  if (prefix.empty() && metrics.confusion) {
    eval.confusion = metrics.confusion->counts;
    eval.classes = data.labels;
  }
}

std::string describe_task_metrics(const EvalResult& eval) { return describe(eval.metrics); }

std::string describe_majority_baseline(const ClassificationData& data, const PackedSequences& split) {
  if (data.regression) return "";
  const auto baseline = majority_baseline(data.train_labels, split_classes(split, split.n_sequences()),
                                          static_cast<int64_t>(data.labels.size()));
  return describe(baseline.values);
}

}  // namespace weft
