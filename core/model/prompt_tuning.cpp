#include "core/model/prompt_tuning.h"

#include <filesystem>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/fs.h"
#include "core/util/hash.h"

namespace weft {
namespace {

constexpr const char* kName = "model.prompt_embeddings";
constexpr const char* kFileName = "prompt_embeddings";  // PEFT's key in adapter_model.safetensors

torch::Tensor& register_prompt(LlamaForCausalLMImpl& model, torch::Tensor values) {
  auto& backbone = *model.model;
  WEFT_CHECK(!backbone.prompt_embeddings.defined(), "prompt tuning: the model has a prompt embedding already");
  backbone.prompt_embeddings = backbone.register_parameter("prompt_embeddings", std::move(values), /*requires_grad=*/true);
  return backbone.prompt_embeddings;
}

}  // namespace

void apply_prompt_tuning(LlamaForCausalLMImpl& model, const PromptTuningConfig& config, uint64_t seed,
                         const std::vector<int32_t>& init_ids) {
  const int64_t p = config.num_virtual_tokens, hidden = model.config().hidden_size;
  WEFT_CHECK(p > 0 && model.options().prompt_tokens == p,
             "prompt tuning: the model was built for {} virtual tokens, the config has {}", model.options().prompt_tokens,
             p);
  WEFT_CHECK(!model.vocab_parallel(),
             "train.mode = \"prompt_tuning\" needs the whole embedding on its stage, and this layout splits it over "
             "the vocabulary (tensor parallelism): use data, pipeline or context parallelism");
  for (auto& param : model.parameters()) param.set_requires_grad(false);
  if (!model.holds_stage(0)) return;  // a pipeline's later stage: the prompt lives with the embedding
  const auto device = model.model->embed_tokens->weight.device();
  torch::Tensor values;
  if (config.init == "text") {
    WEFT_CHECK(!init_ids.empty(), "prompt_tuning.init = \"text\" needs prompt_tuning.init_text (it has no tokens)");
    std::vector<int64_t> ids;  // PEFT: the text's tokens repeated, then cut to P
    for (int64_t k = 0; k < p; ++k) ids.push_back(init_ids[static_cast<size_t>(k) % init_ids.size()]);
    torch::NoGradGuard no_grad;
    values = model.model->embed_tokens->weight.index_select(0, torch::tensor(ids, torch::kLong).to(device))
                 .to(torch::kFloat32)
                 .clone();
  } else {
    WEFT_CHECK(config.init == "random", "prompt_tuning.init must be random or text, got '{}'", config.init);
    auto generator = at::make_generator<at::CPUGeneratorImpl>(hash64(kName, seed));
    values = torch::empty({p, hidden}, torch::kFloat32).normal_(0.0, 1.0, generator).to(device);  // nn.Embedding's init
  }
  register_prompt(model, values);
}

void add_prompt_parameter(LlamaForCausalLMImpl& model) {
  if (model.options().prompt_tokens <= 0 || !model.holds_stage(0) || model.model->prompt_embeddings.defined()) return;
  register_prompt(model, torch::zeros({model.options().prompt_tokens, model.config().hidden_size}, torch::kFloat32));
}

bool has_prompt_tuning(const LlamaForCausalLMImpl& model) { return model.options().prompt_tokens > 0; }

void save_prompt_adapter(LlamaForCausalLMImpl& model, const std::string& dir, const std::string& base_model) {
  WEFT_CHECK(model.model->prompt_embeddings.defined(), "save_prompt_adapter: the model has no prompt embedding");
  std::filesystem::create_directories(dir);
  const auto& values = model.model->prompt_embeddings;
  save_safetensors(dir + "/adapter_model.safetensors", {{kFileName, values.detach().to(torch::kCPU).contiguous()}});
  const nlohmann::json adapter_config = {
      {"peft_type", "PROMPT_TUNING"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model},
      {"num_virtual_tokens", values.size(0)},
      {"token_dim", values.size(1)},
      {"num_transformer_submodules", 1},
      {"num_attention_heads", model.config().num_attention_heads},
      {"num_layers", model.config().num_hidden_layers},
      {"prompt_tuning_init", "RANDOM"},
      {"inference_mode", true},
  };
  write_file_atomically(dir + "/adapter_config.json", adapter_config.dump(2) + "\n");
}

void load_prompt_adapter(LlamaForCausalLMImpl& model, const std::string& dir) {
  if (!model.model->prompt_embeddings.defined()) return;  // a later pipeline stage
  const std::string path = dir + "/adapter_model.safetensors";
  auto file = SafetensorsFile::open(path);
  WEFT_CHECK(file->contains(kFileName), "{}: no '{}' tensor (is it a prompt-tuning adapter?)", path, kFileName);
  auto& values = model.model->prompt_embeddings;
  const auto& info = file->info(kFileName);
  WEFT_CHECK(info.shape == values.sizes().vec(), "{}: '{}' has shape {} but the model expects {}", path, kFileName,
             fmt::join(info.shape, "x"), fmt::join(values.sizes().vec(), "x"));
  torch::NoGradGuard no_grad;
  values.copy_(file->load(kFileName, torch::kFloat32));
}

PromptTuningConfig read_prompt_adapter_config(const std::string& dir) {
  const std::string path = dir + "/adapter_config.json";
  WEFT_CHECK(std::filesystem::is_regular_file(path), "{}: no adapter config (is {} an adapter directory?)", path, dir);
  PromptTuningConfig config;
  try {
    const auto j = nlohmann::json::parse(read_file(path));
    WEFT_CHECK(j.value("peft_type", std::string()) == "PROMPT_TUNING", "{}: peft_type is {}, not PROMPT_TUNING", path,
               j.value("peft_type", std::string("LORA")));
    WEFT_CHECK(j.value("task_type", std::string("CAUSAL_LM")) == "CAUSAL_LM",
               "{}: task_type {}: weft's prompt tuning is for CAUSAL_LM", path, j.value("task_type", std::string()));
    WEFT_CHECK(j.value("num_transformer_submodules", 1) == 1,
               "{}: num_transformer_submodules {} (an encoder-decoder's prompt): weft's models are decoders", path,
               j.value("num_transformer_submodules", 1));
    WEFT_CHECK(j.contains("num_virtual_tokens") && j.at("num_virtual_tokens").is_number_integer() &&
                   j.at("num_virtual_tokens").get<int64_t>() > 0,
               "{}: num_virtual_tokens must be a positive integer", path);
    config.num_virtual_tokens = j.at("num_virtual_tokens").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not a prompt-tuning adapter config ({})", path, e.what());
  }
  return config;
}

}  // namespace weft
