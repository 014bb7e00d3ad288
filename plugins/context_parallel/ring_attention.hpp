// ring_attention.hpp - ring attention over the ranks of one sequence group (ABI 1.5), on the SDK
// alone: the host computes every block (Host::attention_block), this class moves them.
//
// Forward: the rank's own keys and values go into a send buffer; at each of the N steps of
// ring_schedule they leave for rank r + 1 while the next block arrives from rank r - 1 (async
// send/recv, overlapped with the current step's blocks), and the step's blocks are merged into
// the output and log-sum-exp of this rank's queries.
// Backward: the keys and values travel the same ring again; each step's key/value gradients are
// accumulated in fp32 into a buffer that travels one step behind them (received from rank r - 1
// while the step computes, added, sent on), and after the last step one more hop brings every
// block's summed gradient home. grad_q stays local.
// Transfers are posted in the same order at both ends of every pair of ranks (gradients before
// blocks; even ranks send first, odd ranks receive first), as NCCL, which ignores tags and pairs
// a peer's transfers in posting order, needs; Gloo matches them by tag as well.
// Per rank, it times the blocks' arithmetic (compute_seconds): with the balanced layout every rank
// computes the same number of blocks, with the contiguous one rank r computes r + 1.
#ifndef WEFT_PLUGINS_CONTEXT_PARALLEL_RING_ATTENTION_HPP
#define WEFT_PLUGINS_CONTEXT_PARALLEL_RING_ATTENTION_HPP

#include <cstdint>
#include <vector>

#include <weft/strategy.hpp>

#include "ring_schedule.hpp"

namespace weft {
namespace context_parallel {

class RingAttention {
 public:
  // `group`: the ranks that split the same sequences, in sequence-rank order; `rank`: this
  // rank's place in it.
  RingAttention(weft::sdk::Host host, weft::sdk::Group group, int32_t size, int32_t rank, bool balanced);

  // weft_attention_call in the forward (out, lse written) and the backward (grad_q/k/v written).
  void forward(const weft_attention_call& call);
  void backward(const weft_attention_call& call);

  // Wall seconds spent in the blocks' arithmetic since the last take (the host computes
  // synchronously on the CPU; on a GPU this is the time to issue the work).
  double take_compute_seconds();
  int64_t blocks_per_pass() const;  // blocks this rank computes per forward (and per backward)
  int64_t bytes_per_layer(const weft_attention_call& call) const;  // bytes sent per forward + backward

 private:
  // Checks the call, makes the block buffers and puts this rank's k and v in the first; returns
  // the chunk length.
  int64_t start_pass(const weft_attention_call& call);
  // A send to `to` and a receive from `from`, posted in the order both ends of a pair agree on.
  void exchange(const DLTensor& out, int32_t to, DLTensor& in, int32_t from, int32_t tag, weft::sdk::Work& send,
                weft::sdk::Work& recv) const;
  // The send/receive buffers, (re)made when the shape or dtype changes.
  void ensure(weft::sdk::Buffer& buffer, const std::vector<int64_t>& shape, DLDataType dtype);

  weft::sdk::Host host_;
  weft::sdk::Group group_;
  int32_t size_, rank_;
  bool balanced_;
  std::vector<RingStep> schedule_;
  weft::sdk::Buffer kv_[2];            // [2 (k, v), B, Hkv, s, D], compute dtype: the block held, the next
  weft::sdk::Buffer grad_kv_[2];       // fp32, the travelling key/value gradients (alternating)
  weft::sdk::Buffer grad_kv_in_;       // fp32, the gradients received from rank r - 1
  double compute_seconds_ = 0.0;
};

}  // namespace context_parallel
}  // namespace weft

#endif
