// Evaluation: the token-weighted cross-entropy of a set of sequences under the job's model,
// through its strategy (so every plugin evaluates, with the numbers of one process). Training's
// held-out evaluation and `trainer eval` are this one function.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "core/data/dataset.h"

namespace weft {

class Job;

struct EvalResult {
  double loss = 0;        // token-weighted mean cross-entropy over the sequences evaluated
  double perplexity = 0;  // exp(loss)
  int64_t tokens = 0;     // target tokens evaluated
  int64_t sequences = 0;
  double seconds = 0;
  // With per_sequence: every sequence's mean loss, in the order of `sequences` (rank 0 only).
  std::vector<double> sequence_losses;
  // A classification model: every evaluated sequence's head outputs [sequences, num_labels]
  // (float64, the logits at its pooled position; on every rank). `loss` is then the mean over
  // sequences and `tokens` counts sequences.
  at::Tensor outputs;
  // The task's metrics (train.task = "classification", core/train/classification_eval.h), by
  // name in the order GLUE reports them, and the confusion matrix (row = true class, column =
  // predicted; classes x classes, row-major; empty for regression). A further held-out set's
  // (MNLI's mismatched) come prefixed with its name: "mismatched_accuracy".
  std::vector<std::pair<std::string, double>> metrics;
  std::vector<int64_t> confusion;
  std::vector<std::string> classes;
};

struct EvalOptions {
  int64_t batch_size = 8;    // global sequences per batch
  int64_t max_batches = 0;   // 0 = every batch
  bool per_sequence = false; // also each sequence's loss
  int64_t global_step = 0, epoch = 0;  // for the plugin's step info
};

// Collective: every rank of the job calls it with the same arguments. Leaves the model in
// training mode.
EvalResult evaluate(Job& job, const std::shared_ptr<const PackedSequences>& sequences, const EvalOptions& options);

}  // namespace weft
