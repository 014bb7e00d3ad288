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

int64_t elements_of(const DLTensor& t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t.ndim; ++d) n *= t.shape[d];
  return n;
}

void require_contiguous_elements(const DLTensor& t, int64_t elements, const char* what) {
  if (elements_of(t) != elements) {
    throw Error(WEFT_STATUS_INTERNAL, std::string("zero: ") + what + " has " + std::to_string(elements_of(t)) +
                                          " elements, expected " + std::to_string(elements));
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

// Calls copy(matrix part, whole part) for the rows of piece k that hold all of it, then for the
// row that holds its beginning only. Row r's part of the piece is the whole parameter's elements
// [r * chunk + start, r * chunk + start + length), clipped to the parameter.
template <class Copy>
void for_each_piece(const FlatGroup& group, size_t k, const DLTensor& matrix, const DLTensor& whole, Copy&& copy) {
  const int64_t n = group.elements[k], chunk = group.chunks[k], start = group.starts[k], length = group.lengths[k];
  require_contiguous_elements(whole, n, "a whole parameter");
  if (length == 0) return;
  const int64_t full = n >= start + length ? std::min<int64_t>(group.ranks, (n - start - length) / chunk + 1) : 0;
  if (full > 0) {
    int64_t mshape[2] = {full, length}, mstrides[2] = {group.width, 1};
    int64_t wshape[2] = {full, length}, wstrides[2] = {chunk, 1};
    DLTensor m = view_of(matrix, group.offsets[k], 2, mshape, mstrides);
    DLTensor w = view_of(whole, start, 2, wshape, wstrides);
    copy(m, w);
  }
  const int64_t first = full * chunk + start, rest = full < group.ranks ? std::min(n - first, length) : 0;
  if (rest > 0) {
    int64_t mshape[1] = {rest}, mstrides[1] = {1};
    int64_t wshape[1] = {rest}, wstrides[1] = {1};
    DLTensor m = view_of(matrix, full * group.width + group.offsets[k], 1, mshape, mstrides);
    DLTensor w = view_of(whole, first, 1, wshape, wstrides);
    copy(m, w);
  }
}

// Calls copy(row part, shard part) for the elements of piece k that this rank's shard holds.
template <class Copy>
void with_row_part(const FlatGroup& group, size_t k, const DLTensor& row, const DLTensor& shard, Copy&& copy) {
  const int64_t n = std::min(elements_of(shard) - group.starts[k], group.lengths[k]);
  if (n <= 0) return;
  int64_t rshape[1] = {n}, rstrides[1] = {1}, sshape[1] = {n}, sstrides[1] = {1};
  DLTensor r = view_of(row, group.offsets[k], 1, rshape, rstrides);
  DLTensor s = view_of(shard, group.starts[k], 1, sshape, sstrides);
  copy(r, s);
}

}  // namespace

int64_t chunk_of(int64_t elements, int32_t ranks) { return (elements + ranks - 1) / ranks; }

weft_flat_shard shard_of(int64_t elements, int32_t ranks, int32_t rank) {
  const int64_t chunk = chunk_of(elements, ranks);
  const int64_t begin = std::min(rank * chunk, elements), end = std::min((rank + 1) * chunk, elements);
  return weft_flat_shard{begin, end - begin, 0u, 0u};
}

std::vector<FlatGroup> make_groups(const std::vector<int64_t>& parameters, const std::vector<int64_t>& elements,
                                   int32_t ranks, int64_t max_width) {
  max_width = std::max<int64_t>(max_width, 1);
  std::vector<FlatGroup> groups;
  const auto open = [&] {
    groups.emplace_back();
    groups.back().ranks = ranks;
  };
  for (size_t p = 0; p < parameters.size(); ++p) {
    const int64_t chunk = chunk_of(elements[p], ranks);
    for (int64_t start = 0; start < chunk;) {
      if (groups.empty() || groups.back().width >= max_width) open();
      FlatGroup& g = groups.back();
      const int64_t length = std::min(chunk - start, max_width - g.width);
      g.parameters.push_back(parameters[p]);
      g.elements.push_back(elements[p]);
      g.chunks.push_back(chunk);
      g.starts.push_back(start);
      g.lengths.push_back(length);
      g.offsets.push_back(g.width);
      g.width += length;
      start += length;
    }
  }
  return groups;
}

void copy_into_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole) {
  for_each_piece(group, k, matrix, whole, [&](DLTensor& m, DLTensor& w) { host.copy(m, w); });
}

void copy_from_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole) {
  for_each_piece(group, k, matrix, whole, [&](DLTensor& m, DLTensor& w) { host.copy(w, m); });
}

void copy_into_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   const DLTensor& shard) {
  with_row_part(group, k, row, shard, [&](DLTensor& r, DLTensor& s) { host.copy(r, s); });
}

void copy_from_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   const DLTensor& shard) {
  with_row_part(group, k, row, shard, [&](DLTensor& r, DLTensor& s) { host.copy(s, r); });
}

}  // namespace zero
}  // namespace weft
