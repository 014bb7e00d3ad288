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
using weft::zero::make_group;
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

TEST(ZeroFlatLayout, AGroupPlacesEachParameterInItsColumnsRowByRank) {
  weft_host host{};
  const weft_host_api api = make_fake_host_api();
  const weft::sdk::Host sdk_host(&api, &host);
  const int32_t ranks = 3;
  const std::vector<int64_t> sizes{5, 3, 8, 1};  // chunks 2, 1, 3, 1: width 7, uneven shards
  const FlatGroup group = make_group({10, 11, 12, 13}, sizes, ranks);
  ASSERT_EQ(group.width, 7);
  EXPECT_EQ(group.offsets, (std::vector<int64_t>{0, 2, 3, 6}));

  std::vector<std::vector<float>> params;
  float value = 1.0f;
  for (int64_t n : sizes) {
    params.emplace_back(static_cast<size_t>(n));
    for (float& v : params.back()) v = value++;
  }
  std::vector<float> matrix(static_cast<size_t>(ranks * group.width), -1.0f);  // -1: padding untouched
  int64_t matrix_extent = 0;
  const DLTensor matrix_view = view_of(matrix, matrix_extent);
  for (size_t k = 0; k < params.size(); ++k) {
    int64_t extent = 0;
    weft::zero::copy_into_matrix(sdk_host, group, k, matrix_view, view_of(params[k], extent));
  }
  // Row r, parameter k's columns: elements [r * chunk, r * chunk + shard count) of parameter k.
  for (int32_t r = 0; r < ranks; ++r) {
    for (size_t k = 0; k < params.size(); ++k) {
      const weft_flat_shard shard = shard_of(sizes[k], ranks, r);
      for (int64_t c = 0; c < group.chunks[k]; ++c) {
        const float got = matrix[static_cast<size_t>(r * group.width + group.offsets[k] + c)];
        const float want = c < shard.count ? params[k][static_cast<size_t>(shard.begin + c)] : -1.0f;
        EXPECT_EQ(got, want) << "rank " << r << ", parameter " << k << ", column " << c;
      }
    }
  }
  // Back: a zeroed copy of every parameter receives exactly its elements.
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<float> back(params[k].size(), 0.0f);
    int64_t extent = 0;
    weft::zero::copy_from_matrix(sdk_host, group, k, matrix_view, view_of(back, extent));
    EXPECT_EQ(back, params[k]) << "parameter " << k;
  }
  // One rank's row: its shard of parameter 2 in and out.
  std::vector<float> row(static_cast<size_t>(group.width), 0.0f);
  int64_t row_extent = 0, shard_extent = 0;
  const DLTensor row_view = view_of(row, row_extent);
  std::vector<float> shard{7.0f, 8.0f};  // rank 2's shard of an 8-element parameter over 3: 2 elements
  weft::zero::copy_into_row(sdk_host, group, 2, row_view, view_of(shard, shard_extent));
  EXPECT_EQ(row, (std::vector<float>{0, 0, 0, 7, 8, 0, 0}));
  std::vector<float> out(2, 0.0f);
  DLTensor out_view = view_of(out, shard_extent);
  weft::zero::copy_from_row(sdk_host, group, 2, row_view, out_view);
  EXPECT_EQ(out, shard);
}

}  // namespace
