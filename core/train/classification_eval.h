// The metrics of a classification job's evaluation (train.task = "classification"): the task's
// GLUE metrics (task_metrics.h) from the head outputs evaluate() gathered, and their one-line
// description for the console.
#pragma once

#include <string>

#include "core/data/classification.h"
#include "core/job/evaluate.h"

namespace weft {

// Fills eval.metrics, eval.confusion and eval.classes from eval.outputs against the labels of
// `split`'s first eval.sequences examples: the argmax class (classification), or the score
// (regression). `prefix` goes before every metric name (a further held-out set: "mismatched_").
void add_task_metrics(EvalResult& eval, const ClassificationData& data, const PackedSequences& split,
                      const std::string& prefix = "");

// "accuracy 0.8123, macro_f1 0.7012" (empty when there are no metrics).
std::string describe_task_metrics(const EvalResult& eval);

// The majority-class baseline of the held-out split (the most frequent training class), as
// "accuracy 0.4000, macro_f1 0.0952"; empty for regression.
std::string describe_majority_baseline(const ClassificationData& data, const PackedSequences& split);

}  // namespace weft
