// LLaMA 3.x model shape: read from an HF config.json, from a named preset, or written back out.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace weft {

// Llama 3's frequency-dependent RoPE rescaling (HF rope_scaling with rope_type "llama3").
struct RopeScaling {
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // hidden_size / num_attention_heads unless the config says otherwise
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;
  bool tie_word_embeddings = false;
  std::optional<int64_t> bos_token_id;
  std::optional<int64_t> eos_token_id;
  // Every end token the checkpoint names (config.json's eos_token_id may be a list, as Llama 3
  // Instruct's [128001, 128008, 128009]; a GGUF file's EOS, EOT and EOM ids); eos_token_id is the
  // first. Generation stops at any of them.
  std::vector<int64_t> eos_token_ids;
  std::string torch_dtype = "float32";  // dtype recorded in config.json; training keeps fp32 masters
  // Sequence classification (LlamaForSequenceClassification): num_labels > 0 replaces the LM head
  // by `score` [num_labels, hidden] (no bias), applied to every position; the loss pools the
  // position of each row's last token. num_labels = 1 is regression (mean squared error), as HF
  // infers problem_type. labels: the class names in id order (config.json's id2label).
  int64_t num_labels = 0;
  std::vector<std::string> labels;
  std::optional<int64_t> pad_token_id;
  bool classification() const { return num_labels > 0; }
  bool regression() const { return num_labels == 1; }

  // Throws weft::Error naming the first inconsistent field (e.g. heads not divisible by kv heads).
  void validate() const;
  // Number of parameters of the full model (tied head counted once).
  int64_t parameter_count() const;
};

// Reads an HF config.json (model_type "llama"). Unsupported features (attention/MLP biases, an
// activation other than silu, an unknown rope_scaling type) are errors that name the field.
ModelConfig load_hf_config(const std::string& path);
// Parses the JSON text of a config.json; `origin` names it in error messages.
ModelConfig parse_hf_config(const std::string& json_text, const std::string& origin);
// Writes the HF config.json text for `config` (architectures LlamaForCausalLM).
std::string to_hf_config_json(const ModelConfig& config);

// Named shapes: "tiny" (tests), "small" (benchmarks on 2 cores; 6.1M parameters, the same shape
// as the PyTorch reference point), "llama-3.2-1b", "llama-3.2-3b". Unknown names throw.
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

}  // namespace weft
