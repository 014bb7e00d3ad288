// For the targets whose parser reads files: a folder of this fuzz process's own, and the input
// written into a file there (each run overwrites the last).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace weft::fuzz {

inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const auto d = std::filesystem::temp_directory_path() / ("weft_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir;
}

inline std::string write_file(const std::string& relative, const uint8_t* data, size_t size) {
  const auto path = std::filesystem::path(scratch_dir()) / relative;
  std::filesystem::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                static_cast<std::streamsize>(size));
  return path.string();
}

}  // namespace weft::fuzz
