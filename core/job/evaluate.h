// Evaluation: the token-weighted cross-entropy of a set of sequences under the job's model,
// through its strategy (so every plugin evaluates, with the numbers of one process). Training's
// held-out evaluation and `trainer eval` are this one function.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

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
