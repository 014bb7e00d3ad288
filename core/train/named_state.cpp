// The checkpoint format of named_state.h: reading either layout, and the shard index. Nothing
// here touches a model (named_state_model.cpp does), so the fuzz target links it alone.
#include "core/train/named_state.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {
namespace fs = std::filesystem;

std::string named_state_format::rank_file(int32_t rank) { return fmt::format("rank-{:05}.safetensors", rank); }

namespace {

using named_state_format::kIndex;
using named_state_format::kPieces;
using named_state_format::kSteps;
using named_state_format::rank_file;

// A JSON object held as text in a safetensors metadata entry.
nlohmann::json metadata_json(const SafetensorsFile& file, const char* key) {
  const auto it = file.metadata().find(key);
  if (it == file.metadata().end()) return nlohmann::json::object();
  try {
    auto j = nlohmann::json::parse(it->second);
    WEFT_CHECK(j.is_object(), "{}: metadata {} is not a JSON object", file.path(), key);
    return j;
  } catch (const nlohmann::json::exception& e) {
    fail("{}: metadata {} is not valid JSON ({})", file.path(), key, e.what());
  }
}

std::map<std::string, int64_t> read_steps(const SafetensorsFile& file) {
  std::map<std::string, int64_t> steps;
  const nlohmann::json counts = metadata_json(file, kSteps);
  for (const auto& [name, value] : counts.items()) {
    WEFT_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0, "{}: the step count of '{}' is not a count",
               file.path(), name);
    steps[name] = value.get<int64_t>();
  }
  return steps;
}

// A piece's integer field ("dim", "start", the entries of "shape"): a JSON integer within int64
// (nlohmann's get would cast a float such as 1e30, which is undefined behaviour).
int64_t integer(const nlohmann::json& value, const std::string& what, const std::string& origin) {
  WEFT_CHECK(value.is_number_integer() && !(value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(INT64_MAX)),
             "{}: {} is not an integer ({})", origin, what, value.dump());
  return value.get<int64_t>();
}

std::vector<int64_t> shape_of(const nlohmann::json& value, const std::string& what, const std::string& origin) {
  WEFT_CHECK(value.is_array(), "{}: the shape of {} is not a list", origin, what);
  std::vector<int64_t> shape;
  for (const auto& size : value) shape.push_back(integer(size, "a dimension of " + what, origin));
  return shape;
}

// Throws unless the pieces' [start, end) ranges along dimension `dim` cover [0, size) exactly once.
void check_cover(const std::string& name, std::vector<std::pair<int64_t, int64_t>> ranges, int64_t size, int64_t dim,
                 const std::string& where) {
  std::sort(ranges.begin(), ranges.end());
  int64_t end = 0;
  for (const auto& [begin, stop] : ranges) {
    WEFT_CHECK(begin == end, "{}: the pieces of '{}' {} [{}, {}) of dimension {}", where, name,
               begin < end ? "overlap at" : "leave out", std::min(begin, end), std::max(begin, end), dim);
    end = stop;
  }
  WEFT_CHECK(end == size, "{}: the pieces of '{}' cover {} of its {} rows along dimension {}", where, name, end, size,
             dim);
}

}  // namespace

void write_shard_index(const std::string& dir, int32_t world_size) {
  nlohmann::json files = nlohmann::json::array(), tensors = nlohmann::json::object();
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> covered;  // tensor -> [start, end) along dim
  std::map<std::string, std::pair<std::vector<int64_t>, int64_t>> whole;    // tensor -> (shape, dim)
  for (int32_t rank = 0; rank < world_size; ++rank) {
    const std::string file = rank_file(rank);
    auto shard = SafetensorsFile::open((fs::path(dir) / file).string());
    files.push_back(file);
    const nlohmann::json pieces = metadata_json(*shard, kPieces);
    for (const auto& [name, piece] : pieces.items()) {
      const auto& info = shard->info(name);
      const auto shape = shape_of(piece.at("shape"), name, file);
      const int64_t dim = integer(piece.at("dim"), name, file), start = integer(piece.at("start"), name, file);
      auto [it, fresh] = whole.emplace(name, std::make_pair(shape, dim));
      WEFT_CHECK(it->second.first == shape && (info.shape.size() <= 1 || it->second.second == dim),
                 "checkpoint: the pieces of '{}' disagree on its shape ({} in {})", name, fmt::join(shape, "x"), file);
      const int64_t length = info.shape.empty() ? 1 : info.shape[static_cast<size_t>(dim)];
      covered[name].emplace_back(start, start + length);
      tensors[name].push_back(file);
    }
  }
  for (auto& [name, ranges] : covered) {
    const auto& [shape, dim] = whole.at(name);
    check_cover(name, ranges, shape.empty() ? 1 : shape[static_cast<size_t>(dim)], dim, "checkpoint");
  }
  const nlohmann::json index = {
      {"format", "weft-shards"}, {"version", 1}, {"world_size", world_size}, {"files", files}, {"tensors", tensors}};
  write_file_atomically((fs::path(dir) / kIndex).string(), index.dump(1) + "\n");
}

NamedState NamedState::open(const std::string& dir) {
  NamedState state;
  state.dir_ = dir;
  const fs::path index_path = fs::path(dir) / "shards" / kIndex;
  if (!fs::exists(index_path)) {
    const fs::path optimizer = fs::path(dir) / "optimizer.safetensors";
    if (fs::exists(optimizer)) {
      state.optimizer_ = SafetensorsFile::open(optimizer.string());
      state.steps_ = read_steps(*state.optimizer_);
    }
    return state;
  }
  state.sharded_ = true;
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_file(index_path.string()));
    WEFT_CHECK(index.value("format", "") == "weft-shards" && index.value("version", 0) == 1,
               "{}: not a weft-shards index of version 1", index_path.string());
    for (const auto& file : index.at("files")) {
      const std::string name = file.get<std::string>();
      WEFT_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..",
                 "{}: '{}' is not a file name", index_path.string(), name);
      auto shard = SafetensorsFile::open((index_path.parent_path() / name).string());
      for (const auto& [step_name, count] : read_steps(*shard)) state.steps_[step_name] = count;
      const nlohmann::json pieces = metadata_json(*shard, kPieces);
      for (const auto& [name_in_file, piece] : pieces.items()) {
        Piece p;
        p.file = shard;
        p.shape = shape_of(piece.at("shape"), name_in_file, shard->path());
        p.dim = integer(piece.at("dim"), name_in_file, shard->path());
        p.start = integer(piece.at("start"), name_in_file, shard->path());
        const auto& info = shard->info(name_in_file);
        WEFT_CHECK(info.shape.size() == p.shape.size() && p.dim >= 0 &&
                       (p.shape.empty() || p.dim < static_cast<int64_t>(p.shape.size())),
                   "{}: the piece '{}' does not match its whole shape", shard->path(), name_in_file);
        for (size_t d = 0; d < p.shape.size(); ++d) {
          const bool cut = static_cast<int64_t>(d) == p.dim;
          WEFT_CHECK(cut ? p.start >= 0 && p.start <= p.shape[d] - info.shape[d] : info.shape[d] == p.shape[d],
                     "{}: the piece '{}' ({} at {}) lies outside its whole shape {}", shard->path(), name_in_file,
                     fmt::join(info.shape, "x"), p.start, fmt::join(p.shape, "x"));
        }
        state.pieces_[name_in_file].push_back(std::move(p));
      }
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed shard index or piece metadata ({})", index_path.string(), e.what());
  }
  // Every tensor whole from its pieces, each part once (so no whole is larger than its pieces).
  for (const auto& [name, pieces] : state.pieces_) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    const Piece& first = pieces.front();
    for (const auto& piece : pieces) {
      WEFT_CHECK(piece.shape == first.shape && piece.dim == first.dim, "{}: the pieces of '{}' disagree on its shape",
                 piece.file->path(), name);
      const auto& shape = piece.file->info(name).shape;
      ranges.emplace_back(piece.start, piece.start + (shape.empty() ? 1 : shape[static_cast<size_t>(piece.dim)]));
    }
    check_cover(name, ranges, first.shape.empty() ? 1 : first.shape[static_cast<size_t>(first.dim)], first.dim,
                index_path.string());
  }
  return state;
}

std::optional<at::Tensor> NamedState::whole(const std::string& name) const {
  if (!sharded_) {
    if (optimizer_ == nullptr || !optimizer_->contains(name)) return std::nullopt;
    return optimizer_->load(name, torch::kFloat32);
  }
  const auto it = pieces_.find(name);
  if (it == pieces_.end()) return std::nullopt;
  const auto& first = it->second.front();
  auto out = torch::empty(first.shape, torch::kFloat32);
  if (first.shape.empty()) return out.copy_(first.file->load(name, torch::kFloat32));
  for (const auto& piece : it->second) {  // open() checked that they cover it exactly once
    const auto values = piece.file->load(name, torch::kFloat32);
    out.narrow(piece.dim, piece.start, values.size(piece.dim)).copy_(values);
  }
  return out;
}

std::vector<std::string> NamedState::names() const {
  std::vector<std::string> out;
  for (const auto& item : pieces_) out.push_back(item.first);
  return out;
}

std::optional<int64_t> NamedState::step(const std::string& parameter) const {
  const auto it = steps_.find(parameter);
  if (it == steps_.end()) return std::nullopt;
  return it->second;
}

}  // namespace weft
