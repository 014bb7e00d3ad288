#include "core/data/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <queue>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/data/pretokenizer.h"
#include "core/data/unicode.h"
#include "core/util/error.h"
#include "core/util/hash.h"

namespace weft {

using nlohmann::json;

namespace {

constexpr size_t kMaxCachedWords = 1 << 18;
constexpr int64_t kMaxTokenId = (1 << 24) - 1;  // far above any real vocabulary; bounds the id table

struct Merge {
  int32_t rank;
  int32_t merged_id;
};

struct AddedToken {
  std::string content;
  int32_t id;
};

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

std::string byte_level_chars(std::string_view bytes) {
  std::string mapped;
  mapped.reserve(bytes.size() * 2);
  for (unsigned char byte : bytes) unicode::append_utf8(mapped, unicode::byte_char(byte));
  return mapped;
}

// Inverse of byte_level_chars; characters outside the byte map are kept as they are.
std::string byte_level_bytes(std::string_view token) {
  std::string bytes;
  for (const auto& c : unicode::decode_utf8_lenient(token)) {
    const int byte = unicode::char_byte(c.code_point);
    if (byte >= 0)
      bytes += static_cast<char>(byte);
    else
      bytes.append(token.substr(c.byte_offset, c.byte_length));
  }
  return bytes;
}

std::string type_of(const json& j) {
  return j.is_object() && j.contains("type") && j["type"].is_string() ? j["type"].get<std::string>()
                                                                        : std::string("?");
}

bool is_unset(const json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return true;
  const json& value = j[key];
  return (value.is_boolean() && !value.get<bool>()) || (value.is_string() && value.get<std::string>().empty()) ||
         (value.is_number() && value.get<double>() == 0.0);
}

bool is_valid_id(const json& id) {
  return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= kMaxTokenId;
}

}  // namespace

struct BpeTokenizer::State {
  std::string source;
  std::string fingerprint;
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_ids{};  // id of each byte's one-character token, or -1
  std::optional<int32_t> unk_id;
  bool ignore_merges = false;
  std::vector<SplitPattern> splits;
  std::vector<AddedToken> added;
  std::array<std::vector<size_t>, 256> added_by_first_byte;  // indices into added, longest first
  std::vector<std::string> id_bytes;                         // decoded bytes per id
  std::vector<bool> id_known;
  int64_t vocab_size = 0;
  std::optional<int32_t> bos, eos;
  bool adds_bos = false, adds_eos = false;

  std::mutex cache_mutex;
  std::unordered_map<std::string, std::vector<int32_t>> cache;

  [[noreturn]] void error(const std::string& problem) const { fail("tokenizer {}: {}", source, problem); }

  void parse(const json& root);
  void parse_model(const json& model);
  void parse_vocab(const json& vocab_json);
  void parse_merges(const json& merges_json);
  int32_t vocab_id(const std::string& token, const std::string& context) const;
  void parse_byte_ids();
  void parse_normalizer(const json& root);
  void parse_pre_tokenizer(const json& pre);
  void parse_split(const json& split);
  void parse_decoder(const json& root);
  void parse_added_tokens(const json& root);
  void build_id_table();
  void choose_bos_eos(const json& root);
  std::optional<int32_t> token_id(const std::string& content) const;

  const AddedToken* added_at(std::string_view text, size_t pos) const;
  void encode_segment(std::string_view segment, std::vector<int32_t>& ids);
  void encode_word(std::string_view word, std::vector<int32_t>& ids);
  std::vector<int32_t> bpe(std::string_view word) const;
  void merge_symbols(std::vector<int32_t>& symbols) const;
};

void BpeTokenizer::State::parse(const json& root) {
  if (!root.is_object()) error("top level is not a JSON object");
  if (!root.contains("model") || !root["model"].is_object()) error("missing \"model\" object");
  parse_model(root["model"]);
  parse_normalizer(root);
  if (!root.contains("pre_tokenizer") || root["pre_tokenizer"].is_null()) error("missing \"pre_tokenizer\"");
  parse_pre_tokenizer(root["pre_tokenizer"]);
  parse_decoder(root);
  parse_added_tokens(root);
  build_id_table();
  choose_bos_eos(root);
}

void BpeTokenizer::State::parse_model(const json& model) {
  if (model.contains("type") && type_of(model) != "BPE")
    error(fmt::format("model type \"{}\" is not supported (only \"BPE\")", type_of(model)));
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback"})
    if (!is_unset(model, key)) error(fmt::format("model.{} is not supported", key));
  if (!model.contains("vocab") || !model["vocab"].is_object()) error("model.vocab is missing or not an object");
  if (!model.contains("merges") || !model["merges"].is_array()) error("model.merges is missing or not an array");
  parse_vocab(model["vocab"]);
  parse_merges(model["merges"]);
  ignore_merges = model.value("ignore_merges", false);
  if (model.contains("unk_token") && !model["unk_token"].is_null())
    unk_id = vocab_id(model["unk_token"].get<std::string>(), "model.unk_token");
  parse_byte_ids();
}

void BpeTokenizer::State::parse_vocab(const json& vocab_json) {
  vocab.reserve(vocab_json.size());
  std::unordered_map<int32_t, std::string> token_of_id;  // an id decodes to one token only
  token_of_id.reserve(vocab_json.size());
  for (const auto& [token, id] : vocab_json.items()) {
    if (!is_valid_id(id))
      error(fmt::format("model.vocab[\"{}\"] is not a valid token id", token));
    const auto [other, fresh] = token_of_id.emplace(id.get<int32_t>(), token);
    if (!fresh)
      error(fmt::format("model.vocab gives id {} to two tokens, \"{}\" and \"{}\"", other->first, other->second,
                        token));
    vocab[token] = id.get<int32_t>();
  }
}

int32_t BpeTokenizer::State::vocab_id(const std::string& token, const std::string& context) const {
  const auto it = vocab.find(token);
  if (it == vocab.end()) error(fmt::format("{}: token \"{}\" is not in the vocabulary", context, token));
  return it->second;
}

void BpeTokenizer::State::parse_merges(const json& merges_json) {
  merges.reserve(merges_json.size());
  for (size_t rank = 0; rank < merges_json.size(); ++rank) {
    const json& entry = merges_json[rank];
    const std::string context = fmt::format("model.merges[{}]", rank);
    std::string left, right;
    if (entry.is_string()) {
      const std::string text = entry.get<std::string>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
        error(fmt::format("{} \"{}\" is not two tokens separated by one space", context, text));
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else {
      error(fmt::format("{} is neither \"a b\" nor [\"a\", \"b\"]", context));
    }
    const int32_t left_id = vocab_id(left, context);
    const int32_t right_id = vocab_id(right, context);
    const int32_t merged_id = vocab_id(left + right, context);
    merges[pair_key(left_id, right_id)] = {static_cast<int32_t>(rank), merged_id};
  }
}

void BpeTokenizer::State::parse_byte_ids() {
  for (int byte = 0; byte < 256; ++byte) {
    const auto it = vocab.find(byte_level_chars(std::string(1, static_cast<char>(byte))));
    byte_ids[byte] = it == vocab.end() ? -1 : it->second;
  }
}

void BpeTokenizer::State::parse_normalizer(const json& root) {
  if (root.contains("normalizer") && !root["normalizer"].is_null())
    error(fmt::format("normalizer \"{}\" is not supported (only none)", type_of(root["normalizer"])));
}

void BpeTokenizer::State::parse_pre_tokenizer(const json& pre) {
  const std::string type = type_of(pre);
  if (type == "ByteLevel") {
    if (pre.value("add_prefix_space", false)) error("pre_tokenizer ByteLevel.add_prefix_space=true is not supported");
    if (pre.value("use_regex", true)) splits.push_back(SplitPattern::kGpt2);
    return;
  }
  if (type != "Sequence") error(fmt::format("pre_tokenizer \"{}\" is not supported", type));
  if (!pre.contains("pretokenizers") || !pre["pretokenizers"].is_array() || pre["pretokenizers"].empty())
    error("pre_tokenizer Sequence has no \"pretokenizers\" list");
  const json& steps = pre["pretokenizers"];
  for (size_t i = 0; i + 1 < steps.size(); ++i) {
    if (type_of(steps[i]) != "Split")
      error(fmt::format("pre_tokenizer step \"{}\" is not supported (only Split, then ByteLevel)", type_of(steps[i])));
    parse_split(steps[i]);
  }
  if (type_of(steps.back()) != "ByteLevel") error("pre_tokenizer Sequence does not end with ByteLevel");
  parse_pre_tokenizer(steps.back());
}

void BpeTokenizer::State::parse_split(const json& split) {
  if (split.value("behavior", std::string()) != "Isolated")
    error(fmt::format("pre_tokenizer Split behavior \"{}\" is not supported (only Isolated)",
                      split.value("behavior", std::string())));
  if (split.value("invert", false)) error("pre_tokenizer Split invert=true is not supported");
  if (!split.contains("pattern") || !split["pattern"].contains("Regex"))
    error("pre_tokenizer Split has no {\"Regex\": ...} pattern");
  const std::string regex = split["pattern"]["Regex"].get<std::string>();
  const auto pattern = split_pattern_for_regex(regex);
  if (!pattern) error(fmt::format("unsupported pre-tokenizer regex {}", json(regex).dump()));
  splits.push_back(*pattern);
}

void BpeTokenizer::State::parse_decoder(const json& root) {
  if (!root.contains("decoder") || type_of(root["decoder"]) != "ByteLevel")
    error(fmt::format("decoder \"{}\" is not supported (only ByteLevel)",
                      root.contains("decoder") ? type_of(root["decoder"]) : "none"));
}

void BpeTokenizer::State::parse_added_tokens(const json& root) {
  if (!root.contains("added_tokens") || root["added_tokens"].is_null()) return;
  if (!root["added_tokens"].is_array()) error("added_tokens is not an array");
  for (const json& token : root["added_tokens"]) {
    if (!token.is_object() || !token.contains("id") || !token.contains("content"))
      error("added_tokens entry without \"id\" and \"content\"");
    AddedToken added_token{token["content"].get<std::string>(), -1};
    if (!is_valid_id(token["id"])) error(fmt::format("added token \"{}\" has an invalid id", added_token.content));
    added_token.id = token["id"].get<int32_t>();
    for (const char* key : {"lstrip", "rstrip", "single_word"})
      if (token.value(key, false))
        error(fmt::format("added token \"{}\": {}=true is not supported", added_token.content, key));
    if (added_token.content.empty()) continue;
    for (const auto& earlier : added)
      if (earlier.id == added_token.id && earlier.content != added_token.content)
        error(fmt::format("added_tokens gives id {} to two tokens, \"{}\" and \"{}\"", added_token.id,
                          earlier.content, added_token.content));
    added.push_back(std::move(added_token));
  }
  for (size_t i = 0; i < added.size(); ++i)
    added_by_first_byte[static_cast<unsigned char>(added[i].content[0])].push_back(i);
  for (auto& candidates : added_by_first_byte)
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](size_t a, size_t b) { return added[a].content.size() > added[b].content.size(); });
}

void BpeTokenizer::State::build_id_table() {
  int64_t max_id = -1;
  for (const auto& [token, id] : vocab) max_id = std::max<int64_t>(max_id, id);
  for (const auto& token : added) max_id = std::max<int64_t>(max_id, token.id);
  vocab_size = max_id + 1;
  id_bytes.assign(vocab_size, std::string());
  id_known.assign(vocab_size, false);
  for (const auto& [token, id] : vocab) {
    id_bytes[id] = byte_level_bytes(token);
    id_known[id] = true;
  }
  for (const auto& token : added) {  // an added token decodes to its content, even if in the vocab
    id_bytes[token.id] = token.content;
    id_known[token.id] = true;
  }
}

std::optional<int32_t> BpeTokenizer::State::token_id(const std::string& content) const {
  for (const auto& token : added)
    if (token.content == content) return token.id;
  const auto it = vocab.find(content);
  if (it != vocab.end()) return it->second;
  return std::nullopt;
}

namespace {

const json* find_template_processing(const json& processor) {
  const std::string type = type_of(processor);
  if (type == "TemplateProcessing") return &processor;
  if (type == "Sequence" && processor.contains("processors") && processor["processors"].is_array())
    for (const json& inner : processor["processors"])
      if (const json* found = find_template_processing(inner)) return found;
  return nullptr;
}

// The name of the SpecialToken at the front (or back) of a template's "single" list.
std::optional<std::string> template_special_token(const json& processing, bool front) {
  if (!processing.contains("single") || !processing["single"].is_array() || processing["single"].empty())
    return std::nullopt;
  const json& piece = front ? processing["single"].front() : processing["single"].back();
  if (!piece.is_object() || !piece.contains("SpecialToken")) return std::nullopt;
  return piece["SpecialToken"].at("id").get<std::string>();
}

}  // namespace

void BpeTokenizer::State::choose_bos_eos(const json& root) {
  const json* processing = root.contains("post_processor") ? find_template_processing(root["post_processor"]) : nullptr;
  const auto resolve = [&](const std::string& name) -> std::optional<int32_t> {
    if (processing && processing->contains("special_tokens") && (*processing)["special_tokens"].contains(name)) {
      const json& ids = (*processing)["special_tokens"][name].at("ids");
      if (ids.is_array() && !ids.empty()) return ids[0].get<int32_t>();
    }
    const auto id = token_id(name);
    if (!id) error(fmt::format("post_processor special token \"{}\" is not a known token", name));
    return id;
  };
  const auto named = [&](const char* preferred) {
    const auto id = token_id(preferred);
    return id ? id : token_id("<|endoftext|>");
  };
  const auto front = processing ? template_special_token(*processing, true) : std::nullopt;
  const auto back = processing ? template_special_token(*processing, false) : std::nullopt;
  bos = front ? resolve(*front) : named("<|begin_of_text|>");
  eos = back ? resolve(*back) : named("<|end_of_text|>");
  adds_bos = front.has_value();
  adds_eos = back.has_value();
}

const AddedToken* BpeTokenizer::State::added_at(std::string_view text, size_t pos) const {
  for (size_t index : added_by_first_byte[static_cast<unsigned char>(text[pos])]) {
    const std::string& content = added[index].content;
    if (text.compare(pos, content.size(), content) == 0) return &added[index];
  }
  return nullptr;
}

void BpeTokenizer::State::encode_segment(std::string_view segment, std::vector<int32_t>& ids) {
  if (segment.empty()) return;
  std::vector<std::string_view> pieces{segment};
  for (SplitPattern pattern : splits) {
    std::vector<std::string_view> finer;
    for (std::string_view piece : pieces)
      for (std::string_view part : split_pretokens(piece, pattern)) finer.push_back(part);
    pieces = std::move(finer);
  }
  for (std::string_view piece : pieces) encode_word(piece, ids);
}

void BpeTokenizer::State::encode_word(std::string_view word, std::vector<int32_t>& ids) {
  const std::string key(word);
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word_ids = bpe(word);
  ids.insert(ids.end(), word_ids.begin(), word_ids.end());
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() < kMaxCachedWords) cache.emplace(key, std::move(word_ids));
}

std::vector<int32_t> BpeTokenizer::State::bpe(std::string_view word) const {
  if (ignore_merges) {
    const auto it = vocab.find(byte_level_chars(word));
    if (it != vocab.end()) return {it->second};
  }
  std::vector<int32_t> symbols;
  symbols.reserve(word.size());
  for (unsigned char byte : word) {
    const int32_t id = byte_ids[byte] >= 0 ? byte_ids[byte] : unk_id.value_or(-1);
    if (id < 0)
      error(fmt::format("byte 0x{:02X} (symbol \"{}\") is not in the vocabulary and there is no unk_token", byte,
                        byte_level_chars(std::string(1, static_cast<char>(byte)))));
    symbols.push_back(id);
  }
  merge_symbols(symbols);
  return symbols;
}

// Applies merges lowest rank first (leftmost first among equal ranks) until none applies, on a
// linked list of symbols, as HF's BPE does.
void BpeTokenizer::State::merge_symbols(std::vector<int32_t>& symbols) const {
  const int n = static_cast<int>(symbols.size());
  if (n < 2) return;
  std::vector<int> next(n), prev(n);
  for (int i = 0; i < n; ++i) {
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  struct Candidate {
    int32_t rank;
    int left;
    int32_t left_id, right_id, merged_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  const auto push = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    const auto it = merges.find(pair_key(symbols[left], symbols[next[left]]));
    if (it != merges.end())
      queue.push({it->second.rank, left, symbols[left], symbols[next[left]], it->second.merged_id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  std::vector<bool> alive(n, true);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    const int right = next[c.left];
    if (!alive[c.left] || right < 0 || symbols[c.left] != c.left_id || symbols[right] != c.right_id) continue;
    symbols[c.left] = c.merged_id;
    alive[right] = false;
    next[c.left] = next[right];
    if (next[right] >= 0) prev[next[right]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  std::vector<int32_t> merged;
  for (int i = 0; i >= 0; i = next[i]) merged.push_back(symbols[i]);
  symbols = std::move(merged);
}

BpeTokenizer::BpeTokenizer(std::string_view json_text, const std::string& source) : state_(std::make_unique<State>()) {
  state_->source = source;
  state_->fingerprint = hex64(hash64(json_text));
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    state_->error(fmt::format("invalid JSON: {}", e.what()));
  }
  try {
    state_->parse(root);
  } catch (const json::exception& e) {
    state_->error(fmt::format("unexpected structure: {}", e.what()));
  }
}

BpeTokenizer::BpeTokenizer(std::string_view json_text, const std::string& source, const SpecialIds& special)
    : BpeTokenizer(json_text, source) {
  for (const auto& id : {special.bos, special.eos}) {
    if (id && (*id < 0 || *id >= state_->vocab_size || !state_->id_known[*id])) {
      state_->error(fmt::format("special token id {} is not in the vocabulary (vocab size {})", *id, state_->vocab_size));
    }
  }
  // The ids take part in the fingerprint: a token cache made with other special ids is not reused.
  state_->fingerprint = hex64(hash64(std::string(json_text) + fmt::format("\nbos {} eos {}", special.bos.value_or(-1),
                                                                           special.eos.value_or(-1))));
  if (special.bos) state_->bos = special.bos;
  if (special.eos) state_->eos = special.eos;
  if (special.adds_bos) state_->adds_bos = *special.adds_bos;
  if (special.adds_eos) state_->adds_eos = *special.adds_eos;
}

BpeTokenizer::~BpeTokenizer() = default;

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer {}: cannot open file", path);
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) fail("tokenizer {}: read error", path);
  auto tokenizer = std::make_unique<BpeTokenizer>(contents.str(), path);
  // transformers' tokenizer_config.json beside it: the checkpoint's BOS, EOS and framing.
  const std::string config_path = (std::filesystem::path(path).parent_path() / "tokenizer_config.json").string();
  std::ifstream config_in(config_path, std::ios::binary);
  if (!config_in) return tokenizer;
  std::ostringstream config_text;
  config_text << config_in.rdbuf();
  json config;
  try {
    config = json::parse(config_text.str());
  } catch (const json::exception& e) {
    fail("tokenizer {}: invalid JSON: {}", config_path, e.what());
  }
  if (!config.is_object()) fail("tokenizer {}: top level is not a JSON object", config_path);
  State& state = *tokenizer->state_;
  const auto special = [&](const char* key) -> std::optional<int32_t> {
    if (!config.contains(key) || config[key].is_null()) return std::nullopt;
    const json& value = config[key];
    const json& content = value.is_object() ? value.value("content", json()) : value;  // AddedToken's form
    if (!content.is_string()) fail("tokenizer {}: {} is not a token", config_path, key);
    const auto id = state.token_id(content.get<std::string>());
    if (!id) fail("tokenizer {}: {} '{}' is not in the vocabulary of {}", config_path, key, content.get<std::string>(), path);
    return id;
  };
  const auto flag = [&](const char* key) -> std::optional<bool> {
    if (!config.contains(key) || config[key].is_null()) return std::nullopt;
    if (!config[key].is_boolean()) fail("tokenizer {}: {} is not a boolean", config_path, key);
    return config[key].get<bool>();
  };
  if (const auto bos = special("bos_token")) state.bos = bos;
  if (const auto eos = special("eos_token")) state.eos = eos;
  if (const auto adds = flag("add_bos_token")) state.adds_bos = *adds;
  if (const auto adds = flag("add_eos_token")) state.adds_eos = *adds;
  state.fingerprint = hex64(hash64(contents.str() + "\n" + config_text.str()));
  return tokenizer;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3);
  size_t segment_start = 0;
  for (size_t pos = 0; pos < text.size();) {
    const AddedToken* token = state_->added_at(text, pos);
    if (!token) {
      ++pos;
      continue;
    }
    state_->encode_segment(text.substr(segment_start, pos - segment_start), ids);
    ids.push_back(token->id);
    pos = segment_start = pos + token->content.size();
  }
  state_->encode_segment(text.substr(segment_start), ids);
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  for (int32_t id : ids) {
    if (id < 0 || id >= state_->vocab_size || !state_->id_known[id])
      fail("tokenizer {}: token id {} is not in the vocabulary (vocab size {})", state_->source, id,
           state_->vocab_size);
    text += state_->id_bytes[id];
  }
  return text;
}

int64_t BpeTokenizer::vocab_size() const { return state_->vocab_size; }
std::optional<int32_t> BpeTokenizer::bos_id() const { return state_->bos; }
std::optional<int32_t> BpeTokenizer::eos_id() const { return state_->eos; }
bool BpeTokenizer::adds_bos() const { return state_->adds_bos; }
bool BpeTokenizer::adds_eos() const { return state_->adds_eos; }
std::string BpeTokenizer::fingerprint() const { return state_->fingerprint; }

}  // namespace weft
