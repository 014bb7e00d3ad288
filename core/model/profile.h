// Timing the model's stages in isolation: what a pipeline partitioner needs to balance stages by
// time rather than by count (the plugin ABI's profile_stages).
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include "core/model/config.h"

namespace weft {

// Seconds of forward + backward of every stage of `config` (0 the embedding, 1..L the decoder
// blocks, L+1 the norm, head and loss) on `rows` x `seq_len` random tokens in `compute_dtype`:
// the median of `repeats` timings after a warm-up. The blocks are alike, so one is timed for all.
// Builds its own small models (the embedding with one block, and the head); seeds torch with 0.
std::vector<double> profile_stage_seconds(const ModelConfig& config, torch::Dtype compute_dtype, int64_t rows,
                                          int64_t seq_len, int32_t repeats);

}  // namespace weft
