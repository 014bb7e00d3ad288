#include "core/job/evaluate.h"

#include <chrono>
#include <cmath>

#include <torch/torch.h>

#include "core/data/loader.h"
#include "core/job/job.h"
#include "core/util/error.h"
#include "core/util/fault_injection.h"
#include "core/util/trace.h"

namespace weft {

EvalResult evaluate(Job& job, const std::shared_ptr<const PackedSequences>& sequences, const EvalOptions& options) {
  WEFT_CHECK(sequences != nullptr, "nothing to evaluate");
  TraceSpan span("eval", "evaluation");
  const auto start = std::chrono::steady_clock::now();
  const Placement& place = job.placement();
  EvalLoader loader(sequences, options.batch_size, place.data_parallel_rank, place.data_parallel_size);
  int64_t batches = loader.num_batches();
  if (options.max_batches > 0) batches = std::min(batches, options.max_batches);
  auto& strategy = job.strategy();
  const int64_t prompt_tokens = job.prompt_tuning() ? job.prompt_tuning()->num_virtual_tokens : 0;
  const int64_t outputs = job.model().config().num_labels;  // > 0: a classifier, whose outputs are the result
  const bool record = options.per_sequence || outputs > 0;
  if (record) strategy.record_sequence_losses(sequences->n_sequences(), outputs);
  job.model().eval();
  double loss_sum = 0.0;
  int64_t tokens = 0;
  try {
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < batches; ++i) {
      fault_point("eval");
      const EvalSums sums =
          strategy.eval_batch(loader, i, options.global_step, options.epoch, sequences->seq_len() + prompt_tokens);
      loss_sum += sums.loss_sum;
      tokens += sums.tokens;
    }
  } catch (...) {
    job.model().train();
    throw;
  }
  job.model().train();
  EvalResult result;
  result.tokens = tokens;
  result.sequences = std::min(sequences->n_sequences(), batches * options.batch_size);
  result.loss = tokens > 0 ? loss_sum / static_cast<double>(tokens) : 0.0;
  result.perplexity = std::exp(result.loss);
  if (record) {
    // Each rank holds the sums of the sequences it computed a loss for (several ranks may hold the
    // same ones: tensor-parallel ranks, or none: pipeline stages before the last); summed over the
    // world, each divided by the number of ranks that computed it (a rank that holds 1/N of every
    // sequence, under context parallelism, counts 1/N).
    auto [sums, counts] = strategy.take_sequence_losses();
    auto& world = job.communicator().world();
    auto add = job.communicator().all_reduce(world, sums, c10d::ReduceOp::SUM);
    job.communicator().wait(add);
    auto count = job.communicator().all_reduce(world, counts, c10d::ReduceOp::SUM);
    job.communicator().wait(count);
    for (int64_t s = 0; s < result.sequences; ++s) {
      const double n = counts[s].item<double>();
      WEFT_CHECK(n > 0, "evaluation: no rank computed the loss of sequence {}", s);
      const auto counted = static_cast<double>(sequences->counted_targets(s));
      if (options.per_sequence) result.sequence_losses.push_back(sums[s].item<double>() / n / counted);
    }
    if (outputs > 0) {
      auto summed = strategy.take_sequence_outputs();
      auto reduce = job.communicator().all_reduce(world, summed, c10d::ReduceOp::SUM);
      job.communicator().wait(reduce);
      result.outputs = summed.narrow(0, 0, result.sequences) / counts.narrow(0, 0, result.sequences).unsqueeze(1);
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace weft
