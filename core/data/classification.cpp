#include "core/data/classification.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/util/error.h"

namespace weft {
namespace {

int64_t score_bits(double score) {
  int64_t bits = 0;
  std::memcpy(&bits, &score, sizeof bits);
  return bits;
}

struct Encoded {
  std::vector<std::vector<uint32_t>> tokens;
  std::vector<int64_t> targets;
  std::vector<int64_t> classes;  // class ids (classification)
};

Encoded encode_all(const std::vector<LabeledExample>& examples, const ClassificationData& data,
                   const DatasetOptions& options, const Tokenizer& tokenizer, int64_t& truncated) {
  Encoded out;
  if (data.regression) {
    for (double v : label_values(examples)) out.targets.push_back(score_bits(v));
  } else {
    out.classes = label_ids(examples, data.labels);
    out.targets = out.classes;
  }
  out.tokens.reserve(examples.size());
  for (const auto& example : examples) {
    bool cut = false;
    out.tokens.push_back(encode_example(example, tokenizer, options.seq_len, options.bos_for(tokenizer), &cut));
    truncated += cut ? 1 : 0;
  }
  return out;
}

std::shared_ptr<const PackedSequences> pack(const std::string& name, Encoded encoded, const DatasetOptions& options,
                                            uint32_t pad) {
  return std::make_shared<const PackedSequences>(
      PackedSequences::examples(name, encoded.tokens, std::move(encoded.targets), options.seq_len, pad));
}

template <typename T>
std::vector<T> pick(const std::vector<T>& items, const std::vector<int64_t>& indices) {
  std::vector<T> out;
  out.reserve(indices.size());
  for (int64_t i : indices) out.push_back(items[static_cast<size_t>(i)]);
  return out;
}

}  // namespace

std::vector<uint32_t> encode_example(const LabeledExample& example, const Tokenizer& tokenizer, int64_t seq_len,
                                     bool add_bos, bool* truncated) {
  std::vector<int32_t> a = tokenizer.encode(example.text), b;
  if (example.has_pair) b = tokenizer.encode(example.text_pair);
  // Llama 3's template: <|begin_of_text|> A, and <|begin_of_text|> A <|begin_of_text|> B; without
  // a BOS the pair is joined by EOS where the tokenizer has one.
  const std::optional<int32_t> bos = add_bos ? tokenizer.bos_id() : std::nullopt;
  const std::optional<int32_t> separator = example.has_pair ? (bos ? bos : tokenizer.eos_id()) : std::nullopt;
  const auto specials = static_cast<int64_t>((bos ? 1 : 0) + (separator ? 1 : 0));
  WEFT_CHECK(seq_len > specials, "seq_len {} leaves no room for an example's text", seq_len);
  bool cut = false;
  // transformers' longest_first: one token at a time from the longer text (the pair's on a tie).
  while (static_cast<int64_t>(a.size() + b.size()) + specials > seq_len) {
    cut = true;
    if (a.size() > b.size()) a.pop_back();
    else b.pop_back();
  }
  if (truncated) *truncated = cut;
  std::vector<uint32_t> out;
  out.reserve(a.size() + b.size() + 2);
  if (bos) out.push_back(static_cast<uint32_t>(*bos));
  for (int32_t t : a) out.push_back(static_cast<uint32_t>(t));
  if (separator) out.push_back(static_cast<uint32_t>(*separator));
  for (int32_t t : b) out.push_back(static_cast<uint32_t>(t));
  if (out.empty()) out.push_back(tokenizer.eos_id() ? static_cast<uint32_t>(*tokenizer.eos_id()) : 0u);  // an empty text
  return out;
}

ClassificationData prepare_classification(const DatasetOptions& options, const ClassificationOptions& task,
                                          const Tokenizer& tokenizer) {
  const auto start = std::chrono::steady_clock::now();
  WEFT_CHECK(options.seq_len > 0, "seq_len must be positive, got {}", options.seq_len);
  WEFT_CHECK(!options.paths.empty(), "data.path names no file");
  ClassificationData data;
  data.glue_task = task.glue_task;
  data.pad = tokenizer.eos_id() ? static_cast<uint32_t>(*tokenizer.eos_id()) : 0u;
  std::vector<LabeledExample> train, heldout;
  std::vector<std::pair<std::string, std::vector<LabeledExample>>> extra;
  int64_t files = 0;
  if (!task.glue_task.empty()) {
    const GlueTask& glue = glue_task(task.glue_task);
    WEFT_CHECK(options.paths.size() == 1 && std::filesystem::is_directory(options.paths[0]),
               "data.glue_task = \"{}\": data.path must be the task's directory (with train.tsv and {}), got {}",
               glue.name, glue.eval_files.front(), options.paths.size() == 1 ? options.paths[0] : "several paths");
    const std::filesystem::path dir = options.paths[0];
    train = read_glue_tsv((dir / "train.tsv").string(), glue);
    heldout = read_glue_tsv((dir / glue.eval_files.front()).string(), glue);
    for (size_t i = 1; i < glue.eval_files.size(); ++i) {
      std::string name = glue.eval_files[i];  // dev_mismatched.tsv -> mismatched
      if (name.rfind("dev_", 0) == 0) name = name.substr(4);
      if (name.size() > 4 && name.substr(name.size() - 4) == ".tsv") name.resize(name.size() - 4);
      extra.emplace_back(name, read_glue_tsv((dir / glue.eval_files[i]).string(), glue));
    }
    files = 1 + static_cast<int64_t>(glue.eval_files.size());
    data.regression = glue.regression;
    data.labels = glue.labels;
  } else {
    std::vector<LabeledExample> all;
    for (const auto& path : options.paths) {
      auto part = read_labeled_jsonl(path, options.text_field, task.pair_field, task.label_field);
      all.insert(all.end(), std::make_move_iterator(part.begin()), std::make_move_iterator(part.end()));
      ++files;
    }
    if (options.max_documents > 0 && static_cast<int64_t>(all.size()) > options.max_documents) {
      // A seeded draw, in file order: labeled files are often sorted by class.
      auto order = seeded_permutation(static_cast<int64_t>(all.size()), options.split_seed ^ 0x5eedULL);
      order.resize(static_cast<size_t>(options.max_documents));
      std::sort(order.begin(), order.end());
      all = pick(all, order);
    }
    const DocumentSplit split =
        split_documents(static_cast<int64_t>(all.size()), options.heldout_fraction, options.split_seed);
    train = pick(all, split.train);
    heldout = pick(all, split.heldout);
    data.regression = task.regression;
    if (!data.regression) data.labels = label_names(all, task.labels);
  }
  WEFT_CHECK(data.regression || data.labels.size() >= 2, "classification needs at least 2 classes, the data has {}",
             data.labels.size());
  if (!data.regression && task.glue_task.empty() && task.labels.empty()) {
    // A class the training split never shows cannot be learnt: name it rather than train blind.
    std::vector<char> seen(data.labels.size(), 0);
    for (int64_t id : label_ids(train, data.labels)) seen[static_cast<size_t>(id)] = 1;
    for (size_t c = 0; c < seen.size(); ++c) {
      WEFT_CHECK(seen[c], "class '{}' appears only in the held-out examples (add data or change data.split_seed)",
                 data.labels[c]);
    }
  }
  Encoded encoded_train = encode_all(train, data, options, tokenizer, data.truncated);
  data.train_labels = encoded_train.classes;
  DatasetSummary& s = data.splits.summary;
  s.files = files;
  s.documents = static_cast<int64_t>(train.size() + heldout.size());
  s.train_documents = s.train_sequences = static_cast<int64_t>(train.size());
  for (const auto& t : encoded_train.tokens) s.train_tokens += static_cast<int64_t>(t.size());
  data.splits.train = pack("train", std::move(encoded_train), options, data.pad);
  if (!heldout.empty()) {
    Encoded encoded = encode_all(heldout, data, options, tokenizer, data.truncated);
    s.heldout_documents = s.heldout_sequences = static_cast<int64_t>(heldout.size());
    for (const auto& t : encoded.tokens) s.heldout_tokens += static_cast<int64_t>(t.size());
    data.splits.heldout = pack("held-out", std::move(encoded), options, data.pad);
  }
  for (auto& [name, examples] : extra) {
    data.extra_heldout.emplace_back(name, pack(name, encode_all(examples, data, options, tokenizer, data.truncated),
                                               options, data.pad));
  }
  s.tokens = s.train_tokens + s.heldout_tokens;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return data;
}

}  // namespace weft
