// Reading safetensors files and checkpoints. Writing lives in safetensors_write.cpp.
#include "core/io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/io/mapped_file.h"
#include "core/util/error.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "weft's safetensors reader/writer assumes a little-endian host"
#endif

namespace weft {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;
constexpr uint64_t kMaxIndexBytes = 100ull * 1000 * 1000;

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<std::string, at::ScalarType>> table = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool},
  };
  return table;
}

// ---- JSON parsing that also reports duplicate object keys (nlohmann keeps the last silently).

struct DuplicateKey {
  std::string key;
  std::string parent;  // the key whose object holds the duplicate; "" for the root object
};

struct ParsedJson {
  json value;
  std::optional<DuplicateKey> duplicate;
};

// Throws json::parse_error on invalid JSON.
ParsedJson parse_json_reporting_duplicates(const char* begin, const char* end) {
  struct Level {
    std::string parent;
    std::string last_key;
    std::set<std::string> keys;
  };
  std::vector<Level> levels;
  ParsedJson result;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      levels.push_back({levels.empty() ? "" : levels.back().last_key, "", {}});
    } else if (event == json::parse_event_t::object_end && !levels.empty()) {
      levels.pop_back();
    } else if (event == json::parse_event_t::key && !levels.empty()) {
      Level& level = levels.back();
      level.last_key = parsed.get<std::string>();
      if (!level.keys.insert(level.last_key).second && !result.duplicate) {
        result.duplicate = DuplicateKey{level.last_key, level.parent};
      }
    }
    return true;
  };
  result.value = json::parse(begin, end, callback);
  return result;
}

// JSON text never holds a raw NUL, but nlohmann stops at one as if the input ended there, so
// callers reject NULs first.
bool has_nul(const char* text, size_t size) { return std::memchr(text, '\0', size) != nullptr; }

// ---- Header validation. Every message is "<file>: <problem>", one distinct wording per problem.

uint64_t read_u64_le(const uint8_t* bytes) {
  uint64_t value;
  std::memcpy(&value, bytes, sizeof value);
  return value;
}

uint64_t header_length(const MappedFile& file, const std::string& path) {
  if (file.size() < 8) {
    fail("{}: file is {} bytes, shorter than the 8-byte header length prefix", path, file.size());
  }
  uint64_t length = read_u64_le(file.data());
  if (length > kMaxHeaderBytes) {
    fail("{}: header length {} is absurdly large (limit {} bytes)", path, length, kMaxHeaderBytes);
  }
  if (length > file.size() - 8) {
    fail("{}: header length {} runs past the end of the file ({} bytes)", path, length,
         file.size());
  }
  return length;
}

json parse_header(const MappedFile& file, uint64_t length, const std::string& path) {
  const char* begin = reinterpret_cast<const char*>(file.data()) + 8;
  if (has_nul(begin, length)) fail("{}: header is not valid JSON: it contains a NUL byte", path);
  ParsedJson parsed;
  try {
    parsed = parse_json_reporting_duplicates(begin, begin + length);
  } catch (const json::exception& error) {
    fail("{}: header is not valid JSON: {}", path, error.what());
  }
  if (!parsed.value.is_object()) fail("{}: header JSON is not an object", path);
  if (parsed.duplicate && parsed.duplicate->parent.empty()) {
    fail("{}: duplicate tensor name '{}' in header", path, parsed.duplicate->key);
  }
  if (parsed.duplicate) {
    fail("{}: duplicate key '{}' in '{}'", path, parsed.duplicate->key, parsed.duplicate->parent);
  }
  return std::move(parsed.value);
}

std::map<std::string, std::string> parse_metadata(const json& value, const std::string& path) {
  if (!value.is_object()) fail("{}: __metadata__ is not an object", path);
  std::map<std::string, std::string> metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) fail("{}: __metadata__ value for '{}' is not a string", path, key);
    metadata[key] = item.get<std::string>();
  }
  return metadata;
}

const json& field(const json& entry, const char* key, const std::string& name,
                  const std::string& path) {
  auto found = entry.find(key);
  if (found == entry.end()) fail("{}: tensor '{}' is missing \"{}\"", path, name, key);
  return *found;
}

at::ScalarType parse_dtype(const json& value, std::string& dtype_name, const std::string& name,
                           const std::string& path) {
  if (!value.is_string()) fail("{}: tensor '{}': \"dtype\" is not a string", path, name);
  dtype_name = value.get<std::string>();
  auto dtype = safetensors_dtype_from_name(dtype_name);
  if (!dtype) fail("{}: tensor '{}' has unsupported dtype '{}'", path, name, dtype_name);
  return *dtype;
}

std::vector<int64_t> parse_shape(const json& value, const std::string& name,
                                 const std::string& path) {
  if (!value.is_array()) fail("{}: tensor '{}': \"shape\" is not an array", path, name);
  std::vector<int64_t> shape;
  for (const json& dim : value) {
    if (!dim.is_number_integer()) {
      fail("{}: tensor '{}': \"shape\" holds a non-integer {}", path, name, dim.dump());
    }
    if (dim.is_number_unsigned() && dim.get<uint64_t>() > uint64_t(INT64_MAX)) {
      fail("{}: tensor '{}': dimension {} is too large", path, name, dim.dump());
    }
    int64_t size = dim.get<int64_t>();
    if (size < 0) fail("{}: tensor '{}' has negative dimension {}", path, name, size);
    shape.push_back(size);
  }
  return shape;
}

std::pair<uint64_t, uint64_t> parse_offsets(const json& value, const std::string& name,
                                            const std::string& path) {
  bool well_typed = value.is_array() && value.size() == 2 && value[0].is_number_unsigned() &&
                    value[1].is_number_unsigned();
  if (!well_typed) {
    fail("{}: tensor '{}': \"data_offsets\" is not [begin, end] of non-negative integers", path,
         name);
  }
  return {value[0].get<uint64_t>(), value[1].get<uint64_t>()};
}

// numel * element size, or nullopt on 64-bit overflow.
std::optional<uint64_t> byte_count(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  uint64_t bytes = c10::elementSize(dtype);
  for (int64_t size : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(size), &bytes)) return std::nullopt;
  }
  return bytes;
}

TensorInfo parse_entry(const std::string& name, const json& entry, uint64_t data_size,
                       const std::string& path) {
  if (!entry.is_object()) fail("{}: tensor '{}': entry is not an object", path, name);
  TensorInfo info;
  info.name = name;
  info.dtype = parse_dtype(field(entry, "dtype", name, path), info.dtype_name, name, path);
  info.shape = parse_shape(field(entry, "shape", name, path), name, path);
  std::tie(info.begin, info.end) =
      parse_offsets(field(entry, "data_offsets", name, path), name, path);
  if (info.begin > info.end) {
    fail("{}: tensor '{}': data_offsets begin {} is greater than end {}", path, name, info.begin,
         info.end);
  }
  if (info.end > data_size) {
    fail("{}: tensor '{}': data_offsets end {} is past the end of the data region ({} bytes)", path,
         name, info.end, data_size);
  }
  auto expected = byte_count(info.shape, info.dtype);
  if (!expected) {
    fail("{}: tensor '{}': shape [{}] of {} overflows a 64-bit byte count", path, name,
         fmt::join(info.shape, ", "), info.dtype_name);
  }
  if (*expected != info.nbytes()) {
    fail("{}: tensor '{}': data_offsets span {} bytes but shape [{}] of {} needs {} bytes", path,
         name, info.nbytes(), fmt::join(info.shape, ", "), info.dtype_name, *expected);
  }
  return info;
}

// Sorts into storage order and checks that the non-empty tensors tile the data region exactly, as
// the reference implementation (huggingface/safetensors) requires: no two byte ranges intersect,
// no bytes lie between them, and the last one ends where the file ends. (Empty tensors hold no
// bytes; the reference also wants them on the tiling, weft lets them sit at any offset inside
// the region.)
void sort_and_check_layout(std::vector<TensorInfo>& tensors, uint64_t data_size, const std::string& path) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const TensorInfo* furthest = nullptr;  // the non-empty tensor reaching furthest so far
  uint64_t covered = 0;                  // bytes [0, covered) belong to tensors seen so far
  for (const TensorInfo& info : tensors) {
    if (info.nbytes() == 0) continue;
    if (furthest != nullptr && info.begin < furthest->end) {
      fail("{}: tensors '{}' [{}, {}) and '{}' [{}, {}) overlap", path, furthest->name,
           furthest->begin, furthest->end, info.name, info.begin, info.end);
    }
    if (info.begin != covered) {
      fail("{}: bytes [{}, {}) of the data region belong to no tensor (before '{}')", path, covered,
           info.begin, info.name);
    }
    if (furthest == nullptr || info.end > furthest->end) furthest = &info;
    covered = info.end;
  }
  if (covered != data_size) {
    fail("{}: {} bytes after the last tensor's data (the data region ends at byte {} of {})", path,
         data_size - covered, covered, data_size);
  }
}

void check_slice(const TensorInfo& info, int64_t& dim, int64_t start, int64_t length,
                 const std::string& path) {
  const int64_t rank = static_cast<int64_t>(info.shape.size());
  if (rank == 0) fail("{}: tensor '{}' is 0-dim and cannot be sliced", path, info.name);
  if (dim < -rank || dim >= rank) {
    fail("{}: tensor '{}': slice dim {} is out of range for {} dims", path, info.name, dim, rank);
  }
  if (dim < 0) dim += rank;
  const int64_t size = info.shape[dim];
  if (start < 0 || length < 0 || start > size || length > size - start) {
    fail("{}: tensor '{}': slice [{}, {}+{}) is outside dim {} of size {}", path, info.name, start,
         start, length, dim, size);
  }
}

at::Tensor convert(at::Tensor tensor, std::optional<at::ScalarType> dtype) {
  if (!dtype || *dtype == tensor.scalar_type()) return tensor;
  return tensor.to(*dtype);
}

// ---- Checkpoints.

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

std::string read_small_file(const std::string& path, uint64_t limit) {
  auto file = MappedFile::open(path);
  if (file->size() > limit) {
    fail("{}: file is {} bytes, over the {} byte limit", path, file->size(), limit);
  }
  if (file->size() == 0) return {};
  return std::string(reinterpret_cast<const char*>(file->data()), file->size());
}

// weight_map of an index json: tensor name -> shard file name, validated.
std::map<std::string, std::string> read_weight_map(const std::string& index_path) {
  const std::string text = read_small_file(index_path, kMaxIndexBytes);
  if (has_nul(text.data(), text.size())) {
    fail("{}: index is not valid JSON: it contains a NUL byte", index_path);
  }
  ParsedJson parsed;
  try {
    parsed = parse_json_reporting_duplicates(text.data(), text.data() + text.size());
  } catch (const json::exception& error) {
    fail("{}: index is not valid JSON: {}", index_path, error.what());
  }
  const json& root = parsed.value;
  if (!root.is_object()) fail("{}: index JSON is not an object", index_path);
  if (parsed.duplicate && parsed.duplicate->parent == "weight_map") {
    fail("{}: duplicate tensor name '{}' in weight_map", index_path, parsed.duplicate->key);
  }
  if (parsed.duplicate) {
    fail("{}: duplicate key '{}' in index", index_path, parsed.duplicate->key);
  }
  auto found = root.find("weight_map");
  if (found == root.end()) fail("{}: index has no \"weight_map\"", index_path);
  if (!found->is_object()) fail("{}: index \"weight_map\" is not an object", index_path);
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, file] : found->items()) {
    if (!file.is_string()) {
      fail("{}: weight_map entry for tensor '{}' is not a string", index_path, name);
    }
    const std::string file_name = file.get<std::string>();
    if (!is_plain_file_name(file_name)) {
      fail("{}: weight_map file '{}' for tensor '{}' is not a plain file name", index_path,
           file_name, name);
    }
    weight_map[name] = file_name;
  }
  return weight_map;
}

}  // namespace

std::optional<at::ScalarType> safetensors_dtype_from_name(const std::string& name) {
  for (const auto& [dtype_name, dtype] : dtype_table()) {
    if (dtype_name == name) return dtype;
  }
  return std::nullopt;
}

std::optional<std::string> safetensors_dtype_name(at::ScalarType dtype) {
  for (const auto& [dtype_name, table_dtype] : dtype_table()) {
    if (table_dtype == dtype) return dtype_name;
  }
  return std::nullopt;
}

// ---- SafetensorsFile

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->mapping_ = MappedFile::open(path);
  const uint64_t length = header_length(*file->mapping_, path);
  file->data_start_ = 8 + length;
  const uint64_t data_size = file->mapping_->size() - file->data_start_;

  const json header = parse_header(*file->mapping_, length, path);
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      file->metadata_ = parse_metadata(entry, path);
    } else {
      file->tensors_.push_back(parse_entry(name, entry, data_size, path));
    }
  }
  sort_and_check_layout(file->tensors_, data_size, path);
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const {
  auto found = index_.find(name);
  if (found == index_.end()) fail("{}: no tensor named '{}'", path_, name);
  return tensors_[found->second];
}

const uint8_t* SafetensorsFile::tensor_bytes(const TensorInfo& info) const {
  return mapping_->data() + data_start_ + info.begin;
}

at::Tensor SafetensorsFile::view(const std::string& name) const {
  const TensorInfo& tensor = info(name);
  const uint8_t* bytes = tensor_bytes(tensor);
  const size_t element_size = c10::elementSize(tensor.dtype);
  if (tensor.nbytes() > 0 && reinterpret_cast<uintptr_t>(bytes) % element_size != 0) {
    fail("{}: tensor '{}' is not aligned to its {}-byte elements and cannot be viewed; use load()",
         path_, name, element_size);
  }
  std::shared_ptr<const MappedFile> keep_alive = mapping_;
  return at::from_blob(
      const_cast<uint8_t*>(bytes), tensor.shape, [keep_alive](void*) {},
      at::TensorOptions().dtype(tensor.dtype));
}

at::Tensor SafetensorsFile::load(const std::string& name,
                                 std::optional<at::ScalarType> dtype) const {
  const TensorInfo& tensor = info(name);
  at::Tensor out = at::empty(tensor.shape, at::TensorOptions().dtype(tensor.dtype));
  if (tensor.nbytes() > 0) std::memcpy(out.data_ptr(), tensor_bytes(tensor), tensor.nbytes());
  return convert(std::move(out), dtype);
}

at::Tensor SafetensorsFile::load_slice(const std::string& name, int64_t dim, int64_t start,
                                       int64_t length, std::optional<at::ScalarType> dtype) const {
  const TensorInfo& tensor = info(name);
  check_slice(tensor, dim, start, length, path_);
  std::vector<int64_t> out_shape = tensor.shape;
  out_shape[dim] = length;
  at::Tensor out = at::empty(out_shape, at::TensorOptions().dtype(tensor.dtype));

  // Row-major: the slice is `outer` runs of length * inner bytes, one per index of dims < dim.
  uint64_t outer = 1, inner = c10::elementSize(tensor.dtype);
  for (int64_t d = 0; d < dim; ++d) outer *= tensor.shape[d];
  for (size_t d = dim + 1; d < tensor.shape.size(); ++d) inner *= tensor.shape[d];
  const uint64_t run = length * inner, stride = tensor.shape[dim] * inner;
  const uint8_t* source = tensor_bytes(tensor) + start * inner;
  auto* target = static_cast<uint8_t*>(out.data_ptr());
  if (run > 0) {
    for (uint64_t o = 0; o < outer; ++o) std::memcpy(target + o * run, source + o * stride, run);
  }
  return convert(std::move(out), dtype);
}

// ---- SafetensorsCheckpoint

SafetensorsCheckpoint SafetensorsCheckpoint::open(const std::string& path) {
  const fs::path location(path);
  std::error_code ignored;
  if (fs::is_directory(location, ignored)) {
    if (fs::is_regular_file(location / "model.safetensors", ignored)) {
      SafetensorsCheckpoint checkpoint = open((location / "model.safetensors").string());
      checkpoint.path_ = path;
      return checkpoint;
    }
    if (fs::is_regular_file(location / "model.safetensors.index.json", ignored)) {
      SafetensorsCheckpoint checkpoint = open((location / "model.safetensors.index.json").string());
      checkpoint.path_ = path;
      return checkpoint;
    }
    fail("{}: directory holds neither model.safetensors nor model.safetensors.index.json", path);
  }

  SafetensorsCheckpoint checkpoint;
  checkpoint.path_ = path;
  if (location.extension() != ".json") {
    checkpoint.files_.push_back(SafetensorsFile::open(path));
    for (const TensorInfo& tensor : checkpoint.files_[0]->tensors()) {
      checkpoint.owner_[tensor.name] = 0;
      checkpoint.names_.push_back(tensor.name);
    }
    return checkpoint;
  }

  const std::map<std::string, std::string> weight_map = read_weight_map(path);
  std::map<std::string, size_t> file_position;  // shard file name -> position in files_
  for (const auto& [name, file_name] : weight_map) file_position[file_name] = 0;
  for (auto& [file_name, position] : file_position) {
    const fs::path shard = location.parent_path() / file_name;
    if (!fs::is_regular_file(shard, ignored)) {
      fail("{}: weight_map file '{}' does not exist", path, shard.string());
    }
    position = checkpoint.files_.size();
    checkpoint.files_.push_back(SafetensorsFile::open(shard.string()));
  }

  std::unordered_map<std::string, size_t> stored_in;  // every tensor of every shard
  for (size_t i = 0; i < checkpoint.files_.size(); ++i) {
    for (const TensorInfo& tensor : checkpoint.files_[i]->tensors()) {
      auto [it, inserted] = stored_in.emplace(tensor.name, i);
      if (!inserted) {
        fail("{}: tensor '{}' is stored in both {} and {}", path, tensor.name,
             checkpoint.files_[it->second]->path(), checkpoint.files_[i]->path());
      }
    }
  }
  for (const auto& [name, file_name] : weight_map) {
    const size_t position = file_position.at(file_name);
    if (!checkpoint.files_[position]->contains(name)) {
      fail("{}: weight_map maps tensor '{}' to {}, which has no such tensor", path, name,
           checkpoint.files_[position]->path());
    }
    checkpoint.owner_[name] = position;
  }
  for (const auto& file : checkpoint.files_) {
    for (const TensorInfo& tensor : file->tensors()) {
      if (weight_map.count(tensor.name)) checkpoint.names_.push_back(tensor.name);
    }
  }
  return checkpoint;
}

const SafetensorsFile& SafetensorsCheckpoint::file_of(const std::string& name) const {
  auto found = owner_.find(name);
  if (found == owner_.end()) fail("{}: checkpoint has no tensor named '{}'", path_, name);
  return *files_[found->second];
}

const TensorInfo& SafetensorsCheckpoint::info(const std::string& name) const {
  return file_of(name).info(name);
}

at::Tensor SafetensorsCheckpoint::view(const std::string& name) const {
  return file_of(name).view(name);
}

at::Tensor SafetensorsCheckpoint::load(const std::string& name,
                                       std::optional<at::ScalarType> dtype) const {
  return file_of(name).load(name, dtype);
}

at::Tensor SafetensorsCheckpoint::load_slice(const std::string& name, int64_t dim, int64_t start,
                                             int64_t length,
                                             std::optional<at::ScalarType> dtype) const {
  return file_of(name).load_slice(name, dim, start, length, dtype);
}

}  // namespace weft
