// Prompt tuning (train.mode = "prompt_tuning"), as PEFT's PromptTuningConfig for a causal LM: a
// trainable embedding of num_virtual_tokens rows (model.prompt_embeddings, [P, hidden], fp32) put
// before every sequence's token embeddings, the rest of the model frozen.
//
// The virtual tokens are positions of the sequence (RoPE positions 0..P-1, the text after them,
// as PEFT's inputs_embeds): the host prepends P slots to each row (ids -1..-P, which the embedding
// stage replaces with the prompt's rows; targets kIgnoreTarget), so that every strategy sees
// sequences of seq_len + P positions. PEFT also trains the last virtual token to predict the row's
// first token; weft does not (that target belongs to the previous window of packed text), so
// weft's loss counts the same targets with or without a prompt. Logits at the text's positions
// equal PEFT's (Reference.PromptTuningMatchesPeft).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/model/llama.h"

namespace weft {

struct PromptTuningConfig {
  int64_t num_virtual_tokens = 32;  // prompt_tuning.num_virtual_tokens
  std::string init = "random";      // random (PEFT's RANDOM: N(0, 1)) | text (PEFT's TEXT)
  std::string init_text;            // init = text: its tokens' embeddings, repeated or cut to P rows
};

// The slot id of virtual token k (0-based) in a row's inputs: -(k + 1).
inline int64_t prompt_slot_id(int64_t k) { return -(k + 1); }

// Registers model.prompt_embeddings on the model's embedding stage (where this process holds it;
// the model's options().prompt_tokens must be config.num_virtual_tokens) and freezes every other
// parameter. Initialised seeded by `seed` (random) or from the embeddings of `init_ids` (text; the
// model's embedding must be whole). Throws weft::Error for a vocabulary-parallel embedding (tensor
// parallelism), which prompt tuning does not support, and for an empty init_ids with init = text.
void apply_prompt_tuning(LlamaForCausalLMImpl& model, const PromptTuningConfig& config, uint64_t seed,
                         const std::vector<int32_t>& init_ids = {});

// Adds the parameter (zeros) to a model built with options().prompt_tokens > 0 that holds the
// embedding stage and has none yet (a whole copy to gather a split model into).
void add_prompt_parameter(LlamaForCausalLMImpl& model);

// Whether the model holds a prompt-tuning embedding.
bool has_prompt_tuning(const LlamaForCausalLMImpl& model);

// PEFT's files: adapter_model.safetensors {"prompt_embeddings": [P, hidden]} and adapter_config.json
// (peft_type PROMPT_TUNING, task_type CAUSAL_LM, num_virtual_tokens, token_dim, prompt_tuning_init
// RANDOM: the values are in the file, so PEFT loads them without the init text's tokenizer).
void save_prompt_adapter(LlamaForCausalLMImpl& model, const std::string& dir, const std::string& base_model = "");
// Loads them into a model with the parameter; weft::Error naming the file for a missing tensor or
// a shape other than [options().prompt_tokens, hidden].
void load_prompt_adapter(LlamaForCausalLMImpl& model, const std::string& dir);
// num_virtual_tokens from dir/adapter_config.json (peft_type PROMPT_TUNING, task_type CAUSAL_LM,
// num_transformer_submodules 1); weft::Error naming the file otherwise.
PromptTuningConfig read_prompt_adapter_config(const std::string& dir);

}  // namespace weft
