#include "core/model/gguf_model.h"

#include <algorithm>
#include <cmath>
#include <regex>

#include <fmt/format.h>

#include "core/io/gguf.h"
#include "core/util/error.h"

namespace weft {
namespace {

// llama.cpp's tensor names (gguf-py's tensor_mapping.py) and transformers' for the same tensor.
const std::vector<std::pair<std::string, std::string>>& block_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"attn_norm.weight", "input_layernorm.weight"},   {"attn_q.weight", "self_attn.q_proj.weight"},
      {"attn_k.weight", "self_attn.k_proj.weight"},     {"attn_v.weight", "self_attn.v_proj.weight"},
      {"attn_output.weight", "self_attn.o_proj.weight"}, {"ffn_norm.weight", "post_attention_layernorm.weight"},
      {"ffn_gate.weight", "mlp.gate_proj.weight"},      {"ffn_up.weight", "mlp.up_proj.weight"},
      {"ffn_down.weight", "mlp.down_proj.weight"},
  };
  return names;
}

std::string hf_name_of(const std::string& gguf_name, int64_t layers) {
  if (gguf_name == "token_embd.weight") return "model.embed_tokens.weight";
  if (gguf_name == "output_norm.weight") return "model.norm.weight";
  if (gguf_name == "output.weight") return "lm_head.weight";
  static const std::regex block(R"(blk\.(\d+)\.(.+))");
  std::smatch m;
  if (std::regex_match(gguf_name, m, block)) {
    const int64_t layer = std::stoll(m[1].str().substr(0, 9));
    if (layer < layers) {
      for (const auto& [from, to] : block_names()) {
        if (m[2].str() == from) return fmt::format("model.layers.{}.{}", layer, to);
      }
    }
  }
  return "";
}

}  // namespace

std::string gguf_tensor_name(const std::string& hf_name) {
  if (hf_name == "model.embed_tokens.weight") return "token_embd.weight";
  if (hf_name == "model.norm.weight") return "output_norm.weight";
  if (hf_name == "lm_head.weight") return "output.weight";
  static const std::regex block(R"(model\.layers\.(\d+)\.(.+))");
  std::smatch m;
  if (std::regex_match(hf_name, m, block)) {
    for (const auto& [gguf, hf] : block_names()) {
      if (m[2].str() == hf) return fmt::format("blk.{}.{}", m[1].str(), gguf);
    }
  }
  return "";
}

namespace {

std::vector<float> dequantized(const GgufFile& file, const GgufTensor& tensor) {
  std::vector<float> values(static_cast<size_t>(tensor.numel));
  file.dequantize(tensor, values.data());
  return values;
}

// Llama 3's RoPE scaling from the factors llama.cpp's converter stored (rope_freqs.weight: per
// frequency, 1 for short wavelengths, `factor` for long ones, smoothed between), for the scaling
// the converter supports: the factor is their largest; low 1, high 4 and the original context
// (8192 unless the metadata says) are Llama 3's. Refused unless those reproduce every factor.
RopeScaling rope_scaling_from_factors(const GgufFile& file, const std::vector<float>& stored, const ModelConfig& c) {
  RopeScaling s;
  s.factor = *std::max_element(stored.begin(), stored.end());
  if (const auto original = file.get_int("llama.rope.scaling.original_context_length")) {
    s.original_max_position_embeddings = *original;
  }
  const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
  const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
  WEFT_CHECK(static_cast<int64_t>(stored.size()) == c.head_dim / 2, "{}: rope_freqs.weight has {} factors, expected {}",
             file.path(), stored.size(), c.head_dim / 2);
  for (size_t i = 0; i < stored.size(); ++i) {
    const double freq = 1.0 / std::pow(c.rope_theta, static_cast<double>(2 * i) / static_cast<double>(c.head_dim));
    const double wavelen = 2 * M_PI / freq;
    double expected = 1.0;
    if (wavelen > low_wavelen) {
      expected = s.factor;
    } else if (wavelen >= high_wavelen) {
      const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      expected = 1.0 / ((1 - smooth) / s.factor + smooth);
    }
    WEFT_CHECK(std::abs(expected - stored[i]) <= 1e-4 * expected,
               "{}: rope_freqs.weight is not Llama 3's RoPE scaling (factor {}, low 1, high 4, original context {}): "
               "factor {} is {}, expected {}; weft does not run this scaling",
               file.path(), s.factor, s.original_max_position_embeddings, i, stored[i], expected);
  }
  return s;
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& file) {
  const auto arch = file.get_string("general.architecture");
  WEFT_CHECK(arch.has_value(), "{}: GGUF metadata has no general.architecture", file.path());
  WEFT_CHECK(*arch == "llama", "{}: GGUF architecture '{}' is not one weft builds (llama)", file.path(), *arch);
  const auto required = [&](const std::string& key) {
    const auto v = file.get_int(key);
    WEFT_CHECK(v.has_value(), "{}: GGUF metadata has no {}", file.path(), key);
    return *v;
  };
  ModelConfig c;
  c.num_hidden_layers = required("llama.block_count");
  c.hidden_size = required("llama.embedding_length");
  c.intermediate_size = required("llama.feed_forward_length");
  c.num_attention_heads = required("llama.attention.head_count");
  c.num_key_value_heads = file.get_int("llama.attention.head_count_kv").value_or(c.num_attention_heads);
  c.max_position_embeddings = file.get_int("llama.context_length").value_or(c.max_position_embeddings);
  c.rms_norm_eps = file.get_float("llama.attention.layer_norm_rms_epsilon").value_or(c.rms_norm_eps);
  c.rope_theta = file.get_float("llama.rope.freq_base").value_or(c.rope_theta);
  WEFT_CHECK(c.num_attention_heads > 0, "{}: GGUF llama.attention.head_count is {}", file.path(), c.num_attention_heads);
  c.head_dim = file.get_int("llama.attention.key_length").value_or(c.hidden_size / c.num_attention_heads);
  const int64_t rope_dims = file.get_int("llama.rope.dimension_count").value_or(c.head_dim);
  WEFT_CHECK(rope_dims == c.head_dim, "{}: GGUF llama.rope.dimension_count {} is not the head dimension {} (partial "
             "RoPE is not a Llama weft builds)", file.path(), rope_dims, c.head_dim);
  const auto scaling = file.get_string("llama.rope.scaling.type");
  WEFT_CHECK(!scaling || *scaling == "none" || *scaling == "llama3",
             "{}: GGUF llama.rope.scaling.type '{}' is not a RoPE scaling weft runs (Llama 3's)", file.path(), *scaling);
  const GgufTensor* embedding = file.find("token_embd.weight");
  WEFT_CHECK(embedding != nullptr && embedding->shape.size() == 2, "{}: GGUF file has no 2-D token_embd.weight",
             file.path());
  c.vocab_size = embedding->shape[0];
  c.tie_word_embeddings = file.find("output.weight") == nullptr;
  c.bos_token_id = file.get_int("tokenizer.ggml.bos_token_id");
  c.eos_token_id = file.get_int("tokenizer.ggml.eos_token_id");
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    const auto id = file.get_int(key);  // llama.cpp stops at each
    if (id && std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), *id) == c.eos_token_ids.end()) {
      c.eos_token_ids.push_back(*id);
    }
  }
  c.pad_token_id = file.get_int("tokenizer.ggml.padding_token_id");
  if (const GgufTensor* factors = file.find("rope_freqs.weight")) {
    c.rope_scaling = rope_scaling_from_factors(file, dequantized(file, *factors), c);
  }
  c.validate();
  return c;
}

ModelConfig load_gguf_model_config(const std::string& path) { return gguf_model_config(*GgufFile::open(path)); }

GgufWeights::GgufWeights(std::shared_ptr<const GgufFile> file, const ModelConfig& config)
    : file_(std::move(file)), config_(config) {
  for (const GgufTensor& tensor : file_->tensors()) {
    if (tensor.name == "rope_freqs.weight") continue;  // in the config's rope_scaling
    const std::string hf = hf_name_of(tensor.name, config_.num_hidden_layers);
    WEFT_CHECK(!hf.empty(), "{}: GGUF tensor '{}' is not part of a Llama model weft builds", file_->path(), tensor.name);
    names_.emplace(hf, tensor.name);
  }
}

const std::string& GgufWeights::path() const { return file_->path(); }

std::vector<std::string> GgufWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [hf, gguf] : names_) out.push_back(hf);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> GgufWeights::shape(const std::string& hf_name) const {
  return file_->find(names_.at(hf_name))->shape;
}

at::Tensor GgufWeights::load(const std::string& hf_name, at::ScalarType dtype) const {
  const auto it = names_.find(hf_name);
  WEFT_CHECK(it != names_.end(), "{}: no tensor for '{}'", file_->path(), hf_name);
  const GgufTensor& tensor = *file_->find(it->second);
  at::Tensor out = at::empty(tensor.shape, at::kFloat);
  file_->dequantize(tensor, out.data_ptr<float>());
  // llama.cpp's converter permuted q's and k's rows per head, (2, half) -> (half, 2), for its RoPE
  // on interleaved pairs; transformers rotates halves: (half, 2) -> (2, half) again.
  const bool q = hf_name.find(".q_proj.") != std::string::npos, k = hf_name.find(".k_proj.") != std::string::npos;
  if ((q || k) && out.dim() == 2) {
    const int64_t heads = q ? config_.num_attention_heads : config_.num_key_value_heads;
    const int64_t rows = out.size(0), cols = out.size(1);
    WEFT_CHECK(rows % (2 * heads) == 0, "{}: tensor '{}' has {} rows, not {} heads of pairs", file_->path(),
               tensor.name, rows, heads);
    out = out.reshape({heads, rows / heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

}  // namespace weft
