// Activation checkpointing for decoder blocks: a custom autograd function that runs the block
// without recording a graph, keeps only its input, and in backward recomputes the block with
// autograd on and back-propagates through the recomputed graph (PyTorch's reentrant checkpoint).
#include <optional>

#include <torch/torch.h>

#include "core/model/llama.h"

namespace weft {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // `anchor` is an empty tensor that requires grad, so the output requires grad (and backward
  // runs) even when x does not, as when the embedding is frozen under LoRA.
  // The block and the rope tables belong to the model, which outlives the backward pass, so
  // their addresses are kept in the context.
  static variable_list forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor anchor,
                               int64_t block_address, int64_t rope_address, const TokenLayout* layout) {
    ctx->saved_data["block"] = block_address;
    ctx->saved_data["rope"] = rope_address;
    ctx->saved_data["rng"] = at::detail::getDefaultCPUGenerator().get_state();
    ctx->save_for_backward({x});
    if (layout != nullptr) {  // packed rows: the recomputation needs the same positions and mask
      ctx->saved_data["cos"] = layout->cos;
      ctx->saved_data["sin"] = layout->sin;
      ctx->saved_data["mask"] = layout->mask;
    }
    torch::NoGradGuard no_grad;
    return {block(ctx)->forward(x, rope(ctx), layout)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto generator = at::detail::getDefaultCPUGenerator();
    const auto current_rng = generator.get_state();
    generator.set_state(ctx->saved_data["rng"].toTensor());
    std::optional<TokenLayout> layout;
    if (ctx->saved_data.count("mask") > 0) {
      layout = TokenLayout{ctx->saved_data["cos"].toTensor(), ctx->saved_data["sin"].toTensor(),
                           ctx->saved_data["mask"].toTensor()};
    }
    torch::Tensor y;
    {
      torch::AutoGradMode enable(true);
      y = block(ctx)->forward(x, rope(ctx), layout ? &*layout : nullptr);
    }
    generator.set_state(current_rng);
    torch::autograd::backward({y}, {grad_outputs[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }

 private:
  static DecoderBlockImpl* block(AutogradContext* ctx) {
    return reinterpret_cast<DecoderBlockImpl*>(ctx->saved_data["block"].toInt());
  }
  static const RotaryEmbedding& rope(AutogradContext* ctx) {
    return *reinterpret_cast<const RotaryEmbedding*>(ctx->saved_data["rope"].toInt());
  }
};

}  // namespace

torch::Tensor checkpointed_block(DecoderBlockImpl& block, const RotaryEmbedding& rope, const torch::Tensor& x,
                                 const TokenLayout* layout) {
  static const auto anchor = torch::empty({0}, torch::requires_grad());
  return CheckpointFunction::apply(x, anchor, reinterpret_cast<int64_t>(&block), reinterpret_cast<int64_t>(&rope),
                                   layout)[0];
}

}  // namespace weft
