// weft's logits for a Hugging Face model directory, for the reference check against transformers'
// LlamaForCausalLM and PEFT (tools/hf_reference.py; built with the tests, run by ctest as
// Reference.*):
//   hf_logits MODEL_DIR TOKENS.safetensors OUT.safetensors [--adapter DIR]
//             [--write-adapter DIR R ALPHA SEED TARGET,TARGET,...]
//             [--write-adalora DIR INIT_R TARGET_R ALPHA SEED TARGET,...] [--save-pretrained DIR]
//             [--replay-adalora TRACE.safetensors OUT2.safetensors]
// MODEL_DIR holds config.json and safetensors weights, or is a GGUF file (llama architecture); TOKENS holds "tokens" (int64 [B, T]). OUT
// gets "logits" (fp32 [B, T, V]) of the model: with the LoRA, AdaLoRA or prompt-tuning adapter of DIR
// loaded (--adapter; a prompt's virtual tokens go before the tokens, and the logits are the tokens'); or with new adapters on the named targets, seeded random values, written to DIR in
// PEFT's layout (--write-adapter: LoRA; --write-adalora: AdaLoRA with a rank pattern), so that PEFT
// can load what weft writes. --save-pretrained writes the model as weft saves a checkpoint
// (config.json, model.safetensors), for transformers. --replay-adalora runs weft's rank allocator
// on the parameters and gradients PEFT's saw (replay_adalora below).
#include <cstdlib>
#include <optional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/adalora.h"
#include "core/model/config.h"
#include "core/model/gguf_model.h"
#include "core/model/llama.h"
#include "core/model/lora.h"
#include "core/model/prompt_tuning.h"
#include "core/model/weights.h"
#include "core/util/error.h"

namespace {

[[noreturn]] void usage() {
  std::cerr << "usage: hf_logits MODEL_DIR TOKENS.safetensors OUT.safetensors [--adapter DIR]"
               " [--write-adapter DIR R ALPHA SEED TARGET,...] [--write-adalora DIR INIT_R TARGET_R ALPHA SEED TARGET,...]"
               " [--save-pretrained DIR] [--replay-adalora TRACE OUT2]\n";
  std::exit(2);
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream items(list);
  for (std::string item; std::getline(items, item, ',');) out.push_back(item);
  return out;
}

// TRACE holds "config" (int64: init_r, target_r, tinit, tfinal, deltaT, total_step, steps),
// "betas" (fp64: beta1, beta2), "lora_alpha" (fp64), "targets" (uint8: the target module names,
// comma-separated), and for each step s and adapted layer L "s.L.lora_A" etc. and "s.L.lora_A.grad"
// etc. as PEFT's parameters and gradients were when it called update_and_allocate(s). OUT gets
// "s.L.lora_E" after weft's allocator ran on them, and "L.pattern" (uint8) at the end.
void replay_adalora(weft::LlamaForCausalLMImpl& model, const std::string& trace_path, const std::string& out_path) {
  auto trace = weft::SafetensorsFile::open(trace_path);
  const auto config = trace->load("config", torch::kLong);
  const auto betas = trace->load("betas", torch::kDouble);
  const auto names = trace->load("targets", torch::kUInt8);
  weft::AdaLoraConfig c;
  c.spec.r = config[0].item<int64_t>();
  c.target_r = config[1].item<int64_t>();
  c.tinit = config[2].item<int64_t>();
  c.tfinal = config[3].item<int64_t>();
  c.delta_t = config[4].item<int64_t>();
  c.total_step = config[5].item<int64_t>();
  const int64_t steps = config[6].item<int64_t>();
  c.beta1 = betas[0].item<double>();
  c.beta2 = betas[1].item<double>();
  c.spec.alpha = trace->load("lora_alpha", torch::kDouble).item<double>();
  c.target_modules = split(std::string(names.data_ptr<uint8_t>(), names.data_ptr<uint8_t>() + names.numel()));
  weft::apply_adalora(model, c, 0);
  weft::RankAllocator allocator(model, c);
  weft::NamedTensors out;
  for (int64_t step = 0; step < steps; ++step) {
    for (auto& item : model.named_parameters()) {
      const std::string key = std::to_string(step) + "." + item.key();
      if (!trace->contains(key)) continue;
      item.value().set_data(trace->load(key, torch::kFloat32));
      item.value().mutable_grad() = trace->load(key + ".grad", torch::kFloat32);
    }
    allocator.update_and_allocate(step);
    for (auto& item : model.named_parameters()) {
      if (item.key().size() > 7 && item.key().compare(item.key().size() - 7, 7, ".lora_E") == 0) {
        out.emplace_back(std::to_string(step) + "." + item.key(), item.value().detach().clone());
      }
    }
  }
  for (const auto& [layer, flags] : allocator.rank_pattern()) {
    std::vector<uint8_t> bytes(flags.begin(), flags.end());
    out.emplace_back(layer + ".pattern", torch::tensor(bytes, torch::kUInt8));
  }
  weft::save_safetensors(out_path, out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) usage();
  try {
    torch::NoGradGuard no_grad;
    const std::string model_dir = argv[1];
    std::optional<weft::PromptTuningConfig> prompt;  // a prompt-tuning adapter shapes the model it goes on
    for (int i = 4; i + 1 < argc; ++i) {
      if (std::string(argv[i]) == "--adapter" && weft::adapter_peft_type(argv[i + 1]) == "PROMPT_TUNING") {
        prompt = weft::read_prompt_adapter_config(argv[i + 1]);
      }
    }
    weft::ModelOptions options;
    options.prompt_tokens = prompt ? prompt->num_virtual_tokens : 0;
    weft::LlamaForCausalLM model(weft::is_gguf_path(model_dir) ? weft::load_gguf_model_config(model_dir)
                                                                : weft::load_hf_config(model_dir + "/config.json"),
                                 options);
    weft::load_weights(*model, model_dir);
    for (int i = 4; i < argc;) {
      const std::string option = argv[i];
      if (option == "--adapter" && i + 1 < argc) {
        if (prompt) {
          weft::apply_prompt_tuning(*model, *prompt, /*seed=*/0);
          weft::load_prompt_adapter(*model, argv[i + 1]);
        } else if (weft::adapter_peft_type(argv[i + 1]) == "ADALORA") {
          weft::apply_adalora(*model, weft::read_adalora_adapter_config(argv[i + 1]), /*seed=*/0);
          weft::load_adalora_adapter(*model, argv[i + 1]);
        } else {
          weft::apply_lora(*model, weft::read_lora_adapter_config(argv[i + 1]), /*seed=*/0);
          weft::load_lora_adapter(*model, argv[i + 1]);
        }
        i += 2;
      } else if (option == "--write-adalora" && i + 6 < argc) {
        // AdaLoRA adapters with random P, Lambda, Q and a rank pattern masking about a third of the
        // triplets (all of the first layer's), written as PEFT writes them (kept triplets only).
        weft::AdaLoraConfig config;
        config.spec.r = std::stoll(argv[i + 2]);
        config.target_r = std::stoll(argv[i + 3]);
        config.spec.alpha = std::stod(argv[i + 4]);
        config.total_step = 10;
        const uint64_t seed = std::stoull(argv[i + 5]);
        config.target_modules = split(argv[i + 6]);
        weft::apply_adalora(*model, config, seed);
        torch::manual_seed(seed);
        weft::RankPattern pattern;
        bool first = true;
        for (auto& item : model->named_modules("", false)) {
          auto* linear = item.value()->as<weft::LinearImpl>();
          auto* adapter = linear != nullptr ? linear->adapter_as<weft::AdaLoraAdapter>() : nullptr;
          if (adapter == nullptr) continue;
          adapter->E.normal_(0.0, 1.0);
          auto& flags = pattern[item.key()];
          for (int64_t r = 0; r < config.spec.r; ++r) flags.push_back(!first && (r + item.key().size()) % 3 != 0);
          first = false;
        }
        weft::apply_rank_pattern(*model, pattern);
        weft::save_adalora_adapter(*model, config, pattern, argv[i + 1]);
        i += 7;
      } else if (option == "--write-adapter" && i + 5 < argc) {
        weft::LoraConfig config;
        config.spec.r = std::stoll(argv[i + 2]);
        config.spec.alpha = std::stod(argv[i + 3]);
        const uint64_t seed = std::stoull(argv[i + 4]);
        config.target_modules = split(argv[i + 5]);
        weft::apply_lora(*model, config, seed);
        // B starts at zero (an adapter that changes nothing): give it values so the check means something.
        torch::manual_seed(seed);
        for (auto& item : model->named_parameters()) {
          if (item.key().find(".lora_B.") != std::string::npos) item.value().normal_(0.0, 0.05);
        }
        weft::save_lora_adapter(*model, config, argv[i + 1]);
        i += 6;
      } else if (option == "--replay-adalora" && i + 2 < argc) {
        // PEFT's allocator inputs, step by step (tools/hf_reference.py writes them): weft's
        // RankAllocator takes the same parameters and gradients and its masks go to OUT2.
        replay_adalora(*model, argv[i + 1], argv[i + 2]);
        i += 3;
      } else if (option == "--save-pretrained" && i + 1 < argc) {
        weft::save_pretrained(*model, argv[i + 1]);
        i += 2;
      } else {
        usage();
      }
    }
    model->eval();
    auto tokens = weft::SafetensorsFile::open(argv[2])->load("tokens", torch::kLong);
    const int64_t p = model->options().prompt_tokens;
    if (p > 0) tokens = torch::cat({-torch::arange(1, p + 1, torch::kLong).expand({tokens.size(0), p}), tokens}, 1);
    const auto logits = model->forward(tokens).narrow(1, p, tokens.size(1) - p).to(torch::kFloat32).contiguous();
    weft::save_safetensors(argv[3], {{"logits", logits}});
  } catch (const std::exception& e) {
    std::cerr << "hf_logits: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
