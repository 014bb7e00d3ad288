#include "core/data/labeled.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <nlohmann/json.hpp>

#include "core/data/documents.h"
#include "core/util/error.h"

namespace weft {

namespace {

// Where a task's fields are in its train/dev files (0-based columns), after
// transformers/data/processors/glue.py (the *Processor._create_examples for train and dev).
struct GlueLayout {
  bool header;               // the first line names the columns (every task but CoLA)
  int min_columns;           // fewer -> malformed line (error; skipped for qqp)
  int text_column;
  int pair_column;           // -1: single sentence
  int label_column;          // -1: the last column
  const char* label_header;  // the header's name for the label column (absent in test files)
};

template <typename Strings>
std::string join_strings(const Strings& items, std::string_view separator) {
  std::string joined;
  bool first = true;
  for (const auto& item : items) {
    if (!first) joined += separator;
    joined += item;
    first = false;
  }
  return joined;
}

struct GlueEntry {
  GlueTask task;
  GlueLayout layout;
};

const std::vector<GlueEntry>& glue_entries() {
  static const std::vector<GlueEntry> entries = {
      {{"cola", {"0", "1"}, false, false, {"dev.tsv"}}, {false, 4, 3, -1, 1, nullptr}},
      {{"sst2", {"0", "1"}, false, false, {"dev.tsv"}}, {true, 2, 0, -1, 1, "label"}},
      {{"mrpc", {"0", "1"}, false, true, {"dev.tsv"}}, {true, 5, 3, 4, 0, "Quality"}},
      {{"qqp", {"0", "1"}, false, true, {"dev.tsv"}}, {true, 6, 3, 4, 5, "is_duplicate"}},
      {{"stsb", {}, true, true, {"dev.tsv"}}, {true, 10, 7, 8, -1, "score"}},
      {{"mnli",
        {"contradiction", "entailment", "neutral"},
        false,
        true,
        {"dev_matched.tsv", "dev_mismatched.tsv"}},
       {true, 11, 8, 9, -1, "gold_label"}},
      {{"qnli", {"entailment", "not_entailment"}, false, true, {"dev.tsv"}},
       {true, 4, 1, 2, -1, "label"}},
      {{"rte", {"entailment", "not_entailment"}, false, true, {"dev.tsv"}},
       {true, 4, 1, 2, -1, "label"}},
      {{"wnli", {"0", "1"}, false, true, {"dev.tsv"}}, {true, 4, 1, 2, -1, "label"}},
  };
  return entries;
}

const GlueEntry& glue_entry(const std::string& name) {
  for (const auto& entry : glue_entries()) {
    if (entry.task.name == name) return entry;
  }
  fail("'{}' is not a GLUE task (use one of {})", name, join_strings(glue_task_names(), ", "));
}

// "a, b, c", or the first 20 and "... (N in all)" for long lists.
std::string name_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 20;
  std::string list;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    if (i > 0) list += ", ";
    list += "'" + names[i] + "'";
  }
  if (names.size() > kShown) list += fmt::format(", ... ({} in all)", names.size());
  return list.empty() ? "none" : list;
}

constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";

std::string_view without_bom(std::string_view text) {
  return text.substr(0, kUtf8Bom.size()) == kUtf8Bom ? text.substr(kUtf8Bom.size()) : text;
}

// Calls on_line(line_number, line) for each line, without its "\n" / "\r\n" terminator.
template <typename OnLine>
void for_each_numbered_line(std::string_view text, OnLine on_line) {
  size_t start = 0;
  int64_t line_number = 0;
  while (start < text.size()) {
    const size_t newline = text.find('\n', start);
    const size_t next = newline == std::string_view::npos ? text.size() : newline + 1;
    size_t end = newline == std::string_view::npos ? text.size() : newline;
    if (end > start && text[end - 1] == '\r') --end;
    on_line(++line_number, text.substr(start, end - start));
    start = next;
  }
}

std::vector<std::string_view> split_tabs(std::string_view line) {
  std::vector<std::string_view> fields;
  size_t start = 0;
  while (true) {
    const size_t tab = line.find('\t', start);
    if (tab == std::string_view::npos) {
      fields.push_back(line.substr(start));
      return fields;
    }
    fields.push_back(line.substr(start, tab - start));
    start = tab + 1;
  }
}


// A finite decimal number with an optional sign and exponent; nullopt otherwise.
std::optional<double> parse_finite(std::string_view text) {
  std::string_view digits = text;
  if (!digits.empty() && digits.front() == '+') {
    digits.remove_prefix(1);
    if (!digits.empty() && digits.front() == '-') return std::nullopt;
  }
  if (digits.empty()) return std::nullopt;
  double value = 0;
  const auto [end, ec] =
      std::from_chars(digits.data(), digits.data() + digits.size(), value, std::chars_format::general);
  if (ec != std::errc() || end != digits.data() + digits.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

// A non-negative integer written plainly ("0", "17"; not "+1", "01", "1.0"), at most 99999.
constexpr int64_t kMaxIntegerLabel = 99999;
bool is_plain_integer(std::string_view text) {
  if (text.empty() || (text.size() > 1 && text.front() == '0')) return false;
  return std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c); });
}

// Map from name to index; refuses duplicates and empty names.
std::unordered_map<std::string, int64_t> index_names(const std::vector<std::string>& names,
                                                     const char* what) {
  std::unordered_map<std::string, int64_t> index;
  for (size_t i = 0; i < names.size(); ++i) {
    WEFT_CHECK(!names[i].empty(), "{} has an empty class name (position {})", what, i);
    WEFT_CHECK(index.emplace(names[i], static_cast<int64_t>(i)).second,
               "{} names the class '{}' twice ({})", what, names[i], name_list(names));
  }
  return index;
}


}  // namespace

const GlueTask& glue_task(const std::string& name) {
  std::string key;
  for (const unsigned char c : name) {
    if (c != '-' && c != '_') key.push_back(static_cast<char>(std::tolower(c)));
  }
  for (const auto& entry : glue_entries()) {
    if (entry.task.name == key) return entry.task;
  }
  fail("unknown GLUE task '{}' (use one of {})", name, join_strings(glue_task_names(), ", "));
}

std::vector<std::string> glue_task_names() {
  std::vector<std::string> names;
  for (const auto& entry : glue_entries()) names.push_back(entry.task.name);
  return names;
}

std::vector<LabeledExample> read_glue_tsv(const std::string& path, const GlueTask& task,
                                          int64_t* skipped) {
  const GlueLayout& layout = glue_entry(task.name).layout;
  const std::string bytes = read_file_bytes(path);
  const std::string_view content = without_bom(bytes);
  const bool skip_malformed = task.name == "qqp";
  int64_t skipped_lines = 0;
  bool first_line = true;
  std::vector<LabeledExample> examples;

  for_each_numbered_line(content, [&](int64_t line_number, std::string_view line) {
    if (line.empty()) return;
    const auto fields = split_tabs(line);
    const bool is_first = first_line;
    first_line = false;
    if (is_first && layout.header) {
      const size_t label_at = layout.label_column < 0 ? fields.size() - 1 : layout.label_column;
      WEFT_CHECK(label_at < fields.size() && fields[label_at] == layout.label_header,
                 "{}:{}: the header '{}' (tab-separated) has no '{}' column where GLUE {} keeps its label: this "
                 "looks like a GLUE test file, and test files carry no labels (read train.tsv "
                 "or {})",
                 path, line_number, join_strings(fields, " "), layout.label_header, task.name,
                 join_strings(task.eval_files, " or "));
      return;
    }
    if (is_first && !layout.header) {  // CoLA's test.tsv is the only CoLA file with a header
      WEFT_CHECK(!(fields.size() == 2 && fields[0] == "index" && fields[1] == "sentence"),
                 "{}:{}: the header 'index<TAB>sentence' marks GLUE's CoLA test file, and test "
                 "files carry no labels (read train.tsv or dev.tsv)",
                 path, line_number);
    }
    if (fields.size() < static_cast<size_t>(layout.min_columns)) {
      if (skip_malformed) {
        ++skipped_lines;
        return;
      }
      fail("{}:{}: expected at least {} tab-separated columns for GLUE {}, got {}", path,
           line_number, layout.min_columns, task.name, fields.size());
    }
    LabeledExample example;
    example.text = std::string(fields[layout.text_column]);
    if (layout.pair_column >= 0) {
      example.text_pair = std::string(fields[layout.pair_column]);
      example.has_pair = true;
    }
    example.label = std::string(
        layout.label_column < 0 ? fields.back() : fields[layout.label_column]);
    if (task.regression) {
      WEFT_CHECK(parse_finite(example.label).has_value(),
                 "{}:{}: the GLUE {} score '{}' is not a finite number", path, line_number,
                 task.name, example.label);
    } else {
      WEFT_CHECK(std::find(task.labels.begin(), task.labels.end(), example.label) !=
                     task.labels.end(),
                 "{}:{}: '{}' is not a GLUE {} label (valid: {})", path, line_number,
                 example.label, task.name, name_list(task.labels));
    }
    examples.push_back(std::move(example));
  });

  if (skipped != nullptr) *skipped = skipped_lines;
  WEFT_CHECK(!examples.empty(), "GLUE {} file '{}' has no examples{}", task.name, path,
             skipped_lines > 0 ? fmt::format(" ({} malformed lines skipped)", skipped_lines)
                               : std::string());
  return examples;
}

std::vector<LabeledExample> read_labeled_jsonl(const std::string& path,
                                               const std::string& text_field,
                                               const std::string& pair_field,
                                               const std::string& label_field) {
  const std::string bytes = read_file_bytes(path);
  const std::string_view content = without_bom(bytes);
  std::vector<LabeledExample> examples;

  for_each_jsonl_object(content, path, [&](int64_t line_number, const nlohmann::json& value) {
    LabeledExample example;
    example.text = jsonl_string_field(value, text_field, path, line_number);

    const auto pair = value.find(pair_field);
    if (pair != value.end() && !pair->is_null()) {
      WEFT_CHECK(pair->is_string(), "{}:{}: field '{}' is {}, expected a string (or null)", path,
                 line_number, pair_field, pair->type_name());
      example.text_pair = pair->get<std::string>();
      example.has_pair = true;
    }

    const auto label = value.find(label_field);
    WEFT_CHECK(label != value.end(), "{}:{}: object has no field '{}'", path, line_number,
               label_field);
    if (label->is_string()) {
      example.label = label->get<std::string>();
      WEFT_CHECK(!example.label.empty(), "{}:{}: field '{}' is an empty string", path,
                 line_number, label_field);
    } else if (label->is_number()) {  // integers as written, floats as JSON writes them back
      example.label = label->dump();
    } else {
      fail("{}:{}: field '{}' is {}, expected a string, an integer or a number", path,
           line_number, label_field, label->type_name());
    }
    examples.push_back(std::move(example));
  });

  WEFT_CHECK(!examples.empty(), "labeled JSONL file '{}' has no examples", path);
  return examples;
}

std::vector<std::string> label_names(const std::vector<LabeledExample>& examples,
                                     const std::vector<std::string>& declared) {
  if (!declared.empty()) {
    const auto index = index_names(declared, "the declared label list");
    for (size_t i = 0; i < examples.size(); ++i) {
      WEFT_CHECK(index.count(examples[i].label) > 0,
                 "example {} has the label '{}', which is not one of the declared labels ({})", i,
                 examples[i].label, name_list(declared));
    }
    return declared;
  }
  if (examples.empty()) return {};

  const bool all_integers = std::all_of(examples.begin(), examples.end(), [](const auto& e) {
    return is_plain_integer(e.label);
  });
  if (all_integers) {
    int64_t max_label = 0;
    for (size_t i = 0; i < examples.size(); ++i) {
      const std::string& label = examples[i].label;
      WEFT_CHECK(label.size() <= 5,
                 "example {} has the integer label {}, more than {} classes: declare the class "
                 "names instead",
                 i, label, kMaxIntegerLabel + 1);
      max_label = std::max<int64_t>(max_label, std::stoll(label));
    }
    std::vector<std::string> names;
    for (int64_t id = 0; id <= max_label; ++id) names.push_back(std::to_string(id));
    return names;
  }

  std::vector<std::string> names;
  names.reserve(examples.size());
  for (const auto& example : examples) names.push_back(example.label);
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

std::vector<int64_t> label_ids(const std::vector<LabeledExample>& examples,
                               const std::vector<std::string>& names) {
  const auto index = index_names(names, "the class name list");
  std::vector<int64_t> ids;
  ids.reserve(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    const auto it = index.find(examples[i].label);
    WEFT_CHECK(it != index.end(), "example {} has the label '{}', which is not a class ({})", i,
               examples[i].label, name_list(names));
    ids.push_back(it->second);
  }
  return ids;
}

std::vector<double> label_values(const std::vector<LabeledExample>& examples) {
  std::vector<double> values;
  values.reserve(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    const auto value = parse_finite(examples[i].label);
    WEFT_CHECK(value.has_value(), "example {} has the label '{}', which is not a finite number", i,
               examples[i].label);
    values.push_back(*value);
  }
  return values;
}

}  // namespace weft
