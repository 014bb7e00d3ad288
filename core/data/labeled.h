// Reading labeled text-classification data (one text or a text pair, and a label) before
// tokenization, in two formats:
//  - GLUE's own TSV files as distributed (CoLA, SST-2, MRPC, QQP, STS-B, MNLI, QNLI, RTE, WNLI),
//    read column for column as the GLUE processors of HF transformers read them
//    (transformers/data/processors/glue.py), labels numbered in those processors' order;
//  - JSONL, one object per line with a text, an optional pair and a label.
// Labels are kept as written; label_names / label_ids / label_values turn them into class ids or
// regression targets. Every problem with the input throws weft::Error naming the file and line
// (or the example index) and what is wrong.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace weft {

struct LabeledExample {
  std::string text;
  std::string text_pair;  // empty unless has_pair
  bool has_pair = false;
  std::string label;  // the label as written: a class name ("entailment"), an integer ("1"), or a score ("3.8")
};

// What a GLUE task looks like.
struct GlueTask {
  std::string name;                     // "cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"
  std::vector<std::string> labels;      // class names in id order as HF's GLUE processors number
                                        // them (their get_labels()); empty for regression
  bool regression = false;              // stsb: the label is a similarity score (0..5)
  bool has_pair = false;                // sentence pairs (all but cola and sst2)
  std::vector<std::string> eval_files;  // held-out files in the task directory: {"dev.tsv"};
                                        // mnli: {"dev_matched.tsv", "dev_mismatched.tsv"}
};

// The GLUE task called `name`. Case, '-' and '_' are ignored, so HF's spellings "sst-2" and
// "sts-b" (and "SST-2", "MNLI") name the same tasks as "sst2" and "stsb". An unknown name ->
// weft::Error listing the valid names. The returned reference stays valid for the program's life.
//   cola, sst2, mrpc, qqp, wnli: labels {"0", "1"}
//   mnli:                        labels {"contradiction", "entailment", "neutral"}
//   qnli, rte:                   labels {"entailment", "not_entailment"}
//   stsb:                        regression, no labels
const GlueTask& glue_task(const std::string& name);

// The canonical task names, in GLUE's order: cola sst2 mrpc qqp stsb mnli qnli rte wnli.
std::vector<std::string> glue_task_names();

// Reads one GLUE TSV file of `task`: train.tsv or one of task.eval_files. Lines are split on '\t'
// only (no quoting: quote characters are text), a trailing '\r' is dropped, a UTF-8 byte order
// mark at the start of the file is dropped, and empty lines are skipped. Columns (0-based), as
// HF's processors read them (all but CoLA have a header line, which is not an example):
//   cola  no header; label 1, sentence 3                         (at least 4 columns)
//   sst2  header "sentence label"; sentence 0, label 1            (at least 2)
//   mrpc  header "Quality ..."; label 0, sentences 3 and 4        (at least 5)
//   qqp   header "id qid1 qid2 question1 question2 is_duplicate"; questions 3 and 4, label 5
//         (at least 6; see `skipped`)
//   stsb  header "index genre ... sentence1 sentence2 score"; sentences 7 and 8, score = last
//         column (at least 10)
//   mnli  header "index promptID ... sentence1 sentence2 ... gold_label"; sentences 8 and 9,
//         label = last column (at least 11)
//   qnli  header "index question sentence label"; texts 1 and 2, label = last (at least 4)
//   rte, wnli  header "index sentence1 sentence2 label"; same columns as qnli
// Errors (weft::Error "path:line: problem"):
//  - a test file (GLUE's test files carry no labels): recognised by a header without the task's
//    label column (CoLA: a first line "index<TAB>sentence"), refused saying so;
//  - a line with fewer columns than the task needs, naming the count expected and found —
//    except for qqp, whose malformed lines HF's processor skips: they are skipped too, and
//    counted in *skipped when `skipped` is not null (0 for every other task);
//  - a label that is not one of task.labels (naming the valid labels), or, for stsb, a score
//    that is not a finite number;
//  - a file that cannot be read, or one with no examples (empty, or a header only).
std::vector<LabeledExample> read_glue_tsv(const std::string& path, const GlueTask& task,
                                          int64_t* skipped = nullptr);

// Reads JSONL: one JSON object per line with a string `text_field`, optionally a string
// `pair_field` (absent or null: no pair; then has_pair is false) and a `label_field` that is a
// non-empty string (kept as is), an integer ("3", "-1") or a number (as JSON writes it back,
// e.g. "3.8"); a bool, null, array or object label is refused. A UTF-8 byte order mark at the
// start of the file is dropped; blank lines are skipped. An invalid line, a missing or mistyped
// field -> weft::Error "path:line: problem"; a file that cannot be read or has no examples ->
// weft::Error naming the file.
std::vector<LabeledExample> read_labeled_jsonl(const std::string& path,
                                               const std::string& text_field = "text",
                                               const std::string& pair_field = "text_pair",
                                               const std::string& label_field = "label");

// Class names in id order for classification data that is not a GLUE task:
//  - `declared` when non-empty: every example's label must be one of them, else weft::Error
//    naming the first unknown label, its example index and the declared list (a declared list
//    with a name twice or an empty name is refused too);
//  - otherwise, when every label is a non-negative integer written plainly (digits, no sign, no
//    leading zero): "0", "1", ..., up to the largest label (labels above 99999 -> weft::Error
//    asking for declared names, rather than that many classes);
//  - otherwise the distinct labels sorted in byte order.
// No examples and nothing declared -> an empty list.
std::vector<std::string> label_names(const std::vector<LabeledExample>& examples,
                                     const std::vector<std::string>& declared = {});

// The id (index in `names`) of every example's label, in example order. A label not in `names`
// -> weft::Error naming the label, the example index and `names`; `names` with a name twice ->
// weft::Error.
std::vector<int64_t> label_ids(const std::vector<LabeledExample>& examples,
                               const std::vector<std::string>& names);

// Every example's label as a number (regression targets), in example order. A label is a
// decimal or exponent number with an optional sign ("3.8", "-1", "+2e-1", "5.000"); anything
// else, including inf and nan -> weft::Error naming the example index and the label.
std::vector<double> label_values(const std::vector<LabeledExample>& examples);

}  // namespace weft
