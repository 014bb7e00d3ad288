#include "core/dist/mesh.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/util/error.h"

namespace weft {

const char* Mesh::name(int dim) {
  static const char* const kNames[kDims] = {"pp", "dp", "cp", "tp"};
  WEFT_CHECK(0 <= dim && dim < kDims, "no mesh dimension {}", dim);
  return kNames[dim];
}

Mesh::Mesh(std::array<int32_t, kDims> size) : size_(size) {
  for (int d = 0; d < kDims; ++d) WEFT_CHECK(size_[static_cast<size_t>(d)] >= 1, "mesh.{} must be >= 1", name(d));
}

Mesh Mesh::resolve(std::array<int32_t, kDims> requested, const std::array<bool, kDims>& owned, int32_t world) {
  int64_t known = 1;
  std::vector<int> open;  // unset sizes that take what is left
  for (int d = 0; d < kDims; ++d) {
    const int32_t s = requested[static_cast<size_t>(d)];
    WEFT_CHECK(s >= 0, "mesh.{} = {} must be >= 1 (or left out)", name(d), s);
    if (s > 0) {
      known *= s;
    } else if (d == kDP || owned[static_cast<size_t>(d)]) {
      open.push_back(d);
    } else {
      requested[static_cast<size_t>(d)] = 1;
    }
  }
  // An unset dp that no plugin owns yields to an open size that one does (a tp plugin and a pp one
  // with mesh.tp given: the pipeline takes the rest, dp stays 1).
  if (open.size() > 1 && !owned[kDP] && requested[kDP] == 0) {
    requested[kDP] = 1;
    open.erase(std::find(open.begin(), open.end(), kDP));
  }
  WEFT_CHECK(open.size() <= 1,
             "the device mesh is ambiguous: set {} in [mesh] (their product with the other sizes must be the world "
             "size {})",
             [&] {
               std::string names;
               for (int d : open) names += (names.empty() ? "mesh." : " and mesh.") + std::string(name(d));
               return names;
             }(),
             world);
  WEFT_CHECK(known >= 1 && world % known == 0,
             "the [mesh] sizes multiply to {}, which does not divide the world size {}", known, world);
  if (!open.empty()) requested[static_cast<size_t>(open.front())] = static_cast<int32_t>(world / known);
  Mesh mesh(requested);
  WEFT_CHECK(mesh.world() == world, "the device mesh {} has {} ranks but the run has {}: its sizes must multiply to the "
             "world size", mesh.describe(), mesh.world(), world);
  return mesh;
}

int32_t Mesh::world() const {
  int32_t w = 1;
  for (int32_t s : size_) w *= s;
  return w;
}

std::array<int32_t, Mesh::kDims> Mesh::coords(int32_t rank) const {
  std::array<int32_t, kDims> c{};
  for (int d = kDims - 1; d >= 0; --d) {
    c[static_cast<size_t>(d)] = rank % size_[static_cast<size_t>(d)];
    rank /= size_[static_cast<size_t>(d)];
  }
  return c;
}

int32_t Mesh::rank_of(const std::array<int32_t, kDims>& c) const {
  int32_t rank = 0;
  for (int d = 0; d < kDims; ++d) rank = rank * size_[static_cast<size_t>(d)] + c[static_cast<size_t>(d)];
  return rank;
}

std::vector<std::vector<int32_t>> Mesh::slices(int dim) const {
  std::vector<std::vector<int32_t>> out;
  for (int32_t r = 0; r < world(); ++r) {
    auto c = coords(r);
    if (c[static_cast<size_t>(dim)] != 0) continue;  // r is the lowest rank of its slice
    std::vector<int32_t> slice;
    for (int32_t i = 0; i < size(dim); ++i) {
      c[static_cast<size_t>(dim)] = i;
      slice.push_back(rank_of(c));
    }
    out.push_back(std::move(slice));
  }
  return out;
}

int32_t Mesh::slice_of(int32_t rank, int dim) const {
  const auto all = slices(dim);
  for (size_t i = 0; i < all.size(); ++i) {
    for (int32_t r : all[i]) {
      if (r == rank) return static_cast<int32_t>(i);
    }
  }
  fail("rank {} is outside the mesh {}", rank, describe());
}

bool Mesh::crosses_nodes(int dim, int32_t per_node) const {
  WEFT_CHECK(per_node > 0, "nodes of {} ranks", per_node);
  for (const auto& slice : slices(dim)) {
    for (int32_t r : slice) {
      if (r / per_node != slice.front() / per_node) return true;
    }
  }
  return false;
}

std::string Mesh::describe() const {
  std::string out;
  for (int d = 0; d < kDims; ++d) {
    if (size(d) > 1) out += fmt::format("{}{} {}", out.empty() ? "" : " x ", name(d), size(d));
  }
  return out.empty() ? "1" : out;
}

}  // namespace weft
