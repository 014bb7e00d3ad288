// context_parallel.so: sequence (context) parallelism, composed with data parallelism (world =
// plugin.size x data-parallel ranks; layout.hpp), in two modes:
//  - "ulysses" (ABI 1.4): around every attention core the host calls sequence_exchange, an
//    all-to-all over the group that turns token-split q/k/v into head-split ones over the whole
//    sequence and the output back; the host runs the core for 1/size of the heads.
//  - "ring" (ABI 1.5): every rank keeps its queries; the host calls sequence_attention, and
//    ring_attention.hpp passes key/value blocks around the group (async send/recv overlapped with
//    the current block), merging blocks with their log-sum-exp in forward and backward through
//    the host's attention_block. With plugin.layout = "balanced" (the default) rank r holds chunks
//    r and 2 size - 1 - r of each sequence, so that every rank computes as many causal blocks;
//    "contiguous" keeps the 1.4 layout (rank r: the r-th slice; its work grows with r), for
//    comparison. Each step reports the ranks' attention seconds (plugin.ring_attention_seconds_*).
//
// Each rank of a sequence group holds 1/size of every sequence's tokens of its group's rows:
// embeddings, norms, MLP, head and loss run on those tokens, RoPE at their global positions (the
// host does both from the plan). Weights are replicated; gradients are averaged over the whole
// world by ddp.so's bucketed, overlapped all-reduce (this plugin is Ddp with another plan): every
// rank holds as many target tokens, so the mean of the ranks' local-mean gradients is the global
// batch's.
//
// Configuration ([plugin]): size (int, default: the world size) ranks per sequence group, which
// must divide the world size and data.seq_len (ring, balanced: 2 x size must divide it; the host
// refuses before compute), and, for ulysses, the attention heads; mode = "ulysses" | "ring";
// layout = "balanced" | "contiguous" (ring only); bucket_mb and log_every as ddp.so.
#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "../common/dl_views.hpp"
#include "../ddp/ddp.hpp"
#include "layout.hpp"
#include "ring_attention.hpp"

namespace weft {
namespace context_parallel {

using weft::sdk::Error;

class ContextParallel : public weft::ddp::Ddp {
 public:
  static constexpr uint16_t min_host_minor = 4;
  // ABI 1.12: the context-parallel dimension of a composed run (finish_step, finish_eval and
  // gradient_copies are ddp's: gradients averaged and losses summed over the sequence group).
  static constexpr uint32_t mesh_dimensions = 1u << WEFT_MESH_CP;

  explicit ContextParallel(weft::sdk::Host host) : Ddp(host) {
    const auto world = host.world();
    const int64_t size = host.config_int("size", world.size());
    mode_ = host.config_string("mode", "ulysses");
    if (mode_ != "ulysses" && mode_ != "ring") {
      throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.mode = \"" + mode_ + "\": context_parallel has \"ulysses\" and \"ring\"");
    }
    const std::string layout = host.config_string("layout", mode_ == "ring" ? "balanced" : "contiguous");
    if (layout != "balanced" && layout != "contiguous") {
      throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.layout = \"" + layout + "\": \"balanced\" or \"contiguous\"");
    }
    if (mode_ == "ulysses" && layout != "contiguous") {
      throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.layout = \"" + layout + "\" needs plugin.mode = \"ring\" (Ulysses "
                                          "exchanges contiguous slices)");
    }
    if (mode_ == "ring" && host.negotiated_minor() < 5) {
      throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.mode = \"ring\" needs a host of ABI 1.5 (this one speaks 1." +
                                              std::to_string(host.negotiated_minor()) + ")");
    }
    balanced_ = layout == "balanced";
    try {
      layout_ = layout_of(world.size(), world.rank(), static_cast<int32_t>(size));
    } catch (const std::invalid_argument& e) {
      throw Error(WEFT_STATUS_BAD_CONFIG, e.what());
    }
    // Collective: every rank creates every group, in the same order.
    for (const auto& ranks : layout_.groups) {
      auto group = host.create_group(ranks);
      if (ranks[0] / layout_.sequence_size == layout_.data_parallel_rank) group_ = group;
    }
    if (mode_ == "ring") {
      ring_ = std::make_unique<RingAttention>(host, group_, layout_.sequence_size, layout_.sequence_rank, balanced_);
    }
  }

  void plan(weft_model_plan& plan) override {
    Ddp::plan(plan);
    plan.data_parallel_size = layout_.data_parallel_size;
    plan.data_parallel_rank = layout_.data_parallel_rank;
    plan.sequence_parallel_size = layout_.sequence_size;
    plan.sequence_parallel_rank = layout_.sequence_rank;
    if (plan.struct_size >= offsetof(weft_model_plan, sequence_parallel_attention) + sizeof(int32_t)) {
      plan.sequence_parallel_layout = balanced_ ? WEFT_SEQUENCE_BALANCED : WEFT_SEQUENCE_CONTIGUOUS;
      plan.sequence_parallel_attention = ring_ ? WEFT_SEQUENCE_ATTENTION_PLUGIN : WEFT_SEQUENCE_ATTENTION_EXCHANGE;
    }
  }

  // Activations: each rank keeps its share of every sequence (Ulysses: the attention core's share
  // of the heads over the whole sequence is the same size; ring: the host's estimate already
  // counts blockwise attention's output and log-sum-exp instead of the probabilities). Ring adds
  // its buffers: two key/value blocks, and in the backward three fp32 gradient blocks.
  void memory_plan(weft_memory_plan& plan) override {
    Ddp::memory_plan(plan);
    plan.activation_bytes /= layout_.sequence_size;
    if (ring_) {
      const weft_model_info info = host().model_info();
      const int64_t cb = info.compute_dtype.bits / 8;
      const int64_t kv = 2 * plan.rows_per_micro_batch * info.num_key_value_heads * info.head_dim *
                         (plan.seq_len / layout_.sequence_size);
      plan.buffer_bytes += 2 * kv * cb + 3 * kv * 4;
    }
  }

  void sequence_exchange(int64_t, weft_direction, const DLTensor& send, DLTensor& recv) override {
    host().all_to_all(group_, recv, send).wait();
  }

  void sequence_attention(const weft_attention_call& call) override {
    if (!ring_) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "sequence_attention: plugin.mode is \"ulysses\"");
    if (call.direction == WEFT_FORWARD) {
      ring_->forward(call);
    } else {
      ring_->backward(call);
    }
  }

  double train_step(const weft_step_info& step) override {
    if (ring_) ring_->take_compute_seconds();  // this step's forward, recompute and backward only (not evaluation)
    const double loss = Ddp::train_step(step);
    if (ring_) report_attention_seconds();
    return loss;
  }

 private:
  // Every rank's attention seconds of this step (all-gathered over the sequence group), so that
  // rank 0's metrics show the balance: ring_attention_seconds_rank<i>, _max and _min.
  void report_attention_seconds() {
    std::vector<double> mine{ring_->take_compute_seconds()};
    std::vector<double> all(static_cast<size_t>(layout_.sequence_size), 0.0);
    int64_t mine_shape[2], all_shape[2];
    DLTensor in = weft::plugins::flat_view(mine, mine_shape), out = weft::plugins::flat_view(all, all_shape);
    host().all_gather(group_, out, in).wait();
    double lo = all[0], hi = all[0];
    for (size_t i = 0; i < all.size(); ++i) {
      host().report_metric(("ring_attention_seconds_rank" + std::to_string(i)).c_str(), all[i]);
      lo = std::min(lo, all[i]);
      hi = std::max(hi, all[i]);
    }
    host().report_metric("ring_attention_seconds_max", hi);
    host().report_metric("ring_attention_seconds_min", lo);
  }

  Layout layout_;
  weft::sdk::Group group_;
  std::string mode_;
  bool balanced_ = false;
  std::unique_ptr<RingAttention> ring_;
};

}  // namespace context_parallel
}  // namespace weft

WEFT_STRATEGY(weft::context_parallel::ContextParallel, "context_parallel", "0.2.0",
              "sequence (context) parallelism: Ulysses all-to-all or ring attention, composed with data parallelism")
