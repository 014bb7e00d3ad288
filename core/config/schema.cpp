#include "core/config/schema.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include <fmt/format.h>

namespace weft {
namespace {

using Bound = std::optional<double>;
constexpr std::nullopt_t none = std::nullopt;

SchemaEntry int_key(std::string key, int64_t def, std::string doc, Bound min = none,
                    Bound max = none) {
  return {std::move(key), ValueType::Int, def, std::move(doc), {}, min, max};
}
SchemaEntry float_key(std::string key, double def, std::string doc, Bound min = none,
                      Bound max = none) {
  return {std::move(key), ValueType::Float, def, std::move(doc), {}, min, max};
}
// A bound that the value may not equal: exclusive(float_key(...), /*min=*/true, /*max=*/false).
SchemaEntry exclusive(SchemaEntry entry, bool min, bool max) {
  entry.min_exclusive = min;
  entry.max_exclusive = max;
  return entry;
}
SchemaEntry bool_key(std::string key, bool def, std::string doc) {
  return {std::move(key), ValueType::Bool, def, std::move(doc), {}, none, none};
}
SchemaEntry string_key(std::string key, std::string def, std::string doc,
                       std::vector<std::string> choices = {}) {
  return {std::move(key), ValueType::String, std::move(def), std::move(doc), std::move(choices),
          none, none};
}
SchemaEntry list_key(std::string key, std::vector<std::string> def, std::string doc) {
  return {std::move(key), ValueType::StringList, std::move(def), std::move(doc), {}, none, none};
}

}  // namespace

const std::vector<SchemaSection>& config_sections() {
  static const std::vector<SchemaSection> sections = {
      {"model", "Model architecture and initial weights.", false},
      {"data", "Training data, tokenizer and held-out split.", false},
      {"train", "Optimisation: mode, batch, learning-rate schedule, AdamW, precision.", false},
      {"lora", "LoRA adapters (used when train.mode = \"lora\").", false},
      {"eval", "Held-out evaluation and early stopping.", false},
      {"checkpoint", "Checkpoint saving and resuming.", false},
      {"generate", "Text generation (trainer generate --prompt ...).", false},
      {"log", "Console logging and the metrics file.", false},
      {"plugin", "Free-form settings for a strategy plugin (any keys, not validated here).", true},
  };
  return sections;
}

const std::vector<SchemaEntry>& config_schema() {
  static const std::vector<SchemaEntry> schema = {
      // [model]
      string_key("model.preset", "tiny",
                 "Named model shape (\"\" = none, model.config required); ignored when model.config "
                 "is set.",
                 {"tiny", "small", "llama-3.2-1b", "llama-3.2-3b", ""}),
      string_key("model.config", "", "Path to an HF config.json describing the model shape."),
      string_key("model.weights", "",
                 "Safetensors file, directory or index to load; empty = seeded random init."),
      string_key("model.adapter", "",
                 "A LoRA adapter directory (PEFT: adapter_config.json, adapter_model.safetensors) applied on top "
                 "of model.weights; train it further with train.mode = \"lora\". Empty = none."),
      float_key("model.init_std", 0.02, "Standard deviation of the random weight init.", 0),
      int_key("model.vocab_size", 0,
              "Vocabulary size override; 0 = the preset's or config's value (must cover the tokenizer).",
              0),
      string_key("model.attention", "auto",
                 "Causal attention kernel: sdpa = at::scaled_dot_product_attention (LibTorch 2.x), weft = weft's "
                 "own; auto = sdpa where LibTorch has it, weft on 1.13.",
                 {"auto", "sdpa", "weft"}),
      bool_key("model.activation_checkpointing", false,
               "Recompute each decoder block in backward instead of storing its activations."),
      // [data]
      list_key("data.path", {"data/austen/austen.jsonl"},
               "Training files or directories: text .txt, JSONL .jsonl, or tokens .u16/.u32/.bin."),
      string_key("data.format", "auto", "Input format; auto = by file extension.",
                 {"auto", "text", "jsonl", "tokens-u16", "tokens-u32"}),
      string_key("data.text_field", "text", "Field of each JSONL record that holds the text."),
      string_key("data.text_document", "paragraph", "How plain text is cut into documents.",
                 {"file", "paragraph", "line"}),
      string_key("data.tokenizer", "byte",
                 "\"byte\" for the built-in byte tokenizer, or a tokenizer.json (or its directory)."),
      int_key("data.seq_len", 256, "Tokens per training sequence.", 2),
      float_key("data.heldout_fraction", 0.1, "Fraction of documents held out for evaluation.", 0,
                0.9),
      int_key("data.split_seed", 1234, "Seed of the train/held-out document split."),
      int_key("data.max_documents", 0, "Use at most this many documents; 0 = all.", 0),
      string_key("data.cache_dir", ".cache/weft", "Directory for cached tokenized data."),
      bool_key("data.add_bos", true, "Prepend the BOS token to each document."),
      bool_key("data.add_eos", true, "Append the EOS token to each document."),
      // [train]
      string_key("train.mode", "full", "Train all weights (full) or LoRA adapters only (lora).",
                 {"full", "lora"}),
      int_key("train.seed", 1234, "Seed for initialisation, shuffling and dropout."),
      int_key("train.epochs", 1, "Passes over the training set.", 1),
      int_key("train.max_steps", 0, "Stop after this many optimizer steps; 0 = no limit.", 0),
      int_key("train.batch_size", 8,
              "Global micro-batch: sequences per forward/backward, summed over data-parallel ranks.",
              1),
      int_key("train.grad_accum_steps", 1, "Micro-batches accumulated per optimizer step.", 1),
      float_key("train.lr", 3e-4, "Peak learning rate.", 0),
      float_key("train.min_lr_ratio", 0.1, "Final learning rate as a fraction of train.lr.", 0, 1),
      int_key("train.warmup_steps", 100, "Linear warm-up steps from 0 to train.lr.", 0),
      string_key("train.schedule", "cosine", "Learning-rate decay after warm-up.",
                 {"cosine", "linear", "constant"}),
      float_key("train.weight_decay", 0.1, "AdamW decoupled weight decay.", 0),
      exclusive(float_key("train.beta1", 0.9, "AdamW first-moment decay.", 0, 1), false, true),
      exclusive(float_key("train.beta2", 0.95, "AdamW second-moment decay.", 0, 1), false, true),
      exclusive(float_key("train.eps", 1e-8, "AdamW denominator epsilon.", 0), true, false),
      float_key("train.grad_clip", 1.0, "Clip the global gradient norm to this; 0 = off.", 0),
      string_key("train.precision", "fp32", "Compute precision.", {"fp32", "bf16"}),
      int_key("train.threads", 1, "Intra-op threads per process.", 1),
      string_key("train.out_dir", "runs/default",
                 "Run directory for checkpoints, metrics and the effective config."),
      string_key("train.plugin", "",
                 "Strategy plugin: a path or a name found in the build's plugins/ or WEFT_PLUGIN_PATH (e.g. single); empty = the host's built-in one-process step."),
      float_key("train.collective_timeout_s", 300.0,
                "Seconds a collective or the start-up rendezvous may take before the run stops with an error naming it.",
                1.0),
      bool_key("train.overwrite", false,
               "Start fresh even if out_dir already holds checkpoints or saved models (they are replaced)."),
      // [lora]
      int_key("lora.r", 8, "Rank of the LoRA update matrices.", 1),
      exclusive(float_key("lora.alpha", 16, "LoRA scaling numerator (the update is scaled by alpha / r).", 0),
                true, false),
      exclusive(float_key("lora.dropout", 0.05, "Dropout on the LoRA input.", 0, 1), false, true),
      list_key("lora.target_modules", {"q_proj", "k_proj", "v_proj", "o_proj"},
               "Linear layers that get LoRA adapters (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head)."),
      bool_key("lora.save_merged", false,
               "At the end, also save the base model with the adapters merged in (<out_dir>/final-merged)."),
      // [eval]
      int_key("eval.every_steps", 0, "Evaluate every N optimizer steps; 0 = only at each epoch end.",
              0),
      int_key("eval.max_batches", 0, "Batches per evaluation; 0 = the whole held-out set.", 0),
      int_key("eval.batch_size", 0, "Sequences per evaluation batch; 0 = train.batch_size.", 0),
      int_key("eval.patience", 0,
              "Evaluations without improvement before early stopping; 0 = off.", 0),
      // [checkpoint]
      int_key("checkpoint.every_steps", 0, "Save a checkpoint every N optimizer steps; 0 = off.", 0),
      int_key("checkpoint.keep_last", 2, "Periodic checkpoints to keep (older ones are deleted).",
              1),
      string_key("checkpoint.resume", "",
                 "\"\" = start fresh, \"auto\" = latest in train.out_dir if any, or a checkpoint "
                 "directory."),
      bool_key("checkpoint.save_final", true, "Save a checkpoint when training ends."),
      bool_key("checkpoint.keep_best", true,
               "Keep the checkpoint with the best held-out loss as well."),
      // [generate]
      int_key("generate.max_new_tokens", 64, "Tokens to generate after the prompt (trainer generate).", 1),
      float_key("generate.temperature", 0.0, "Sampling temperature; 0 = greedy (the most likely token).", 0.0),
      exclusive(float_key("generate.top_p", 1.0, "Nucleus sampling: sample among the most likely tokens whose "
                          "probabilities sum to top_p (with temperature > 0).", 0.0, 1.0),
                true, false),
      int_key("generate.seed", 0, "Seed of the sampler (every rank draws the same tokens).", 0),
      // [log]
      string_key("log.level", "info", "Console log level.",
                 {"trace", "debug", "info", "warn", "error"}),
      string_key("log.progress", "auto",
                 "Progress display; auto = a bar on a terminal, lines otherwise.",
                 {"auto", "bar", "lines", "off"}),
      int_key("log.every_steps", 10, "Log training metrics every N optimizer steps.", 1),
      string_key("log.metrics_file", "", "JSONL metrics file; empty = <out_dir>/metrics.jsonl."),
      string_key("log.trace", "",
                 "Chrome/Perfetto trace file (open in ui.perfetto.dev or chrome://tracing); ranks of "
                 "a multi-process run write FILE.rank<r>.json; empty = off. Also --trace FILE."),
  };
  return schema;
}

std::string SchemaEntry::section() const { return key.substr(0, key.find('.')); }
std::string SchemaEntry::name() const { return key.substr(key.find('.') + 1); }

const SchemaSection* find_config_section(const std::string& name) {
  for (const auto& section : config_sections())
    if (section.name == name) return &section;
  return nullptr;
}

const SchemaEntry* find_config_key(const std::string& key) {
  for (const auto& entry : config_schema())
    if (entry.key == key) return &entry;
  return nullptr;
}

std::string describe_type(ValueType type) {
  switch (type) {
    case ValueType::Int: return "an integer";
    case ValueType::Float: return "a float";
    case ValueType::Bool: return "a boolean";
    case ValueType::String: return "a string";
    case ValueType::StringList: return "a list of strings";
  }
  return "?";
}

std::string type_name(ValueType type) {
  switch (type) {
    case ValueType::Int: return "int";
    case ValueType::Float: return "float";
    case ValueType::Bool: return "bool";
    case ValueType::String: return "string";
    case ValueType::StringList: return "string list";
  }
  return "?";
}

namespace {

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f)
          out += fmt::format("\\u{:04X}", c);
        else
          out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Shortest decimal that reads back as the same double, always with a '.' or exponent.
std::string float_to_toml(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? separator : "") + items[i];
  return out;
}

std::string bound_to_string(double v) {
  return v == std::floor(v) && std::abs(v) < 1e15 ? fmt::format("{}", static_cast<int64_t>(v))
                                                  : fmt::format("{}", v);
}

}  // namespace

std::string describe_range(const SchemaEntry& entry) {
  const std::string low = entry.min ? fmt::format("{} {}", entry.min_exclusive ? ">" : ">=", bound_to_string(*entry.min)) : "";
  const std::string high = entry.max ? fmt::format("{} {}", entry.max_exclusive ? "<" : "<=", bound_to_string(*entry.max)) : "";
  if (entry.min && entry.max && !entry.min_exclusive && !entry.max_exclusive) {
    return fmt::format("between {} and {}", bound_to_string(*entry.min), bound_to_string(*entry.max));
  }
  if (!low.empty() && !high.empty()) return low + " and " + high;
  return low + high;
}

namespace {

// "one of: "a", "b"; min 0; max 1 (excluded)" - the constraints of an entry, empty when it has none.
std::string constraints(const SchemaEntry& entry) {
  std::vector<std::string> parts;
  if (!entry.choices.empty()) {
    std::vector<std::string> quoted;
    for (const auto& choice : entry.choices) quoted.push_back(quote(choice));
    parts.push_back("one of " + join(quoted, ", "));
  }
  if (entry.min) parts.push_back("min " + bound_to_string(*entry.min) + (entry.min_exclusive ? " (excluded)" : ""));
  if (entry.max) parts.push_back("max " + bound_to_string(*entry.max) + (entry.max_exclusive ? " (excluded)" : ""));
  return join(parts, "; ");
}

// Escapes what would break a table cell or be read as HTML.
std::string markdown_cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += "\\|";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string value_to_toml(const ConfigValue& value) {
  struct Visitor {
    std::string operator()(int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const { return float_to_toml(v); }
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(const std::string& v) const { return quote(v); }
    std::string operator()(const std::vector<std::string>& v) const {
      std::vector<std::string> quoted;
      for (const auto& s : v) quoted.push_back(quote(s));
      return "[" + join(quoted, ", ") + "]";
    }
  };
  return std::visit(Visitor{}, value);
}

std::string render_help() {
  std::ostringstream out;
  out << "Configuration keys (set in the TOML file or with --set section.key=value):\n";
  for (const auto& section : config_sections()) {
    out << "\n[" << section.name << "]  " << section.doc << "\n";
    for (const auto& entry : config_schema()) {
      if (entry.section() != section.name) continue;
      out << "  " << entry.key << " (" << type_name(entry.type)
          << ", default " << value_to_toml(entry.default_value);
      const std::string limits = constraints(entry);
      if (!limits.empty()) out << "; " << limits;
      out << ")\n      " << entry.doc << "\n";
    }
  }
  return out.str();
}

std::string render_markdown_reference() {
  std::ostringstream out;
  for (const auto& section : config_sections()) {
    out << "### `[" << section.name << "]`\n\n" << section.doc << "\n\n";
    if (section.open) continue;
    out << "| Key | Type | Default | Description |\n|---|---|---|---|\n";
    for (const auto& entry : config_schema()) {
      if (entry.section() != section.name) continue;
      std::string description = entry.doc;
      const std::string limits = constraints(entry);
      if (!limits.empty()) description += " (" + limits + ")";
      out << "| `" << entry.name() << "` | " << type_name(entry.type) << " | `"
          << value_to_toml(entry.default_value) << "` | "
          << markdown_cell(description) << " |\n";
    }
    out << "\n";
  }
  return out.str();
}

}  // namespace weft
