// Text generation with the job's model: greedy or temperature + nucleus (top-p) sampling with a
// per-layer KV cache, under any strategy (tensor parallelism included: the vocabulary's shards are
// combined through the strategy's communication points).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

class Job;

struct GenerateResult {
  std::vector<int32_t> tokens;     // generated after the prompt (stop token excluded)
  std::string text;                // their decoding
  int64_t prompt_tokens = 0;
  double seconds = 0;              // prompt processing and generation
  double first_token_seconds = 0;  // prompt processing and the first new token
  // This rank's communication through the strategy during generation (tensor parallelism's
  // all-reduces): operations, bytes, and seconds spent waiting for them to complete.
  int64_t comm_operations = 0, comm_bytes = 0;
  double comm_wait_seconds = 0;
};

// Continues `prompt` for up to generate.max_new_tokens tokens (fewer where the model's positions
// end, with a warning), stopping at any of the checkpoint's end tokens (config.json's eos_token_id,
// a list too, or a GGUF file's EOS, EOT and EOM; the generation_config.json beside the weights;
// the tokenizer's EOS). Collective: every rank runs it and
// gets the same tokens.
// chat: `prompt` is a user message, rendered with the tokenizer's chat template and the
// generation prompt (core/data/chat_template.h; the template writes BOS where it wants one), as
// transformers' apply_chat_template(add_generation_prompt=True) renders it.
GenerateResult generate(Job& job, const std::string& prompt, bool chat = false);

}  // namespace weft
