#include "core/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/util/error.h"

namespace weft {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Closes a file descriptor when it goes out of scope.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* bytes, size_t count, const std::string& path) {
  auto* cursor = static_cast<const uint8_t*>(bytes);
  while (count > 0) {
    ssize_t written = ::write(fd, cursor, count);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) fail("{}: write failed: {}", path, errno_text());
    cursor += written;
    count -= static_cast<size_t>(written);
  }
}

// Makes a finished rename durable. Some file systems refuse fsync on directories; the data itself
// is already on disk then, so that failure is not an error.
void sync_directory_of(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path) {
  FdCloser file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) fail("{}: cannot open: {}", path, errno_text());
  struct stat st {};
  if (::fstat(file.fd, &st) != 0) fail("{}: cannot stat: {}", path, errno_text());
  if (!S_ISREG(st.st_mode)) fail("{}: not a regular file", path);

  std::shared_ptr<MappedFile> mapped(new MappedFile());
  mapped->size_ = static_cast<uint64_t>(st.st_size);
  if (mapped->size_ == 0) return mapped;
  void* address = ::mmap(nullptr, mapped->size_, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_NORESERVE, file.fd, 0);
  if (address == MAP_FAILED)
    fail("{}: cannot mmap {} bytes: {}", path, mapped->size_, errno_text());
  mapped->data_ = static_cast<uint8_t*>(address);
  return mapped;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink&)>& write_content) {
  const std::string temp_path = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("{}: cannot create: {}", temp_path, errno_text());
  try {
    write_content([&](const void* bytes, size_t count) { write_all(fd, bytes, count, temp_path); });
    if (::fsync(fd) != 0) fail("{}: fsync failed: {}", temp_path, errno_text());
    int closed = ::close(fd);
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
  sync_directory_of(path);
}

}  // namespace weft
