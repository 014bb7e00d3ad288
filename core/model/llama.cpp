#include "core/model/llama.h"

#include <torch/torch.h>

#include "core/util/error.h"

namespace weft {

LlamaBackboneImpl::LlamaBackboneImpl(const ModelConfig& c, int64_t first, int64_t last) {
  const int64_t final_stage = c.num_hidden_layers + 1;
  const bool holds_head = first <= final_stage && final_stage < last;
  if (first == 0 || (holds_head && c.tie_word_embeddings)) {
    embed_tokens = register_module("embed_tokens",
                                   torch::nn::Embedding(c.vocab_size, c.hidden_size));
  }
  layers = register_module("layers", std::make_shared<torch::nn::Module>());
  for (int64_t stage = std::max<int64_t>(first, 1); stage < std::min(last, final_stage); ++stage) {
    const int64_t index = stage - 1;
    blocks.emplace(index, layers->register_module(std::to_string(index), DecoderBlock(c)));
  }
  if (holds_head) norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps));
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const ModelConfig& config, const ModelOptions& options)
    : config_(config), options_(options), rope_(config) {
  config_.validate();
  first_stage_ = options.stages.first;
  last_stage_ = options.stages.last < 0 ? num_stages() : options.stages.last;
  WEFT_CHECK(0 <= first_stage_ && first_stage_ < last_stage_ && last_stage_ <= num_stages(),
             "stage range [{}, {}) is not within the model's {} stages", first_stage_, last_stage_,
             num_stages());
  model = register_module("model", LlamaBackbone(config_, first_stage_, last_stage_));
  if (last_stage_ == num_stages() && !config_.tie_word_embeddings) {
    lm_head = register_module("lm_head", Linear(config_.hidden_size, config_.vocab_size));
  }
  set_compute_dtype(options_.compute_dtype);
}

void LlamaForCausalLMImpl::set_compute_dtype(torch::Dtype dtype) {
  WEFT_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16,
             "compute dtype must be fp32 or bf16");
  options_.compute_dtype = dtype;
  weft::set_compute_dtype(*this, dtype);
}

torch::Tensor LlamaForCausalLMImpl::head_weight() const {
  return lm_head.is_empty() ? model->embed_tokens->weight : lm_head->weight;
}

torch::Tensor LlamaForCausalLMImpl::run_stage(int64_t stage, const torch::Tensor& input) {
  const int64_t final_stage = num_stages() - 1;
  if (stage == 0) {
    WEFT_CHECK(input.scalar_type() == torch::kLong && input.dim() == 2,
               "stage 0 expects int64 token ids [batch, seq], got {} with {} dims",
               std::string(c10::toString(input.scalar_type())), input.dim());
    return model->embed_tokens(input);
  }
  if (stage < final_stage) {
    auto& block = model->blocks.at(stage - 1);
    if (options_.activation_checkpointing && is_training() && torch::GradMode::is_enabled()) {
      return checkpointed_block(*block, rope_, input);
    }
    return block->forward(input, rope_);
  }
  auto h = model->norm(input);
  if (!lm_head.is_empty()) return lm_head(h);
  return torch::nn::functional::linear(h.to(options_.compute_dtype),
                                       head_weight().to(options_.compute_dtype));
}

torch::Tensor LlamaForCausalLMImpl::forward_stages(int64_t first, int64_t last, const torch::Tensor& input) {
  WEFT_CHECK(first_stage_ <= first && first <= last && last <= last_stage_,
             "stages [{}, {}) requested but this model holds stages [{}, {})", first, last,
             first_stage_, last_stage_);
  torch::Tensor x = input;
  for (int64_t stage = first; stage < last; ++stage) x = run_stage(stage, x);
  return x;
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& tokens) {
  return forward_stages(0, num_stages(), tokens);
}

int64_t stage_of_parameter(const std::string& name, int64_t num_layers) {
  const std::string layers = "model.layers.";
  if (name.rfind("model.embed_tokens.", 0) == 0) return 0;
  if (name.rfind(layers, 0) == 0) return 1 + std::stoll(name.substr(layers.size()));
  return num_layers + 1;
}

torch::Tensor cross_entropy_sum(const torch::Tensor& logits, const torch::Tensor& targets) {
  const int64_t vocab = logits.size(-1);
  return torch::nn::functional::cross_entropy(
      logits.reshape({-1, vocab}).to(torch::kFloat32), targets.reshape({-1}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  return cross_entropy_sum(logits, targets) / static_cast<double>(targets.numel());
}

}  // namespace weft
