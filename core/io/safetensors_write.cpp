// Writing safetensors files and HF-style sharded checkpoints.
#include <cstring>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/util/fs.h"
#include "core/io/safetensors.h"
#include "core/util/error.h"

namespace weft {
namespace {

namespace fs = std::filesystem;

uint64_t tensor_nbytes(const at::Tensor& tensor) {
  return static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
}

// Rejects anything that would make a bad file, before any file is touched. `target` names the
// destination in messages.
void check_tensors(const NamedTensors& tensors, const std::string& target) {
  std::set<std::string> seen;
  for (const auto& [name, tensor] : tensors) {
    WEFT_CHECK(!name.empty(), "{}: cannot save a tensor with an empty name", target);
    WEFT_CHECK(name != "__metadata__", "{}: cannot save a tensor named __metadata__", target);
    WEFT_CHECK(seen.insert(name).second, "{}: duplicate tensor name '{}'", target, name);
    try {
      (void)nlohmann::json(name).dump();
    } catch (const nlohmann::json::exception&) {
      fail("{}: tensor name '{}' is not valid UTF-8", target, name);
    }
    WEFT_CHECK(tensor.defined(), "{}: tensor '{}' is undefined", target, name);
    WEFT_CHECK(tensor.layout() == at::kStrided, "{}: tensor '{}' is not a dense (strided) tensor",
               target, name);
    WEFT_CHECK(safetensors_dtype_name(tensor.scalar_type()).has_value(),
               "{}: tensor '{}' has dtype {}, which safetensors cannot store", target, name,
               c10::toString(tensor.scalar_type()));
  }
}

std::string encode_header(const NamedTensors& tensors,
                          const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json& meta = header["__metadata__"] = nlohmann::ordered_json::object();
  for (const auto& [key, value] : metadata) meta[key] = value;
  if (!meta.contains("format")) meta["format"] = "pt";
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const uint64_t end = offset + tensor_nbytes(tensor);
    header[name] = {{"dtype", *safetensors_dtype_name(tensor.scalar_type())},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

std::string shard_file_name(size_t index, size_t count) {
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", index + 1, count);
}

// Greedy packing in the given order; a tensor over the limit gets a shard of its own.
std::vector<NamedTensors> split_into_shards(const NamedTensors& tensors, uint64_t max_shard_bytes) {
  std::vector<NamedTensors> shards;
  uint64_t shard_bytes = 0;
  for (const auto& named : tensors) {
    const uint64_t bytes = tensor_nbytes(named.second);
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(named);
    shard_bytes += bytes;
  }
  return shards;
}

void remove_stale(const fs::path& file) {
  std::error_code error;
  fs::remove(file, error);
  WEFT_CHECK(!error, "{}: cannot remove stale file: {}", file.string(), error.message());
}

void write_text_atomically(const std::string& path, const std::string& text) {
  write_file_atomically(path, [&](const ByteSink& sink) { sink(text.data(), text.size()); });
}

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  check_tensors(tensors, path);
  const std::string encoded = encode_header(tensors, metadata);
  write_file_atomically(path, [&](const ByteSink& sink) {
    uint8_t length[8];
    uint64_t size = encoded.size();
    std::memcpy(length, &size, sizeof length);  // little-endian host (see safetensors.cpp)
    sink(length, sizeof length);
    sink(encoded.data(), encoded.size());
    for (const auto& named : tensors) {
      const at::Tensor cpu = named.second.detach().to(at::kCPU).contiguous();
      if (cpu.numel() > 0) sink(cpu.data_ptr(), tensor_nbytes(cpu));
    }
  });
}

void save_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                              uint64_t max_shard_bytes,
                              const std::map<std::string, std::string>& metadata) {
  WEFT_CHECK(max_shard_bytes > 0, "{}: max_shard_bytes must be positive", dir);
  check_tensors(tensors, dir);
  std::error_code error;
  fs::create_directories(dir, error);
  WEFT_CHECK(!error, "{}: cannot create directory: {}", dir, error.message());

  const fs::path root(dir);
  uint64_t total_bytes = 0;
  for (const auto& named : tensors) total_bytes += tensor_nbytes(named.second);
  if (total_bytes <= max_shard_bytes) {
    save_safetensors((root / "model.safetensors").string(), tensors, metadata);
    remove_stale(root / "model.safetensors.index.json");
    return;
  }

  const std::vector<NamedTensors> shards = split_into_shards(tensors, max_shard_bytes);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file_name = shard_file_name(i, shards.size());
    save_safetensors((root / file_name).string(), shards[i], metadata);
    for (const auto& named : shards[i]) weight_map[named.first] = file_name;
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                                {"weight_map", weight_map}};
  write_text_atomically((root / "model.safetensors.index.json").string(), index.dump(2) + "\n");
  remove_stale(root / "model.safetensors");
}

}  // namespace weft
