#include "buckets.hpp"

#include <stdexcept>

namespace weft {
namespace plugins {

std::vector<BucketLayout> build_buckets(const std::vector<BucketInput>& inputs, int64_t limit_bytes) {
  if (limit_bytes <= 0) throw std::invalid_argument("bucket limit must be positive");
  constexpr int64_t bytes_per_element = 4;
  std::vector<BucketLayout> buckets;
  for (auto it = inputs.rbegin(); it != inputs.rend(); ++it) {
    const bool fits = !buckets.empty() &&
                      (buckets.back().elements + it->elements) * bytes_per_element <= limit_bytes;
    if (!fits) buckets.emplace_back();
    BucketLayout& bucket = buckets.back();
    bucket.parameters.push_back(it->parameter);
    bucket.offsets.push_back(bucket.elements);
    bucket.sizes.push_back(it->elements);
    bucket.elements += it->elements;
  }
  return buckets;
}

}  // namespace plugins
}  // namespace weft
