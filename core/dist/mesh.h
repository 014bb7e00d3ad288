// The device mesh of a run that composes several strategy plugins: sizes along pp, dp,
// cp and tp (the order of weft_mesh_dim), world rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
// (tp fastest, as torchtitan and Megatron lay out theirs), and the slices of ranks that differ
// along one dimension only, each of which gets its own process group.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace weft {

class Mesh {
 public:
  static constexpr int kDims = 4;  // pp, dp, cp, tp: weft_mesh_dim's values
  static constexpr int kPP = 0, kDP = 1, kCP = 2, kTP = 3;
  static const char* name(int dim);  // "pp", "dp", "cp", "tp"

  // Sizes from [mesh] (0 = unset) for `world` ranks: an unset dp takes what is left; an unset
  // dimension in `owned` (one a plugin owns) takes what is left when it is the only one unset;
  // any other unset size is 1. Throws weft::Error naming the problem (a product that is not the
  // world, a size that does not divide it, two unset owned sizes).
  static Mesh resolve(std::array<int32_t, kDims> requested, const std::array<bool, kDims>& owned, int32_t world);
  explicit Mesh(std::array<int32_t, kDims> size);

  int32_t size(int dim) const { return size_[static_cast<size_t>(dim)]; }
  int32_t world() const;
  std::array<int32_t, kDims> coords(int32_t rank) const;
  int32_t rank_of(const std::array<int32_t, kDims>& coords) const;
  // Every slice along `dim`: the world ranks that share all other coordinates, in `dim`'s
  // coordinate order; slices ordered by their lowest rank. slice_of says which one holds `rank`.
  std::vector<std::vector<int32_t>> slices(int dim) const;
  int32_t slice_of(int32_t rank, int dim) const;
  // Whether some slice along `dim` holds ranks of two nodes, for nodes of `per_node` consecutive
  // ranks (torchrun's and Slurm's numbering).
  bool crosses_nodes(int dim, int32_t per_node) const;
  // "pp 2 x tp 2" (the dimensions above 1; "1" when none).
  std::string describe() const;

 private:
  std::array<int32_t, kDims> size_;
};

}  // namespace weft
