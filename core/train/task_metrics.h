// Evaluation metrics for sequence classification and regression (GLUE and JSONL tasks): the
// confusion matrix, accuracy, F1 (binary and macro), Matthews correlation, Pearson and Spearman
// correlation, and the set of metrics each GLUE task reports. Each function computes what its
// scikit-learn / SciPy namesake computes (tests/train/test_task_metrics.cpp checks them against
// reference values); where the two differ on an edge case the comment says so.
// Inputs that cannot be scored (mismatched lengths, ids outside [0, classes), no samples) throw
// weft::Error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace weft {

// Counts of (true label, predicted label) pairs over `classes` classes.
struct ConfusionMatrix {
  int64_t classes = 0;
  std::vector<int64_t> counts;  // row = true label, col = predicted, row-major classes x classes

  // The number of samples of label `truth` predicted as `predicted`; throws weft::Error when
  // either is outside [0, classes).
  int64_t at(int64_t truth, int64_t predicted) const;
};

// sklearn.metrics.confusion_matrix(labels, predictions, labels=range(classes)). Both are class
// ids in [0, classes); throws weft::Error when the lengths differ, an id is out of range or
// classes < 1. Empty inputs give a matrix of zeros (the metrics below refuse it).
ConfusionMatrix confusion_matrix(const std::vector<int64_t>& labels, const std::vector<int64_t>& predictions,
                                 int64_t classes);

// The metrics below throw weft::Error on a matrix with no samples (as scikit-learn refuses empty
// inputs) or with counts that do not match its classes.

// The fraction of samples predicted correctly (sklearn accuracy_score).
double accuracy(const ConfusionMatrix& m);

// F1 of class `positive` against the rest: 2·TP / (2·TP + FP + FN). On a two-class matrix this is
// sklearn f1_score(average='binary', pos_label=positive); on more classes it is that class's entry
// of f1_score(average=None). 0 when there is no true and no predicted positive (sklearn's
// zero_division=0 result; sklearn's default also returns 0 there, with a warning).
// Throws weft::Error when `positive` is outside [0, classes).
double f1_binary(const ConfusionMatrix& m, int64_t positive = 1);

// sklearn f1_score(average='macro'): the unweighted mean of the per-class F1 over the classes that
// occur in the labels or the predictions (sklearn's default labels, their union); a class that
// occurs in neither is left out. A class's F1 is 0 when it is undefined (zero_division=0).
double macro_f1(const ConfusionMatrix& m);

// sklearn matthews_corrcoef: the multiclass Matthews correlation coefficient (Gorodkin's R_K),
//   (c·s − Σ_k p_k·t_k) / sqrt((s² − Σ_k p_k²)(s² − Σ_k t_k²))
// with c correct samples of s, t_k true and p_k predicted samples of class k. In [-1, 1]; 0 when
// the denominator is 0 (all labels, or all predictions, one class), as sklearn returns.
double matthews_corrcoef(const ConfusionMatrix& m);

// scipy.stats.pearsonr(x, y).statistic: the sample correlation coefficient, clipped to [-1, 1].
// NaN when either input is constant (every value equal, as SciPy returns with a
// ConstantInputWarning), which includes a single pair (SciPy raises there) and NaN in an input.
// Throws weft::Error when the lengths differ or the inputs are empty.
double pearson(const std::vector<double>& x, const std::vector<double>& y);

// scipy.stats.spearmanr(x, y).statistic: the Pearson correlation of the ranks, where tied values
// get the mean of the ranks they span (scipy.stats.rankdata's 'average'). NaN when either input
// is constant or holds a NaN (SciPy's nan_policy='propagate'). Throws as pearson does.
double spearman(const std::vector<double>& x, const std::vector<double>& y);

// The metrics a task reports, by name, in the order below, with the confusion matrix of a
// classification task.
struct TaskMetrics {
  std::vector<std::pair<std::string, double>> values;
  std::optional<ConfusionMatrix> confusion;  // classification only
};

// The metrics GLUE's leaderboard reports for `glue_task`, named as Hugging Face evaluate's "glue"
// metric names them, the GLUE metric first and accuracy always included:
//   cola                      -> matthews_correlation, accuracy
//   sst2, mnli, qnli, rte, wnli -> accuracy
//   mrpc, qqp                 -> accuracy, f1 (f1_binary with class 1 positive)
//   "" (not GLUE: JSONL data) -> accuracy, macro_f1
// `labels` and `predictions` are class ids in [0, classes). Throws weft::Error on a task name
// other than these (the message lists the valid ones), on stsb (a regression task: use
// regression_metrics), and as confusion_matrix and the metrics do (empty inputs included).
TaskMetrics classification_metrics(const std::string& glue_task, const std::vector<int64_t>& labels,
                                   const std::vector<int64_t>& predictions, int64_t classes);

// The metrics of a regression task (stsb, or any task with regression = true): pearson and
// spearmanr (GLUE's for stsb), then mse, the mean squared error (sklearn mean_squared_error).
// Throws weft::Error when the lengths differ or the inputs are empty.
TaskMetrics regression_metrics(const std::vector<double>& labels, const std::vector<double>& predictions);

// The majority-class baseline: always predicting the most frequent label of `train_labels`
// (ties: the smallest id), scored on `labels` -> accuracy, macro_f1, and the confusion matrix.
// Throws weft::Error when `train_labels` is empty and as classification_metrics does.
TaskMetrics majority_baseline(const std::vector<int64_t>& train_labels, const std::vector<int64_t>& labels,
                              int64_t classes);

}  // namespace weft
