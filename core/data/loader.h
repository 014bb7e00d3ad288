// Batches of packed sequences, with random access so that resuming needs only (epoch, index).
//
// Data parallelism: a *global* batch of G sequences is split over `world` ranks; rank r gets
// rows [r*G/world, (r+1)*G/world) of it. The union over ranks is exactly the batch one process
// with world = 1 would see, in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>
#include <torch/torch.h>

#include "core/data/dataset.h"

namespace weft {

// inputs/targets: int64 [rows, seq_len] on the CPU; targets[r][t] is the token following
// inputs[r][t]. Packed sequences have no padding: every target position counts.
struct Batch {
  at::Tensor inputs;
  at::Tensor targets;
  // Rows that hold several examples (PackedSequences::segmented): each input token's position
  // within its example, int64 [rows, seq_len]; undefined otherwise (positions 0, 1, ... of the row).
  at::Tensor positions;

  int64_t rows() const { return inputs.size(0); }
  // Number of target tokens (for token-weighted losses and evaluation): rows * seq_len.
  int64_t target_tokens() const { return targets.numel(); }
};

// Training batches. An epoch is batches_per_epoch() global batches; the sequences that do not
// fill a last global batch are dropped for that epoch (with shuffle, different ones each epoch).
class BatchLoader {
 public:
  // Movable, not copyable.
  // global_batch: sequences per micro-batch summed over all ranks. Throws weft::Error when seqs
  // is null, global_batch <= 0, world < 1, rank outside [0, world), global_batch % world != 0
  // ("batch_size 8 cannot be split over 3 ranks"), or the split holds fewer sequences than one
  // global batch (naming the split, its sequence count and the batch size).
  BatchLoader(std::shared_ptr<const PackedSequences> seqs, int64_t global_batch, int rank,
              int world, uint64_t seed, bool shuffle);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t global_batch() const { return global_batch_; }
  int64_t local_batch() const { return global_batch_ / world_; }  // rows per rank
  const PackedSequences& sequences() const { return *seqs_; }

  // This rank's rows of global batch `index` of `epoch`: global batch i of an epoch holds the
  // sequences at positions [i*G, (i+1)*G) of the epoch order, which is 0, 1, 2, ... without
  // shuffle and seeded_permutation(n_sequences, f(seed, epoch)) with shuffle (a different,
  // reproducible order per epoch). A pure function of (epoch, index): the result does not
  // depend on which batches were read before. Throws weft::Error when epoch < 0 or index is
  // outside [0, batches_per_epoch()). Thread-safe.
  Batch batch(int64_t epoch, int64_t index) const;

  // The sequence indices of this rank's rows of that batch (what batch() copies).
  std::vector<int64_t> sequence_indices(int64_t epoch, int64_t index) const;

  // The targets the loss counts in global batch `index` of `epoch`, over every rank's rows
  // (PackedSequences::counted_targets): what a token-weighted loss divides by. Throws like batch().
  int64_t counted_targets(int64_t epoch, int64_t index) const;

 private:
  std::shared_ptr<const std::vector<int64_t>> epoch_order(int64_t epoch) const;

  std::shared_ptr<const PackedSequences> seqs_;
  int64_t global_batch_;
  int rank_;
  int world_;
  uint64_t seed_;
  bool shuffle_;
  int64_t batches_per_epoch_;
  // The last epoch's permutation, reused while consecutive calls stay in the same epoch
  // (behind a pointer so that the loader stays movable).
  struct EpochCache {
    std::mutex mutex;
    int64_t epoch = -1;
    std::shared_ptr<const std::vector<int64_t>> order;
  };
  std::unique_ptr<EpochCache> cache_ = std::make_unique<EpochCache>();
};

// Evaluation batches: every sequence of the split exactly once, in order, sharded by rank.
// Batches are global batches of G consecutive sequences; the last one may be partial (holding
// the remaining R < G sequences), and is then split the same way: rank r gets rows
// [r*R/world, (r+1)*R/world), which may be zero rows (a [0, seq_len] tensor): such a rank must
// still join any collective that sums the loss over ranks. Nothing is dropped, so the
// token-weighted mean over all batches and ranks is the exact mean over the split.
class EvalLoader {
 public:
  // Throws like BatchLoader, except that a split smaller than one global batch is fine.
  EvalLoader(std::shared_ptr<const PackedSequences> seqs, int64_t global_batch, int rank,
             int world);

  const PackedSequences& sequences() const { return *seqs_; }
  int64_t num_batches() const;  // ceil(n_sequences / global_batch), the same on every rank
  // Throws weft::Error when index is outside [0, num_batches()).
  Batch batch(int64_t index) const;
  std::vector<int64_t> sequence_indices(int64_t index) const;

 private:
  std::shared_ptr<const PackedSequences> seqs_;
  int64_t global_batch_;
  int rank_;
  int world_;
};

// Copies the given sequences into a Batch (rows in the given order).
Batch make_batch(const PackedSequences& seqs, const std::vector<int64_t>& sequence_indices);

}  // namespace weft
