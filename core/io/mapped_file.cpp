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

}  // namespace weft
