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
  parameters_ = parameters;
  bucket_mb_ = bucket_mb;
  std::vector<int64_t> sizes;
  for (int64_t i : parameters) sizes.push_back(element_count(host_.parameter_data(i)));  // local slice under TP
  lay_out(sizes);
}

void GradientAverager::lay_out(const std::vector<int64_t>& sizes) {
  std::vector<BucketInput> inputs;
  for (size_t k = 0; k < parameters_.size(); ++k) inputs.push_back({parameters_[k], sizes[k]});
  const auto limit = static_cast<int64_t>(bucket_mb_ * 1024.0 * 1024.0);
  buckets_.clear();
  position_.clear();
  sizes_ = sizes;
  for (size_t k = 0; k < parameters_.size(); ++k) position_[parameters_[k]] = k;
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
  // The gradients as the step left them; the buckets follow their sizes.
  std::vector<DLTensor> grads(parameters_.size());
  std::vector<int64_t> sizes(parameters_.size());
  for (size_t k = 0; k < parameters_.size(); ++k) {
    if (!host_.step_gradient(parameters_[k], grads[k]) || !is_fp32(grads[k])) {
      throw Error(WEFT_STATUS_UNSUPPORTED, "gradient of parameter " + std::to_string(parameters_[k]) +
                                               " is missing or not an fp32 tensor");
    }
    sizes[k] = element_count(grads[k]);
  }
  if (sizes != sizes_) lay_out(sizes);
  std::vector<weft::sdk::Work> works;
  for (Bucket& bucket : buckets_) {
    const BucketLayout& layout = bucket.layout;
    for (size_t k = 0; k < layout.parameters.size(); ++k) {
      int64_t part_shape[2];
      DLTensor part = bucket.buffer.part(layout.offsets[k], layout.sizes[k], part_shape);
      host_.copy(part, grads[position_.at(layout.parameters[k])]);
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
      int64_t part_shape[2];
      const DLTensor part = bucket.buffer.part(layout.offsets[k], layout.sizes[k], part_shape);
      host_.copy(grads[position_.at(layout.parameters[k])], part);
    }
  }
}

}  // namespace plugins
}  // namespace weft
