// Reading and writing HF safetensors files (https://github.com/huggingface/safetensors).
//
// Layout of one file: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON (possibly padded
// with trailing spaces), then the data region. The JSON is an object
//   {"__metadata__": {str: str},                                   (optional)
//    "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
// where offsets are byte offsets relative to the start of the data region (8 + N), and each
// tensor's bytes are its values in row-major order, little-endian.
//
// Files are untrusted input. SafetensorsFile::open validates the whole header before returning
// and every rejection is a weft::Error with one line naming the file and the problem. Supported
// dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL.
//
// Only little-endian hosts are supported (checked at compile time).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

namespace weft {

class MappedFile;  // core/io/mapped_file.h

// One tensor's entry in a safetensors header.
struct TensorInfo {
  std::string name;
  std::string dtype_name;                            // as written in the file, e.g. "BF16"
  at::ScalarType dtype = at::ScalarType::Undefined;  // the matching torch dtype
  std::vector<int64_t> shape;                        // empty for a 0-dim (scalar) tensor
  uint64_t begin = 0;                                // byte offsets relative to the data
  uint64_t end = 0;                                  // region, begin <= end

  uint64_t nbytes() const { return end - begin; }
};

// The torch dtype for a safetensors dtype name ("F32" -> kFloat), or nullopt when unsupported.
std::optional<at::ScalarType> safetensors_dtype_from_name(const std::string& name);

// The safetensors dtype name for a torch dtype (kBFloat16 -> "BF16"); nullopt when the dtype has
// no supported safetensors name (complex, quantized, ...).
std::optional<std::string> safetensors_dtype_name(at::ScalarType dtype);

// One .safetensors file, memory-mapped (POSIX mmap, MAP_PRIVATE: pages are copy-on-write, so
// nothing done to a view ever reaches the file; MAP_NORESERVE, so huge files map anywhere). The mapping lives as long as
// the SafetensorsFile or any tensor returned by view(), whichever is last.
// The file must not be truncated by another process while mapped (that raises SIGBUS on access,
// as with any mmap reader). Thread-safe for concurrent const use.
class SafetensorsFile {
 public:
  // Maps `path` and validates the whole header: the length prefix, JSON syntax, the type of every
  // field, dtypes, non-negative dimensions, offsets inside the data region, byte counts equal to
  // numel * element size, no two tensors overlapping, no duplicate names. Throws weft::Error
  // naming the file and the problem, or when the file cannot be opened or mapped.
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);

  // All tensors, in storage order (ascending data offset, ties by name).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws weft::Error naming the file and the tensor when there is no such tensor.
  const TensorInfo& info(const std::string& name) const;
  // The "__metadata__" object (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

  // Zero-copy CPU tensor of the stored dtype and shape over the mapping. The tensor keeps the
  // mapping alive (it may outlive this object). In-place writes to it are private to this
  // process (copy-on-write). Throws weft::Error when the tensor's bytes are not aligned to its
  // element size (possible in files whose tensors are not ordered by element size); use load().
  at::Tensor view(const std::string& name) const;

  // An owned, contiguous CPU copy, converted to `dtype` when given.
  at::Tensor load(const std::string& name,
                  std::optional<at::ScalarType> dtype = std::nullopt) const;

  // An owned, contiguous CPU copy of [start, start + length) along `dim` (negative dims count
  // from the end), converted to `dtype` when given. Reads only the bytes of the slice, so each
  // tensor-parallel rank touches only its shard. Throws weft::Error for a 0-dim tensor, a dim
  // out of range, or a range outside [0, size(dim)].
  at::Tensor load_slice(const std::string& name, int64_t dim, int64_t start, int64_t length,
                        std::optional<at::ScalarType> dtype = std::nullopt) const;

 private:
  SafetensorsFile() = default;
  const uint8_t* tensor_bytes(const TensorInfo& info) const;

  std::string path_;
  std::shared_ptr<const MappedFile> mapping_;
  uint64_t data_start_ = 0;  // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A weight set that may span several files. open() accepts
//  - a .safetensors file;
//  - a directory holding model.safetensors (preferred, as in HF transformers) or
//    model.safetensors.index.json;
//  - an index json path: {"metadata": {...}, "weight_map": {"<tensor>": "<file>"}}, files
//    relative to the index's directory.
// For an index, the tensors are exactly the weight_map entries. Rejected with weft::Error:
// malformed index json, a duplicate name in weight_map, a weight_map file that is missing or is
// not a plain file name (no '/' or ".."), a mapped tensor absent from its file, and a tensor name
// stored in more than one shard. Every shard is opened (and its header validated) by open().
// Copies share the underlying files.
class SafetensorsCheckpoint {
 public:
  static SafetensorsCheckpoint open(const std::string& path);

  // Tensor names in storage order: shard by shard (sorted file names), each in storage order.
  std::vector<std::string> names() const { return names_; }
  bool contains(const std::string& name) const { return owner_.count(name) != 0; }
  // Same semantics as SafetensorsFile's, dispatched to the file holding the tensor; unknown
  // names throw weft::Error naming the checkpoint and the tensor.
  const TensorInfo& info(const std::string& name) const;
  at::Tensor view(const std::string& name) const;
  at::Tensor load(const std::string& name,
                  std::optional<at::ScalarType> dtype = std::nullopt) const;
  at::Tensor load_slice(const std::string& name, int64_t dim, int64_t start, int64_t length,
                        std::optional<at::ScalarType> dtype = std::nullopt) const;

  // The files making up the checkpoint (one for a single file), sorted by path.
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }
  // The path open() was given.
  const std::string& path() const { return path_; }

 private:
  const SafetensorsFile& file_of(const std::string& name) const;

  std::string path_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, size_t> owner_;  // tensor name -> position in files_
  std::vector<std::string> names_;
};

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Writes one safetensors file atomically: to "<path>.tmp.<pid>", fsync, rename over `path`
// (then fsync of the directory). Tensors (any device; copied to CPU) are written contiguous in
// the order given, each with its own dtype; the header is padded with spaces to a multiple of 8.
// `metadata` is written as "__metadata__", with "format": "pt" added unless it has a "format" key.
// Throws weft::Error, before creating any file, for an empty, duplicate or non-UTF-8 name, the
// name "__metadata__", an undefined or non-strided tensor or an unsupported dtype; and for I/O
// failures, in which case the temp file is removed and `path` is left untouched.
// Note: a tensor stored after one of a smaller element size may end up unaligned, which view()
// rejects; write larger element sizes first (or one dtype) when views matter.
void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Writes the tensors under `dir` (created if missing) the way HF transformers does:
// <dir>/model.safetensors when the total tensor bytes fit in max_shard_bytes, otherwise
// <dir>/model-00001-of-0000N.safetensors ... (tensors packed greedily in the order given; a single
// tensor larger than the limit gets a shard of its own) plus <dir>/model.safetensors.index.json
// ({"metadata": {"total_size": <bytes>}, "weight_map": {name: file}}), written last. Every file is
// written atomically and carries `metadata`. A stale entry point of the other form
// (model.safetensors.index.json, resp. model.safetensors) is removed so that
// SafetensorsCheckpoint::open(dir) finds the new weights. Same errors as save_safetensors, all
// checked before anything is written; max_shard_bytes must be positive.
void save_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                              uint64_t max_shard_bytes,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace weft
