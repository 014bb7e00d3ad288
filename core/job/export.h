// A training job as plain files, for another trainer to run the very same job (trainer bench's
// PyTorch baseline, python/pytorch_baseline.py).
#pragma once

#include <cstdint>
#include <string>

#include "core/job/options.h"

namespace weft {

// Writes into `dir`: config.json (the model's shape, HF layout), tokens.u32 (the training
// split's packed token stream, little-endian uint32: sequence i is tokens [i*L, i*L + L + 1)),
// order.u32 (little-endian uint32: the sequence at each position of weft's global batches over the
// `steps` steps, micro-batch after micro-batch, as the trainer's shuffled loader gives them)
// and run.json (seq_len, batch_size, grad_accum_steps, the AdamW settings, warmup_steps,
// grad_clip, seed, threads, precision, device ("cpu" or "cuda": train.device resolved here), steps_per_epoch,
// `steps` to run, mode (train.mode), weights (model.weights as an absolute path, "" for none) and
// lora (r, alpha, dropout, target_modules)). Tokenizes the data
// like a run would (or reads the token cache); builds no model. Throws weft::Error for bad
// options or a file that cannot be written.
void export_job(const TrainOptions& options, const std::string& dir, int64_t steps);

}  // namespace weft
