// Helpers for the dataset tests: a deterministic fake tokenizer and temporary directories.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/data/tokenizer.h"
#include "core/util/error.h"

namespace weft::dataset_test {

// One id per byte (0..255), bos = 256, eos = 257 (both optional), vocab 258.
class FakeTokenizer : public Tokenizer {
 public:
  // `frames`: whether its encoding adds the BOS and EOS it has (the byte tokenizer's framing);
  // false as SmolLM2's checkpoint, which has both and adds neither.
  explicit FakeTokenizer(std::string fingerprint = "fake-v1", bool has_bos = true,
                         bool has_eos = true, bool frames = true)
      : fingerprint_(std::move(fingerprint)), has_bos_(has_bos), has_eos_(has_eos), frames_(frames) {}

  std::vector<int32_t> encode(std::string_view text) const override {
    ++encode_calls;
    return std::vector<int32_t>(reinterpret_cast<const unsigned char*>(text.data()),
                                reinterpret_cast<const unsigned char*>(text.data()) + text.size());
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    for (const int32_t id : ids) {
      WEFT_CHECK(id >= 0 && id < 256, "fake tokenizer cannot decode id {}", id);
      text.push_back(static_cast<char>(id));
    }
    return text;
  }
  int64_t vocab_size() const override { return 258; }
  std::optional<int32_t> bos_id() const override {
    return has_bos_ ? std::optional<int32_t>(256) : std::nullopt;
  }
  std::optional<int32_t> eos_id() const override {
    return has_eos_ ? std::optional<int32_t>(257) : std::nullopt;
  }
  bool adds_bos() const override { return has_bos_ && frames_; }
  bool adds_eos() const override { return has_eos_ && frames_; }
  std::string fingerprint() const override { return fingerprint_; }
  std::string kind() const override { return "fake"; }

  mutable std::atomic<int64_t> encode_calls{0};  // counts documents tokenized

 private:
  std::string fingerprint_;
  bool has_bos_, has_eos_, frames_;
};

inline constexpr uint32_t kBos = 256;
inline constexpr uint32_t kEos = 257;

// [bos] + bytes of text + [eos], as the dataset tokenizes a document with the fake tokenizer.
inline std::vector<uint32_t> framed(const std::string& text) {
  std::vector<uint32_t> ids{kBos};
  for (const unsigned char c : text) ids.push_back(c);
  ids.push_back(kEos);
  return ids;
}

// A fresh directory under the system temp dir, removed with its contents on destruction.
class TempDir {
 public:
  TempDir() {
    std::random_device random;
    path_ = std::filesystem::temp_directory_path() /
            ("weft-data-test-" + std::to_string(random()) + std::to_string(random()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  // Writes `contents` to dir/name (creating subdirectories) and returns the full path.
  std::string write(const std::string& name, const std::string& contents) const {
    const auto path = path_ / name;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path, std::ios::binary) << contents;
    return path.string();
  }
  std::string path(const std::string& name = "") const {
    return name.empty() ? path_.string() : (path_ / name).string();
  }

 private:
  std::filesystem::path path_;
};

// Little-endian bytes of token ids, `width` bytes each.
inline std::string token_bytes(const std::vector<uint32_t>& ids, int width) {
  std::string bytes;
  for (const uint32_t id : ids) {
    for (int b = 0; b < width; ++b) bytes.push_back(static_cast<char>((id >> (8 * b)) & 0xFF));
  }
  return bytes;
}

// Expects `body` to throw weft::Error whose message contains `needle`.
template <typename Body>
void expect_error(Body body, const std::string& needle) {
  try {
    body();
    ADD_FAILURE() << "expected weft::Error containing: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

}  // namespace weft::dataset_test
