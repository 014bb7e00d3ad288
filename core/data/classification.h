// Sequence classification data (train.task = "classification"): labeled examples (labeled.h)
// tokenized into one padded sequence each (PackedSequences::examples), with the split and the
// class names the model's head is built for.
//
//   ClassificationData data = prepare_classification(options, task, tokenizer);
//   config.num_labels = data.regression ? 1 : data.labels.size();
//
// An example is encoded as Llama 3's tokenizer does a text or a pair (its template: BOS A, and
// BOS A BOS B), truncated longest-first to seq_len as transformers' truncation=True does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/data/dataset.h"
#include "core/data/labeled.h"
#include "core/data/tokenizer.h"

namespace weft {

struct ClassificationOptions {
  std::string glue_task;                  // data.glue_task: a GLUE task directory in data.path; "" = JSONL
  std::string pair_field = "text_pair";   // JSONL: the optional second text
  std::string label_field = "label";      // JSONL: the label (class name, integer id or score)
  std::vector<std::string> labels;        // data.labels: the classes in id order; empty = from the data
  bool regression = false;                // JSONL: labels are scores (mean squared error, Pearson/Spearman)
};

struct ClassificationData {
  DatasetSplits splits;  // train and held-out (GLUE: dev.tsv; MNLI: dev_matched.tsv)
  // Further held-out sets evaluated beside it, by name (MNLI: "mismatched", dev_mismatched.tsv).
  std::vector<std::pair<std::string, std::shared_ptr<const PackedSequences>>> extra_heldout;
  std::vector<std::string> labels;  // class names in id order; empty for regression
  bool regression = false;
  std::string glue_task;
  std::vector<int64_t> train_labels;  // class ids of the training examples (the majority baseline)
  int64_t truncated = 0;              // examples cut to seq_len
  uint32_t pad = 0;                   // the padding token (the tokenizer's EOS, else 0)
};

// Reads, labels and encodes the data. GLUE: data.path is the task's directory (train.tsv and its
// dev files). JSONL: the files of data.path, of which data.heldout_fraction of the examples
// (seeded by data.split_seed) are held out. Throws weft::Error naming the file and problem, for a
// class seen only in the held-out data, and for fewer than 2 classes.
ClassificationData prepare_classification(const DatasetOptions& options, const ClassificationOptions& task,
                                          const Tokenizer& tokenizer);

// One example's tokens (see above); `truncated` is set when it had to be cut.
std::vector<uint32_t> encode_example(const LabeledExample& example, const Tokenizer& tokenizer, int64_t seq_len,
                                     bool add_bos, bool* truncated = nullptr);

}  // namespace weft
