// The dataset pipeline: documents -> tokens (cached) -> train/held-out split -> packed sequences.
//
//   DatasetSplits splits = prepare_dataset(options, tokenizer);
//   BatchLoader train(splits.train, global_batch, rank, world, seed, /*shuffle=*/true);
//
// Determinism: for the same inputs, options and tokenizer, every process on every platform gets
// the same corpus, the same split and the same sequences (the permutations are driven by
// std::mt19937_64, whose output the C++ standard fixes, through our own Fisher-Yates shuffle).
// Everything here is immutable once built and safe to share between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/data/corpus.h"
#include "core/data/tokenizer.h"

namespace weft {

struct DatasetOptions {
  std::vector<std::string> paths;       // files and/or directories (see resolve_inputs)
  std::string format = "auto";          // auto | text | jsonl | tokens-u16 | tokens-u32
  std::string text_field = "text";      // jsonl: the field holding the document text
  std::string text_document = "paragraph";  // text files: file | paragraph | line
  int64_t seq_len = 0;                  // tokens per training sequence (required, > 0)
  double heldout_fraction = 0.0;        // in [0, 1): share of documents held out for evaluation
  uint64_t split_seed = 0;              // seeds the document split
  int64_t max_documents = 0;            // keep only the first N documents (0 = all)
  std::string cache_dir;                // token cache directory; empty = no cache
  // Prepend the tokenizer's BOS id to each text document, append its EOS id; unset: what the
  // tokenizer's checkpoint does (Tokenizer::adds_bos, adds_eos).
  std::optional<bool> add_bos, add_eos;
  int64_t token_vocab_size = 0;         // token files: ids below the model's vocab_size (0: the tokenizer's)
  int tokenize_threads = 0;             // 0 = hardware concurrency (see CorpusOptions)
  std::string train_name = "train";     // what the first split is called in logs ("evaluated" for eval --data)
  // The first split shorter than seq_len + 1 tokens (at least 2) is one sequence of all of them
  // rather than an error (trainer eval --data on a short file), as transformers scores a text.
  bool fit_short_split = false;

  // Validates format/text_document names and converts, with the framing decided for `tokenizer`.
  // Throws weft::Error on unknown names.
  CorpusOptions corpus_options(const Tokenizer& tokenizer) const;
  bool bos_for(const Tokenizer& tokenizer) const { return add_bos.value_or(tokenizer.adds_bos()); }
  bool eos_for(const Tokenizer& tokenizer) const { return add_eos.value_or(tokenizer.adds_eos()); }
};

// Returns a permutation of 0..n-1 fully determined by `seed`: Fisher-Yates driven by
// std::mt19937_64(seed), drawing bounded integers by rejection sampling (identical everywhere).
std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed);

// Document indices of the two splits, each in increasing (original) order; disjoint, together
// covering 0..n_documents-1.
struct DocumentSplit {
  std::vector<int64_t> train;
  std::vector<int64_t> heldout;
};

// Holds out round(heldout_fraction * n_documents) documents (at least 1 when the fraction is
// > 0, at most n_documents - 1), the first ones of seeded_permutation(n_documents, seed).
// Throws weft::Error when heldout_fraction is outside [0, 1), or when it is > 0 and
// n_documents < 2 (nothing could be left for training).
DocumentSplit split_documents(int64_t n_documents, double heldout_fraction, uint64_t seed);

// One split's documents concatenated into a token stream and viewed as overlapping windows:
// sequence i is tokens [i*L, i*L + L + 1); its inputs are the first L of those tokens and its
// targets the last L (inputs shifted by one). n_sequences = (n_tokens - 1) / L; the tail that
// does not fill a window is unused.
class PackedSequences {
 public:
  // Throws weft::Error naming `name`, the token count and seq_len when seq_len <= 0 or the
  // stream has fewer than seq_len + 1 tokens.
  PackedSequences(std::string name, std::vector<uint32_t> tokens, int64_t seq_len,
                  int64_t n_documents);

  const std::string& name() const { return name_; }  // "train" or "held-out"
  int64_t seq_len() const { return seq_len_; }
  int64_t n_documents() const { return n_documents_; }
  int64_t n_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t n_sequences() const { return n_sequences_; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }

  // Labeled examples (sequence classification): sequence i is example i's tokens (1 to seq_len of
  // them), padded to seq_len with `pad`; its targets are kUnlabeledTarget everywhere but at the
  // example's last token, which holds targets[i] (a class id, or a regression score's double
  // bits). Throws weft::Error when the counts differ, an example is empty or longer than seq_len.
  static PackedSequences examples(std::string name, const std::vector<std::vector<uint32_t>>& examples,
                                  std::vector<int64_t> targets, int64_t seq_len, uint32_t pad);
  bool labeled() const { return kind_ == Kind::kLabeled; }
  // Labeled: example i's target; labeled and chat: its token count.
  int64_t target(int64_t i) const { return targets_.at(static_cast<size_t>(i)); }
  int64_t length(int64_t i) const;

  // Instruction examples (data.format = "chat"): sequence i is example i's tokens (2 to seq_len + 1
  // of them) as inputs [0, n - 1) and targets [1, n), padded to seq_len with `pad` (inputs) and
  // kUnlabeledTarget (targets); a target whose `trained` flag is 0 is kUnlabeledTarget too. Throws
  // weft::Error when the sizes differ, an example has fewer than 2 or more than seq_len + 1 tokens,
  // or none of its targets is trained.
  static PackedSequences chat(std::string name, const std::vector<std::vector<uint32_t>>& examples,
                              const std::vector<std::vector<uint8_t>>& trained, int64_t seq_len, uint32_t pad);
  // Packed instruction examples (data.packing, TRL's packing = True): sequence r holds the
  // examples bins[r] names, one after another, as one stream of at most seq_len + 1 tokens padded
  // to seq_len + 1 (inputs the first seq_len, targets the last seq_len). Each example's tokens
  // have positions 0, 1, ... of their own (positions()), and an example's last token has no
  // target, so no example predicts or sees another's tokens (the model keeps them apart by
  // position); padding has position 0 and no target. Throws weft::Error as chat() does, and when
  // a bin is empty, exceeds seq_len + 1 tokens, or the bins do not name every example once.
  static PackedSequences chat(std::string name, const std::vector<std::vector<uint32_t>>& examples,
                              const std::vector<std::vector<uint8_t>>& trained, int64_t seq_len, uint32_t pad,
                              const std::vector<std::vector<int64_t>>& bins);
  // Whether sequences hold several examples each (packed chat): batches then carry positions.
  bool segmented() const { return segmented_; }
  // Writes sequence i's seq_len positions: each input token's position within its example
  // (0, 1, ... from each example's first token; 0 for padding). Precondition: segmented().
  void copy_positions(int64_t i, int64_t* positions) const;
  // The examples of sequence i (chat): [first, last) in storage order.
  std::pair<int64_t, int64_t> examples_of(int64_t i) const;
  // Whether some target positions carry no token for the loss (chat): losses then weigh each
  // counted target alike over a whole step (transformers' num_items_in_batch).
  bool masked() const { return kind_ == Kind::kChat; }
  // The targets of sequence i the loss counts: seq_len (packed text), 1 (labeled), the trained
  // ones (chat).
  int64_t counted_targets(int64_t i) const;

  // Writes sequence i's L inputs and L targets. Precondition: 0 <= i < n_sequences().
  void copy_sequence(int64_t i, int64_t* inputs, int64_t* targets) const;

 private:
  PackedSequences() = default;
  enum class Kind { kPacked, kLabeled, kChat };
  // Checks what examples() and chat() share and starts their sequences (offsets [0]).
  static PackedSequences empty_examples(Kind kind, std::string name, size_t examples, size_t labels, const char* what,
                                        int64_t seq_len, uint32_t pad);
  Kind kind_ = Kind::kPacked;

  std::string name_;
  std::vector<uint32_t> tokens_;
  int64_t seq_len_ = 0;
  int64_t n_documents_ = 0;
  int64_t n_sequences_ = 0;
  // Labeled and chat examples: example i is tokens_[offsets_[i], offsets_[i + 1]).
  std::vector<int64_t> offsets_;
  std::vector<int64_t> targets_;  // labeled: each example's target; chat: its counted targets
  std::vector<uint8_t> trained_;  // chat: per token, whether it is a target the loss counts
  std::vector<int64_t> row_first_;    // chat: sequence i holds examples [row_first_[i], row_first_[i + 1])
  std::vector<int64_t> row_counted_;  // chat: sequence i's counted targets
  bool segmented_ = false;
  uint32_t pad_ = 0;
};

// Best-fit-decreasing bins of `lengths` (each in [1, capacity]) of at most `capacity` each, as
// TRL's pack_dataset(strategy = "bfd") makes them: items by decreasing length (ties in index
// order), each into the partly filled bin with the least room that fits it (the first such bin to
// have reached that room), else a new bin; bins in creation order, each listing its items'
// indices in insertion order. Throws weft::Error for a length outside [1, capacity].
std::vector<std::vector<int64_t>> best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity);

// The target of a position that carries no label in a classification batch (the model's
// kIgnoreTarget, and PyTorch's cross_entropy ignore_index default).
constexpr int64_t kUnlabeledTarget = -100;

// Concatenates `documents` of `corpus` (in the given order) and packs them; throws like the
// PackedSequences constructor.
PackedSequences pack_documents(const TokenizedCorpus& corpus, const std::vector<int64_t>& documents,
                               int64_t seq_len, const std::string& name);

// What prepare_dataset did, for logging.
struct DatasetSummary {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t train_documents = 0;
  int64_t train_tokens = 0;
  int64_t train_sequences = 0;
  std::string train_name = "train";  // DatasetOptions::train_name
  int64_t heldout_documents = 0;
  int64_t heldout_tokens = 0;
  int64_t heldout_sequences = 0;
  bool cache_hit = false;
  std::string cache_path;  // empty when caching is off
  double seconds = 0;      // wall time of prepare_dataset

  // One line, e.g. "dataset: 3 files, 120 documents, 51234 tokens (cache hit) | train: ...".
  std::string describe() const;
};

struct DatasetSplits {
  std::shared_ptr<const PackedSequences> train;
  std::shared_ptr<const PackedSequences> heldout;  // null when heldout_fraction == 0
  DatasetSummary summary;
};

// Runs the whole pipeline: load_corpus (cache or tokenize), split_documents, pack_documents
// for each split. Throws weft::Error for invalid options (seq_len <= 0, bad format or
// text_document names, fraction outside [0, 1)), for anything load_corpus rejects, and when a
// split is too small to hold one sequence.
DatasetSplits prepare_dataset(const DatasetOptions& options, const Tokenizer& tokenizer);

}  // namespace weft
