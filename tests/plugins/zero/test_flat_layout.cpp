// zero.so's flat shards and group layout: every element of a parameter belongs to exactly one
// rank's shard for any world size (uneven ones included), and the copies between whole
// parameters, a group's [ranks, width] matrix and one rank's row put every element where the
// collectives expect it and back. The copies run through a host's tensor_copy (here the fake
// host's, over host memory).
#include <cstdint>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "common/fake_host.h"

#include "../../../plugins/zero/flat_layout.cpp"

namespace {

using weft::zero::chunk_of;
using weft::zero::FlatGroup;
using weft::zero::shard_of;

DLTensor view_of(std::vector<float>& values, int64_t& extent) {
  extent = static_cast<int64_t>(values.size());
  DLTensor t{};
  t.data = values.data();
  t.device = {kDLCPU, 0};
  t.ndim = 1;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = &extent;
  t.strides = nullptr;
  return t;
}

TEST(ZeroFlatLayout, ShardsCoverEveryElementOnceForAnyWorldSize) {
  for (int64_t elements : {0, 1, 2, 3, 7, 64, 65, 4097}) {
    for (int32_t ranks : {1, 2, 3, 4, 5, 8}) {
      int64_t next = 0;
      for (int32_t rank = 0; rank < ranks; ++rank) {
        const weft_flat_shard shard = shard_of(elements, ranks, rank);
        EXPECT_LE(shard.count, chunk_of(elements, ranks));
        EXPECT_GE(shard.count, 0);
        if (shard.count > 0) {
          EXPECT_EQ(shard.begin, next) << elements << " over " << ranks << ", rank " << rank;
          next = shard.begin + shard.count;
        }
        EXPECT_EQ(shard.flags, 0u);
      }
      EXPECT_EQ(next, elements) << elements << " over " << ranks;
    }
  }
  // 3 over 4 ranks: ranks 0-2 one element each, rank 3 none (an empty shard).
  EXPECT_EQ(shard_of(3, 4, 3).count, 0);
  EXPECT_EQ(shard_of(3, 4, 2).begin, 2);
  // 65 over 3: chunks of 22, the last rank 21.
  EXPECT_EQ(shard_of(65, 3, 2).begin, 44);
  EXPECT_EQ(shard_of(65, 3, 2).count, 21);
}

// Every group's [ranks, width] matrix built from whole parameters must hold, in row r and piece
// k's columns, rank r's elements of that piece (padding untouched), must give every parameter back
// whole, and its row r must be what rank r's shards put there.
void check_layout(const std::vector<int64_t>& sizes, int32_t ranks, int64_t max_width, size_t expected_groups) {
  weft_host host{};
  const weft_host_api api = make_fake_host_api();
  const weft::sdk::Host sdk_host(&api, &host);
  std::vector<int64_t> indices(sizes.size());
  std::iota(indices.begin(), indices.end(), 10);
  const auto groups = weft::zero::make_groups(indices, sizes, ranks, max_width);
  EXPECT_EQ(groups.size(), expected_groups);
  std::vector<std::vector<float>> params;
  float value = 1.0f;
  for (int64_t n : sizes) {
    params.emplace_back(static_cast<size_t>(n));
    for (float& v : params.back()) v = value++;
  }
  std::vector<std::vector<float>> back(params.size());
  for (size_t p = 0; p < params.size(); ++p) back[p].assign(params[p].size(), 0.0f);
  std::vector<int64_t> columns(sizes.size(), 0);  // columns each parameter got, over all groups
  for (const FlatGroup& group : groups) {
    EXPECT_LE(group.width, max_width);
    std::vector<float> matrix(static_cast<size_t>(ranks * group.width), -1.0f);  // -1: padding untouched
    int64_t matrix_extent = 0;
    const DLTensor matrix_view = view_of(matrix, matrix_extent);
    for (size_t k = 0; k < group.parameters.size(); ++k) {
      const auto p = static_cast<size_t>(group.parameters[k] - 10);
      columns[p] += group.lengths[k];
      int64_t extent = 0;
      weft::zero::copy_into_matrix(sdk_host, group, k, matrix_view, view_of(params[p], extent));
    }
    for (int32_t r = 0; r < ranks; ++r) {
      std::vector<float> row(static_cast<size_t>(group.width), -1.0f);
      int64_t row_extent = 0;
      const DLTensor row_view = view_of(row, row_extent);
      for (size_t k = 0; k < group.parameters.size(); ++k) {
        const auto p = static_cast<size_t>(group.parameters[k] - 10);
        const weft_flat_shard shard = shard_of(sizes[p], ranks, r);
        for (int64_t c = 0; c < group.lengths[k]; ++c) {
          const int64_t element = r * group.chunks[k] + group.starts[k] + c;
          const float got = matrix[static_cast<size_t>(r * group.width + group.offsets[k] + c)];
          const float want = element < sizes[p] ? params[p][static_cast<size_t>(element)] : -1.0f;
          EXPECT_EQ(got, want) << "rank " << r << ", piece " << k << ", column " << c;
        }
        // Rank r's shard into its row: the same values where the shard has them.
        std::vector<float> mine(params[p].begin() + shard.begin, params[p].begin() + shard.begin + shard.count);
        int64_t shard_extent = 0;
        weft::zero::copy_into_row(sdk_host, group, k, row_view, view_of(mine, shard_extent));
        std::vector<float> out(mine.size(), 0.0f);
        weft::zero::copy_from_row(sdk_host, group, k, row_view, view_of(out, shard_extent));
        for (int64_t c = 0; c < group.lengths[k] && group.starts[k] + c < shard.count; ++c) {
          EXPECT_EQ(out[static_cast<size_t>(group.starts[k] + c)], mine[static_cast<size_t>(group.starts[k] + c)]);
        }
      }
      for (int64_t c = 0; c < group.width; ++c) {
        EXPECT_EQ(row[static_cast<size_t>(c)], matrix[static_cast<size_t>(r * group.width + c)]) << "rank " << r;
      }
    }
    for (size_t k = 0; k < group.parameters.size(); ++k) {
      const auto p = static_cast<size_t>(group.parameters[k] - 10);
      int64_t extent = 0;
      weft::zero::copy_from_matrix(sdk_host, group, k, matrix_view, view_of(back[p], extent));
    }
  }
  for (size_t p = 0; p < params.size(); ++p) {
    EXPECT_EQ(back[p], params[p]) << "parameter " << p;
    EXPECT_EQ(columns[p], chunk_of(sizes[p], ranks)) << "parameter " << p;
  }
}

TEST(ZeroFlatLayout, AGroupPlacesEachParameterInItsColumnsRowByRank) {
  // Chunks 2, 1, 3, 1 over 3 ranks: one group of width 7, uneven shards.
  const auto groups = weft::zero::make_groups({10, 11, 12, 13}, {5, 3, 8, 1}, 3, 1000);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].width, 7);
  EXPECT_EQ(groups[0].offsets, (std::vector<int64_t>{0, 2, 3, 6}));
  check_layout({5, 3, 8, 1}, 3, 1000, 1);
}

TEST(ZeroFlatLayout, LargeParametersAreCutIntoPiecesOfBoundedGroups) {
  // Groups of at most 2 columns: the 8-element parameter's chunk of 3 goes in two pieces.
  const auto groups = weft::zero::make_groups({10, 11, 12, 13}, {5, 3, 8, 1}, 3, 2);
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[1].parameters, (std::vector<int64_t>{11, 12}));
  EXPECT_EQ(groups[2].starts, (std::vector<int64_t>{1}));
  check_layout({5, 3, 8, 1}, 3, 2, 4);
  check_layout({4097, 64, 3, 0, 65}, 4, 100, 11);
  check_layout({4097, 64, 3, 0, 65}, 3, 1, 1411);
  check_layout({10}, 1, 3, 4);
}

}  // namespace
