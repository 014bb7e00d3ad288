// The LM head and its cross-entropy in one pass over row chunks, never holding the whole logits
// (Liger-Kernel's FusedLinearCrossEntropy): for each chunk of rows the logits h W^T, their
// log-sum-exp and loss, and when a gradient is wanted the chunk's softmax - one-hot turned at once
// into the gradients of h (and of W where it trains). Backward only scales those by the loss's
// gradient. The head's memory is then one chunk's logits (about 256 MiB) instead of several copies
// of [rows, vocab] (the logits, their fp32 copy, the saved log-softmax and the gradient).
#pragma once

#include <cstdint>

#include <torch/torch.h>

namespace weft {

// Rows per chunk for a vocabulary of `vocab`: one chunk's fp32 logits within about 256 MiB.
int64_t linear_cross_entropy_chunk_rows(int64_t vocab);

// The sum over rows of -log softmax(h W^T)[target] in fp32, rows whose target is `ignore_index`
// adding 0. h [N, H] (any float dtype), weight [V, H]; the product runs in `compute_dtype` (h and
// the weight cast to it, as the LM head's linear does) and the softmax in fp32. Differentiable in h
// and, where it requires a gradient, in the weight (accumulated in fp32). With `row_losses`, also
// each row's loss [N] (fp32; 0 for ignored rows), outside the graph. `chunk_rows` 0: the default.
// `grad_hint`: the gradient the sum is expected to get (a mean's 1 / N): the logits' gradient is
// scaled by it before its products, in the order the whole logits' backward scales it, and
// backward multiplies by the actual gradient over the hint (exactly 1 where it was right).
torch::Tensor linear_cross_entropy_sum(const torch::Tensor& h, const torch::Tensor& weight, const torch::Tensor& targets,
                                       torch::Dtype compute_dtype, int64_t ignore_index,
                                       torch::Tensor* row_losses = nullptr, int64_t chunk_rows = 0,
                                       double grad_hint = 1.0);

}  // namespace weft
