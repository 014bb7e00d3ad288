// Instruction data (data.format = "chat"), prepared as TRL's SFTTrainer (1.16) prepares it without
// packing (or with it, data.packing): each example rendered with the checkpoint's chat template,
// tokenized, its loss limited to the assistant's (or the completion's) tokens, cut to the sequence
// length and padded to a row of its own (or packed with others into rows whose positions restart
// at each example, which the model keeps apart), so that no example ever attends to another.
//
//   ChatData data = prepare_chat(options, chat, tokenizer, chat_template.get());
//
// A JSONL line is one example, in one of TRL's dataset types:
//  - conversational language modelling: {"messages": [{"role": "system" | "user" | "assistant" | ...,
//    "content": "..."}, ...]};
//  - conversational prompt-completion: {"prompt": [messages], "completion": [messages]};
//  - standard prompt-completion: {"prompt": "text", "completion": "text"}.
// Encoding (TRL's tokenize_fn and build_labels):
//  - conversational: the template's text tokenized as transformers' apply_chat_template(tokenize=True)
//    does (the template writes any BOS; none is added);
//  - standard prompt-completion: the tokenizer's EOS text appended to the completion unless it ends
//    with it, then prompt + completion encoded with the checkpoint's framing (data.add_bos);
//  - the loss (data.loss_on = "assistant", TRL's completion_only_loss / assistant_only_loss):
//    prompt-completion: the tokens from where the tokenized prompt (with the generation prompt)
//    and the tokenized whole stop agreeing; messages: each assistant turn's tokens, from where the
//    conversation before it with the generation prompt stops agreeing with the whole, to the end of
//    the conversation rendered up to and including it (a template that does not render a
//    conversation's beginning as the beginning of its rendering is refused for messages);
//    data.loss_on = "all": every token.
//  - Cut to seq_len + 1 tokens keeping the start (TRL's max_length = seq_len + 1, truncation_mode
//    "keep_start"); an example left with no token in the loss is dropped, as TRL drops it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/data/chat_template.h"
#include "core/data/dataset.h"
#include "core/data/tokenizer.h"

namespace weft {

struct ChatRecord {
  enum class Kind { kMessages, kPromptCompletion, kTextPromptCompletion };
  Kind kind = Kind::kMessages;
  std::vector<ChatMessage> messages;            // kMessages: the conversation; kPromptCompletion: the prompt
  std::vector<ChatMessage> completion;          // kPromptCompletion
  std::string prompt_text, completion_text;     // kTextPromptCompletion
  std::string where;                            // "path:line", for errors
};

// Reads chat JSONL (the types above). A line of another shape, a message without a string role or
// content, an empty conversation or a conversation with no assistant message (messages) ->
// weft::Error "path:line: problem"; a file with no examples -> weft::Error naming it.
std::vector<ChatRecord> read_chat_jsonl(const std::string& path);

// One encoded example: its tokens, and for each whether it is a target the loss counts.
struct ChatEncoding {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> trained;
};

// Encodes one example (see above; not cut to a length). `chat_template` may be null for standard
// prompt-completion only; otherwise weft::Error. assistant_only: data.loss_on = "assistant".
ChatEncoding encode_chat(const ChatRecord& record, const Tokenizer& tokenizer, const ChatTemplate* chat_template,
                         bool assistant_only, bool add_bos);

struct ChatOptions {
  std::string loss_on = "assistant";  // data.loss_on: assistant | all
  bool packing = false;               // data.packing: several examples per row (see prepare_chat)
};

// TRL packs each batch of datasets.map (1000 examples) on its own.
constexpr size_t kPackingGroup = 1000;

struct ChatData {
  DatasetSplits splits;
  int64_t examples = 0;   // read
  int64_t truncated = 0;  // cut to seq_len + 1 tokens
  int64_t dropped = 0;    // left with no token in the loss, not used
  uint32_t pad = 0;       // the padding token (the tokenizer's EOS, else 0)
};

// Reads every file of options.paths (JSONL), holds out options.heldout_fraction of the examples
// (seeded by options.split_seed; options.max_documents keeps the first N), encodes and packs each
// split one example per row (PackedSequences::chat), or with chat.packing several per row as TRL's
// packing = True makes them (best_fit_decreasing into rows of seq_len + 1 tokens, within each run of
// kPackingGroup examples; the examples are cut and dropped as without packing first, where TRL
// packs examples without a trained token too, which add no loss). Throws weft::Error for what read_chat_jsonl
// and encode_chat refuse, an unknown loss_on, and a split left without examples.
ChatData prepare_chat(const DatasetOptions& options, const ChatOptions& chat, const Tokenizer& tokenizer,
                      const ChatTemplate* chat_template);

}  // namespace weft
