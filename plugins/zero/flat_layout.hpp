// flat_layout.hpp - how zero.so cuts parameters into per-rank flat shards and packs a group of
// them into one collective. SDK only (no LibTorch); pure arithmetic plus the copies between a
// whole parameter and its place in a group's buffer.
//
// A parameter of n elements over R ranks: chunk = ceil(n / R); rank r keeps the flattened
// elements [min(r * chunk, n), min((r + 1) * chunk, n)) (the last ranks' shards may be shorter or
// empty: uneven shards). A group (one model stage's parameters) is an [R, width] matrix: parameter
// k takes columns [offset_k, offset_k + chunk_k) and row r holds rank r's shard there, padded with
// zeros. Row r alone is what rank r contributes to an all_gather (its shards), or what it
// receives from a reduce_scatter (the reduced gradient of its shards); the whole matrix is a whole
// group, every parameter's elements in order within its columns.
#ifndef WEFT_PLUGINS_ZERO_FLAT_LAYOUT_HPP
#define WEFT_PLUGINS_ZERO_FLAT_LAYOUT_HPP

#include <cstdint>
#include <vector>

#include <weft/strategy.hpp>

namespace weft {
namespace zero {

// Elements per rank of a parameter of `elements` over `ranks`: ceil(elements / ranks).
int64_t chunk_of(int64_t elements, int32_t ranks);
// Rank `rank`'s shard of a parameter of `elements` over `ranks` (flags 0).
weft_flat_shard shard_of(int64_t elements, int32_t ranks, int32_t rank);

struct FlatGroup {
  std::vector<int64_t> parameters;  // host parameter indices, in model order
  std::vector<int64_t> elements;    // each one's element count (this rank's local tensor)
  std::vector<int64_t> chunks;      // chunk_of(elements, ranks)
  std::vector<int64_t> offsets;     // first column in a row
  int64_t width = 0;                // the sum of the chunks
  int32_t ranks = 1;
};

// The layout of `parameters` (with their element counts) over `ranks`.
FlatGroup make_group(const std::vector<int64_t>& parameters, const std::vector<int64_t>& elements, int32_t ranks);

// Copies between the whole parameter k of `group` (a contiguous view of its elements) and its
// columns of `matrix` ([ranks, width] contiguous, the same dtype): the whole rows and the partial
// last one, two strided copies through the host. Padding is never written.
void copy_into_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole);
void copy_from_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole);
// Copies between this rank's shard of parameter k (`count` elements: its flat_shard's count) and
// its columns of `row` ([width] contiguous).
void copy_into_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   const DLTensor& shard);
void copy_from_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   DLTensor& shard);

}  // namespace zero
}  // namespace weft

#endif  // WEFT_PLUGINS_ZERO_FLAT_LAYOUT_HPP
