#include "core/train/task_metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/util/error.h"

namespace weft {

// Named, not anonymous: core/train's sources share unity-build units (CMAKE_UNITY_BUILD), where
// every file's anonymous namespace is the same one.
namespace task_metrics_impl {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Checks the matrix's shape and returns its number of samples (> 0).
int64_t checked_total(const ConfusionMatrix& m) {
  WEFT_CHECK(m.classes >= 1 && m.counts.size() == static_cast<size_t>(m.classes * m.classes),
             "confusion matrix of {} classes has {} counts, not {}", m.classes, m.counts.size(),
             m.classes * m.classes);
  int64_t total = 0;
  for (int64_t c : m.counts) {
    WEFT_CHECK(c >= 0, "confusion matrix has a negative count ({})", c);
    total += c;
  }
  WEFT_CHECK(total > 0, "cannot score a confusion matrix with no samples");
  return total;
}

// Per-class totals: true (row sums) and predicted (column sums).
void class_sums(const ConfusionMatrix& m, std::vector<int64_t>& truth, std::vector<int64_t>& predicted) {
  truth.assign(m.classes, 0);
  predicted.assign(m.classes, 0);
  for (int64_t t = 0; t < m.classes; ++t)
    for (int64_t p = 0; p < m.classes; ++p) {
      truth[t] += m.counts[t * m.classes + p];
      predicted[p] += m.counts[t * m.classes + p];
    }
}

// 2·TP / (2·TP + FP + FN) = 2·TP / (true + predicted); 0 when both are 0.
double f1_of(int64_t tp, int64_t truth, int64_t predicted) {
  return truth + predicted == 0 ? 0.0 : 2.0 * static_cast<double>(tp) / static_cast<double>(truth + predicted);
}

void check_ids(const std::vector<int64_t>& ids, const char* what, int64_t classes) {
  for (size_t i = 0; i < ids.size(); ++i)
    WEFT_CHECK(ids[i] >= 0 && ids[i] < classes, "{} {} at index {} is outside [0, {})", what, ids[i], i, classes);
}

void check_pair(const std::vector<double>& x, const std::vector<double>& y, const char* what) {
  WEFT_CHECK(x.size() == y.size(), "{}: the inputs have different lengths ({} and {})", what, x.size(), y.size());
  WEFT_CHECK(!x.empty(), "{}: the inputs are empty", what);
}

bool constant(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [&](double a) { return a == v[0]; });
}

double mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

// The deviations from the mean divided by their Euclidean norm (scaled by the largest first, as
// SciPy does, so that large values do not overflow).
std::vector<double> unit_deviations(const std::vector<double>& v) {
  const double mu = mean(v);
  std::vector<double> d(v.size());
  double largest = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    d[i] = v[i] - mu;
    largest = std::max(largest, std::abs(d[i]));
  }
  double squares = 0;
  for (double a : d) squares += (a / largest) * (a / largest);
  const double norm = largest * std::sqrt(squares);
  for (double& a : d) a /= norm;
  return d;
}

// scipy.stats.rankdata(v, method='average'): 1-based ranks, ties sharing the mean of their ranks.
std::vector<double> average_ranks(const std::vector<double>& v) {
  std::vector<size_t> order(v.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> ranks(v.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i + 1;
    while (j < order.size() && v[order[j]] == v[order[i]]) ++j;
    const double rank = (static_cast<double>(i + 1) + static_cast<double>(j)) / 2.0;  // mean of i+1 .. j
    for (size_t k = i; k < j; ++k) ranks[order[k]] = rank;
    i = j;
  }
  return ranks;
}

}  // namespace task_metrics_impl

int64_t ConfusionMatrix::at(int64_t truth, int64_t predicted) const {
  WEFT_CHECK(truth >= 0 && truth < classes && predicted >= 0 && predicted < classes,
             "confusion matrix entry ({}, {}) is outside [0, {})", truth, predicted, classes);
  return counts[truth * classes + predicted];
}

ConfusionMatrix confusion_matrix(const std::vector<int64_t>& labels, const std::vector<int64_t>& predictions,
                                 int64_t classes) {
  WEFT_CHECK(classes >= 1, "a classification needs at least 1 class, got {}", classes);
  WEFT_CHECK(labels.size() == predictions.size(), "{} labels but {} predictions", labels.size(),
             predictions.size());
  task_metrics_impl::check_ids(labels, "label", classes);
  task_metrics_impl::check_ids(predictions, "prediction", classes);
  ConfusionMatrix m;
  m.classes = classes;
  m.counts.assign(classes * classes, 0);
  for (size_t i = 0; i < labels.size(); ++i) ++m.counts[labels[i] * classes + predictions[i]];
  return m;
}

double accuracy(const ConfusionMatrix& m) {
  const int64_t total = task_metrics_impl::checked_total(m);
  int64_t correct = 0;
  for (int64_t k = 0; k < m.classes; ++k) correct += m.counts[k * m.classes + k];
  return static_cast<double>(correct) / static_cast<double>(total);
}

double f1_binary(const ConfusionMatrix& m, int64_t positive) {
  task_metrics_impl::checked_total(m);
  WEFT_CHECK(positive >= 0 && positive < m.classes, "positive class {} is outside [0, {})", positive, m.classes);
  std::vector<int64_t> truth, predicted;
  task_metrics_impl::class_sums(m, truth, predicted);
  return task_metrics_impl::f1_of(m.counts[positive * m.classes + positive], truth[positive], predicted[positive]);
}

double macro_f1(const ConfusionMatrix& m) {
  task_metrics_impl::checked_total(m);
  std::vector<int64_t> truth, predicted;
  task_metrics_impl::class_sums(m, truth, predicted);
  double sum = 0;
  int64_t present = 0;
  for (int64_t k = 0; k < m.classes; ++k) {
    if (truth[k] + predicted[k] == 0) continue;  // in neither labels nor predictions
    sum += task_metrics_impl::f1_of(m.counts[k * m.classes + k], truth[k], predicted[k]);
    ++present;
  }
  return sum / static_cast<double>(present);  // present > 0: the matrix has samples
}

double matthews_corrcoef(const ConfusionMatrix& m) {
  const int64_t s = task_metrics_impl::checked_total(m);
  std::vector<int64_t> truth, predicted;
  task_metrics_impl::class_sums(m, truth, predicted);
  // In double: s² and the sums of squares fit int64 for any realistic s, their product does not.
  double c = 0, tp = 0, pp = 0, tt = 0;
  for (int64_t k = 0; k < m.classes; ++k) {
    c += static_cast<double>(m.counts[k * m.classes + k]);
    tp += static_cast<double>(truth[k]) * static_cast<double>(predicted[k]);
    pp += static_cast<double>(predicted[k]) * static_cast<double>(predicted[k]);
    tt += static_cast<double>(truth[k]) * static_cast<double>(truth[k]);
  }
  const double n = static_cast<double>(s);
  const double cov_tp = c * n - tp, cov_pp = n * n - pp, cov_tt = n * n - tt;
  if (cov_pp * cov_tt == 0) return 0.0;
  return cov_tp / std::sqrt(cov_tt * cov_pp);
}

double pearson(const std::vector<double>& x, const std::vector<double>& y) {
  task_metrics_impl::check_pair(x, y, "pearson");
  if (task_metrics_impl::constant(x) || task_metrics_impl::constant(y)) return task_metrics_impl::kNaN;
  const std::vector<double> dx = task_metrics_impl::unit_deviations(x), dy = task_metrics_impl::unit_deviations(y);
  double r = 0;
  for (size_t i = 0; i < dx.size(); ++i) r += dx[i] * dy[i];
  return std::isnan(r) ? r : std::clamp(r, -1.0, 1.0);
}

double spearman(const std::vector<double>& x, const std::vector<double>& y) {
  task_metrics_impl::check_pair(x, y, "spearman");
  auto has_nan = [](const std::vector<double>& v) {
    return std::any_of(v.begin(), v.end(), [](double a) { return std::isnan(a); });
  };
  if (has_nan(x) || has_nan(y)) return task_metrics_impl::kNaN;
  return pearson(task_metrics_impl::average_ranks(x), task_metrics_impl::average_ranks(y));
}

TaskMetrics classification_metrics(const std::string& glue_task, const std::vector<int64_t>& labels,
                                   const std::vector<int64_t>& predictions, int64_t classes) {
  static const char* kTasks = "cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli, or \"\" (not a GLUE task)";
  const std::string& t = glue_task;
  const bool accuracy_only = t == "sst2" || t == "mnli" || t == "qnli" || t == "rte" || t == "wnli";
  WEFT_CHECK(t != "stsb", "GLUE task stsb is a regression task: it has no classification metrics");
  WEFT_CHECK(accuracy_only || t == "cola" || t == "mrpc" || t == "qqp" || t.empty(),
             "unknown GLUE task '{}' (valid: {})", t, kTasks);
  WEFT_CHECK(!labels.empty(), "cannot score a classification with no samples");
  TaskMetrics out;
  out.confusion = confusion_matrix(labels, predictions, classes);
  const ConfusionMatrix& m = *out.confusion;
  if (t == "cola") out.values.emplace_back("matthews_correlation", matthews_corrcoef(m));
  out.values.emplace_back("accuracy", accuracy(m));
  if (t == "mrpc" || t == "qqp") out.values.emplace_back("f1", f1_binary(m, 1));
  if (t.empty()) out.values.emplace_back("macro_f1", macro_f1(m));
  return out;
}

TaskMetrics regression_metrics(const std::vector<double>& labels, const std::vector<double>& predictions) {
  task_metrics_impl::check_pair(labels, predictions, "regression metrics");
  double squares = 0;
  for (size_t i = 0; i < labels.size(); ++i) squares += (labels[i] - predictions[i]) * (labels[i] - predictions[i]);
  TaskMetrics out;
  out.values = {{"pearson", pearson(labels, predictions)},
                {"spearmanr", spearman(labels, predictions)},
                {"mse", squares / static_cast<double>(labels.size())}};
  return out;
}

TaskMetrics majority_baseline(const std::vector<int64_t>& train_labels, const std::vector<int64_t>& labels,
                              int64_t classes) {
  WEFT_CHECK(classes >= 1, "a classification needs at least 1 class, got {}", classes);
  WEFT_CHECK(!train_labels.empty(), "the majority baseline needs training labels, got none");
  task_metrics_impl::check_ids(train_labels, "training label", classes);
  std::vector<int64_t> frequency(classes, 0);
  for (int64_t label : train_labels) ++frequency[label];
  // max_element returns the first of equal maxima: the smallest id.
  const int64_t majority = std::max_element(frequency.begin(), frequency.end()) - frequency.begin();
  return classification_metrics("", labels, std::vector<int64_t>(labels.size(), majority), classes);
}

}  // namespace weft
