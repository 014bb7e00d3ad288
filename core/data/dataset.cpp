#include "core/data/dataset.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <random>
#include <spdlog/spdlog.h>

#include "core/util/error.h"

namespace weft {

namespace {

// Uniform integer in [0, bound) from raw 64-bit draws (rejects the biased low tail).
uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

int64_t heldout_count(int64_t n_documents, double fraction) {
  if (fraction == 0) return 0;
  const auto rounded = static_cast<int64_t>(std::llround(fraction * n_documents));
  return std::min(std::max<int64_t>(rounded, 1), n_documents - 1);
}

}  // namespace

CorpusOptions DatasetOptions::corpus_options(const Tokenizer& tokenizer) const {
  CorpusOptions corpus;
  corpus.paths = paths;
  corpus.format = parse_data_format(format);
  corpus.text_field = text_field;
  corpus.text_document = parse_text_document_mode(text_document);
  corpus.max_documents = max_documents;
  corpus.cache_dir = cache_dir;
  corpus.add_bos = bos_for(tokenizer);
  corpus.add_eos = eos_for(tokenizer);
  corpus.token_vocab_size = token_vocab_size;
  corpus.tokenize_threads = tokenize_threads;
  return corpus;
}

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(std::max<int64_t>(n, 0));
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::mt19937_64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(order[i], order[uniform_below(rng, static_cast<uint64_t>(i) + 1)]);
  }
  return order;
}

DocumentSplit split_documents(int64_t n_documents, double heldout_fraction, uint64_t seed) {
  WEFT_CHECK(heldout_fraction >= 0 && heldout_fraction < 1,
             "heldout_fraction must be in [0, 1), got {}", heldout_fraction);
  WEFT_CHECK(heldout_fraction == 0 || n_documents >= 2,
             "heldout_fraction {} needs at least 2 documents, the dataset has {} (use a finer "
             "text_document mode or heldout_fraction = 0)",
             heldout_fraction, n_documents);
  const int64_t n_heldout = heldout_count(n_documents, heldout_fraction);
  const auto order = seeded_permutation(n_documents, seed);
  std::vector<char> is_heldout(n_documents, 0);
  for (int64_t i = 0; i < n_heldout; ++i) is_heldout[order[i]] = 1;
  DocumentSplit split;
  for (int64_t d = 0; d < n_documents; ++d) {
    (is_heldout[d] ? split.heldout : split.train).push_back(d);
  }
  return split;
}

PackedSequences::PackedSequences(std::string name, std::vector<uint32_t> tokens, int64_t seq_len,
                                 int64_t n_documents)
    : name_(std::move(name)), tokens_(std::move(tokens)), seq_len_(seq_len),
      n_documents_(n_documents) {
  WEFT_CHECK(seq_len > 0, "seq_len must be positive, got {}", seq_len);
  WEFT_CHECK(n_tokens() >= seq_len + 1,
             "{} split has {} tokens ({} documents), fewer than seq_len + 1 = {}: add data, "
             "lower seq_len or change heldout_fraction",
             name_, n_tokens(), n_documents, seq_len + 1);
  n_sequences_ = (n_tokens() - 1) / seq_len;
}

PackedSequences PackedSequences::empty_examples(Kind kind, std::string name, size_t examples, size_t labels,
                                                const char* what, int64_t seq_len, uint32_t pad) {
  WEFT_CHECK(seq_len > 0, "seq_len must be positive, got {}", seq_len);
  WEFT_CHECK(examples == labels, "{} split: {} examples but {} {}", name, examples, labels, what);
  WEFT_CHECK(examples > 0, "{} split has no examples", name);
  PackedSequences s;
  s.kind_ = kind;
  s.name_ = std::move(name);
  s.seq_len_ = seq_len;
  s.pad_ = pad;
  s.offsets_.reserve(examples + 1);
  s.offsets_.push_back(0);
  return s;
}

PackedSequences PackedSequences::examples(std::string name, const std::vector<std::vector<uint32_t>>& examples,
                                          std::vector<int64_t> targets, int64_t seq_len, uint32_t pad) {
  PackedSequences s = empty_examples(Kind::kLabeled, std::move(name), examples.size(), targets.size(), "targets",
                                     seq_len, pad);
  for (size_t i = 0; i < examples.size(); ++i) {
    const auto n = static_cast<int64_t>(examples[i].size());
    WEFT_CHECK(n >= 1 && n <= seq_len, "{} split: example {} has {} tokens (1 to seq_len = {} allowed)", s.name_, i, n,
               seq_len);
    s.tokens_.insert(s.tokens_.end(), examples[i].begin(), examples[i].end());
    s.offsets_.push_back(static_cast<int64_t>(s.tokens_.size()));
  }
  s.targets_ = std::move(targets);
  s.n_documents_ = s.n_sequences_ = static_cast<int64_t>(examples.size());
  return s;
}

PackedSequences PackedSequences::chat(std::string name, const std::vector<std::vector<uint32_t>>& examples,
                                      const std::vector<std::vector<uint8_t>>& trained, int64_t seq_len, uint32_t pad) {
  std::vector<std::vector<int64_t>> rows(examples.size());
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = {static_cast<int64_t>(i)};
  PackedSequences s = chat(std::move(name), examples, trained, seq_len, pad, rows);
  s.segmented_ = false;
  return s;
}

PackedSequences PackedSequences::chat(std::string name, const std::vector<std::vector<uint32_t>>& examples,
                                      const std::vector<std::vector<uint8_t>>& trained, int64_t seq_len, uint32_t pad,
                                      const std::vector<std::vector<int64_t>>& bins) {
  PackedSequences s = empty_examples(Kind::kChat, std::move(name), examples.size(), trained.size(), "masks", seq_len, pad);
  std::vector<uint8_t> placed(examples.size(), 0);
  s.row_first_.push_back(0);
  for (size_t b = 0; b < bins.size(); ++b) {
    WEFT_CHECK(!bins[b].empty(), "{} split: packed sequence {} holds no example", s.name_, b);
    int64_t stream = 0, counted_row = 0;
    for (const int64_t i : bins[b]) {
      WEFT_CHECK(0 <= i && i < static_cast<int64_t>(examples.size()) && placed[static_cast<size_t>(i)] == 0,
                 "{} split: packed sequence {} names example {}, which is not one of the {} examples or is placed twice",
                 s.name_, b, i, examples.size());
      placed[static_cast<size_t>(i)] = 1;
      const auto& tokens = examples[static_cast<size_t>(i)];
      const auto& flags = trained[static_cast<size_t>(i)];
      const auto n = static_cast<int64_t>(tokens.size());
      WEFT_CHECK(n >= 2 && n <= seq_len + 1, "{} split: example {} has {} tokens (2 to seq_len + 1 = {} allowed)",
                 s.name_, i, n, seq_len + 1);
      WEFT_CHECK(flags.size() == tokens.size(), "{} split: example {} has {} tokens but {} mask flags", s.name_, i, n,
                 flags.size());
      int64_t counted = 0;
      for (int64_t t = 1; t < n; ++t) counted += flags[static_cast<size_t>(t)] != 0 ? 1 : 0;
      WEFT_CHECK(counted > 0, "{} split: example {} has no token in the loss", s.name_, i);
      s.tokens_.insert(s.tokens_.end(), tokens.begin(), tokens.end());
      s.trained_.insert(s.trained_.end(), flags.begin(), flags.end());
      s.offsets_.push_back(static_cast<int64_t>(s.tokens_.size()));
      s.targets_.push_back(counted);
      stream += n;
      counted_row += counted;
    }
    WEFT_CHECK(stream <= seq_len + 1, "{} split: packed sequence {} holds {} tokens, more than seq_len + 1 = {}",
               s.name_, b, stream, seq_len + 1);
    s.row_first_.push_back(static_cast<int64_t>(s.offsets_.size()) - 1);
    s.row_counted_.push_back(counted_row);
  }
  const auto missing = std::find(placed.begin(), placed.end(), 0);
  WEFT_CHECK(missing == placed.end(), "{} split: example {} is in no packed sequence", s.name_, missing - placed.begin());
  s.segmented_ = true;
  s.n_documents_ = static_cast<int64_t>(examples.size());
  s.n_sequences_ = static_cast<int64_t>(bins.size());
  return s;
}

std::pair<int64_t, int64_t> PackedSequences::examples_of(int64_t i) const {
  WEFT_CHECK(kind_ == Kind::kChat && 0 <= i && i < n_sequences_, "{} split: sequence {} holds no chat examples", name_, i);
  return {row_first_[static_cast<size_t>(i)], row_first_[static_cast<size_t>(i) + 1]};
}

void PackedSequences::copy_positions(int64_t i, int64_t* positions) const {
  WEFT_CHECK(segmented_, "{} split: sequences hold one example each (no positions)", name_);
  const auto [first, last] = examples_of(i);
  int64_t t = 0;
  for (int64_t e = first; e < last && t < seq_len_; ++e) {
    for (int64_t p = 0; p < length(e) && t < seq_len_; ++p) positions[t++] = p;
  }
  for (; t < seq_len_; ++t) positions[t] = 0;
}

std::vector<std::vector<int64_t>> best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity) {
  WEFT_CHECK(capacity > 0, "packing: the capacity must be positive, got {}", capacity);
  std::vector<int64_t> order(lengths.size());
  for (size_t i = 0; i < order.size(); ++i) {
    WEFT_CHECK(lengths[i] >= 1 && lengths[i] <= capacity, "packing: item {} has length {} (1 to {} allowed)", i,
               lengths[i], capacity);
    order[i] = static_cast<int64_t>(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lengths[static_cast<size_t>(a)] > lengths[static_cast<size_t>(b)];
  });
  std::vector<std::vector<int64_t>> bins;
  std::vector<int64_t> room;                           // each bin's free space
  std::map<int64_t, std::deque<size_t>> with_room;     // free space (> 0) -> bins, first filled to it first
  for (const int64_t item : order) {
    const int64_t length = lengths[static_cast<size_t>(item)];
    size_t bin;
    auto fit = with_room.lower_bound(length);
    if (fit != with_room.end() && fit->first < capacity) {
      bin = fit->second.front();
      fit->second.pop_front();
      if (fit->second.empty()) with_room.erase(fit);
    } else {
      bin = bins.size();
      bins.emplace_back();
      room.push_back(capacity);
    }
    bins[bin].push_back(item);
    room[bin] -= length;
    if (room[bin] > 0) with_room[room[bin]].push_back(bin);
  }
  return bins;
}

int64_t PackedSequences::length(int64_t i) const {
  WEFT_CHECK(kind_ != Kind::kPacked, "{} split: not examples", name_);
  return offsets_.at(static_cast<size_t>(i) + 1) - offsets_.at(static_cast<size_t>(i));
}

int64_t PackedSequences::counted_targets(int64_t i) const {
  switch (kind_) {
    case Kind::kLabeled: return 1;
    case Kind::kChat: return row_counted_.at(static_cast<size_t>(i));
    case Kind::kPacked: break;
  }
  return seq_len_;
}

void PackedSequences::copy_sequence(int64_t i, int64_t* inputs, int64_t* targets) const {
  if (labeled()) {
    const int64_t begin = offsets_[static_cast<size_t>(i)], n = length(i);
    for (int64_t t = 0; t < seq_len_; ++t) {
      inputs[t] = t < n ? tokens_[static_cast<size_t>(begin + t)] : pad_;
      targets[t] = kUnlabeledTarget;
    }
    targets[n - 1] = targets_[static_cast<size_t>(i)];
    return;
  }
  if (kind_ == Kind::kChat) {  // the row's examples as one stream, padded to seq_len + 1 tokens
    const auto [first, last] = examples_of(i);
    int64_t t = 0;
    for (int64_t e = first; e < last; ++e) {
      // One example per row: its last token is no input (it has no target), padding is.
      const int64_t begin = offsets_[static_cast<size_t>(e)], n = length(e), written = segmented_ ? n : n - 1;
      for (int64_t p = 0; p < written && t < seq_len_; ++p, ++t) {
        const auto at = static_cast<size_t>(begin + p);
        inputs[t] = tokens_[at];
        targets[t] = p + 1 < n && trained_[at + 1] != 0 ? static_cast<int64_t>(tokens_[at + 1]) : kUnlabeledTarget;
      }
    }
    for (; t < seq_len_; ++t) {
      inputs[t] = pad_;
      targets[t] = kUnlabeledTarget;
    }
    return;
  }
  const uint32_t* window = tokens_.data() + i * seq_len_;
  for (int64_t t = 0; t < seq_len_; ++t) {
    inputs[t] = window[t];
    targets[t] = window[t + 1];
  }
}

PackedSequences pack_documents(const TokenizedCorpus& corpus, const std::vector<int64_t>& documents,
                               int64_t seq_len, const std::string& name) {
  size_t total = 0;
  for (const int64_t d : documents) total += corpus.document_size(d);
  std::vector<uint32_t> tokens;
  tokens.reserve(total);
  for (const int64_t d : documents) {
    tokens.insert(tokens.end(), corpus.tokens.begin() + corpus.offsets[d],
                  corpus.tokens.begin() + corpus.offsets[d + 1]);
  }
  return PackedSequences(name, std::move(tokens), seq_len,
                         static_cast<int64_t>(documents.size()));
}

std::string DatasetSummary::describe() const {
  std::string line = fmt::format("dataset: {} files, {} documents, {} tokens ({}) in {:.2f}s",
                                 files, documents, tokens,
                                 cache_path.empty() ? "no cache"
                                 : cache_hit        ? "cache hit"
                                                    : "tokenized, cached",
                                 seconds);
  line += fmt::format(" | {}: {} documents, {} tokens, {} sequences", train_name, train_documents, train_tokens,
                      train_sequences);
  if (heldout_documents > 0) {
    line += fmt::format(" | held-out: {} documents, {} tokens, {} sequences", heldout_documents,
                        heldout_tokens, heldout_sequences);
  }
  return line;
}

DatasetSplits prepare_dataset(const DatasetOptions& options, const Tokenizer& tokenizer) {
  const auto start = std::chrono::steady_clock::now();
  WEFT_CHECK(options.seq_len > 0, "seq_len must be positive, got {}", options.seq_len);
  WEFT_CHECK(options.heldout_fraction >= 0 && options.heldout_fraction < 1,
             "heldout_fraction must be in [0, 1), got {}", options.heldout_fraction);
  const CorpusLoad load = load_corpus(options.corpus_options(tokenizer), tokenizer);
  const TokenizedCorpus& corpus = load.corpus;
  const DocumentSplit split =
      split_documents(corpus.n_documents(), options.heldout_fraction, options.split_seed);

  DatasetSplits result;
  int64_t train_seq_len = options.seq_len;
  if (options.fit_short_split) {
    int64_t tokens = 0;
    for (const int64_t d : split.train) tokens += static_cast<int64_t>(corpus.document_size(d));
    if (tokens >= 2 && tokens < options.seq_len + 1) {
      train_seq_len = tokens - 1;
      spdlog::info("dataset: the {} split has {} tokens, fewer than seq_len + 1 = {}: one sequence of {}",
                   options.train_name, tokens, options.seq_len + 1, train_seq_len);
    }
  }
  result.train = std::make_shared<const PackedSequences>(
      pack_documents(corpus, split.train, train_seq_len, options.train_name));
  if (!split.heldout.empty()) {
    result.heldout = std::make_shared<const PackedSequences>(
        pack_documents(corpus, split.heldout, options.seq_len, "held-out"));
  }

  DatasetSummary& s = result.summary;
  s.files = load.n_files;
  s.documents = corpus.n_documents();
  s.tokens = corpus.n_tokens();
  s.train_name = options.train_name;
  s.train_documents = result.train->n_documents();
  s.train_tokens = result.train->n_tokens();
  s.train_sequences = result.train->n_sequences();
  if (result.heldout) {
    s.heldout_documents = result.heldout->n_documents();
    s.heldout_tokens = result.heldout->n_tokens();
    s.heldout_sequences = result.heldout->n_sequences();
  }
  s.cache_hit = load.cache_hit;
  s.cache_path = load.cache_path;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace weft
