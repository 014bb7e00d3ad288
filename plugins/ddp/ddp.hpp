// ddp.hpp - ddp.so: data parallelism as a strategy plugin, on the SDK alone (no LibTorch).
//
// Every rank holds the whole model (plan: data_parallel_size = world size, rank = world rank)
// and sees its own rows of each global batch.
//  - setup: broadcasts every parameter from rank 0 (replicas start identical) and groups the
//    trainable parameters into buckets (buckets.hpp) of at most plugin.bucket_mb MiB of fp32.
//  - train_step: the one-process micro-batch loop; during the LAST micro-batch's backward the
//    grad-ready callback copies each completed bucket's gradients into the bucket's flat fp32
//    buffer and starts an asynchronous all_reduce(SUM) on it, buckets strictly in index order
//    (so every rank issues the same collectives in the same order). After backward, buckets not
//    yet started (parameters that got no gradient count as zeros) are started, all are waited
//    for in order, divided by the world size and copied back into the gradients. The loss is
//    the mean over micro-batches and ranks.
//  - eval_step: this rank's rows (possibly none) -> {loss sum, tokens} summed over the world.
//
// Configuration ([plugin]): bucket_mb (float > 0, default 25), log_every (int >= 0, default 0:
// never; else the step counters are logged at debug level every log_every steps).
// Requirements on the host: every gradient and parameter is a contiguous fp32 CPU tensor
// (WEFT_STATUS_UNSUPPORTED otherwise); fp64 all_reduce for the loss and evaluation sums.
#ifndef WEFT_PLUGINS_DDP_DDP_HPP
#define WEFT_PLUGINS_DDP_DDP_HPP

#include <cstdint>
#include <exception>
#include <vector>

#include <weft/strategy.hpp>

#include "../common/buckets.hpp"

namespace weft {
namespace ddp {

using weft::plugins::BucketInput;
using weft::plugins::BucketLayout;
using weft::plugins::build_buckets;

// What one train_step did, for the log and the tests.
struct StepStats {
  int64_t step = -1;                 // weft_step_info.step
  double wait_seconds = 0.0;         // wall time blocked in Work::wait (gradient buckets + loss)
  int64_t bytes_all_reduced = 0;     // payload of every all_reduce this step (buckets + loss)
  int64_t all_reduces = 0;           // all_reduce calls this step
  int64_t buckets_in_backward = 0;   // buckets started from the grad-ready callback
  int64_t missing_grads = 0;         // trainable parameters without a gradient (sent as zeros)
};

// The strategy. Construction reads and validates the configuration (Error BAD_CONFIG naming
// plugin.bucket_mb / plugin.log_every); methods throw weft::sdk::Error on failure.
class Ddp : public weft::sdk::Strategy {
 public:
  // ABI 1.12: ddp owns the data-parallel dimension of a composed run.
  static constexpr uint32_t mesh_dimensions = 1u << WEFT_MESH_DP;

  explicit Ddp(weft::sdk::Host host);
  ~Ddp() override;

  void plan(weft_model_plan& plan) override;
  void setup() override;
  double train_step(const weft_step_info& step) override;
  weft::sdk::EvalResult eval_step(const weft_step_info& step) override;
  // The host's plan plus the buckets: a flat fp32 copy of every trainable gradient.
  void memory_plan(weft_memory_plan& plan) override;
  // Composed (ABI 1.12), after the driver's step: averages every trainable gradient over this
  // plugin's world (its mesh dimension) in the same buckets, after backward (no overlap: the
  // driver's backward does not say when its last micro-batch starts), and the loss with them.
  double finish_step(const weft_step_info& step, double loss) override;
  // Sums the held-out loss and tokens over the world (its ranks see different rows).
  weft::sdk::EvalResult finish_eval(const weft_step_info& step, const weft::sdk::EvalResult& sums) override;
  // Every rank of the world holds the same averaged gradient.
  int32_t gradient_copies(int64_t index) override;

  // --- introspection (tests, logging) ---
  double bucket_mb() const noexcept { return bucket_mb_; }
  // The bucket layout built by setup (empty before).
  std::vector<BucketLayout> bucket_layouts() const;
  // The counters of the last train_step (step == -1 before the first).
  const StepStats& last_step_stats() const noexcept { return stats_; }

 private:
  struct Bucket {
    BucketLayout layout;
    weft::sdk::Buffer buffer;  // fp32, on the rank's device (the host's memory since ABI 1.2)
    int64_t pending = 0;  // parameters not yet ready in this backward
    bool started = false;
    weft::sdk::Work work;
  };

  // The buckets for these trainable parameters and gradient sizes (setup; match_step_gradients).
  void lay_out_buckets(const std::vector<BucketInput>& trainable);
  // ABI 1.14: lays the buckets out again if the step's gradients (Host::step_gradient) are a
  // stage-driving driver's flat shards rather than whole gradients.
  void match_step_gradients();
  static void grad_ready_trampoline(void* user_data, int64_t parameter_index) noexcept;
  void on_grad_ready(int64_t parameter_index);
  void begin_sync();
  void start_ready_buckets();
  void start_bucket(Bucket& bucket);
  void fill_bucket(Bucket& bucket);
  void finish_sync();
  void scatter_bucket(Bucket& bucket);
  void abandon_sync() noexcept;
  double all_reduce_doubles(std::vector<double>& values);
  void timed_wait(const weft::sdk::Work& work);
  void maybe_log(const weft_step_info& step) const;

  weft::sdk::Group world_;
  double bucket_mb_ = 25.0;
  int64_t log_every_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;  // per host parameter: its bucket, or -1 (not trainable)
  std::vector<char> ready_;         // per host parameter: ready in this backward
  size_t next_bucket_ = 0;          // the next bucket to start (buckets start in order)
  bool syncing_ = false;            // true during the last micro-batch's backward
  std::exception_ptr callback_error_;
  StepStats stats_;
};

}  // namespace ddp
}  // namespace weft

#endif  // WEFT_PLUGINS_DDP_DDP_HPP
