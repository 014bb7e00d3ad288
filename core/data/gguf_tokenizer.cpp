#include "core/data/gguf_tokenizer.h"

#include <nlohmann/json.hpp>

#include "core/data/bpe_tokenizer.h"
#include "core/data/pretokenizer.h"
#include "core/io/gguf.h"
#include "core/util/error.h"

namespace weft {
namespace {

using nlohmann::json;

constexpr int64_t kControl = 3, kUserDefined = 4;  // llama.cpp's token types

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

}  // namespace

std::unique_ptr<Tokenizer> gguf_tokenizer(const GgufFile& file) {
  const std::string& path = file.path();
  const auto model = file.get_string("tokenizer.ggml.model");
  WEFT_CHECK(model.has_value(), "{}: GGUF metadata has no tokenizer (tokenizer.ggml.model)", path);
  WEFT_CHECK(*model == "gpt2", "{}: GGUF tokenizer.ggml.model '{}' is not one weft reads (gpt2: byte-level BPE)", path,
             *model);
  const GgufValue* tokens = file.value("tokenizer.ggml.tokens");
  WEFT_CHECK(tokens != nullptr && tokens->element_type == 8 && !tokens->texts.empty(),
             "{}: GGUF tokenizer.ggml.tokens is missing or not a list of strings", path);
  const GgufValue* merges = file.value("tokenizer.ggml.merges");
  WEFT_CHECK(merges != nullptr && merges->element_type == 8, "{}: GGUF tokenizer.ggml.merges is missing or not a list of strings",
             path);
  const GgufValue* types = file.value("tokenizer.ggml.token_type");
  WEFT_CHECK(types == nullptr || types->integers.size() == tokens->texts.size(),
             "{}: GGUF tokenizer.ggml.token_type has {} entries for {} tokens", path,
             types == nullptr ? 0 : types->integers.size(), tokens->texts.size());
  const std::string pre = file.get_string("tokenizer.ggml.pre").value_or("default");
  json pre_tokenizer;
  bool ignore_merges = false;
  if (pre == "smollm" || pre == "gpt-2" || pre == "default") {
    pre_tokenizer = byte_level(true);
  } else if (pre == "llama-bpe") {
    pre_tokenizer = {{"type", "Sequence"},
                     {"pretokenizers",
                      {{{"type", "Split"},
                        {"pattern", {{"Regex", std::string(kLlama3SplitRegex)}}},
                        {"behavior", "Isolated"},
                        {"invert", false}},
                       byte_level(false)}}};
    ignore_merges = true;
  } else {
    fail("{}: GGUF tokenizer.ggml.pre '{}' is not a pre-tokenizer weft runs (smollm, gpt-2, default, llama-bpe)", path,
         pre);
  }
  json vocab = json::object();
  json added = json::array();
  for (size_t id = 0; id < tokens->texts.size(); ++id) {
    const std::string& token = tokens->texts[id];
    WEFT_CHECK(vocab.find(token) == vocab.end(), "{}: GGUF tokenizer.ggml.tokens lists '{}' twice", path, token);
    vocab[token] = id;
    const int64_t type = types == nullptr ? 1 : types->integers[id];
    if (type == kControl || type == kUserDefined) {
      added.push_back({{"id", id}, {"content", token}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", type != kControl}, {"special", type == kControl}});
    }
  }
  const json root = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", pre_tokenizer},
      {"post_processor", nullptr},
      {"decoder", byte_level(true)},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", ignore_merges},
        {"vocab", vocab}, {"merges", merges->texts}}},
  };
  BpeTokenizer::SpecialIds special;
  const auto id = [&](const char* key) -> std::optional<int32_t> {
    const auto v = file.get_int(key);
    if (!v) return std::nullopt;
    WEFT_CHECK(*v >= 0 && *v < static_cast<int64_t>(tokens->texts.size()), "{}: GGUF {} is {}, outside the {} tokens",
               path, key, *v, tokens->texts.size());
    return static_cast<int32_t>(*v);
  };
  special.bos = id("tokenizer.ggml.bos_token_id");
  special.eos = id("tokenizer.ggml.eos_token_id");
  // Whether encoding adds them: llama.cpp's flags (absent: not added, as transformers' loader reads them).
  special.adds_bos = file.get_bool("tokenizer.ggml.add_bos_token").value_or(false);
  special.adds_eos = file.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
  return std::make_unique<BpeTokenizer>(root.dump(), path, special);
}

std::unique_ptr<Tokenizer> load_gguf_tokenizer(const std::string& path) { return gguf_tokenizer(*GgufFile::open(path)); }

}  // namespace weft
