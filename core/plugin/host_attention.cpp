// The host's blockwise attention for plugins of ABI 1.5: ring attention's arithmetic
// (plugins/context_parallel/blockwise_attention.hpp, linked here until ABI 1 goes) on views the
// plugin hands over.
#include "blockwise_attention.hpp"
#include "core/plugin/host_services.h"

namespace weft {
namespace host {

using context_parallel::AttentionBlockSpan;
using context_parallel::attention_block_backward;
using context_parallel::attention_block_forward;

weft_status* attention_block(weft_host*, weft_direction direction, const weft_attention_block* block) {
  return guarded([&] {
    WEFT_CHECK(block && block->struct_size >= sizeof(weft_attention_block) && block->q && block->k && block->v &&
                   block->out && block->lse,
               "attention_block: a weft_attention_block with q, k, v, out and lse needed");
    const auto q = sdk::from_dl_view(*block->q), k = sdk::from_dl_view(*block->k), v = sdk::from_dl_view(*block->v);
    auto out = sdk::from_dl_view(*block->out), lse = sdk::from_dl_view(*block->lse);
    const AttentionBlockSpan span{block->q_position, block->k_position, block->causal != 0, block->scale};
    if (direction == WEFT_FORWARD) {
      attention_block_forward(q, k, v, span, out, lse, block->accumulate != 0);
      return;
    }
    WEFT_CHECK(direction == WEFT_BACKWARD, "attention_block: direction {} is neither forward nor backward",
               static_cast<int>(direction));
    WEFT_CHECK(block->grad_out && block->grad_q && block->grad_k && block->grad_v,
               "attention_block: the backward needs grad_out, grad_q, grad_k and grad_v");
    auto grad_q = sdk::from_dl_view(*block->grad_q), grad_k = sdk::from_dl_view(*block->grad_k),
         grad_v = sdk::from_dl_view(*block->grad_v);
    attention_block_backward(q, k, v, span, out, lse, sdk::from_dl_view(*block->grad_out), grad_q, grad_k, grad_v);
  });
}

}  // namespace host
}  // namespace weft
