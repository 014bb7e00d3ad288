// The tokenized corpus: every document of a dataset as token ids, built once and cached on disk.
//
// Each text/JSONL document becomes [bos?] + tokenizer.encode(text) + [eos?] (bos/eos only when
// the flag is set and the tokenizer has that id). Token files are taken verbatim (already
// tokenized: add_bos/add_eos do not apply) and cut into documents by token_document_offsets.
//
// Cache: with a non-empty cache_dir, the corpus is stored in
//   <cache_dir>/weft-tokens-<16 hex digits>.bin
// where the hex is a 64-bit hash of: the cache format version, every input file's absolute path,
// size, mtime and content hash, the format, text_field, text_document, max_documents,
// add_bos/add_eos, the tokenizer's vocab_size and fingerprint(). Any change to those misses the
// cache. The file is written to a temporary name and renamed into place (concurrent writers,
// e.g. several ranks, are safe: the last rename wins with identical contents). A cache file whose
// header, size or payload checksum does not match is reported with a warning and rebuilt.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/data/documents.h"
#include "core/data/tokenizer.h"

namespace weft {

// All documents, concatenated. Document d is tokens[offsets[d], offsets[d + 1]).
struct TokenizedCorpus {
  std::vector<uint32_t> tokens;
  std::vector<uint64_t> offsets{0};  // n_documents() + 1 entries, first 0, last tokens.size()

  int64_t n_documents() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t n_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t document_size(int64_t d) const { return offsets[d + 1] - offsets[d]; }
};

struct CorpusOptions {
  std::vector<std::string> paths;      // files or directories, see resolve_inputs
  DataFormat format = DataFormat::kAuto;
  std::string text_field = "text";     // jsonl: the field holding the document
  TextDocumentMode text_document = TextDocumentMode::kParagraph;  // text files
  int64_t max_documents = 0;           // keep only the first N documents (0 = all)
  bool add_bos = true;
  bool add_eos = true;
  // Token files: every id must be below this (the model's vocab_size: such files need no tokenizer
  // of the model); 0 = the tokenizer's vocab_size.
  int64_t token_vocab_size = 0;
  std::string cache_dir;               // empty = no cache (always tokenize)
  // Threads tokenizing documents in parallel (0 = hardware concurrency). Tokenizer::encode is
  // called concurrently from these threads; the result does not depend on the thread count.
  int tokenize_threads = 0;
};

struct CorpusLoad {
  TokenizedCorpus corpus;
  int64_t n_files = 0;
  bool cache_hit = false;
  std::string cache_path;  // empty when caching is off
};

// Returns the corpus for `options`, from the cache when it holds a valid entry, otherwise by
// reading and tokenizing the inputs (then writing the cache; a failed cache write only warns).
// Logs (info) which of the two happened. Throws weft::Error for anything resolve_inputs,
// parse_jsonl_documents or decode_token_file reject, for max_documents < 0, and when the
// dataset has no documents at all.
CorpusLoad load_corpus(const CorpusOptions& options, const Tokenizer& tokenizer);

// The cache file `options` maps to (empty when cache_dir is empty). Reads every input file to
// hash its contents; throws like resolve_inputs.
std::string corpus_cache_path(const CorpusOptions& options, const Tokenizer& tokenizer);

// Reads/writes the cache file format directly (exposed for tests and tools). read_corpus_cache
// returns false, with the reason in *problem, when the file is missing, truncated, of another
// version, for another key, or fails its checksum. write_corpus_cache throws weft::Error when
// the file cannot be written.
bool read_corpus_cache(const std::string& path, uint64_t key, TokenizedCorpus* corpus,
                       std::string* problem);
void write_corpus_cache(const std::string& path, uint64_t key, const TokenizedCorpus& corpus);


}  // namespace weft
