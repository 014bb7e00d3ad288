// Chat templates: the Jinja template a checkpoint ships (tokenizer_config.json's chat_template,
// chat_template.jinja, or a GGUF file's tokenizer.chat_template) rendered as transformers'
// apply_chat_template renders it: trim_blocks and lstrip_blocks, the messages, add_generation_prompt,
// bos_token and eos_token in the context, raise_exception and strftime_now defined. Rendering is
// Google's minja (third_party/minja, the engine llama.cpp uses), with none of its polyfills.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace weft {

class Tokenizer;

struct ChatMessage {
  std::string role;     // "system", "user", "assistant", ...
  std::string content;
};

class ChatTemplate {
 public:
  // `source` is the template's text; `origin` names it in errors. Throws weft::Error when the
  // template does not parse.
  ChatTemplate(const std::string& source, const std::string& bos_token, const std::string& eos_token,
               std::string origin);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // The conversation as text (the template writes BOS where the checkpoint wants it: encode it
  // without adding one). Throws weft::Error naming the template when rendering fails (e.g. its
  // raise_exception on roles it does not accept).
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  const std::string& source() const;
  const std::string& origin() const { return origin_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string origin_;
};

// The chat template that comes with the tokenizer `spec` (load_tokenizer's spec): a GGUF file's
// tokenizer.chat_template, or beside a tokenizer.json its chat_template.jinja or its
// tokenizer_config.json's chat_template (a string, or a list of named templates: "default").
// nullptr when there is none (the byte tokenizer has none). BOS and EOS are the tokenizer's.
std::unique_ptr<ChatTemplate> load_chat_template(const std::string& spec, const Tokenizer& tokenizer);

}  // namespace weft
