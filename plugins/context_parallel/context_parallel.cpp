// context_parallel.so: sequence (context) parallelism, Ulysses style (ABI 1.4), composed with
// data parallelism (world = plugin.size x data-parallel ranks; layout.hpp).
//
// Each rank of a sequence group holds 1/size of every sequence's tokens of its group's rows:
// embeddings, norms, MLP, head and loss run on those tokens, RoPE at their global positions (the
// host does both from the plan), and around every attention core the host calls
// sequence_exchange, an all-to-all over the group that turns token-split q/k/v into head-split
// ones over the whole sequence and the output back. Weights are replicated; gradients are
// averaged over the whole world by ddp.so's bucketed, overlapped all-reduce (this plugin is
// Ddp with another plan): every rank holds as many target tokens, so the mean of the ranks'
// local-mean gradients is the global batch's.
//
// Configuration ([plugin]): size (int, default: the world size) ranks per sequence group, which
// must divide the world size, the attention heads and data.seq_len (the host refuses the last
// two before compute); mode = "ulysses" (the only one so far; "ring" is refused); bucket_mb and
// log_every as ddp.so.
#include <string>

#include "../ddp/ddp.hpp"
#include "layout.hpp"

namespace weft {
namespace context_parallel {

using weft::sdk::Error;

class ContextParallel : public weft::ddp::Ddp {
 public:
  static constexpr uint16_t min_host_minor = 4;

  explicit ContextParallel(weft::sdk::Host host) : Ddp(host) {
    const auto world = host.world();
    const int64_t size = host.config_int("size", world.size());
    const std::string mode = host.config_string("mode", "ulysses");
    if (mode != "ulysses") {
      throw Error(WEFT_STATUS_BAD_CONFIG, "plugin.mode = \"" + mode + "\": context_parallel has \"ulysses\" (ring "
                                          "attention is not implemented yet)");
    }
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
  }

  void plan(weft_model_plan& plan) override {
    Ddp::plan(plan);
    plan.data_parallel_size = layout_.data_parallel_size;
    plan.data_parallel_rank = layout_.data_parallel_rank;
    plan.sequence_parallel_size = layout_.sequence_size;
    plan.sequence_parallel_rank = layout_.sequence_rank;
  }

  // Activations: each rank keeps its share of every sequence (the attention core's share of the
  // heads over the whole sequence is the same size).
  void memory_plan(weft_memory_plan& plan) override {
    Ddp::memory_plan(plan);
    plan.activation_bytes /= layout_.sequence_size;
  }

  void sequence_exchange(int64_t, weft_direction, const DLTensor& send, DLTensor& recv) override {
    host().all_to_all(group_, recv, send).wait();
  }

 private:
  Layout layout_;
  weft::sdk::Group group_;
};

}  // namespace context_parallel
}  // namespace weft

WEFT_STRATEGY(weft::context_parallel::ContextParallel, "context_parallel", "0.1.0",
              "sequence (context) parallelism, Ulysses all-to-all, composed with data parallelism")
