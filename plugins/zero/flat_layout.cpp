#include "flat_layout.hpp"

#include <algorithm>
#include <string>

namespace weft {
namespace zero {
namespace {

using weft::sdk::Error;

// A view of `base`'s memory starting `offset` elements in, with `ndim` (1 or 2) extents and
// strides in elements; `shape` and `strides` must outlive the view.
DLTensor view_of(const DLTensor& base, int64_t offset, int32_t ndim, int64_t* shape, int64_t* strides) {
  DLTensor view = base;
  view.ndim = ndim;
  view.shape = shape;
  view.strides = strides;
  view.byte_offset = base.byte_offset + static_cast<uint64_t>(offset) * ((base.dtype.bits * base.dtype.lanes + 7) / 8);
  return view;
}

void require_contiguous_elements(const DLTensor& t, int64_t elements, const char* what) {
  int64_t n = 1;
  for (int32_t d = 0; d < t.ndim; ++d) n *= t.shape[d];
  if (n != elements) {
    throw Error(WEFT_STATUS_INTERNAL, std::string("zero: ") + what + " has " + std::to_string(n) + " elements, expected " +
                                          std::to_string(elements));
  }
  if (t.strides != nullptr) {  // row-major contiguous
    int64_t expected = 1;
    for (int32_t d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] != 1 && t.strides[d] != expected) {
        throw Error(WEFT_STATUS_UNSUPPORTED, std::string("zero: ") + what + " is not contiguous");
      }
      expected *= t.shape[d];
    }
  }
}

// Calls copy(matrix piece, flat piece) for the whole rows and the partial row of parameter k.
template <class Copy>
void for_each_piece(const FlatGroup& group, size_t k, const DLTensor& matrix, const DLTensor& whole, Copy&& copy) {
  const int64_t n = group.elements[k], chunk = group.chunks[k];
  require_contiguous_elements(whole, n, "a whole parameter");
  if (n == 0) return;
  const int64_t rows = n / chunk, rest = n - rows * chunk;
  if (rows > 0) {
    int64_t mshape[2] = {rows, chunk}, mstrides[2] = {group.width, 1};
    int64_t fshape[1] = {rows * chunk}, fstrides[1] = {1};
    DLTensor m = view_of(matrix, group.offsets[k], 2, mshape, mstrides);
    DLTensor f = view_of(whole, 0, 1, fshape, fstrides);
    copy(m, f);
  }
  if (rest > 0) {
    int64_t mshape[1] = {rest}, mstrides[1] = {1};
    int64_t fshape[1] = {rest}, fstrides[1] = {1};
    DLTensor m = view_of(matrix, rows * group.width + group.offsets[k], 1, mshape, mstrides);
    DLTensor f = view_of(whole, rows * chunk, 1, fshape, fstrides);
    copy(m, f);
  }
}

}  // namespace

int64_t chunk_of(int64_t elements, int32_t ranks) { return (elements + ranks - 1) / ranks; }

weft_flat_shard shard_of(int64_t elements, int32_t ranks, int32_t rank) {
  const int64_t chunk = chunk_of(elements, ranks);
  const int64_t begin = std::min(rank * chunk, elements), end = std::min((rank + 1) * chunk, elements);
  return weft_flat_shard{begin, end - begin, 0u, 0u};
}

FlatGroup make_group(const std::vector<int64_t>& parameters, const std::vector<int64_t>& elements, int32_t ranks) {
  FlatGroup group;
  group.parameters = parameters;
  group.elements = elements;
  group.ranks = ranks;
  for (int64_t n : elements) {
    group.chunks.push_back(chunk_of(n, ranks));
    group.offsets.push_back(group.width);
    group.width += group.chunks.back();
  }
  return group;
}

void copy_into_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole) {
  for_each_piece(group, k, matrix, whole, [&](DLTensor& m, DLTensor& f) { host.copy(m, f); });
}

void copy_from_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole) {
  for_each_piece(group, k, matrix, whole, [&](DLTensor& m, DLTensor& f) { host.copy(f, m); });
}

void copy_into_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   const DLTensor& shard) {
  int64_t n = 1;
  for (int32_t d = 0; d < shard.ndim; ++d) n *= shard.shape[d];
  if (n == 0) return;
  int64_t shape[1] = {n}, strides[1] = {1};
  DLTensor part = view_of(row, group.offsets[k], 1, shape, strides);
  host.copy(part, shard);
}

void copy_from_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   DLTensor& shard) {
  int64_t n = 1;
  for (int32_t d = 0; d < shard.ndim; ++d) n *= shard.shape[d];
  if (n == 0) return;
  int64_t shape[1] = {n}, strides[1] = {1};
  DLTensor part = view_of(row, group.offsets[k], 1, shape, strides);
  host.copy(shard, part);
}

}  // namespace zero
}  // namespace weft
