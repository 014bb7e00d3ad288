// Not in weft_data's unity source: minja's chat-template.hpp declares a global `json` alias.
#include "core/data/chat_template.h"

#include <filesystem>
#include <stdexcept>

#include <minja/chat-template.hpp>
#include <minja/minja.hpp>
#include <nlohmann/json.hpp>

#include "core/data/tokenizer.h"
#include "core/io/gguf.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {

struct ChatTemplate::Impl {
  std::unique_ptr<minja::chat_template> engine;
  std::string source;
};

ChatTemplate::ChatTemplate(const std::string& source, const std::string& bos_token, const std::string& eos_token,
                           std::string origin)
    : impl_(std::make_unique<Impl>()), origin_(std::move(origin)) {
  impl_->source = source;
  try {
    impl_->engine = std::make_unique<minja::chat_template>(source, bos_token, eos_token);
  } catch (const std::exception& e) {
    fail("chat template of {}: does not parse: {}", origin_, e.what());
  }
}

ChatTemplate::~ChatTemplate() = default;

const std::string& ChatTemplate::source() const { return impl_->source; }

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  minja::chat_template_inputs inputs;
  inputs.messages = nlohmann::ordered_json::array();
  for (const auto& m : messages) inputs.messages.push_back({{"role", m.role}, {"content", m.content}});
  inputs.add_generation_prompt = add_generation_prompt;
  minja::chat_template_options options;
  options.apply_polyfills = false;  // the template as it is, as transformers renders it
  try {
    return impl_->engine->apply(inputs, options);
  } catch (const std::exception& e) {
    fail("chat template of {}: {}", origin_, e.what());
  }
}

std::unique_ptr<ChatTemplate> load_chat_template(const std::string& spec, const Tokenizer& tokenizer) {
  namespace fs = std::filesystem;
  const auto token_text = [&](std::optional<int32_t> id) { return id ? tokenizer.decode({*id}) : std::string(); };
  const std::string bos = token_text(tokenizer.bos_id()), eos = token_text(tokenizer.eos_id());
  if (spec == "byte") return nullptr;
  if (is_gguf_path(spec)) {
    const auto file = GgufFile::open(spec);
    const auto source = file->get_string("tokenizer.chat_template");
    if (!source) return nullptr;
    return std::make_unique<ChatTemplate>(*source, bos, eos, spec);
  }
  std::error_code ec;
  fs::path folder(spec);
  if (!fs::is_directory(folder, ec)) folder = folder.parent_path();
  const fs::path jinja = folder / "chat_template.jinja";
  if (fs::is_regular_file(jinja, ec)) return std::make_unique<ChatTemplate>(read_file(jinja.string()), bos, eos, jinja.string());
  const fs::path config = folder / "tokenizer_config.json";
  if (!fs::is_regular_file(config, ec)) return nullptr;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(config.string()));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", config.string(), e.what());
  }
  if (!j.is_object() || !j.contains("chat_template") || j.at("chat_template").is_null()) return nullptr;
  const auto& t = j.at("chat_template");
  if (t.is_string()) return std::make_unique<ChatTemplate>(t.get<std::string>(), bos, eos, config.string());
  WEFT_CHECK(t.is_array(), "{}: chat_template is neither a string nor a list of named templates", config.string());
  for (const auto& named : t) {  // transformers' list form: [{"name": "default", "template": ...}, ...]
    if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
        named.at("template").is_string()) {
      return std::make_unique<ChatTemplate>(named.at("template").get<std::string>(), bos, eos, config.string());
    }
  }
  fail("{}: chat_template lists no template named \"default\"", config.string());
}

}  // namespace weft
