// A private memory mapping of a whole file, for the readers in core/io.
// (Atomic file replacement lives in core/util/fs.h.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace weft {

// A whole regular file mapped with mmap(MAP_PRIVATE | MAP_NORESERVE, PROT_READ | PROT_WRITE):
// writes through data() are copy-on-write, private to this process, and never reach the file;
// no swap is reserved up front, so very large files map on hosts with little memory.
// Unmapped by the destructor; not copyable (share it through shared_ptr).
class MappedFile {
 public:
  // Throws weft::Error naming the path when it cannot be opened, is not a regular file, or
  // cannot be mapped. An empty file yields size() == 0 and data() == nullptr.
  static std::shared_ptr<const MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  MappedFile() = default;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace weft
