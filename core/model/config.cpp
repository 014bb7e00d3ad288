#include "core/model/config.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/util/error.h"

namespace weft {
namespace {

using nlohmann::json;

template <typename T>
T field(const json& j, const char* key, const T& fallback, const std::string& origin) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  try {
    return j.at(key).get<T>();
  } catch (const json::exception&) {
    fail("{}: field '{}' has the wrong type ({})", origin, key, j.at(key).dump());
  }
}

// bos/eos ids are an int, a list of ints (the first is used), or null.
std::optional<int64_t> token_id(const json& j, const char* key) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  const json& v = j.at(key);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_array() && !v.empty() && v.front().is_number_integer()) return v.front().get<int64_t>();
  return std::nullopt;
}

// Every id of an int or a list of ints (config.json's eos_token_id may be either).
std::vector<int64_t> token_ids(const json& j, const char* key) {
  std::vector<int64_t> ids;
  if (!j.contains(key)) return ids;
  const json& v = j.at(key);
  if (v.is_number_integer()) ids.push_back(v.get<int64_t>());
  if (v.is_array()) {
    for (const json& id : v) {
      if (id.is_number_integer()) ids.push_back(id.get<int64_t>());
    }
  }
  return ids;
}

// The RoPE scaling of `rs` (a rope_scaling or rope_parameters object; `key` names it in errors).
std::optional<RopeScaling> parse_rope_scaling(const json& rs, const char* key, const std::string& origin) {
  if (rs.is_null()) return std::nullopt;
  WEFT_CHECK(rs.is_object(), "{}: {} must be an object, got {}", origin, key, rs.dump());
  const std::string type = rs.value("rope_type", rs.value("type", std::string("default")));
  if (type == "default") return std::nullopt;
  WEFT_CHECK(type == "llama3", "{}: {} type '{}' is not supported (only 'llama3')", origin, key, type);
  RopeScaling s;
  s.factor = field<double>(rs, "factor", s.factor, origin);
  s.low_freq_factor = field<double>(rs, "low_freq_factor", s.low_freq_factor, origin);
  s.high_freq_factor = field<double>(rs, "high_freq_factor", s.high_freq_factor, origin);
  s.original_max_position_embeddings = field<int64_t>(
      rs, "original_max_position_embeddings", s.original_max_position_embeddings, origin);
  return s;
}

}  // namespace

void ModelConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    WEFT_CHECK(v > 0, "model config: {} must be positive, got {}", name, v);
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("intermediate_size", intermediate_size);
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  WEFT_CHECK(num_attention_heads % num_key_value_heads == 0,
             "model config: num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
             num_attention_heads, num_key_value_heads);
  WEFT_CHECK(head_dim % 2 == 0, "model config: head_dim ({}) must be even for RoPE", head_dim);
  WEFT_CHECK(rms_norm_eps > 0, "model config: rms_norm_eps must be positive");
  WEFT_CHECK(rope_theta > 0, "model config: rope_theta must be positive");
  if (rope_scaling) {
    WEFT_CHECK(rope_scaling->factor >= 1.0 && rope_scaling->low_freq_factor > 0 &&
                   rope_scaling->high_freq_factor > rope_scaling->low_freq_factor,
               "model config: rope_scaling needs factor >= 1 and high_freq_factor > low_freq_factor > 0");
  }
}

int64_t ModelConfig::parameter_count() const {
  const int64_t attn = hidden_size * head_dim * (2 * num_attention_heads + 2 * num_key_value_heads);
  const int64_t mlp = 3 * hidden_size * intermediate_size;
  const int64_t block = attn + mlp + 2 * hidden_size;
  const int64_t embed = vocab_size * hidden_size;
  const int64_t head = num_labels > 0 ? num_labels * hidden_size : (tie_word_embeddings ? 0 : embed);
  return embed + head + num_hidden_layers * block + hidden_size;
}

ModelConfig parse_hf_config(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON ({})", origin, e.what());
  }
  WEFT_CHECK(j.is_object(), "{}: expected a JSON object", origin);
  const std::string model_type = field<std::string>(j, "model_type", "llama", origin);
  WEFT_CHECK(model_type == "llama", "{}: model_type '{}' is not supported (only 'llama')", origin,
             model_type);
  const std::string act = field<std::string>(j, "hidden_act", "silu", origin);
  WEFT_CHECK(act == "silu", "{}: hidden_act '{}' is not supported (only 'silu')", origin, act);
  WEFT_CHECK(!field<bool>(j, "attention_bias", false, origin),
             "{}: attention_bias = true is not supported", origin);
  WEFT_CHECK(!field<bool>(j, "mlp_bias", false, origin), "{}: mlp_bias = true is not supported",
             origin);

  ModelConfig c;
  c.vocab_size = field<int64_t>(j, "vocab_size", 0, origin);
  c.hidden_size = field<int64_t>(j, "hidden_size", 0, origin);
  c.intermediate_size = field<int64_t>(j, "intermediate_size", 0, origin);
  c.num_hidden_layers = field<int64_t>(j, "num_hidden_layers", 0, origin);
  c.num_attention_heads = field<int64_t>(j, "num_attention_heads", 0, origin);
  c.num_key_value_heads =
      field<int64_t>(j, "num_key_value_heads", c.num_attention_heads, origin);
  WEFT_CHECK(c.num_attention_heads > 0, "{}: num_attention_heads must be positive", origin);
  c.head_dim = field<int64_t>(j, "head_dim", c.hidden_size / c.num_attention_heads, origin);
  c.max_position_embeddings = field<int64_t>(j, "max_position_embeddings", 2048, origin);
  c.rms_norm_eps = field<double>(j, "rms_norm_eps", 1e-5, origin);
  // transformers 5 writes rope_parameters {rope_type, rope_theta, factor, ...} in place of the
  // top-level rope_theta and rope_scaling of earlier versions; either form is read.
  if (j.contains("rope_parameters") && !j.at("rope_parameters").is_null()) {
    const json& rp = j.at("rope_parameters");
    WEFT_CHECK(rp.is_object() && rp.contains("rope_theta"),
               "{}: rope_parameters must be an object with rope_theta (one set for every layer), got {}", origin,
               rp.dump());
    c.rope_theta = field<double>(rp, "rope_theta", 10000.0, origin);
    c.rope_scaling = parse_rope_scaling(rp, "rope_parameters", origin);
  } else {
    c.rope_theta = field<double>(j, "rope_theta", 10000.0, origin);
    c.rope_scaling = parse_rope_scaling(j.contains("rope_scaling") ? j.at("rope_scaling") : json(), "rope_scaling", origin);
  }
  c.tie_word_embeddings = field<bool>(j, "tie_word_embeddings", false, origin);
  c.bos_token_id = token_id(j, "bos_token_id");
  c.eos_token_id = token_id(j, "eos_token_id");
  c.eos_token_ids = token_ids(j, "eos_token_id");
  c.torch_dtype = field<std::string>(j, "torch_dtype", field<std::string>(j, "dtype", "float32", origin), origin);
  c.pad_token_id = token_id(j, "pad_token_id");
  // LlamaForSequenceClassification: its head's size from id2label (as PretrainedConfig's num_labels).
  bool sequence_classification = false;
  if (j.contains("architectures") && j.at("architectures").is_array()) {
    for (const auto& a : j.at("architectures")) sequence_classification |= a == "LlamaForSequenceClassification";
  }
  if (sequence_classification) {
    WEFT_CHECK(j.contains("id2label") && j.at("id2label").is_object() && !j.at("id2label").empty(),
               "{}: LlamaForSequenceClassification needs id2label (its classes)", origin);
    const json& id2label = j.at("id2label");
    c.num_labels = static_cast<int64_t>(id2label.size());
    for (int64_t i = 0; i < c.num_labels; ++i) {
      const std::string key = std::to_string(i);
      WEFT_CHECK(id2label.contains(key) && id2label.at(key).is_string(), "{}: id2label has no label for id {}", origin, i);
      c.labels.push_back(id2label.at(key).get<std::string>());
    }
  }
  try {
    c.validate();
  } catch (const Error& e) {
    fail("{}: {}", origin, e.what());
  }
  return c;
}

ModelConfig load_hf_config(const std::string& path) {
  std::ifstream in(path);
  WEFT_CHECK(in.good(), "cannot open model config '{}'", path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return parse_hf_config(buffer.str(), path);
}

std::string to_hf_config_json(const ModelConfig& c) {
  json j = {
      {"architectures", {c.classification() ? "LlamaForSequenceClassification" : "LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_act", "silu"},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"torch_dtype", c.torch_dtype},
  };
  j["rope_scaling"] = nullptr;
  if (c.rope_scaling) {
    j["rope_scaling"] = {
        {"rope_type", "llama3"},
        {"factor", c.rope_scaling->factor},
        {"low_freq_factor", c.rope_scaling->low_freq_factor},
        {"high_freq_factor", c.rope_scaling->high_freq_factor},
        {"original_max_position_embeddings", c.rope_scaling->original_max_position_embeddings},
    };
  }
  j["bos_token_id"] = c.bos_token_id ? json(*c.bos_token_id) : json(nullptr);
  j["eos_token_id"] = c.eos_token_ids.size() > 1 ? json(c.eos_token_ids)
                      : c.eos_token_id             ? json(*c.eos_token_id)
                                                   : json(nullptr);
  if (c.pad_token_id) j["pad_token_id"] = *c.pad_token_id;
  if (c.classification()) {
    json id2label = json::object(), label2id = json::object();
    for (int64_t i = 0; i < c.num_labels; ++i) {
      const std::string name = i < static_cast<int64_t>(c.labels.size()) ? c.labels[static_cast<size_t>(i)]
                                                                          : "LABEL_" + std::to_string(i);
      id2label[std::to_string(i)] = name;
      label2id[name] = i;
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
    if (c.regression()) j["problem_type"] = "regression";
    else j["problem_type"] = "single_label_classification";
  }
  return j.dump(2) + "\n";
}

std::vector<std::string> preset_names() { return {"tiny", "small", "llama-3.2-1b", "llama-3.2-3b"}; }

ModelConfig preset_config(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") {
    c.vocab_size = 512;
    c.hidden_size = 64;
    c.intermediate_size = 176;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 1024;
  } else if (name == "small") {
    // dim 288, 6 layers, 6 heads, vocab 512: the 6.1M-parameter shape of the PyTorch reference.
    c.vocab_size = 512;
    c.hidden_size = 288;
    c.intermediate_size = 768;
    c.num_hidden_layers = 6;
    c.num_attention_heads = 6;
    c.num_key_value_heads = 6;
    c.max_position_embeddings = 1024;
    c.tie_word_embeddings = true;
  } else if (name == "llama-3.2-1b" || name == "llama-3.2-3b") {
    const bool one_b = name == "llama-3.2-1b";
    c.vocab_size = 128256;
    c.hidden_size = one_b ? 2048 : 3072;
    c.intermediate_size = 8192;
    c.num_hidden_layers = one_b ? 16 : 28;
    c.num_attention_heads = one_b ? 32 : 24;
    c.num_key_value_heads = 8;
    c.max_position_embeddings = 131072;
    c.rope_theta = 500000.0;
    c.rope_scaling = RopeScaling{32.0, 1.0, 4.0, 8192};
    c.tie_word_embeddings = true;
    c.bos_token_id = 128000;
    c.eos_token_id = 128001;
    c.torch_dtype = "bfloat16";
  } else {
    fail("unknown model preset '{}' (known: tiny, small, llama-3.2-1b, llama-3.2-3b)", name);
  }
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.validate();
  return c;
}

}  // namespace weft
