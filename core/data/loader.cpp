#include "core/data/loader.h"

#include "core/util/error.h"

namespace weft {

namespace {

void check_sharding(const std::shared_ptr<const PackedSequences>& seqs, int64_t global_batch,
                    int rank, int world) {
  WEFT_CHECK(seqs != nullptr, "batch loader needs a split (got none)");
  WEFT_CHECK(global_batch > 0, "batch_size must be positive, got {}", global_batch);
  WEFT_CHECK(world >= 1 && rank >= 0 && rank < world, "rank {} is outside a world of {}", rank,
             world);
  WEFT_CHECK(global_batch % world == 0, "batch_size {} cannot be split over {} ranks",
             global_batch, world);
}

// SplitMix64 finalizer: decorrelates (seed, epoch) pairs before seeding the generator.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Positions [begin + rank*rows/world, begin + (rank+1)*rows/world) of a global batch.
std::pair<int64_t, int64_t> rank_rows(int64_t begin, int64_t rows, int rank, int world) {
  return {begin + rows * rank / world, begin + rows * (rank + 1) / world};
}

}  // namespace

Batch make_batch(const PackedSequences& seqs, const std::vector<int64_t>& sequence_indices) {
  const int64_t rows = static_cast<int64_t>(sequence_indices.size());
  const int64_t len = seqs.seq_len();
  Batch batch{torch::empty({rows, len}, torch::kInt64), torch::empty({rows, len}, torch::kInt64), at::Tensor()};
  int64_t* inputs = batch.inputs.data_ptr<int64_t>();
  int64_t* targets = batch.targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    seqs.copy_sequence(sequence_indices[r], inputs + r * len, targets + r * len);
  }
  if (seqs.segmented()) {
    batch.positions = torch::empty({rows, len}, torch::kInt64);
    for (int64_t r = 0; r < rows; ++r) seqs.copy_positions(sequence_indices[r], batch.positions.data_ptr<int64_t>() + r * len);
  }
  return batch;
}

BatchLoader::BatchLoader(std::shared_ptr<const PackedSequences> seqs, int64_t global_batch,
                         int rank, int world, uint64_t seed, bool shuffle)
    : seqs_(std::move(seqs)), global_batch_(global_batch), rank_(rank), world_(world),
      seed_(seed), shuffle_(shuffle) {
  check_sharding(seqs_, global_batch, rank, world);
  batches_per_epoch_ = seqs_->n_sequences() / global_batch;
  WEFT_CHECK(batches_per_epoch_ > 0,
             "{} split has {} sequences of {} tokens, fewer than one batch of {} (lower "
             "batch_size or seq_len, or add data)",
             seqs_->name(), seqs_->n_sequences(), seqs_->seq_len(), global_batch);
}

std::shared_ptr<const std::vector<int64_t>> BatchLoader::epoch_order(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (cache_->epoch != epoch || !cache_->order) {
    cache_->order = std::make_shared<const std::vector<int64_t>>(
        seeded_permutation(seqs_->n_sequences(), mix64(seed_ ^ mix64(epoch))));
    cache_->epoch = epoch;
  }
  return cache_->order;
}

std::vector<int64_t> BatchLoader::sequence_indices(int64_t epoch, int64_t index) const {
  WEFT_CHECK(epoch >= 0, "epoch must be >= 0, got {}", epoch);
  WEFT_CHECK(index >= 0 && index < batches_per_epoch_,
             "batch index {} is outside the epoch's {} batches", index, batches_per_epoch_);
  const auto [begin, end] = rank_rows(index * global_batch_, global_batch_, rank_, world_);
  std::vector<int64_t> indices;
  indices.reserve(end - begin);
  if (!shuffle_) {
    for (int64_t p = begin; p < end; ++p) indices.push_back(p);
    return indices;
  }
  const auto order = epoch_order(epoch);
  for (int64_t p = begin; p < end; ++p) indices.push_back((*order)[p]);
  return indices;
}

Batch BatchLoader::batch(int64_t epoch, int64_t index) const {
  return make_batch(*seqs_, sequence_indices(epoch, index));
}

int64_t BatchLoader::counted_targets(int64_t epoch, int64_t index) const {
  WEFT_CHECK(epoch >= 0, "epoch must be >= 0, got {}", epoch);
  WEFT_CHECK(index >= 0 && index < batches_per_epoch_,
             "batch index {} is outside the epoch's {} batches", index, batches_per_epoch_);
  const auto order = shuffle_ ? epoch_order(epoch) : nullptr;
  int64_t counted = 0;
  for (int64_t p = index * global_batch_; p < (index + 1) * global_batch_; ++p) {
    counted += seqs_->counted_targets(order ? (*order)[static_cast<size_t>(p)] : p);
  }
  return counted;
}

EvalLoader::EvalLoader(std::shared_ptr<const PackedSequences> seqs, int64_t global_batch,
                       int rank, int world)
    : seqs_(std::move(seqs)), global_batch_(global_batch), rank_(rank), world_(world) {
  check_sharding(seqs_, global_batch, rank, world);
}

int64_t EvalLoader::num_batches() const {
  return (seqs_->n_sequences() + global_batch_ - 1) / global_batch_;
}

std::vector<int64_t> EvalLoader::sequence_indices(int64_t index) const {
  WEFT_CHECK(index >= 0 && index < num_batches(),
             "evaluation batch index {} is outside [0, {})", index, num_batches());
  const int64_t begin = index * global_batch_;
  const int64_t rows = std::min(global_batch_, seqs_->n_sequences() - begin);
  const auto [first, last] = rank_rows(begin, rows, rank_, world_);
  std::vector<int64_t> indices;
  for (int64_t p = first; p < last; ++p) indices.push_back(p);
  return indices;
}

Batch EvalLoader::batch(int64_t index) const {
  return make_batch(*seqs_, sequence_indices(index));
}

}  // namespace weft
