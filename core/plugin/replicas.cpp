#include "core/plugin/replicas.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include "core/plugin/placement_collectives.h"
#include "core/util/error.h"
#include "core/util/hash.h"

namespace weft {
namespace {

constexpr int64_t kDeviceChunkBytes = int64_t{64} << 20;
constexpr uint64_t kFingerprintMask = (uint64_t{1} << 62) - 1;  // a MAX over int64 of it and its complement

int64_t bytes_of(const DLTensor& t) {
  return sdk::detail::elements_of(t) * ((t.dtype.bits * t.dtype.lanes + 7) / 8);
}

uint64_t fingerprint(const DLTensor& t) {
  if (t.strides != nullptr) {
    int64_t expected = 1;
    for (int32_t d = t.ndim - 1; d >= 0; --d) {
      WEFT_CHECK(t.shape[d] == 1 || t.strides[d] == expected, "replicas: a parameter that is not contiguous");
      expected *= t.shape[d];
    }
  }
  const int64_t bytes = bytes_of(t);
  const auto* data = static_cast<const unsigned char*>(t.data) + t.byte_offset;
  if (t.device.device_type == kDLCPU) return hash_bytes(data, static_cast<size_t>(bytes));
  WEFT_CHECK(t.device.device_type == kDLCUDA, "replicas: a parameter on a device that is neither the CPU nor CUDA");
  const auto on_device = at::from_blob(const_cast<unsigned char*>(data), {bytes},
                                       at::TensorOptions().dtype(at::kByte).device(at::kCUDA, t.device.device_id));
  uint64_t h = hash_bytes(nullptr, 0);
  for (int64_t begin = 0; begin < bytes; begin += kDeviceChunkBytes) {
    const auto chunk = on_device.narrow(0, begin, std::min(kDeviceChunkBytes, bytes - begin)).cpu();
    h = hash_combine(h, hash_bytes(chunk.data_ptr(), static_cast<size_t>(chunk.numel())));
  }
  return h;
}

}  // namespace

ReplicaSync make_replicas_equal(const sdk::Host& h, sdk::Group group, const std::vector<int64_t>& parameters) {
  ReplicaSync sync;
  sync.parameters = static_cast<int64_t>(parameters.size());
  if (group.size() <= 1 || parameters.empty()) return sync;
  const size_t n = parameters.size();
  std::vector<int64_t> marks(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const auto f = static_cast<int64_t>(fingerprint(h.parameter_data(parameters[i])) & kFingerprintMask);
    marks[i] = f;                                              // max over the ranks
    marks[n + i] = static_cast<int64_t>(kFingerprintMask) - f;  // mask - min
  }
  int64_t shape_and_stride[2];
  DLTensor view = cpu_vector_view(marks.data(), static_cast<int64_t>(marks.size()), DLDataType{kDLInt, 64, 1},
                                  shape_and_stride);
  h.all_reduce(group, view, WEFT_REDUCE_MAX).wait();
  std::vector<sdk::Work> broadcasts;
  for (size_t i = 0; i < n; ++i) {
    if (marks[i] == static_cast<int64_t>(kFingerprintMask) - marks[n + i]) continue;  // max == min: equal
    DLTensor data = h.parameter_data(parameters[i]);
    ++sync.differed;
    sync.bytes += bytes_of(data);
    broadcasts.push_back(h.broadcast(group, data, 0));
  }
  for (const sdk::Work& work : broadcasts) work.wait();
  if (sync.differed > 0) {
    spdlog::info("replicas: {} of {} parameters ({:.1f} MB) differed from rank 0's on some of the {} ranks and were "
                 "broadcast from it", sync.differed, sync.parameters, sync.bytes / 1e6, group.size());
  } else {
    spdlog::debug("replicas: the {} parameters are equal on the {} ranks (fingerprints); nothing broadcast",
                  sync.parameters, group.size());
  }
  return sync;
}

}  // namespace weft
