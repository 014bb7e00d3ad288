#include "core/data/corpus.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <random>
#include <thread>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "core/util/error.h"
#include "core/util/hash.h"

namespace weft {
namespace fs = std::filesystem;

namespace {

constexpr uint32_t kCacheVersion = 1;
constexpr char kCacheMagic[8] = {'W', 'E', 'F', 'T', 'T', 'O', 'K', 'S'};

// Cache file layout (native byte order; the cache is local to a machine):
//   CacheHeader | offsets: (n_documents + 1) x uint64 | tokens: n_tokens x uint32
struct CacheHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_size;
  uint64_t key;
  uint64_t n_documents;
  uint64_t n_tokens;
  uint64_t payload_hash;
};
static_assert(sizeof(CacheHeader) == 48, "cache header must have no padding");

// Text is tokenized in batches of about this many bytes (bounds memory, feeds the threads).
constexpr size_t kTokenizeBatchBytes = 16 << 20;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t file_mtime(const std::string& path) {
  return fs::last_write_time(path).time_since_epoch().count();
}

uint64_t payload_hash(const TokenizedCorpus& corpus) {
  const uint64_t h = hash_bytes(corpus.offsets.data(), corpus.offsets.size() * sizeof(uint64_t));
  return hash_bytes(corpus.tokens.data(), corpus.tokens.size() * sizeof(uint32_t), h);
}

uint64_t cache_key(const std::vector<InputFile>& files, const CorpusOptions& options,
                   const Tokenizer& tokenizer) {
  std::string material = fmt::format("weft-corpus-cache v{}\n", kCacheVersion);
  for (const auto& file : files) {
    const std::string bytes = read_file_bytes(file.path);
    material += fmt::format("file {} size {} mtime {} hash {:016x} format {}\n",
                            fs::absolute(file.path).lexically_normal().string(), bytes.size(),
                            file_mtime(file.path), hash_bytes(bytes.data(), bytes.size()),
                            data_format_name(file.format));
  }
  material += fmt::format(
      "format {}\ntext_field {}\ntext_document {}\nmax_documents {}\nadd_bos {}\nadd_eos {}\n"
      "vocab_size {}\ntokenizer {}\ntoken_vocab_size {}\n",
      data_format_name(options.format), options.text_field,
      text_document_mode_name(options.text_document), options.max_documents, options.add_bos,
      options.add_eos, tokenizer.vocab_size(), tokenizer.fingerprint(), options.token_vocab_size);
  return hash_bytes(material.data(), material.size());
}

std::string cache_file_for(const std::string& cache_dir, uint64_t key) {
  return (fs::path(cache_dir) / fmt::format("weft-tokens-{:016x}.bin", key)).string();
}

void write_all(std::FILE* file, const void* data, size_t bytes, const std::string& path) {
  WEFT_CHECK(bytes == 0 || std::fwrite(data, 1, bytes, file) == bytes, "cannot write '{}'", path);
}

// Accumulates documents in order, tokenizing text in parallel batches.
class CorpusBuilder {
 public:
  CorpusBuilder(const CorpusOptions& options, const Tokenizer& tokenizer)
      : options_(options), tokenizer_(tokenizer) {
    if (options.add_bos) bos_ = tokenizer.bos_id();
    if (options.add_eos) eos_ = tokenizer.eos_id();
    threads_ = options.tokenize_threads > 0
                   ? options.tokenize_threads
                   : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  }

  bool full() const {
    return options_.max_documents > 0 && n_documents_ >= options_.max_documents;
  }

  void add_file(const InputFile& file) {
    const std::string bytes = read_file_bytes(file.path);
    switch (file.format) {
      case DataFormat::kText:
        return add_texts(split_text_documents(bytes, options_.text_document));
      case DataFormat::kJsonl:
        return add_texts(parse_jsonl_documents(bytes, file.path, options_.text_field));
      case DataFormat::kTokensU16:
      case DataFormat::kTokensU32:
        return add_tokens(
            options_.token_vocab_size > 0
                ? decode_token_file(bytes, file.format, file.path, options_.token_vocab_size, "the model's")
                : decode_token_file(bytes, file.format, file.path, tokenizer_.vocab_size(), "the tokenizer's"));
      case DataFormat::kAuto:
        break;
    }
    fail("dataset file '{}' has no concrete format", file.path);
  }

  TokenizedCorpus finish() {
    flush();
    return std::move(corpus_);
  }

 private:
  int64_t remaining() const {
    return options_.max_documents > 0 ? options_.max_documents - n_documents_ : INT64_MAX;
  }

  void add_texts(std::vector<std::string> texts) {
    const size_t keep = static_cast<size_t>(std::min<int64_t>(remaining(), texts.size()));
    for (size_t i = 0; i < keep; ++i) {
      pending_bytes_ += texts[i].size();
      pending_.push_back(std::move(texts[i]));
    }
    n_documents_ += keep;
    if (pending_bytes_ >= kTokenizeBatchBytes) flush();
  }

  void add_tokens(const std::vector<uint32_t>& tokens) {
    flush();
    const auto offsets = token_document_offsets(tokens, tokenizer_.eos_id());
    const int64_t n = std::min<int64_t>(remaining(), offsets.size() - 1);
    for (int64_t d = 0; d < n; ++d) {
      corpus_.tokens.insert(corpus_.tokens.end(), tokens.begin() + offsets[d],
                            tokens.begin() + offsets[d + 1]);
      corpus_.offsets.push_back(corpus_.tokens.size());
    }
    n_documents_ += n;
  }

  void flush() {
    if (pending_.empty()) return;
    const auto encoded = encode_parallel();
    for (const auto& ids : encoded) append_document(ids);
    pending_.clear();
    pending_bytes_ = 0;
  }

  std::vector<std::vector<int32_t>> encode_parallel() const {
    std::vector<std::vector<int32_t>> encoded(pending_.size());
    std::atomic<size_t> next{0};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto work = [&] {
      try {
        for (size_t i = next++; i < pending_.size(); i = next++) {
          encoded[i] = tokenizer_.encode(pending_[i]);
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next = pending_.size();
      }
    };
    const size_t n_threads = std::min<size_t>(threads_, pending_.size());
    std::vector<std::thread> workers;
    for (size_t t = 1; t < n_threads; ++t) workers.emplace_back(work);
    work();
    for (auto& worker : workers) worker.join();
    if (error) std::rethrow_exception(error);
    return encoded;
  }

  void append_document(const std::vector<int32_t>& ids) {
    const int64_t vocab = tokenizer_.vocab_size();
    if (bos_) corpus_.tokens.push_back(static_cast<uint32_t>(*bos_));
    for (const int32_t id : ids) {
      WEFT_CHECK(id >= 0 && id < vocab, "tokenizer produced id {} outside [0, {})", id, vocab);
      corpus_.tokens.push_back(static_cast<uint32_t>(id));
    }
    if (eos_) corpus_.tokens.push_back(static_cast<uint32_t>(*eos_));
    corpus_.offsets.push_back(corpus_.tokens.size());
  }

  const CorpusOptions& options_;
  const Tokenizer& tokenizer_;
  std::optional<int32_t> bos_, eos_;
  int threads_ = 1;
  TokenizedCorpus corpus_;
  int64_t n_documents_ = 0;  // accepted so far, including pending ones
  std::vector<std::string> pending_;
  size_t pending_bytes_ = 0;
};

TokenizedCorpus build_corpus(const std::vector<InputFile>& files, const CorpusOptions& options,
                             const Tokenizer& tokenizer) {
  CorpusBuilder builder(options, tokenizer);
  for (const auto& file : files) {
    if (builder.full()) break;
    builder.add_file(file);
  }
  return builder.finish();
}

}  // namespace


bool read_corpus_cache(const std::string& path, uint64_t key, TokenizedCorpus* corpus,
                       std::string* problem) {
  std::error_code ec;
  const uint64_t file_size = fs::file_size(path, ec);
  if (ec) return *problem = "cannot stat: " + ec.message(), false;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!file) return *problem = "cannot open", false;
  CacheHeader header{};
  if (std::fread(&header, sizeof header, 1, file.get()) != 1) {
    return *problem = fmt::format("truncated header ({} bytes)", file_size), false;
  }
  if (std::memcmp(header.magic, kCacheMagic, sizeof kCacheMagic) != 0) {
    return *problem = "not a weft token cache (bad magic)", false;
  }
  if (header.version != kCacheVersion || header.header_size != sizeof(CacheHeader)) {
    return *problem = fmt::format("cache version {} (expected {})", header.version, kCacheVersion),
           false;
  }
  if (header.key != key) return *problem = "cache key does not match its file name", false;
  const uint64_t expected = sizeof(CacheHeader) + (header.n_documents + 1) * sizeof(uint64_t) +
                            header.n_tokens * sizeof(uint32_t);
  if (header.n_documents > file_size || header.n_tokens > file_size || expected != file_size) {
    return *problem = fmt::format("size {} bytes, header implies {} ({} documents, {} tokens)",
                                  file_size, expected, header.n_documents, header.n_tokens),
           false;
  }
  TokenizedCorpus loaded;
  loaded.offsets.resize(header.n_documents + 1);
  loaded.tokens.resize(header.n_tokens);
  const bool read_ok =
      std::fread(loaded.offsets.data(), sizeof(uint64_t), loaded.offsets.size(), file.get()) ==
          loaded.offsets.size() &&
      std::fread(loaded.tokens.data(), sizeof(uint32_t), loaded.tokens.size(), file.get()) ==
          loaded.tokens.size();
  if (!read_ok) return *problem = "short read", false;
  if (payload_hash(loaded) != header.payload_hash) return *problem = "checksum mismatch", false;
  const bool offsets_ok = loaded.offsets.front() == 0 &&
                          loaded.offsets.back() == header.n_tokens &&
                          std::is_sorted(loaded.offsets.begin(), loaded.offsets.end());
  if (!offsets_ok) return *problem = "inconsistent document offsets", false;
  *corpus = std::move(loaded);
  return true;
}

void write_corpus_cache(const std::string& path, uint64_t key, const TokenizedCorpus& corpus) {
  CacheHeader header{};
  std::memcpy(header.magic, kCacheMagic, sizeof kCacheMagic);
  header.version = kCacheVersion;
  header.header_size = sizeof(CacheHeader);
  header.key = key;
  header.n_documents = corpus.n_documents();
  header.n_tokens = corpus.n_tokens();
  header.payload_hash = payload_hash(corpus);

  std::error_code ec;
  const fs::path parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent, ec);
  WEFT_CHECK(!ec, "cannot create cache directory '{}': {}", parent.string(), ec.message());
  const std::string temp =
      fmt::format("{}.tmp.{}.{:08x}", path, static_cast<long>(getpid()), std::random_device{}());
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  WEFT_CHECK(file != nullptr, "cannot create cache file '{}'", temp);
  try {
    write_all(file, &header, sizeof header, temp);
    write_all(file, corpus.offsets.data(), corpus.offsets.size() * sizeof(uint64_t), temp);
    write_all(file, corpus.tokens.data(), corpus.tokens.size() * sizeof(uint32_t), temp);
  } catch (...) {
    std::fclose(file);
    fs::remove(temp, ec);
    throw;
  }
  const bool closed = std::fclose(file) == 0;
  if (closed) fs::rename(temp, path, ec);
  if (!closed || ec) {
    fs::remove(temp, ec);
    fail("cannot write cache file '{}'", path);
  }
}

std::string corpus_cache_path(const CorpusOptions& options, const Tokenizer& tokenizer) {
  if (options.cache_dir.empty()) return "";
  const auto files = resolve_inputs(options.paths, options.format);
  return cache_file_for(options.cache_dir, cache_key(files, options, tokenizer));
}

CorpusLoad load_corpus(const CorpusOptions& options, const Tokenizer& tokenizer) {
  WEFT_CHECK(options.max_documents >= 0, "dataset max_documents must be >= 0, got {}",
             options.max_documents);
  const auto start = std::chrono::steady_clock::now();
  const auto files = resolve_inputs(options.paths, options.format);
  CorpusLoad load;
  load.n_files = static_cast<int64_t>(files.size());
  uint64_t key = 0;
  if (!options.cache_dir.empty()) {
    key = cache_key(files, options, tokenizer);
    load.cache_path = cache_file_for(options.cache_dir, key);
    std::string problem;
    if (fs::exists(load.cache_path)) {
      if (read_corpus_cache(load.cache_path, key, &load.corpus, &problem)) {
        load.cache_hit = true;
        spdlog::info("dataset: loaded {} documents, {} tokens from cache {} in {:.2f}s",
                     load.corpus.n_documents(), load.corpus.n_tokens(), load.cache_path,
                     seconds_since(start));
        return load;
      }
      spdlog::warn("dataset: token cache {} is unusable ({}); rebuilding it", load.cache_path,
                   problem);
    }
  }
  load.corpus = build_corpus(files, options, tokenizer);
  WEFT_CHECK(load.corpus.n_documents() > 0, "dataset has no documents ({} input files under {})",
             files.size(), fmt::join(options.paths, ", "));
  const double seconds = seconds_since(start);
  spdlog::info("dataset: tokenized {} files into {} documents, {} tokens in {:.2f}s ({:.0f} tokens/s)",
               files.size(), load.corpus.n_documents(), load.corpus.n_tokens(), seconds,
               load.corpus.n_tokens() / std::max(seconds, 1e-9));
  if (!load.cache_path.empty()) {
    try {
      write_corpus_cache(load.cache_path, key, load.corpus);
      spdlog::info("dataset: wrote token cache {}", load.cache_path);
    } catch (const Error& e) {
      spdlog::warn("dataset: {} (continuing without a cache)", e.what());
    }
  }
  return load;
}

}  // namespace weft
