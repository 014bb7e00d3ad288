// flat_layout.hpp - how zero.so cuts parameters into per-rank flat shards and packs them into
// collectives of bounded size. SDK only (no LibTorch); pure arithmetic plus the copies between a
// whole parameter and its place in a collective's buffer.
//
// A parameter of n elements over R ranks: chunk = ceil(n / R); rank r keeps the flattened
// elements [min(r * chunk, n), min((r + 1) * chunk, n)) (the last ranks' shards may be shorter or
// empty: uneven shards). A group is one collective: an [R, width] matrix whose columns hold pieces
// of parameters; a piece is the elements [start, start + length) of every rank's chunk of one
// parameter, and row r holds rank r's part of each piece (padded with zeros where its shard is
// shorter). Row r alone is what rank r contributes to an all_gather (its shards), or receives from
// a reduce_scatter (the reduced gradient of its shards). A parameter whose chunk is wider than a
// group may be splits into several pieces, in consecutive groups, so that no collective (and no
// buffer) exceeds the width asked for.
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

// One collective's layout; every vector has one entry per piece.
struct FlatGroup {
  std::vector<int64_t> parameters;  // host parameter index of each piece
  std::vector<int64_t> elements;    // its parameter's element count (this rank's local tensor)
  std::vector<int64_t> chunks;      // chunk_of(elements, ranks)
  std::vector<int64_t> starts;      // the piece's first element within each rank's chunk
  std::vector<int64_t> lengths;     // the piece's columns
  std::vector<int64_t> offsets;     // its first column
  int64_t width = 0;                // the sum of the lengths
  int32_t ranks = 1;
};

// `parameters` (with their element counts, in order) over `ranks`, in groups of at most
// `max_width` columns (>= 1): a parameter's chunk is cut into pieces where it does not fit.
// Parameters with no elements take no columns. Every rank computes the same groups.
std::vector<FlatGroup> make_groups(const std::vector<int64_t>& parameters, const std::vector<int64_t>& elements,
                                   int32_t ranks, int64_t max_width);

// Copies between the whole parameter of piece k (a contiguous view of its elements) and the
// piece's columns of `matrix` ([ranks, width] contiguous, the same dtype): the rows that hold
// whole pieces in one strided copy, the partial one in another. Padding is never written.
void copy_into_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole);
void copy_from_matrix(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& matrix,
                      const DLTensor& whole);
// Copies between this rank's shard of piece k's parameter (1-D, its flat_shard's count elements)
// and the piece's columns of `row` ([width] contiguous).
void copy_into_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   const DLTensor& shard);
void copy_from_row(const weft::sdk::Host& host, const FlatGroup& group, size_t k, const DLTensor& row,
                   const DLTensor& shard);

}  // namespace zero
}  // namespace weft

#endif  // WEFT_PLUGINS_ZERO_FLAT_LAYOUT_HPP
