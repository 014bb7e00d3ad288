#include "core/util/fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/util/error.h"

namespace weft {

namespace {

std::string errno_text() { return std::strerror(errno); }

void write_all(int fd, const void* bytes, size_t count, const std::string& path) {
  auto* cursor = static_cast<const uint8_t*>(bytes);
  while (count > 0) {
    const ssize_t written = ::write(fd, cursor, count);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) fail("{}: write failed: {}", path, errno_text());
    cursor += written;
    count -= static_cast<size_t>(written);
  }
}

}  // namespace

void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink&)>& write_content) {
  const std::string temp_path = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot create: {}", temp_path, errno_text());
  try {
    write_content([&](const void* bytes, size_t count) { write_all(fd, bytes, count, temp_path); });
    if (::fsync(fd) != 0) fail("{}: fsync failed: {}", temp_path, errno_text());
    const int closed = ::close(fd);
    fd = -1;
    if (closed != 0) fail("{}: close failed: {}", temp_path, errno_text());
    if (::rename(temp_path.c_str(), path.c_str()) != 0) {
      fail("{}: cannot rename {} over it: {}", path, temp_path, errno_text());
    }
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(temp_path.c_str());
    throw;
  }
  const auto parent = std::filesystem::path(path).parent_path();
  sync_directory(parent.empty() ? "." : parent.string());
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  write_file_atomically(path, [&](const ByteSink& sink) { sink(contents.data(), contents.size()); });
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  WEFT_CHECK(in.good(), "cannot open '{}'", path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace weft
