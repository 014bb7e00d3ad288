// Classification and regression metrics (core/train/task_metrics.h) against scikit-learn and SciPy.
//
// Every expected value below was computed with scikit-learn 1.9.1, SciPy 1.17.1 (NumPy 2.4.6,
// Python 3.11) on the same inputs, with
//   sklearn.metrics.confusion_matrix(y, p, labels=range(k)), accuracy_score(y, p),
//   f1_score(y, p) (average='binary'), f1_score(y, p, average=None, labels=range(k), zero_division=0),
//   f1_score(y, p, average='macro'), matthews_corrcoef(y, p), mean_squared_error(x, y),
//   scipy.stats.pearsonr(x, y).statistic, scipy.stats.spearmanr(x, y).statistic,
//   scipy.stats.rankdata(x)
// and pasted here as Python's repr printed them.
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/train/task_metrics.h"
#include "core/util/error.h"

namespace task_metrics_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

using weft::accuracy;
using weft::classification_metrics;
using weft::ConfusionMatrix;
using weft::confusion_matrix;
using weft::Error;
using weft::f1_binary;
using weft::macro_f1;
using weft::majority_baseline;
using weft::matthews_corrcoef;
using weft::pearson;
using weft::regression_metrics;
using weft::spearman;
using weft::TaskMetrics;

constexpr double kTol = 1e-12;

using Ids = std::vector<int64_t>;
using Values = std::vector<double>;

std::vector<std::string> names(const TaskMetrics& m) {
  std::vector<std::string> out;
  for (const auto& [name, value] : m.values) out.push_back(name);
  return out;
}

double value(const TaskMetrics& m, const std::string& name) {
  for (const auto& [n, v] : m.values)
    if (n == name) return v;
  ADD_FAILURE() << "no metric " << name;
  return NAN;
}

// A case and what sklearn says about it.
struct Case {
  Ids labels, predictions;
  int64_t classes;
  std::vector<int64_t> matrix;  // sklearn's confusion_matrix, flattened row by row
  double accuracy, macro_f1, mcc;
  std::vector<double> per_class_f1;  // f1_score(average=None, labels=range(k), zero_division=0)
};

void check_case(const Case& c) {
  const ConfusionMatrix m = confusion_matrix(c.labels, c.predictions, c.classes);
  EXPECT_EQ(m.classes, c.classes);
  EXPECT_EQ(m.counts, c.matrix);
  EXPECT_NEAR(accuracy(m), c.accuracy, kTol);
  EXPECT_NEAR(macro_f1(m), c.macro_f1, kTol);
  EXPECT_NEAR(matthews_corrcoef(m), c.mcc, kTol);
  for (int64_t k = 0; k < c.classes; ++k) EXPECT_NEAR(f1_binary(m, k), c.per_class_f1[k], kTol) << "class " << k;
}

TEST(TaskMetrics, ConfusionMatrixCountsTruthByPrediction) {
  const ConfusionMatrix m = confusion_matrix({0, 1, 2, 2, 1}, {0, 2, 2, 1, 1}, 3);
  EXPECT_EQ(m.classes, 3);
  EXPECT_EQ(m.counts, (std::vector<int64_t>{1, 0, 0, 0, 1, 1, 0, 1, 1}));
  EXPECT_EQ(m.at(1, 2), 1);  // true 1 predicted 2
  EXPECT_EQ(m.at(2, 1), 1);
  EXPECT_EQ(m.at(0, 2), 0);
  EXPECT_THROW(m.at(3, 0), Error);
  EXPECT_THROW(m.at(0, -1), Error);
  // No samples: a matrix of zeros, which the metrics refuse (sklearn raises on empty inputs).
  const ConfusionMatrix empty = confusion_matrix({}, {}, 2);
  EXPECT_EQ(empty.counts, (std::vector<int64_t>{0, 0, 0, 0}));
  EXPECT_THROW(accuracy(empty), Error);
  EXPECT_THROW(macro_f1(empty), Error);
  EXPECT_THROW(f1_binary(empty), Error);
  EXPECT_THROW(matthews_corrcoef(empty), Error);
}

TEST(TaskMetrics, BinaryImbalanced) {
  const Ids y = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0}, p = {0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1};
  check_case({y, p, 2, {7, 2, 2, 1}, 0.6666666666666666, 0.5555555555555556, 0.1111111111111111,
              {0.7777777777777778, 0.3333333333333333}});
  EXPECT_NEAR(f1_binary(confusion_matrix(y, p, 2)), 0.3333333333333333, kTol);  // f1_score(y, p)
}

TEST(TaskMetrics, ThreeClasses) {
  check_case({{0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 1, 0},
              {0, 2, 1, 0, 0, 2, 1, 1, 2, 2, 1, 0},
              3,
              {3, 1, 0, 1, 2, 1, 0, 1, 3},
              0.6666666666666666,
              0.6666666666666666,
              0.5,
              {0.75, 0.5, 0.75}});
}

TEST(TaskMetrics, FiveClasses) {
  check_case({{4, 0, 3, 1, 2, 4, 4, 0, 2, 3, 1, 1, 4, 2, 0, 3, 4, 1},
              {4, 0, 1, 1, 2, 3, 4, 0, 2, 3, 4, 1, 4, 0, 0, 3, 2, 1},
              5,
              {3, 0, 0, 0, 0, 0, 3, 0, 0, 1, 1, 0, 2, 0, 0, 0, 1, 0, 2, 0, 0, 0, 1, 1, 3},
              0.7222222222222222,
              0.7214285714285713,
              0.6537014466829248,
              {0.8571428571428571, 0.75, 0.6666666666666666, 0.6666666666666666, 0.6666666666666666}});
}

// Class 3 is never predicted (F1 0, counted in the macro mean); class 4 is in neither the labels
// nor the predictions, so sklearn's macro mean leaves it out: (4/7 + 3/4 + 3/4 + 0) / 4.
TEST(TaskMetrics, ClassNeverPredictedCountsClassInNeitherDoesNot) {
  check_case({{0, 1, 2, 3, 0, 1, 2, 3, 1, 2, 3, 0, 2},
              {0, 1, 2, 1, 1, 1, 0, 2, 1, 2, 0, 0, 2},
              5,
              {2, 1, 0, 0, 0, 0, 3, 0, 0, 0, 1, 0, 3, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0},
              0.6153846153846154,
              0.5178571428571428,
              0.5134942101473738,
              {0.5714285714285714, 0.75, 0.75, 0.0, 0.0}});
}

// Class 2 is only predicted, never a label: it is in sklearn's union of labels and so in the mean.
TEST(TaskMetrics, ClassOnlyPredictedCountsInMacroF1) {
  const ConfusionMatrix m = confusion_matrix({0, 0, 1, 1, 0, 1}, {0, 2, 1, 1, 2, 0}, 4);
  EXPECT_EQ(m.counts, (std::vector<int64_t>{1, 0, 2, 0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_NEAR(accuracy(m), 0.5, kTol);
  EXPECT_NEAR(macro_f1(m), 0.4000000000000001, kTol);
  EXPECT_NEAR(matthews_corrcoef(m), 0.28867513459481287, kTol);
}

TEST(TaskMetrics, AllCorrect) {
  check_case({{0, 1, 2, 1, 0, 2}, {0, 1, 2, 1, 0, 2}, 3, {2, 0, 0, 0, 2, 0, 0, 0, 2}, 1.0, 1.0, 1.0, {1.0, 1.0, 1.0}});
}

TEST(TaskMetrics, AllWrong) {
  const Ids y = {0, 1, 1, 0, 1}, p = {1, 0, 0, 1, 0};
  check_case({y, p, 2, {0, 2, 3, 0}, 0.0, 0.0, -1.0, {0.0, 0.0}});
  EXPECT_NEAR(f1_binary(confusion_matrix(y, p, 2)), 0.0, kTol);  // f1_score(y, p)
}

// No true and no predicted positive: F1 is undefined (sklearn: 0.0, zero_division); every label
// and prediction one class: MCC's denominator is 0 (sklearn: 0.0). Only class 0 is in the union.
TEST(TaskMetrics, NoPositivesGivesZeroF1AndZeroMcc) {
  const ConfusionMatrix m = confusion_matrix({0, 0, 0, 0}, {0, 0, 0, 0}, 2);
  EXPECT_EQ(m.counts, (std::vector<int64_t>{4, 0, 0, 0}));
  EXPECT_EQ(accuracy(m), 1.0);
  EXPECT_EQ(f1_binary(m), 0.0);
  EXPECT_EQ(f1_binary(m, 0), 1.0);
  EXPECT_EQ(macro_f1(m), 1.0);
  EXPECT_EQ(matthews_corrcoef(m), 0.0);
  // Every prediction one class but the labels varied: still 0.
  EXPECT_EQ(matthews_corrcoef(confusion_matrix({0, 1, 1}, {1, 1, 1}, 2)), 0.0);
  // A one-class problem is allowed.
  EXPECT_EQ(accuracy(confusion_matrix({0, 0}, {0, 0}, 1)), 1.0);
}

TEST(TaskMetrics, PearsonAndSpearmanMatchScipy) {
  struct Reg {
    Values x, y;
    double pearson, spearman, mse;
  };
  const std::vector<Reg> cases = {
      {{1.0, 2.5, 3.1, 4.7, 5.2, 6.0}, {1.2, 2.0, 3.9, 4.1, 6.3, 5.5}, 0.9273953588490275, 0.942857142857143,
       0.4583333333333333},
      // ties in both (rankdata(x) = [1, 2.5, 2.5, 4, 6, 6, 6, 8])
      {{1, 2, 2, 3, 4, 4, 4, 5}, {2, 1, 3, 3, 5, 4, 6, 6}, 0.8767227853705732, 0.9007775105401477, 1.125},
      {{0.5, -1.25, 3.0, 2.0, 7.5}, {4.0, 5.5, 1.0, 2.5, -3.0}, -0.9977340128989783, -0.9999999999999999, 34.4625},
      // monotone but not linear: Spearman 1, Pearson less
      {{1, 2, 3, 4, 5}, {1, 4, 9, 16, 100}, 0.7952035738296035, 0.9999999999999999, 1841.8},
      {{1.0, 2.0}, {3.0, 1.0}, -1.0, -0.9999999999999999, 2.5},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Reg& c = cases[i];
    EXPECT_NEAR(pearson(c.x, c.y), c.pearson, kTol) << "case " << i;
    EXPECT_NEAR(spearman(c.x, c.y), c.spearman, kTol) << "case " << i;
    EXPECT_NEAR(pearson(c.y, c.x), c.pearson, kTol) << "case " << i;  // symmetric
    const TaskMetrics r = regression_metrics(c.x, c.y);
    EXPECT_EQ(names(r), (std::vector<std::string>{"pearson", "spearmanr", "mse"})) << "case " << i;
    EXPECT_NEAR(value(r, "pearson"), c.pearson, kTol) << "case " << i;
    EXPECT_NEAR(value(r, "spearmanr"), c.spearman, kTol) << "case " << i;
    EXPECT_NEAR(value(r, "mse"), c.mse, kTol) << "case " << i;
    EXPECT_FALSE(r.confusion.has_value());
  }
}

TEST(TaskMetrics, ConstantInputGivesNaN) {
  // scipy.stats.pearsonr([2, 2, 2, 2], [1, 2, 3, 4]) and spearmanr([1, 2, 3, 4], [5, 5, 5, 5]): nan
  EXPECT_TRUE(std::isnan(pearson({2, 2, 2, 2}, {1, 2, 3, 4})));
  EXPECT_TRUE(std::isnan(pearson({1, 2, 3, 4}, {5, 5, 5, 5})));
  EXPECT_TRUE(std::isnan(spearman({1, 2, 3, 4}, {5, 5, 5, 5})));
  EXPECT_TRUE(std::isnan(spearman({2, 2, 2, 2}, {1, 2, 3, 4})));
  EXPECT_TRUE(std::isnan(pearson({1.5}, {3.0})));  // one pair is constant (SciPy raises instead)
  EXPECT_TRUE(std::isnan(pearson({1, NAN, 3}, {1, 2, 3})));
  EXPECT_TRUE(std::isnan(spearman({1, NAN, 3}, {1, 2, 3})));
  const TaskMetrics r = regression_metrics({3, 3, 3}, {1, 2, 4});
  EXPECT_TRUE(std::isnan(value(r, "pearson")));
  EXPECT_TRUE(std::isnan(value(r, "spearmanr")));
  EXPECT_NEAR(value(r, "mse"), 2.0, kTol);  // (4 + 1 + 1) / 3
}

TEST(TaskMetrics, PearsonDoesNotOverflowOnLargeValues) {
  // The same data as the first case above, times 1e300: deviations squared would overflow.
  const Values x = {1e300, 2.5e300, 3.1e300, 4.7e300, 5.2e300, 6e300}, y = {1.2, 2.0, 3.9, 4.1, 6.3, 5.5};
  EXPECT_NEAR(pearson(x, y), 0.9273953588490275, 1e-9);
}

TEST(TaskMetrics, ClassificationMetricsPerGlueTask) {
  const Ids y = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0}, p = {0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 1};
  using Names = std::vector<std::string>;
  const TaskMetrics cola = classification_metrics("cola", y, p, 2);
  EXPECT_EQ(names(cola), (Names{"matthews_correlation", "accuracy"}));
  EXPECT_NEAR(value(cola, "matthews_correlation"), 0.1111111111111111, kTol);
  EXPECT_NEAR(value(cola, "accuracy"), 0.6666666666666666, kTol);
  for (const char* task : {"sst2", "mnli", "qnli", "rte", "wnli"}) {
    const TaskMetrics m = classification_metrics(task, y, p, 2);
    EXPECT_EQ(names(m), (Names{"accuracy"})) << task;
    EXPECT_NEAR(value(m, "accuracy"), 0.6666666666666666, kTol) << task;
  }
  for (const char* task : {"mrpc", "qqp"}) {
    const TaskMetrics m = classification_metrics(task, y, p, 2);
    EXPECT_EQ(names(m), (Names{"accuracy", "f1"})) << task;
    EXPECT_NEAR(value(m, "f1"), 0.3333333333333333, kTol) << task;
  }
  const TaskMetrics jsonl = classification_metrics("", y, p, 2);
  EXPECT_EQ(names(jsonl), (Names{"accuracy", "macro_f1"}));
  EXPECT_NEAR(value(jsonl, "macro_f1"), 0.5555555555555556, kTol);
  ASSERT_TRUE(jsonl.confusion.has_value());
  EXPECT_EQ(jsonl.confusion->counts, (std::vector<int64_t>{7, 2, 2, 1}));
  // mnli's three classes
  const TaskMetrics mnli = classification_metrics("mnli", {0, 1, 2, 0, 1, 2, 0, 1, 2, 2, 1, 0},
                                                  {0, 2, 1, 0, 0, 2, 1, 1, 2, 2, 1, 0}, 3);
  EXPECT_NEAR(value(mnli, "accuracy"), 0.6666666666666666, kTol);
  ASSERT_TRUE(mnli.confusion.has_value());
  EXPECT_EQ(mnli.confusion->classes, 3);
}

TEST(TaskMetrics, MajorityBaseline) {
  const Ids eval = {0, 1, 2, 2, 0, 1, 0};
  // Classes 0 and 2 tie in training (3 each): the smallest id, 0, is predicted.
  // sklearn: accuracy_score(eval, [0] * 7), f1_score(eval, [0] * 7, average='macro')
  const TaskMetrics tie = majority_baseline({2, 0, 1, 2, 0, 2, 1, 0}, eval, 3);
  EXPECT_EQ(names(tie), (std::vector<std::string>{"accuracy", "macro_f1"}));
  EXPECT_NEAR(value(tie, "accuracy"), 0.42857142857142855, kTol);
  EXPECT_NEAR(value(tie, "macro_f1"), 0.19999999999999998, kTol);
  ASSERT_TRUE(tie.confusion.has_value());
  EXPECT_EQ(tie.confusion->counts, (std::vector<int64_t>{3, 0, 0, 2, 0, 0, 2, 0, 0}));
  // Class 1 the majority: accuracy_score(eval, [1] * 7), f1_score(eval, [1] * 7, average='macro')
  const TaskMetrics one = majority_baseline({1, 1, 0, 2, 1}, eval, 3);
  EXPECT_NEAR(value(one, "accuracy"), 0.2857142857142857, kTol);
  EXPECT_NEAR(value(one, "macro_f1"), 0.14814814814814814, kTol);

  EXPECT_THROW(majority_baseline({}, eval, 3), Error);
  EXPECT_THROW(majority_baseline({0, 3}, eval, 3), Error);
  EXPECT_THROW(majority_baseline({0, 1}, {0, 5}, 3), Error);
  EXPECT_THROW(majority_baseline({0, 1}, eval, 0), Error);
}

// The message of the weft::Error `f` throws ("" if it throws none).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TaskMetrics, RejectsBadInput) {
  auto contains = [](const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; };
  // lengths
  EXPECT_TRUE(contains(error_of([] { confusion_matrix({0, 1}, {0}, 2); }), "2 labels but 1 predictions"));
  EXPECT_THROW(classification_metrics("sst2", {0, 1}, {0, 1, 1}, 2), Error);
  EXPECT_THROW(pearson({1, 2, 3}, {1, 2}), Error);
  EXPECT_THROW(spearman({1, 2}, {1, 2, 3}), Error);
  EXPECT_THROW(regression_metrics({1, 2}, {1}), Error);
  // ids out of range
  EXPECT_TRUE(contains(error_of([] { confusion_matrix({0, 2}, {0, 1}, 2); }), "label 2 at index 1 is outside [0, 2)"));
  EXPECT_TRUE(contains(error_of([] { confusion_matrix({0, 1}, {-1, 1}, 2); }), "prediction -1 at index 0"));
  EXPECT_THROW(classification_metrics("", {0, 1}, {0, 3}, 3), Error);
  // classes
  EXPECT_THROW(confusion_matrix({}, {}, 0), Error);
  EXPECT_THROW(confusion_matrix({0}, {0}, -2), Error);
  EXPECT_THROW(f1_binary(confusion_matrix({0, 1}, {0, 1}, 2), 2), Error);
  EXPECT_THROW(f1_binary(confusion_matrix({0, 1}, {0, 1}, 2), -1), Error);
  ConfusionMatrix malformed;
  malformed.classes = 2;
  malformed.counts = {1, 2, 3};
  EXPECT_THROW(accuracy(malformed), Error);
  // empty
  EXPECT_THROW(pearson({}, {}), Error);
  EXPECT_THROW(spearman({}, {}), Error);
  EXPECT_THROW(regression_metrics({}, {}), Error);
  EXPECT_THROW(classification_metrics("cola", {}, {}, 2), Error);
  // task names
  const std::string unknown = error_of([] { classification_metrics("sst-2", {0}, {0}, 2); });
  EXPECT_TRUE(contains(unknown, "unknown GLUE task 'sst-2'")) << unknown;
  for (const char* task : {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"})
    EXPECT_TRUE(contains(unknown, task)) << unknown;
  EXPECT_THROW(classification_metrics("SST2", {0}, {0}, 2), Error);
  EXPECT_THROW(classification_metrics("mnli_matched", {0}, {0}, 3), Error);
  EXPECT_TRUE(contains(error_of([] { classification_metrics("stsb", {0}, {0}, 2); }), "regression"));
}

}  // namespace task_metrics_test
