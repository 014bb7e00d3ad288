// buckets.hpp - how the pipeline runtime's data-parallel gradient synchronisation (its replicas)
// groups trainable parameters into all-reduce buckets.
//
// Gradients become ready roughly in reverse parameter order during backward, so buckets are
// filled walking the parameters from last to first: each bucket takes parameters while its
// total stays within the byte limit; a parameter larger than the limit gets a bucket of its
// own. Every rank computes the same layout from the same parameter list, so bucket i is the
// same collective on every rank.
#ifndef WEFT_CORE_PIPELINE_BUCKETS_HPP
#define WEFT_CORE_PIPELINE_BUCKETS_HPP

#include <cstdint>
#include <vector>

namespace weft {
namespace plugins {

// One parameter to bucket: its index in the host's parameter list and its fp32 element count.
struct BucketInput {
  int64_t parameter;
  int64_t elements;
};

// One bucket: parameters[k] occupies elements [offsets[k], offsets[k] + sizes[k]) of the
// bucket's flat fp32 buffer of `elements` elements.
struct BucketLayout {
  std::vector<int64_t> parameters;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t elements = 0;
};

// Buckets over `inputs` (given in parameter order) taken in REVERSE order, each holding at
// most `limit_bytes` of fp32 unless a single parameter alone exceeds it. Parameters with zero
// elements are placed like any other. Throws std::invalid_argument if limit_bytes <= 0.
std::vector<BucketLayout> build_buckets(const std::vector<BucketInput>& inputs, int64_t limit_bytes);

}  // namespace plugins
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_BUCKETS_HPP
