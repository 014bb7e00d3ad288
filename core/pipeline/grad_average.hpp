// grad_average.hpp - averages (or sums) trainable gradients over a process group after backward, in
// buckets (buckets.hpp): every bucket's flat fp32 buffer is filled and its all_reduce(SUM)
// started before any is waited for, so transfers of different buckets overlap each other.
// Used by the pipeline runtime's replicas when their reduction is not part of the schedule (each
// stage's replicas average their gradients after the flush). Over the host step interface, no
// LibTorch.
#ifndef WEFT_CORE_PIPELINE_GRAD_AVERAGE_HPP
#define WEFT_CORE_PIPELINE_GRAD_AVERAGE_HPP

#include <cstdint>
#include <map>
#include <vector>

#include "core/plugin/step/step.hpp"

#include "buckets.hpp"

namespace weft {
namespace plugins {

class GradientAverager {
 public:
  // The trainable fp32 parameters of this rank (in host parameter order) over `group`, in
  // buckets of at most `bucket_mb` MiB. Every rank of the group must hold the same parameters.
  GradientAverager(const weft::sdk::Host& host, weft::sdk::Group group, double bucket_mb);
  // Only `parameters` (host indices, in parameter order) instead of every trainable one.
  GradientAverager(const weft::sdk::Host& host, weft::sdk::Group group, double bucket_mb,
                   const std::vector<int64_t>& parameters);

  // Replaces every gradient (the step's: Host::step_gradient) by its mean over the group.
  // Collective over the group.
  void average();
  // Replaces every gradient by its sum over the group (gradients that are partial sums, e.g.
  // the replicated factor of a LoRA adapter on a tensor-parallel layer). Collective.
  void sum();

  size_t bucket_count() const { return buckets_.size(); }

 private:
  struct Bucket {
    BucketLayout layout;
    weft::sdk::Buffer buffer;  // fp32, on the rank's device
  };
  void build(const std::vector<int64_t>& parameters, double bucket_mb);
  void lay_out(const std::vector<int64_t>& sizes);
  void reduce(float scale);

  weft::sdk::Host host_;
  weft::sdk::Group group_;
  std::vector<int64_t> parameters_, sizes_;  // host indices and their gradients' element counts
  std::map<int64_t, size_t> position_;        // host index -> its place in parameters_
  double bucket_mb_ = 25.0;
  std::vector<Bucket> buckets_;
};

}  // namespace plugins
}  // namespace weft

#endif  // WEFT_CORE_PIPELINE_GRAD_AVERAGE_HPP
