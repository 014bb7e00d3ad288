#include "core/job/gguf_export.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <map>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/data/pretokenizer.h"
#include "core/data/tokenizer.h"
#include "core/io/gguf.h"
#include "core/io/gguf_writer.h"
#include "core/model/gguf_model.h"
#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr int32_t kNormal = 1, kControl = 3, kUserDefined = 4;  // llama.cpp's token types

// Llama 3's RoPE scaling as llama.cpp's converter stores it: one factor per frequency.
std::vector<float> rope_factors(const ModelConfig& c) {
  const RopeScaling& s = *c.rope_scaling;
  const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
  const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
  std::vector<float> factors;
  for (int64_t i = 0; i < c.head_dim; i += 2) {
    const float freq = 1.0f / std::pow(static_cast<float>(c.rope_theta), static_cast<float>(i) / c.head_dim);
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      factors.push_back(1.0f);
    } else if (wavelen > low_wavelen) {
      factors.push_back(static_cast<float>(s.factor));
    } else {
      const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                            (s.high_freq_factor - s.low_freq_factor);
      factors.push_back(static_cast<float>(1.0 / ((1 - smooth) / s.factor + smooth)));
    }
  }
  return factors;
}

// GGUF's pre-tokenizer name for a tokenizer.json's pre_tokenizer (llama.cpp's names for the ones
// weft runs), or "" for another.
std::string pre_tokenizer_name(const json& pre) {
  if (!pre.is_object()) return "";
  const std::string type = pre.value("type", "");
  if (type == "ByteLevel") return "gpt-2";
  if (type != "Sequence" || !pre.contains("pretokenizers") || !pre.at("pretokenizers").is_array()) return "";
  const json& parts = pre.at("pretokenizers");
  if (parts.size() != 2 || !parts[1].is_object() || parts[1].value("type", "") != "ByteLevel") return "";
  const json& first = parts[0];
  if (first.value("type", "") == "Digits" && first.value("individual_digits", false)) return "smollm";
  if (first.value("type", "") == "Split" && first.contains("pattern") && first.at("pattern").is_object() &&
      first.at("pattern").value("Regex", "") == std::string(kLlama3SplitRegex)) {
    return "llama-bpe";
  }
  return "";
}

// The tokenizer's metadata from an HF tokenizer.json (and the tokenizer_config.json beside it).
void tokenizer_from_json(GgufWriter& out, const std::string& path) {
  json root;
  try {
    root = json::parse(read_file(path));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON ({})", path, e.what());
  }
  const json& model = root.contains("model") ? root.at("model") : json();
  WEFT_CHECK(model.is_object() && model.value("type", "") == "BPE" && model.contains("vocab") &&
                 model.at("vocab").is_object() && model.contains("merges") && model.at("merges").is_array(),
             "{}: GGUF export writes byte-level BPE tokenizers; this tokenizer.json's model is not one", path);
  const std::string pre = pre_tokenizer_name(root.contains("pre_tokenizer") ? root.at("pre_tokenizer") : json());
  WEFT_CHECK(!pre.empty(),
             "{}: its pre_tokenizer is not one GGUF export names (GPT-2's ByteLevel, SmolLM2's digits + ByteLevel, "
             "Llama 3's split + ByteLevel)",
             path);
  std::map<int64_t, std::string> tokens;
  for (const auto& [token, id] : model.at("vocab").items()) tokens[id.get<int64_t>()] = token;
  std::map<int64_t, int32_t> types;
  if (root.contains("added_tokens") && root.at("added_tokens").is_array()) {
    for (const auto& added : root.at("added_tokens")) {
      const int64_t id = added.at("id").get<int64_t>();
      tokens[id] = added.at("content").get<std::string>();
      types[id] = added.value("special", false) ? kControl : kUserDefined;
    }
  }
  WEFT_CHECK(!tokens.empty() && tokens.begin()->first == 0 && tokens.rbegin()->first + 1 == static_cast<int64_t>(tokens.size()),
             "{}: the token ids are not 0 to {} without gaps, which GGUF's token list needs", path, tokens.size() - 1);
  std::vector<std::string> list;
  std::vector<int32_t> type_list;
  for (const auto& [id, token] : tokens) {
    list.push_back(token);
    type_list.push_back(types.count(id) ? types.at(id) : kNormal);
  }
  std::vector<std::string> merges;
  for (const auto& merge : model.at("merges")) {
    if (merge.is_string()) {
      merges.push_back(merge.get<std::string>());
    } else {
      WEFT_CHECK(merge.is_array() && merge.size() == 2, "{}: a merge is neither \"a b\" nor [a, b]", path);
      merges.push_back(merge[0].get<std::string>() + " " + merge[1].get<std::string>());
    }
  }
  out.set("tokenizer.ggml.model", GgufWriter::string("gpt2"));
  out.set("tokenizer.ggml.pre", GgufWriter::string(pre));
  out.set("tokenizer.ggml.tokens", GgufWriter::strings(std::move(list)));
  out.set("tokenizer.ggml.token_type", GgufWriter::i32s(type_list));
  out.set("tokenizer.ggml.merges", GgufWriter::strings(std::move(merges)));
  // The chat template: tokenizer_config.json's, or chat_template.jinja beside it.
  const fs::path folder = fs::path(path).parent_path();
  std::error_code ec;
  if (fs::is_regular_file(folder / "chat_template.jinja", ec)) {
    out.set("tokenizer.chat_template", GgufWriter::string(read_file((folder / "chat_template.jinja").string())));
  } else if (fs::is_regular_file(folder / "tokenizer_config.json", ec)) {
    try {
      const json config = json::parse(read_file((folder / "tokenizer_config.json").string()));
      if (config.contains("chat_template") && config.at("chat_template").is_string()) {
        out.set("tokenizer.chat_template", GgufWriter::string(config.at("chat_template").get<std::string>()));
      }
    } catch (const json::exception& e) {
      fail("{}: not valid JSON ({})", (folder / "tokenizer_config.json").string(), e.what());
    }
  }
}

}  // namespace

uint32_t gguf_export_type(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "f32") return kGgmlF32;
  if (lower == "f16") return kGgmlF16;
  if (lower == "bf16") return kGgmlBF16;
  if (lower == "q8_0") return kGgmlQ8_0;
  fail("GGUF type '{}' is not one weft writes (f32, f16, bf16, q8_0)", name);
}

void export_gguf(LlamaForCausalLMImpl& model, const Tokenizer& tokenizer, const std::string& tokenizer_path,
                 const std::string& path, uint32_t type, const std::string& name) {
  const ModelConfig& c = model.config();
  WEFT_CHECK(!c.classification(), "GGUF export writes causal LMs; this model has a classification head");
  GgufWriter out;
  out.set("general.architecture", GgufWriter::string("llama"));
  out.set("general.type", GgufWriter::string("model"));
  if (!name.empty()) out.set("general.name", GgufWriter::string(name));
  const uint32_t file_type = type == kGgmlF32 ? 0 : type == kGgmlF16 ? 1 : type == kGgmlQ8_0 ? 7 : 32;
  out.set("general.file_type", GgufWriter::u32(file_type));
  if (type == kGgmlQ8_0) out.set("general.quantization_version", GgufWriter::u32(2));
  out.set("llama.block_count", GgufWriter::u32(static_cast<uint32_t>(c.num_hidden_layers)));
  out.set("llama.context_length", GgufWriter::u32(static_cast<uint32_t>(c.max_position_embeddings)));
  out.set("llama.embedding_length", GgufWriter::u32(static_cast<uint32_t>(c.hidden_size)));
  out.set("llama.feed_forward_length", GgufWriter::u32(static_cast<uint32_t>(c.intermediate_size)));
  out.set("llama.attention.head_count", GgufWriter::u32(static_cast<uint32_t>(c.num_attention_heads)));
  out.set("llama.attention.head_count_kv", GgufWriter::u32(static_cast<uint32_t>(c.num_key_value_heads)));
  out.set("llama.rope.freq_base", GgufWriter::f32(static_cast<float>(c.rope_theta)));
  out.set("llama.attention.layer_norm_rms_epsilon", GgufWriter::f32(static_cast<float>(c.rms_norm_eps)));
  if (c.head_dim * c.num_attention_heads != c.hidden_size) {
    out.set("llama.attention.key_length", GgufWriter::u32(static_cast<uint32_t>(c.head_dim)));
    out.set("llama.attention.value_length", GgufWriter::u32(static_cast<uint32_t>(c.head_dim)));
  }
  out.set("llama.vocab_size", GgufWriter::u32(static_cast<uint32_t>(c.vocab_size)));
  out.set("llama.rope.dimension_count", GgufWriter::u32(static_cast<uint32_t>(c.head_dim)));
  if (c.rope_scaling && c.rope_scaling->original_max_position_embeddings != 8192) {
    out.set("llama.rope.scaling.original_context_length",
            GgufWriter::u32(static_cast<uint32_t>(c.rope_scaling->original_max_position_embeddings)));
  }

  // The tokenizer: a GGUF file's metadata as it is, or a tokenizer.json's.
  WEFT_CHECK(tokenizer.kind() == "bpe",
             "GGUF export needs the model's BPE tokenizer (data.tokenizer: a tokenizer.json or a GGUF file); "
             "data.tokenizer is '{}'", tokenizer_path);
  if (is_gguf_path(tokenizer_path)) {
    const auto source = GgufFile::open(tokenizer_path);
    for (const std::string& key : source->keys()) {
      if (key.rfind("tokenizer.", 0) == 0) out.set(key, *source->value(key));
    }
  } else {
    tokenizer_from_json(out, tokenizer_path);
  }
  WEFT_CHECK(tokenizer.vocab_size() <= c.vocab_size, "the tokenizer has {} tokens, the model {}", tokenizer.vocab_size(),
             c.vocab_size);
  if (const auto bos = tokenizer.bos_id()) out.set("tokenizer.ggml.bos_token_id", GgufWriter::u32(*bos));
  if (const auto eos = tokenizer.eos_id()) out.set("tokenizer.ggml.eos_token_id", GgufWriter::u32(*eos));
  if (c.pad_token_id) out.set("tokenizer.ggml.padding_token_id", GgufWriter::u32(static_cast<uint32_t>(*c.pad_token_id)));
  out.set("tokenizer.ggml.add_bos_token", GgufWriter::boolean(tokenizer.adds_bos()));
  out.set("tokenizer.ggml.add_eos_token", GgufWriter::boolean(tokenizer.adds_eos()));

  // The tensors, in the converter's order: the embedding, each block's, the final norm, the head.
  if (c.rope_scaling) {
    const auto factors = rope_factors(c);
    out.add_tensor("rope_freqs.weight", {static_cast<int64_t>(factors.size())}, kGgmlF32,
                   quantize_ggml(kGgmlF32, factors.data(), static_cast<int64_t>(factors.size())));
  }
  int64_t fell_back = 0;
  for (auto& [hf, tensor] : hf_state(model, torch::kFloat32)) {
    if (hf == "lm_head.weight" && c.tie_word_embeddings) continue;  // the embedding (no output.weight: tied)
    const std::string gguf = gguf_tensor_name(hf);
    WEFT_CHECK(!gguf.empty(), "GGUF export: no llama.cpp name for tensor '{}'", hf);
    torch::Tensor t = tensor.to(torch::kCPU).contiguous();
    const bool q = hf.find(".q_proj.") != std::string::npos, k = hf.find(".k_proj.") != std::string::npos;
    if (q || k) {  // transformers rotates halves, llama.cpp interleaved pairs: (2, half) -> (half, 2) per head
      const int64_t heads = q ? c.num_attention_heads : c.num_key_value_heads;
      const int64_t rows = t.size(0), cols = t.size(1);
      t = t.reshape({heads, 2, rows / heads / 2, cols}).transpose(1, 2).reshape({rows, cols}).contiguous();
    }
    uint32_t tensor_type = t.dim() == 1 ? kGgmlF32 : type;
    if (tensor_type == kGgmlQ8_0 && t.size(-1) % 32 != 0) {
      tensor_type = kGgmlF16;  // rows that are not whole blocks: F16, as llama.cpp's converter falls back
      ++fell_back;
    }
    WEFT_CHECK(torch::isfinite(t).all().item<bool>(), "GGUF export: tensor '{}' holds a non-finite value", hf);
    out.add_tensor(gguf, t.sizes().vec(), tensor_type, quantize_ggml(tensor_type, t.data_ptr<float>(), t.numel()));
  }
  if (fell_back > 0) spdlog::warn("GGUF export: {} matrices have rows that are not blocks of 32: written as F16", fell_back);
  out.write(path);
}

}  // namespace weft
