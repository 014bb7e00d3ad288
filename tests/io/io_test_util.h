// Helpers shared by the io tests: a fresh temp directory per test, raw file writing, byte-exact
// tensor comparison and error-message capture.
#pragma once

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include "core/util/error.h"

namespace weft::testing {

// A test fixture owning an empty directory unique to the running test, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::path(::testing::TempDir()) /
           (std::string("weft_io_") + test->test_suite_name() + "_" + test->name() + "_" +
            std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// The 8-byte little-endian length prefix, assembled byte by byte.
inline std::string u64_le(uint64_t value) {
  std::string bytes;
  for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return bytes;
}

// A safetensors file from a header text (used verbatim, not padded) and a data region.
inline std::string safetensors_bytes(const std::string& header, const std::string& data = "") {
  return u64_le(header.size()) + header + data;
}

// Same dtype, same shape, identical bytes (so NaNs and -0.0 count as well).
inline void expect_identical(const at::Tensor& actual, const at::Tensor& expected) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type());
  ASSERT_EQ(actual.sizes(), expected.sizes());
  if (actual.numel() == 0) return;
  const at::Tensor a = actual.contiguous(), e = expected.contiguous();
  EXPECT_EQ(std::memcmp(a.data_ptr(), e.data_ptr(), a.numel() * a.element_size()), 0)
      << "actual:\n"
      << actual << "\nexpected:\n"
      << expected;
}

// Runs `action`, which must throw weft::Error; returns its message ("" and a test failure
// otherwise). Also checks the message is a single line.
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const weft::Error& error) {
    const std::string message = error.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  } catch (const std::exception& other) {
    ADD_FAILURE() << "expected weft::Error, got another exception: " << other.what();
    return "";
  }
  ADD_FAILURE() << "expected weft::Error, nothing was thrown";
  return "";
}

}  // namespace weft::testing
