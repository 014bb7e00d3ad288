#include "core/data/chat_data.h"

#include <algorithm>
#include <chrono>

#include <nlohmann/json.hpp>

#include "core/data/documents.h"
#include "core/util/error.h"

namespace weft {
namespace {

std::vector<ChatMessage> messages_of(const nlohmann::json& list, const std::string& field, const std::string& where) {
  WEFT_CHECK(list.is_array(), "{}: '{}' is {}, expected a list of messages", where, field, list.type_name());
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& m = list[i];
    WEFT_CHECK(m.is_object() && m.contains("role") && m.at("role").is_string() && m.contains("content") &&
                   m.at("content").is_string(),
               "{}: {}[{}] needs a string 'role' and a string 'content'", where, field, i);
    out.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  }
  return out;
}

bool has_assistant(const std::vector<ChatMessage>& messages) {
  return std::any_of(messages.begin(), messages.end(), [](const ChatMessage& m) { return m.role == "assistant"; });
}

std::vector<uint32_t> ids_of(const Tokenizer& tokenizer, const std::string& text, bool bos) {
  std::vector<uint32_t> out;
  if (bos && tokenizer.bos_id()) out.push_back(static_cast<uint32_t>(*tokenizer.bos_id()));
  for (int32_t id : tokenizer.encode(text)) out.push_back(static_cast<uint32_t>(id));
  return out;
}

size_t common_prefix(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b) {
  return static_cast<size_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
}

// Marks [begin, end) trained.
void train_span(std::vector<uint8_t>& trained, size_t begin, size_t end) {
  for (size_t i = begin; i < std::min(end, trained.size()); ++i) trained[i] = 1;
}

}  // namespace

std::vector<ChatRecord> read_chat_jsonl(const std::string& path) {
  std::vector<ChatRecord> records;
  for_each_jsonl_object(read_file_bytes(path), path, [&](int64_t line, const nlohmann::json& object) {
    ChatRecord r;
    r.where = path + ":" + std::to_string(line);
    if (object.contains("messages")) {
      r.kind = ChatRecord::Kind::kMessages;
      r.messages = messages_of(object.at("messages"), "messages", r.where);
      WEFT_CHECK(has_assistant(r.messages), "{}: the conversation has no assistant message to learn", r.where);
    } else if (object.contains("prompt") && object.contains("completion")) {
      const auto &prompt = object.at("prompt"), &completion = object.at("completion");
      if (prompt.is_string() && completion.is_string()) {
        r.kind = ChatRecord::Kind::kTextPromptCompletion;
        r.prompt_text = prompt.get<std::string>();
        r.completion_text = completion.get<std::string>();
        WEFT_CHECK(!r.completion_text.empty(), "{}: the completion is empty", r.where);
      } else {
        WEFT_CHECK(prompt.is_array() && completion.is_array(),
                   "{}: 'prompt' and 'completion' must both be strings or both lists of messages", r.where);
        r.kind = ChatRecord::Kind::kPromptCompletion;
        r.messages = messages_of(prompt, "prompt", r.where);
        r.completion = messages_of(completion, "completion", r.where);
        WEFT_CHECK(!r.completion.empty(), "{}: the completion has no message", r.where);
      }
    } else {
      fail("{}: a chat example needs 'messages', or 'prompt' and 'completion' (TRL's dataset types)", r.where);
    }
    records.push_back(std::move(r));
  });
  WEFT_CHECK(!records.empty(), "{}: no chat examples", path);
  return records;
}

ChatEncoding encode_chat(const ChatRecord& r, const Tokenizer& tokenizer, const ChatTemplate* chat_template,
                         bool assistant_only, bool add_bos) {
  ChatEncoding e;
  if (r.kind == ChatRecord::Kind::kTextPromptCompletion) {
    std::string completion = r.completion_text;
    if (const auto eos = tokenizer.eos_id()) {  // TRL's add_eos
      const std::string text = tokenizer.decode({*eos});
      if (completion.size() < text.size() || completion.compare(completion.size() - text.size(), text.size(), text) != 0) {
        completion += text;
      }
    }
    e.tokens = ids_of(tokenizer, r.prompt_text + completion, add_bos);
    e.trained.assign(e.tokens.size(), assistant_only ? 0 : 1);
    if (assistant_only) train_span(e.trained, common_prefix(ids_of(tokenizer, r.prompt_text, add_bos), e.tokens), e.tokens.size());
    return e;
  }
  WEFT_CHECK(chat_template != nullptr, "{}: a conversation needs the tokenizer's chat template, and it has none",
             r.where);
  const auto render = [&](const std::vector<ChatMessage>& messages, bool generation_prompt) {
    return ids_of(tokenizer, chat_template->render(messages, generation_prompt), false);
  };
  if (r.kind == ChatRecord::Kind::kPromptCompletion) {
    std::vector<ChatMessage> whole = r.messages;
    whole.insert(whole.end(), r.completion.begin(), r.completion.end());
    e.tokens = render(whole, false);
    e.trained.assign(e.tokens.size(), assistant_only ? 0 : 1);
    if (assistant_only) train_span(e.trained, common_prefix(render(r.messages, true), e.tokens), e.tokens.size());
    return e;
  }
  e.tokens = render(r.messages, false);
  e.trained.assign(e.tokens.size(), assistant_only ? 0 : 1);
  if (!assistant_only) return e;
  for (size_t i = 0; i < r.messages.size(); ++i) {
    if (r.messages[i].role != "assistant") continue;
    const std::vector<ChatMessage> before(r.messages.begin(), r.messages.begin() + static_cast<std::ptrdiff_t>(i));
    const std::vector<ChatMessage> through(r.messages.begin(), r.messages.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    const auto upto = render(through, false);
    WEFT_CHECK(common_prefix(upto, e.tokens) == upto.size(),
               "{}: the chat template ({}) renders the conversation up to message {} differently from the start of "
               "the whole conversation, so that message's tokens cannot be found; use data.loss_on = \"all\" or the "
               "prompt-completion form",
               r.where, chat_template->origin(), i);
    train_span(e.trained, i == 0 ? 0 : common_prefix(render(before, true), e.tokens), upto.size());
  }
  return e;
}

ChatData prepare_chat(const DatasetOptions& options, const ChatOptions& chat, const Tokenizer& tokenizer,
                      const ChatTemplate* chat_template) {
  const auto start = std::chrono::steady_clock::now();
  WEFT_CHECK(chat.loss_on == "assistant" || chat.loss_on == "all", "data.loss_on must be assistant or all, got '{}'",
             chat.loss_on);
  WEFT_CHECK(options.seq_len > 0, "seq_len must be positive, got {}", options.seq_len);
  std::vector<ChatRecord> records;
  const auto files = resolve_inputs(options.paths, DataFormat::kJsonl);
  for (const auto& file : files) {
    auto more = read_chat_jsonl(file.path);
    records.insert(records.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  if (options.max_documents > 0 && static_cast<int64_t>(records.size()) > options.max_documents) {
    records.resize(static_cast<size_t>(options.max_documents));
  }
  ChatData data;
  data.examples = static_cast<int64_t>(records.size());
  data.pad = tokenizer.eos_id() ? static_cast<uint32_t>(*tokenizer.eos_id()) : 0;
  const DocumentSplit split = split_documents(data.examples, options.heldout_fraction, options.split_seed);
  const bool bos = options.bos_for(tokenizer);
  const auto pack = [&](const std::vector<int64_t>& indices, const std::string& name, int64_t& tokens) {
    std::vector<std::vector<uint32_t>> examples;
    std::vector<std::vector<uint8_t>> trained;
    for (int64_t i : indices) {
      ChatEncoding e = encode_chat(records[static_cast<size_t>(i)], tokenizer, chat_template,
                                   chat.loss_on == "assistant", bos);
      if (static_cast<int64_t>(e.tokens.size()) > options.seq_len + 1) {
        ++data.truncated;
        e.tokens.resize(static_cast<size_t>(options.seq_len) + 1);
        e.trained.resize(e.tokens.size());
      }
      if (e.tokens.size() < 2 || std::find(e.trained.begin() + 1, e.trained.end(), 1) == e.trained.end()) {
        ++data.dropped;
        continue;
      }
      tokens += static_cast<int64_t>(e.tokens.size());
      examples.push_back(std::move(e.tokens));
      trained.push_back(std::move(e.trained));
    }
    WEFT_CHECK(!examples.empty(), "the {} split has no example left with a token in the loss ({} cut to seq_len + 1 = {})",
               name, data.truncated, options.seq_len + 1);
    if (!chat.packing) {
      return std::make_shared<const PackedSequences>(PackedSequences::chat(name, examples, trained, options.seq_len, data.pad));
    }
    // TRL's pack_dataset(max_length = seq_len + 1, "bfd"), which datasets.map runs on batches of
    // 1000 examples: best fit decreasing within each run of 1000.
    std::vector<std::vector<int64_t>> bins;
    for (size_t begin = 0; begin < examples.size(); begin += kPackingGroup) {
      const size_t end = std::min(examples.size(), begin + kPackingGroup);
      std::vector<int64_t> lengths;
      for (size_t i = begin; i < end; ++i) lengths.push_back(static_cast<int64_t>(examples[i].size()));
      for (auto& bin : best_fit_decreasing(lengths, options.seq_len + 1)) {
        for (auto& i : bin) i += static_cast<int64_t>(begin);
        bins.push_back(std::move(bin));
      }
    }
    return std::make_shared<const PackedSequences>(
        PackedSequences::chat(name, examples, trained, options.seq_len, data.pad, bins));
  };
  DatasetSummary& s = data.splits.summary;
  data.splits.train = pack(split.train, options.train_name, s.train_tokens);
  if (!split.heldout.empty()) data.splits.heldout = pack(split.heldout, "held-out", s.heldout_tokens);
  s.files = static_cast<int64_t>(files.size());
  s.documents = data.examples;
  s.train_name = options.train_name;
  s.train_documents = data.splits.train->n_documents();
  s.train_sequences = data.splits.train->n_sequences();
  if (data.splits.heldout) {
    s.heldout_documents = data.splits.heldout->n_documents();
    s.heldout_sequences = data.splits.heldout->n_sequences();
  }
  s.tokens = s.train_tokens + s.heldout_tokens;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return data;
}

}  // namespace weft
