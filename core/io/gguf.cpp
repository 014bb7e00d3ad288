// Reading GGUF files: the header's validation (gguf.h) and the tensors' bytes. Dequantization
// lives in gguf_quants.cpp.
#include "core/io/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "core/io/mapped_file.h"
#include "core/util/error.h"

namespace weft {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;          // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;
constexpr int64_t kMaxElements = int64_t{1} << 56;

enum ValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

const char* value_type_name(uint32_t type) {
  static const char* names[] = {"uint8", "int8",   "uint16", "int16",  "uint32", "int32", "float32",
                                "bool",  "string", "array",  "uint64", "int64",  "float64"};
  return type <= kF64 ? names[type] : "unknown";
}

uint64_t scalar_bytes(uint32_t type) {
  switch (type) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    case kString: return 8;  // at least its length
    case kArray: return 12;  // at least its element type and count
    default: return 0;
  }
}

// ggml's types (ggml.h): name and block (values, bytes); one entry per value ggml defines.
struct TypeInfo {
  uint32_t type;
  const char* name;
  int64_t block_values, block_bytes;
};
constexpr TypeInfo kTypes[] = {
    {0, "F32", 1, 4},         {1, "F16", 1, 2},         {2, "Q4_0", 32, 18},      {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},      {7, "Q5_1", 32, 24},      {8, "Q8_0", 32, 34},      {9, "Q8_1", 32, 40},
    {10, "Q2_K", 256, 84},    {11, "Q3_K", 256, 110},   {12, "Q4_K", 256, 144},   {13, "Q5_K", 256, 176},
    {14, "Q6_K", 256, 210},   {15, "Q8_K", 256, 292},   {16, "IQ2_XXS", 256, 66}, {17, "IQ2_XS", 256, 74},
    {18, "IQ3_XXS", 256, 98}, {19, "IQ1_S", 256, 50},   {20, "IQ4_NL", 32, 18},   {21, "IQ3_S", 256, 110},
    {22, "IQ2_S", 256, 82},   {23, "IQ4_XS", 256, 136}, {24, "I8", 1, 1},         {25, "I16", 1, 2},
    {26, "I32", 1, 4},        {27, "I64", 1, 8},        {28, "F64", 1, 8},        {29, "IQ1_M", 256, 56},
    {30, "BF16", 1, 2},       {34, "TQ1_0", 256, 54},   {35, "TQ2_0", 256, 66},   {39, "MXFP4", 32, 17},
};

const TypeInfo* type_info(uint32_t type) {
  for (const TypeInfo& info : kTypes) {
    if (info.type == type) return &info;
  }
  return nullptr;
}

// Bounded reads over the mapping: every read checks the bytes that remain.
class Reader {
 public:
  Reader(const uint8_t* data, uint64_t size, const std::string& path) : data_(data), size_(size), path_(path) {}
  uint64_t position() const { return position_; }
  uint64_t left() const { return size_ - position_; }

  [[noreturn]] void fail(const std::string& problem) const {
    throw Error(fmt::format("{}: not a valid GGUF file: {}", path_, problem));
  }
  void need(uint64_t bytes, const char* what) const {
    if (bytes > left()) {
      fail(fmt::format("{} needs {} bytes at byte {}, but the file ends {} bytes later", what, bytes, position_, left()));
    }
  }
  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T value;
    std::memcpy(&value, data_ + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }
  std::string string(const char* what) {
    const auto length = read<uint64_t>(what);
    need(length, what);
    std::string out(reinterpret_cast<const char*>(data_ + position_), static_cast<size_t>(length));
    position_ += length;
    return out;
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t position_ = 0;
  const std::string& path_;
};

int64_t read_integer(Reader& in, uint32_t type, bool& overflow, const char* what) {
  overflow = false;
  switch (type) {
    case kU8: return in.read<uint8_t>(what);
    case kI8: return in.read<int8_t>(what);
    case kU16: return in.read<uint16_t>(what);
    case kI16: return in.read<int16_t>(what);
    case kU32: return in.read<uint32_t>(what);
    case kI32: return in.read<int32_t>(what);
    case kBool: {
      const auto b = in.read<uint8_t>(what);
      if (b > 1) in.fail(fmt::format("{} is a bool of value {}", what, b));
      return b;
    }
    case kI64: return in.read<int64_t>(what);
    case kU64: {
      const auto u = in.read<uint64_t>(what);
      overflow = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      return overflow ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(u);
    }
    default: return 0;
  }
}

bool is_integer(uint32_t type) { return type <= kI32 ? type != kF32 : type == kBool || type == kU64 || type == kI64; }
bool is_float(uint32_t type) { return type == kF32 || type == kF64; }

double read_float(Reader& in, uint32_t type, const char* what) {
  return type == kF32 ? static_cast<double>(in.read<float>(what)) : in.read<double>(what);
}

void skip_array(Reader& in, int depth, const std::string& key);

GgufValue read_value(Reader& in, uint32_t type, const std::string& key) {
  GgufValue value;
  value.type = type;
  const char* what = "a metadata value";
  if (is_integer(type)) {
    value.integer = read_integer(in, type, value.integer_overflow, what);
  } else if (is_float(type)) {
    value.number = read_float(in, type, what);
  } else if (type == kString) {
    value.text = in.string(what);
  } else if (type == kArray) {
    value.element_type = in.read<uint32_t>("an array's element type");
    value.count = in.read<uint64_t>("an array's length");
    const uint64_t each = scalar_bytes(value.element_type);
    if (each == 0) in.fail(fmt::format("metadata '{}' is an array of unknown type {}", key, value.element_type));
    if (value.count > in.left() / each) {
      in.fail(fmt::format("metadata '{}' is an array of {} {} values, more than the {} bytes left could hold", key,
                          value.count, value_type_name(value.element_type), in.left()));
    }
    const auto n = static_cast<size_t>(value.count);
    if (is_integer(value.element_type)) {
      value.integers.reserve(n);
      bool overflow = false;
      for (size_t i = 0; i < n; ++i) value.integers.push_back(read_integer(in, value.element_type, overflow, what));
    } else if (is_float(value.element_type)) {
      value.numbers.reserve(n);
      for (size_t i = 0; i < n; ++i) value.numbers.push_back(read_float(in, value.element_type, what));
    } else if (value.element_type == kString) {
      value.texts.reserve(n);
      for (size_t i = 0; i < n; ++i) value.texts.push_back(in.string("a string of an array"));
    } else {  // arrays of arrays: skipped, their bytes checked
      for (size_t i = 0; i < n; ++i) skip_array(in, 1, key);
    }
  } else {
    in.fail(fmt::format("metadata '{}' has unknown value type {}", key, type));
  }
  return value;
}

void skip_array(Reader& in, int depth, const std::string& key) {
  if (depth > kMaxArrayDepth) in.fail(fmt::format("metadata '{}' nests arrays more than {} deep", key, kMaxArrayDepth));
  const auto type = in.read<uint32_t>("an array's element type");
  const auto count = in.read<uint64_t>("an array's length");
  const uint64_t each = scalar_bytes(type);
  if (each == 0) in.fail(fmt::format("metadata '{}' is an array of unknown type {}", key, type));
  if (count > in.left() / each) in.fail(fmt::format("metadata '{}' has an array longer than the file", key));
  for (uint64_t i = 0; i < count; ++i) {
    if (type == kArray) {
      skip_array(in, depth + 1, key);
    } else if (type == kString) {
      (void)in.string("a string of an array");
    } else {
      in.need(each, "an array's element");
      (void)read_value(in, type, key);
    }
  }
}

}  // namespace

bool is_gguf_path(const std::string& path) {
  if (path.size() < 5) return false;
  std::string tail = path.substr(path.size() - 5);
  std::transform(tail.begin(), tail.end(), tail.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return tail == ".gguf";
}

std::string ggml_type_name(uint32_t type) {
  const TypeInfo* info = type_info(type);
  return info != nullptr ? info->name : fmt::format("type {}", type);
}

std::shared_ptr<GgufFile> GgufFile::open(const std::string& path) {
  std::shared_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->mapping_ = MappedFile::open(path);
  Reader in(file->mapping_->data(), file->mapping_->size(), file->path_);
  if (in.read<uint32_t>("the magic") != kMagic) in.fail("it does not start with the magic \"GGUF\"");
  file->version_ = in.read<uint32_t>("the version");
  if (file->version_ != 2 && file->version_ != 3) {
    in.fail(fmt::format("version {} (weft reads versions 2 and 3, little-endian)", file->version_));
  }
  const auto tensor_count = in.read<uint64_t>("the tensor count");
  const auto key_count = in.read<uint64_t>("the metadata count");
  // Each metadata entry takes at least 8 + 4 + 1 bytes, each tensor 8 + 4 + 8 + 4 + 8.
  if (key_count > in.left() / 13) in.fail(fmt::format("{} metadata entries do not fit in the file", key_count));
  for (uint64_t k = 0; k < key_count; ++k) {
    std::string key = in.string("a metadata key");
    const auto type = in.read<uint32_t>("a metadata value type");
    GgufValue value = read_value(in, type, key);
    if (!file->values_.emplace(key, std::move(value)).second) in.fail(fmt::format("metadata '{}' appears twice", key));
    file->keys_.push_back(std::move(key));
  }
  uint64_t alignment = kDefaultAlignment;
  if (const GgufValue* a = file->value("general.alignment")) {
    if (!is_integer(a->type) || a->integer <= 0 || (a->integer & (a->integer - 1)) != 0 || a->integer > (1 << 20)) {
      in.fail(fmt::format("general.alignment must be a power of two up to 2^20, got {}", a->integer));
    }
    alignment = static_cast<uint64_t>(a->integer);
  }
  if (tensor_count > in.left() / 32) in.fail(fmt::format("{} tensors do not fit in the file", tensor_count));
  for (uint64_t t = 0; t < tensor_count; ++t) {
    GgufTensor tensor;
    tensor.name = in.string("a tensor name");
    const auto dims = in.read<uint32_t>("a tensor's dimension count");
    if (dims < 1 || dims > kMaxDims) {
      in.fail(fmt::format("tensor '{}' has {} dimensions (1 to {})", tensor.name, dims, kMaxDims));
    }
    std::vector<int64_t> ne;
    int64_t numel = 1;
    for (uint32_t d = 0; d < dims; ++d) {
      const auto n = in.read<uint64_t>("a tensor's dimension");
      if (n == 0 || n > static_cast<uint64_t>(kMaxElements) || static_cast<int64_t>(n) > kMaxElements / numel) {
        in.fail(fmt::format("tensor '{}' has a dimension of {} (at least 1, and at most 2^56 values in all)",
                            tensor.name, n));
      }
      ne.push_back(static_cast<int64_t>(n));
      numel *= static_cast<int64_t>(n);
    }
    tensor.type = in.read<uint32_t>("a tensor's type");
    const TypeInfo* info = type_info(tensor.type);
    if (info == nullptr) in.fail(fmt::format("tensor '{}' has ggml type {}, which ggml does not define", tensor.name, tensor.type));
    const int64_t block_values = info->block_values, block_bytes = info->block_bytes;
    if (ne[0] % block_values != 0) {
      in.fail(fmt::format("tensor '{}' is {} with rows of {} values, not whole blocks of {}", tensor.name,
                          ggml_type_name(tensor.type), ne[0], block_values));
    }
    tensor.numel = numel;
    tensor.nbytes = static_cast<uint64_t>(numel / block_values) * static_cast<uint64_t>(block_bytes);
    tensor.offset = in.read<uint64_t>("a tensor's offset");
    if (tensor.offset % alignment != 0) {
      in.fail(fmt::format("tensor '{}' starts at offset {}, not a multiple of the alignment {}", tensor.name,
                          tensor.offset, alignment));
    }
    tensor.shape.assign(ne.rbegin(), ne.rend());
    if (!file->tensor_index_.emplace(tensor.name, file->tensors_.size()).second) {
      in.fail(fmt::format("tensor '{}' appears twice", tensor.name));
    }
    file->tensors_.push_back(std::move(tensor));
  }
  // The data region: at the next multiple of the alignment.
  const uint64_t header_end = in.position();
  const uint64_t data_start = (header_end + alignment - 1) / alignment * alignment;
  const uint64_t size = file->mapping_->size();
  const uint64_t data_bytes = data_start <= size ? size - data_start : 0;
  std::vector<std::pair<uint64_t, size_t>> ranges;
  for (size_t i = 0; i < file->tensors_.size(); ++i) {
    GgufTensor& tensor = file->tensors_[i];
    if (tensor.offset > data_bytes || tensor.nbytes > data_bytes - tensor.offset) {
      in.fail(fmt::format("tensor '{}' ({} bytes at offset {}) runs past the end of the data region ({} bytes)",
                          tensor.name, tensor.nbytes, tensor.offset, data_bytes));
    }
    ranges.emplace_back(tensor.offset, i);
    tensor.offset += data_start;
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t k = 1; k < ranges.size(); ++k) {
    const GgufTensor& before = file->tensors_[ranges[k - 1].second];
    const GgufTensor& after = file->tensors_[ranges[k].second];
    if (before.offset + before.nbytes > after.offset) {
      in.fail(fmt::format("tensors '{}' and '{}' overlap", before.name, after.name));
    }
  }
  return file;
}

const GgufTensor* GgufFile::find(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue* GgufFile::value(const std::string& key) const {
  const auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

std::optional<int64_t> GgufFile::get_int(const std::string& key) const {
  const GgufValue* v = value(key);
  if (v == nullptr) return std::nullopt;
  WEFT_CHECK(is_integer(v->type) && v->type != kBool && !v->integer_overflow,
             "{}: GGUF metadata '{}' is a {} where an integer is expected", path_, key, value_type_name(v->type));
  return v->integer;
}

std::optional<double> GgufFile::get_float(const std::string& key) const {
  const GgufValue* v = value(key);
  if (v == nullptr) return std::nullopt;
  if (is_integer(v->type) && v->type != kBool) return static_cast<double>(v->integer);
  WEFT_CHECK(is_float(v->type), "{}: GGUF metadata '{}' is a {} where a number is expected", path_, key,
             value_type_name(v->type));
  return v->number;
}

std::optional<std::string> GgufFile::get_string(const std::string& key) const {
  const GgufValue* v = value(key);
  if (v == nullptr) return std::nullopt;
  WEFT_CHECK(v->type == kString, "{}: GGUF metadata '{}' is a {} where a string is expected", path_, key,
             value_type_name(v->type));
  return v->text;
}

std::optional<bool> GgufFile::get_bool(const std::string& key) const {
  const GgufValue* v = value(key);
  if (v == nullptr) return std::nullopt;
  WEFT_CHECK(v->type == kBool, "{}: GGUF metadata '{}' is a {} where a bool is expected", path_, key,
             value_type_name(v->type));
  return v->integer != 0;
}

const uint8_t* GgufFile::data(const GgufTensor& tensor) const { return mapping_->data() + tensor.offset; }

void GgufFile::dequantize(const GgufTensor& tensor, float* out) const {
  WEFT_CHECK(ggml_type_dequantizable(tensor.type), "{}: tensor '{}' is {}, a type weft does not dequantize ({})", path_,
             tensor.name, ggml_type_name(tensor.type), ggml_dequantizable_names());
  dequantize_ggml(tensor.type, data(tensor), tensor.numel, out);
}

}  // namespace weft
