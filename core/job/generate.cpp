#include "core/job/generate.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "core/data/chat_template.h"
#include "core/model/prompt_tuning.h"
#include "core/io/gguf.h"
#include "core/job/job.h"
#include "core/util/fs.h"
#include "core/util/error.h"

namespace weft {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The whole vocabulary's logits of the last position, on every rank (a vocabulary-parallel
// model sums its shards through the loss-sum communication point).
torch::Tensor full_vocabulary(LlamaForCausalLMImpl& model, const torch::Tensor& last) {
  if (!model.vocab_parallel()) return last.to(torch::kFloat32);
  WEFT_CHECK(model.options().comm != nullptr && *model.options().comm,
             "the vocabulary is split over ranks but the plugin has no comm_point to combine it");
  auto full = torch::zeros({model.config().vocab_size}, last.options().dtype(torch::kFloat32));
  full.narrow(0, model.local_shape().vocab_start, model.local_shape().vocab).copy_(last);
  (*model.options().comm)(CommPoint::kLossSum, /*backward=*/false, -1, full);
  return full;
}

// Greedy (temperature 0) or temperature + nucleus (top-p) sampling with `generator`.
int32_t pick_token(const torch::Tensor& logits, double temperature, double top_p, at::Generator& generator) {
  if (temperature <= 0.0) return static_cast<int32_t>(logits.argmax().item<int64_t>());
  auto probs = (logits / temperature).softmax(0);
  auto [sorted, order] = probs.sort(0, /*descending=*/true);
  auto cumulative = sorted.cumsum(0);
  // Keep the smallest prefix whose mass reaches top_p (at least one token).
  auto keep = (cumulative - sorted) < top_p;
  auto kept = sorted * keep.to(torch::kFloat32);
  const int64_t choice = torch::multinomial(kept / kept.sum(), 1, false, generator).item<int64_t>();
  return static_cast<int32_t>(order[choice].item<int64_t>());
}

// The ids generation stops at: the checkpoint's end tokens (config.json's or the GGUF file's, and
// the generation_config.json beside a model folder's weights, as transformers' generate reads it)
// and the tokenizer's EOS.
std::vector<int32_t> stop_tokens(const TrainOptions& options, const ModelConfig& config, const Tokenizer& tokenizer) {
  std::vector<int64_t> ids = config.eos_token_ids;
  if (config.eos_token_id) ids.push_back(*config.eos_token_id);
  if (const auto eos = tokenizer.eos_id()) ids.push_back(*eos);
  const std::string& weights = options.model.weights;
  std::error_code ec;
  if (!weights.empty() && !is_gguf_path(weights)) {
    const fs::path folder = fs::is_directory(weights, ec) ? fs::path(weights) : fs::path(weights).parent_path();
    const fs::path path = folder / "generation_config.json";
    if (fs::is_regular_file(path, ec)) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(read_file(path.string()));
      } catch (const nlohmann::json::exception& e) {
        fail("{}: not valid JSON ({})", path.string(), e.what());
      }
      WEFT_CHECK(j.is_object(), "{}: not a JSON object", path.string());
      if (j.contains("eos_token_id")) {
        const auto& v = j.at("eos_token_id");
        WEFT_CHECK(v.is_null() || v.is_number_integer() || v.is_array(),
                   "{}: eos_token_id must be a token id or a list of them, got {}", path.string(), v.dump());
        if (v.is_number_integer()) ids.push_back(v.get<int64_t>());
        if (v.is_array()) {
          for (const auto& id : v) {
            WEFT_CHECK(id.is_number_integer(), "{}: eos_token_id must be a token id or a list of them, got {}",
                       path.string(), v.dump());
            ids.push_back(id.get<int64_t>());
          }
        }
      }
    }
  }
  std::vector<int32_t> stop;
  for (int64_t id : ids) {
    if (id >= 0 && id < config.vocab_size && std::find(stop.begin(), stop.end(), id) == stop.end()) {
      stop.push_back(static_cast<int32_t>(id));
    }
  }
  return stop;
}

}  // namespace

GenerateResult generate(Job& job, const std::string& prompt, bool chat) {
  const TrainOptions& options = job.options();
  const Tokenizer& tokenizer = job.tokenizer();
  LlamaForCausalLMImpl& model = job.model();
  torch::NoGradGuard no_grad;
  model.eval();
  std::vector<int32_t> ids;
  std::string text = prompt;
  if (chat) {  // the template frames the conversation, BOS included where the checkpoint wants it
    const auto chat_template = load_chat_template(options.tokenizer, tokenizer);
    WEFT_CHECK(chat_template != nullptr,
               "trainer generate --chat: the tokenizer '{}' has no chat template (tokenizer_config.json's "
               "chat_template, chat_template.jinja, or a GGUF file's tokenizer.chat_template)",
               options.tokenizer);
    std::vector<ChatMessage> messages;
    if (!options.chat_system.empty()) messages.push_back({"system", options.chat_system});
    messages.push_back({"user", prompt});
    text = chat_template->render(messages, /*add_generation_prompt=*/true);
  } else if (options.data.bos_for(tokenizer)) {  // framed as the training documents were
    if (const auto bos = tokenizer.bos_id()) ids.push_back(*bos);
  }
  const auto encoded = tokenizer.encode(text);
  ids.insert(ids.end(), encoded.begin(), encoded.end());
  WEFT_CHECK(!ids.empty(), "trainer generate: the prompt encodes to no tokens");
  // Prompt tuning: the virtual tokens first, as every training sequence had them.
  for (int64_t k = model.options().prompt_tokens - 1; k >= 0; --k) ids.insert(ids.begin(), static_cast<int32_t>(prompt_slot_id(k)));
  // The model has positions for max_position_embeddings tokens, prompt included.
  const int64_t positions = model.config().max_position_embeddings;
  const int64_t prompt_tokens = static_cast<int64_t>(ids.size());
  WEFT_CHECK(prompt_tokens < positions,
             "trainer generate: the prompt is {} tokens, but the model has {} positions "
             "(max_position_embeddings) and needs one more for the first new token",
             prompt_tokens, positions);
  int64_t max_new_tokens = options.max_new_tokens;
  if (prompt_tokens + max_new_tokens > positions) {
    max_new_tokens = positions - prompt_tokens;
    spdlog::warn("trainer generate: at most {} new tokens after the {}-token prompt: the model has {} positions "
                 "(max_position_embeddings), fewer than generate.max_new_tokens = {} needs",
                 max_new_tokens, prompt_tokens, positions, options.max_new_tokens);
  }
  const std::vector<int32_t> stop = stop_tokens(options, model.config(), tokenizer);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options.generate_seed);
  std::vector<LayerKvCache> cache;
  GenerateResult result;
  job.strategy().take_comm_stats();  // count generation's communication only
  const auto start = Clock::now();
  // Tokens and the KV cache live on the model's device; sampling reads the last logits on the CPU.
  auto input = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong).unsqueeze(0).to(job.device());
  for (int64_t n = 0; n < max_new_tokens; ++n) {
    const auto logits = model.forward_cached(input, cache);
    // Only ids the tokenizer can decode (a model's vocabulary may be padded beyond them).
    const auto last =
        full_vocabulary(model, logits[0][logits.size(1) - 1]).narrow(0, 0, tokenizer.vocab_size()).to(torch::kCPU);
    const int32_t next = pick_token(last, options.temperature, options.top_p, generator);
    if (n == 0) result.first_token_seconds = seconds_since(start);
    if (std::find(stop.begin(), stop.end(), next) != stop.end()) break;
    result.tokens.push_back(next);
    input = torch::tensor({static_cast<int64_t>(next)}, torch::kLong).unsqueeze(0).to(job.device());
  }
  result.seconds = seconds_since(start);
  const auto comm = job.strategy().take_comm_stats();
  result.comm_operations = comm.operations;
  result.comm_bytes = comm.bytes;
  result.comm_wait_seconds = comm.wait_seconds;
  result.prompt_tokens = static_cast<int64_t>(ids.size());
  result.text = tokenizer.decode(result.tokens);
  return result;
}

}  // namespace weft
