#include "grad_average.hpp"

#include <cstring>
#include <string>

#include "dl_views.hpp"

namespace weft {
namespace plugins {

using weft::sdk::Error;

GradientAverager::GradientAverager(const weft::sdk::Host& host, weft::sdk::Group group, double bucket_mb)
    : host_(host), group_(group) {
  std::vector<int64_t> trainable;
  const int64_t count = host.parameter_count();
  for (int64_t i = 0; i < count; ++i) {
    if (host.parameter_info(i).trainable) trainable.push_back(i);
  }
  build(trainable, bucket_mb);
}

GradientAverager::GradientAverager(const weft::sdk::Host& host, weft::sdk::Group group, double bucket_mb,
                                   const std::vector<int64_t>& parameters)
    : host_(host), group_(group) {
  build(parameters, bucket_mb);
}

void GradientAverager::build(const std::vector<int64_t>& parameters, double bucket_mb) {
  std::vector<BucketInput> inputs;
  for (int64_t i : parameters) inputs.push_back({i, element_count(host_.parameter_data(i))});  // local slice under TP
  const auto limit = static_cast<int64_t>(bucket_mb * 1024.0 * 1024.0);
  for (BucketLayout& layout : build_buckets(inputs, limit > 0 ? limit : 1)) {
    Bucket bucket;
    bucket.layout = std::move(layout);
    bucket.buffer = host_.buffer({bucket.layout.elements}, DLDataType{kDLFloat, 32, 1});
    buckets_.push_back(std::move(bucket));
  }
}

void GradientAverager::average() { reduce(1.0f / static_cast<float>(group_.size())); }

void GradientAverager::sum() { reduce(1.0f); }

void GradientAverager::reduce(float scale) {
  std::vector<weft::sdk::Work> works;
  for (Bucket& bucket : buckets_) {
    const BucketLayout& layout = bucket.layout;
    for (size_t k = 0; k < layout.parameters.size(); ++k) {
      const DLTensor grad = host_.parameter_grad(layout.parameters[k]);
      if (!is_fp32(grad) || element_count(grad) != layout.sizes[k]) {
        throw Error(WEFT_STATUS_UNSUPPORTED, "gradient of parameter " + std::to_string(layout.parameters[k]) +
                                                 " is not an fp32 tensor of the expected size");
      }
      int64_t part_shape[2];
      DLTensor part = bucket.buffer.part(layout.offsets[k], layout.sizes[k], part_shape);
      host_.copy(part, grad);
    }
    DLTensor view = bucket.buffer.view();
    works.push_back(host_.all_reduce(group_, view));
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    works[b].wait();
    Bucket& bucket = buckets_[b];
    if (scale != 1.0f) {
      DLTensor whole = bucket.buffer.view();
      host_.scale(whole, scale);
    }
    const BucketLayout& layout = bucket.layout;
    for (size_t k = 0; k < layout.parameters.size(); ++k) {
      DLTensor grad = host_.parameter_grad(layout.parameters[k]);
      int64_t part_shape[2];
      const DLTensor part = bucket.buffer.part(layout.offsets[k], layout.sizes[k], part_shape);
      host_.copy(grad, part);
    }
  }
}

}  // namespace plugins
}  // namespace weft
