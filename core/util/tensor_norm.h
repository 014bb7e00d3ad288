// The sum of a tensor's squared elements in fp64, in bounded memory: a whole-tensor fp64 copy of
// a 128k x 2048 embedding's gradient shard would cost 1-2 GiB at the step's peak (what gradient
// clipping and tensor_squared_norm compute).
#pragma once

#include <ATen/ATen.h>

namespace weft {

// A 0-dim fp64 tensor on t's device: sum(t^2), widened to fp64 one chunk of at most
// kSquaredSumChunk elements at a time (a tensor that fits one chunk: exactly t.to(fp64).pow(2).sum()).
inline constexpr int64_t kSquaredSumChunk = int64_t{1} << 22;  // 32 MiB of fp64
inline at::Tensor squared_sum_fp64(const at::Tensor& t) {
  const at::Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel();
  if (n <= kSquaredSumChunk) return flat.to(at::kDouble).pow(2).sum();
  at::Tensor total = at::zeros({}, flat.options().dtype(at::kDouble));
  for (int64_t begin = 0; begin < n; begin += kSquaredSumChunk) {
    total += flat.narrow(0, begin, std::min(kSquaredSumChunk, n - begin)).to(at::kDouble).pow(2).sum();
  }
  return total;
}

}  // namespace weft
