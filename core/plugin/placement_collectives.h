// The collectives that placements lower to, for the host's step of ABI 2 plugins (abi2.cpp): a
// gradient reducer (REPLICATE gradients all-reduced in buckets that start during the backward,
// FLAT_SHARD ones reduce-scattered into the ranks' ranges) and a parameter gatherer (FLAT_SHARD
// parameters all-gathered around a model stage's uses). Both work through the host's services (the
// SDK's C++ layer), on any process group.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <utility>
#include <vector>

#include "core/plugin/step/step.hpp"

namespace weft {

using sdk::flat_part;
inline int64_t element_count(const DLTensor& t) { return sdk::detail::elements_of(t); }

// A 1-D view of `count` elements of `dtype` at `data` in this process's memory, for the host's
// collectives; `shape_and_stride` ({count, 1}) must outlive it.
inline DLTensor cpu_vector_view(void* data, int64_t count, DLDataType dtype, int64_t (&shape_and_stride)[2]) {
  shape_and_stride[0] = count;
  shape_and_stride[1] = 1;
  DLTensor view{};
  view.data = data;
  view.device = DLDevice{kDLCPU, 0};
  view.ndim = 1;
  view.dtype = dtype;
  view.shape = &shape_and_stride[0];
  view.strides = &shape_and_stride[1];
  return view;
}

// Rank `rank`'s flat range of `elements` over `ranks` (ceil(n / N) elements in rank order, the last
// ones shorter or empty) for a parameter whose optimizer state is FLAT_SHARD; `parameter`: the
// parameter is FLAT_SHARD too (whole only around its uses: its range is the master copy).
inline weft_flat_shard flat_range(int64_t elements, int64_t ranks, int64_t rank, bool parameter) {
  const int64_t chunk = (elements + ranks - 1) / ranks;
  const int64_t begin = std::min(rank * chunk, elements), end = std::min((rank + 1) * chunk, elements);
  return weft_flat_shard{begin, end - begin, parameter ? WEFT_FLAT_SHARD_RELEASABLE : 0u, 0u};
}

// The optimizer state FLAT_SHARD over whole gradients: rank `rank`'s range (flat_range) of each
// averaged gradient of `state_shards` into the parameter's gradient shard, which the host's optimizer
// reads; zeros for one without a gradient this step. Those in `scattered` (ascending) the reducer
// already wrote.
inline void copy_gradient_ranges(const sdk::Host& h, const std::vector<int64_t>& state_shards,
                                 const std::vector<int64_t>& scattered, int64_t ranks, int64_t rank) {
  for (int64_t index : state_shards) {
    if (std::binary_search(scattered.begin(), scattered.end(), index)) continue;
    DLTensor target = h.parameter_grad_shard(index);
    if (element_count(target) == 0) continue;
    DLTensor grad{};
    if (!h.step_gradient(index, grad)) {
      h.scale(target, 0.0);
      continue;
    }
    const weft_flat_shard range = flat_range(element_count(grad), ranks, rank, false);
    int64_t shape[2];
    h.copy(target, flat_part(grad, range.begin, range.count, shape));
  }
}

// Gradients averaged over a group in buckets of at most `bucket_bytes` (a parameter larger than that
// alone), filled from the last parameter to the first: the model lists them from the embedding to
// the head and the backward finishes them the other way round. Armed for a backward, the buckets
// start their collectives in order, each as soon as its parameters' gradients are final.
//
// A gradient placed REPLICATE is all-reduced and written back whole. One placed FLAT_SHARD is
// reduce-scattered: each rank receives the average of its flat range of it (ceil(n / N) elements in
// rank order, as the optimizer state's) into the parameter's gradient shard, and the whole gradient
// is freed once copied out. Such a bucket is a matrix [N, width]: row r holds rank r's range of each
// of its parameters, zero-padded to ceil(n / N), so one reduce-scatter gives every rank its row.
class GradientReducer {
 public:
  struct Reduced {
    int64_t index;
    bool scatter;  // FLAT_SHARD
  };
  // `group`: the dimension (REPLICATE gradients are averaged over it). FLAT_SHARD ones are
  // reduce-scattered over `shards` (the dimension, or the group of it the layout names) and then, where the
  // dimension holds several such groups, summed over `replicas` (the ranks of the same position in
  // the other groups) before the average. `unit_of` (by parameter index; empty: none): a bucket
  // never spans two units, e.g. the model stages a staged step gathers and releases one by one, so
  // that each stage's reduction starts as soon as that stage's backward is done (as FSDP's per
  // module).
  GradientReducer(sdk::Host host, sdk::Group group, sdk::Group shards, sdk::Group replicas, std::vector<Reduced> parameters,
                  int64_t bucket_bytes, const std::vector<int64_t>& unit_of = {})
      : host_(host), group_(group), shards_(shards), replicas_(replicas), ranks_(shards.size()), rank_(shards.rank()) {
    std::reverse(parameters.begin(), parameters.end());
    of_.assign(static_cast<size_t>(host.parameter_count()), -1);
    ready_.assign(of_.size(), 0);
    int64_t elements = 0, unit = -1;
    for (const Reduced& p : parameters) {
      const DLTensor data = host.parameter_data(p.index);
      int64_t n = 1;
      for (int32_t d = 0; d < data.ndim; ++d) n *= data.shape[d];
      const int64_t u = unit_of.empty() ? -1 : unit_of.at(static_cast<size_t>(p.index));
      const bool new_unit = u != unit;
      unit = u;
      if (buckets_.empty() || buckets_.back().scatter != p.scatter || new_unit ||
          (elements > 0 && (elements + n) * 4 > bucket_bytes)) {
        buckets_.emplace_back();
        buckets_.back().scatter = p.scatter;
        elements = 0;
      }
      Bucket& b = buckets_.back();
      b.parameters.push_back(p.index);
      b.sizes.push_back(n);
      if (p.scatter) {
        const int64_t chunk = (n + ranks_ - 1) / ranks_;
        b.offsets.push_back(b.width);
        b.chunks.push_back(chunk);
        b.width += chunk;
      } else {
        b.offsets.push_back(elements);
        b.chunks.push_back(n);
      }
      elements += n;
      b.elements = elements;
      of_[static_cast<size_t>(p.index)] = static_cast<int64_t>(buckets_.size() - 1);
    }
    // An all-reduce bucket's buffer lives through the run (as PyTorch DDP's); a reduce-scatter
    // bucket's only from its start to the copy out of its row (as FSDP's): the whole gradients it
    // takes are freed as it fills.
    for (Bucket& b : buckets_) {
      if (!b.scatter) b.buffer = host.buffer({b.elements}, DLDataType{kDLFloat, 32, 1});
    }
    host.set_grad_ready_callback(&GradientReducer::ready_trampoline, this);
  }
  ~GradientReducer() {
    try {
      host_.set_grad_ready_callback(nullptr, nullptr);
    } catch (...) {
    }
  }
  // Each REPLICATE gradient becomes a view of its bucket (parameter_grad_into_buffer, as PyTorch
  // DDP's gradient_as_bucket_view): the backward adds into the bucket, which is all-reduced and
  // averaged in place, with no copy in or out and no second copy of the gradients. A gradient the
  // host later replaces with other memory is copied as before.
  void keep_gradients_in_buckets() {
    for (Bucket& b : buckets_) {
      if (b.scatter) continue;
      for (size_t k = 0; k < b.parameters.size(); ++k) {
        host_.check(::weft::host::parameter_grad_into_buffer(host_.handle(), b.parameters[k], b.buffer.handle(),
                                                             b.offsets[k]));
      }
    }
  }
  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Of the last armed backward's buckets, how many started during it (the rest at REDUCE).
  int64_t started_in_backward() const { return started_in_backward_; }

  // Before the backward that makes the gradients final: buckets start as they fill.
  void arm() {
    for (Bucket& b : buckets_) {
      b.pending = static_cast<int64_t>(b.parameters.size());
      b.work.reset();
    }
    std::fill(ready_.begin(), ready_.end(), 0);
    next_ = 0;
    started_in_backward_ = 0;
    error_ = nullptr;
    armed_ = true;
  }
  void disarm() noexcept { armed_ = false; }
  // Stage by stage (parameters FLAT_SHARD), the host's per-backward readiness would call a tied
  // embedding final after the head's backward, before stage 0's adds to it: the step says instead
  // which gradients are final (`ready`), after each stage's backward.
  void set_explicit(bool on) noexcept { explicit_ = on; }
  // The host's gradient-ready callback (one per process) calls this reducer again, after another
  // reducer made later took it.
  void claim_ready_callback() { host_.set_grad_ready_callback(&GradientReducer::ready_trampoline, this); }
  // PARTIAL gradients (each rank holds a part of the sum): all-reduced and left summed, not averaged.
  void set_sum(bool on) noexcept { sum_ = on; }
  // Of the host's per-backward readiness, take only these parameters' (a pipeline chunk's final
  // backward: its own parameters, not a tied embedding that another chunk of the rank adds to
  // later); empty: every parameter's.
  void accept_only(std::vector<char> mask) { accept_ = std::move(mask); }
  void ready(int64_t index) {
    if (!armed_ || error_) return;
    on_ready(index);
  }
  // REDUCE: whatever did not report ready (a parameter without a gradient this step counts as
  // zeros) starts now.
  void start_rest() {
    if (error_) std::rethrow_exception(error_);
    for (Bucket& b : buckets_) b.pending = 0;
    start_ready();
  }
  // REDUCE for a reducer no backward armed: every bucket starts now.
  void start_all() {
    arm();
    disarm();
    start_rest();
  }
  // Before the optimizer step: waits for every bucket and writes the averages into the gradients
  // (FLAT_SHARD: into this rank's gradient shards).
  void finish() {
    for (Bucket& b : buckets_) {
      b.work.wait();
      b.work.reset();
      if (b.scatter) {
        DLTensor row = b.row.view();
        if (replicas_.get() != nullptr && replicas_.size() > 1) host_.all_reduce(replicas_, row, WEFT_REDUCE_SUM).wait();
        host_.scale(row, 1.0 / static_cast<double>(group_.size()));
        for (size_t k = 0; k < b.parameters.size(); ++k) {
          const int64_t count = range_count(b, k, rank_);
          if (count == 0) continue;
          int64_t shape[2];
          DLTensor shard = host_.parameter_grad_shard(b.parameters[k]);
          host_.copy(shard, b.row.part(b.offsets[k], count, shape));
        }
        b.buffer = sdk::Buffer();
        b.row = sdk::Buffer();
        continue;
      }
      DLTensor whole = b.buffer.view();
      if (!sum_) host_.scale(whole, 1.0 / static_cast<double>(group_.size()));
      for (size_t k = 0; k < b.parameters.size(); ++k) {
        DLTensor grad{};
        if (!host_.step_gradient(b.parameters[k], grad)) continue;
        int64_t shape[2];
        const DLTensor part = b.buffer.part(b.offsets[k], b.sizes[k], shape);
        if (!same_memory(grad, part)) host_.copy(grad, part);
      }
    }
  }
  // After a failure: nothing acts any more; the collectives in flight are released.
  void abandon() noexcept {
    armed_ = false;
    error_ = nullptr;
    for (Bucket& b : buckets_) {
      b.work.reset();
      if (b.scatter) {
        b.buffer = sdk::Buffer();
        b.row = sdk::Buffer();
      }
    }
  }

 private:
  struct Bucket {
    bool scatter = false;
    // Each parameter's index, element count, and offset (whole: in the buffer; scatter: in a row)
    // and chunk (scatter: ceil(n / N); whole: n).
    std::vector<int64_t> parameters, offsets, sizes, chunks;
    int64_t elements = 0, pending = 0;
    int64_t width = 0;   // scatter: a row's elements
    sdk::Buffer buffer;  // whole: [elements]; scatter: [N * width], from its start to its finish
    sdk::Buffer row;     // scatter: this rank's reduced row, likewise
    sdk::Work work;
  };
  static bool same_memory(const DLTensor& a, const DLTensor& b) {
    return static_cast<const char*>(a.data) + a.byte_offset == static_cast<const char*>(b.data) + b.byte_offset;
  }
  // The elements of parameter k's range that rank r holds (the last ranges shorter or empty).
  int64_t range_count(const Bucket& b, size_t k, int64_t r) const {
    return std::clamp<int64_t>(b.sizes[k] - r * b.chunks[k], 0, b.chunks[k]);
  }
  static void ready_trampoline(void* user, int64_t index) noexcept {
    auto* self = static_cast<GradientReducer*>(user);
    if (!self->armed_ || self->error_ || self->explicit_) return;
    if (!self->accept_.empty() &&
        (index < 0 || static_cast<size_t>(index) >= self->accept_.size() || !self->accept_[static_cast<size_t>(index)])) {
      return;
    }
    try {
      self->on_ready(index);
    } catch (...) {
      self->error_ = std::current_exception();
    }
  }
  void on_ready(int64_t index) {
    if (index < 0 || static_cast<size_t>(index) >= of_.size()) return;
    const int64_t bucket = of_[static_cast<size_t>(index)];
    if (bucket < 0 || ready_[static_cast<size_t>(index)]) return;
    ready_[static_cast<size_t>(index)] = 1;
    if (--buckets_[static_cast<size_t>(bucket)].pending == 0) {
      const size_t before = next_;
      start_ready();
      started_in_backward_ += static_cast<int64_t>(next_ - before);
    }
  }
  // Buckets start in order, while the next one is complete (every rank issues them alike).
  void start_ready() {
    while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
      Bucket& b = buckets_[next_++];
      if (b.scatter) {
        start_scatter(b);
        continue;
      }
      for (size_t k = 0; k < b.parameters.size(); ++k) {
        int64_t shape[2];
        DLTensor target = b.buffer.part(b.offsets[k], b.sizes[k], shape);
        DLTensor grad{};
        if (host_.step_gradient(b.parameters[k], grad)) {
          if (!same_memory(target, grad)) host_.copy(target, grad);
        } else {
          host_.scale(target, 0.0);
        }
      }
      DLTensor view = b.buffer.view();
      b.work = host_.all_reduce(group_, view, WEFT_REDUCE_SUM);
    }
  }
  // Rank r's range of each gradient into row r, then the reduce-scatter; the whole gradients go.
  void start_scatter(Bucket& b) {
    b.buffer = host_.buffer({ranks_ * b.width}, DLDataType{kDLFloat, 32, 1});
    b.row = host_.buffer({b.width}, DLDataType{kDLFloat, 32, 1});
    DLTensor all = b.buffer.view();
    host_.scale(all, 0.0);  // the rows' padding
    for (size_t k = 0; k < b.parameters.size(); ++k) {
      DLTensor grad{};
      if (!host_.step_gradient(b.parameters[k], grad)) continue;  // no gradient this step: zeros
      for (int64_t r = 0; r < ranks_; ++r) {
        const int64_t count = range_count(b, k, r);
        if (count == 0) continue;
        int64_t a[2], c[2];
        DLTensor target = b.buffer.part(r * b.width + b.offsets[k], count, a);
        host_.copy(target, flat_part(grad, r * b.chunks[k], count, c));
      }
      host_.release_parameter_grad(b.parameters[k]);
    }
    DLTensor row = b.row.view();
    b.work = host_.reduce_scatter(shards_, row, b.buffer.view(), WEFT_REDUCE_SUM);
  }

  sdk::Host host_;
  sdk::Group group_, shards_, replicas_;
  int64_t ranks_ = 1, rank_ = 0;  // of `shards_`
  std::vector<Bucket> buckets_;
  std::vector<int64_t> of_;  // each parameter's bucket, -1 for none
  std::vector<char> ready_;
  size_t next_ = 0;
  int64_t started_in_backward_ = 0;
  bool armed_ = false;
  bool explicit_ = false;
  bool sum_ = false;
  std::vector<char> accept_;  // accept_only's mask (empty: all)
  std::exception_ptr error_;
};

// Parameters placed FLAT_SHARD: each rank keeps its flat range (ceil(n / N) elements
// in rank order) as the master copy, and the whole parameter only around its model stage's uses:
// gathered before the stage's forward and backward, released after. A stage's parameters are
// all-gathered in groups of at most `bucket_bytes`, each a [N, width] matrix whose row r is rank
// r's ranges (zero-padded), as the gradient reducer's scatter buckets.
class ParameterGatherer {
 public:
  ParameterGatherer(sdk::Host host, sdk::Group group, int64_t stages,
                    const std::vector<std::pair<int64_t, int64_t>>& parameters /* (index, stage) */, int64_t bucket_bytes)
      : host_(host), group_(group), ranks_(group.size()), stages_(static_cast<size_t>(stages)),
        whole_(static_cast<size_t>(stages), 1), flying_(static_cast<size_t>(stages)) {
    for (const auto& [index, stage] : parameters) {
      auto& groups = stages_.at(static_cast<size_t>(stage));
      const int64_t n = element_count(host.parameter_data(index));
      const int64_t chunk = (n + ranks_ - 1) / ranks_;
      if (groups.empty() || (groups.back().width > 0 && (groups.back().width + chunk) * ranks_ * 4 > bucket_bytes)) {
        groups.emplace_back();
      }
      Group& g = groups.back();
      g.parameters.push_back(index);
      g.sizes.push_back(n);
      g.chunks.push_back(chunk);
      g.offsets.push_back(g.width);
      g.width += chunk;
    }
  }
  int64_t stages() const { return static_cast<int64_t>(stages_.size()); }
  // Starts the stage's all-gathers (nothing if it is whole or they are under way): called one stage
  // ahead, they run while the current stage computes. Every rank starts them in the same order.
  void prefetch(int64_t stage) {
    if (stage < 0 || stage >= stages()) return;
    auto& flying = flying_[static_cast<size_t>(stage)];
    if (whole_[static_cast<size_t>(stage)] || !flying.empty()) return;
    const int64_t rank = group_.rank();
    for (const Group& g : stages_[static_cast<size_t>(stage)]) {
      InFlight f;
      f.send = host_.buffer({g.width}, DLDataType{kDLFloat, 32, 1});
      f.receive = host_.buffer({ranks_ * g.width}, DLDataType{kDLFloat, 32, 1});
      DLTensor row = f.send.view();
      host_.scale(row, 0.0);
      for (size_t k = 0; k < g.parameters.size(); ++k) {
        const int64_t count = range_count(g, k, rank);
        if (count == 0) continue;
        int64_t a[2];
        DLTensor to = f.send.part(g.offsets[k], count, a);
        host_.copy(to, host_.parameter_shard(g.parameters[k]));
      }
      DLTensor all = f.receive.view();
      f.work = host_.all_gather(group_, all, f.send.view());
      flying.push_back(std::move(f));
    }
  }
  // The stage's parameters whole (nothing if they are).
  void gather(int64_t stage) {
    if (whole_[static_cast<size_t>(stage)]) return;
    prefetch(stage);
    auto& flying = flying_[static_cast<size_t>(stage)];
    const auto& groups = stages_[static_cast<size_t>(stage)];
    for (size_t n = 0; n < groups.size(); ++n) {
      const Group& g = groups[n];
      InFlight& f = flying[n];
      f.work.wait();
      const sdk::Buffer& receive = f.receive;
      for (size_t k = 0; k < g.parameters.size(); ++k) {
        const DLTensor whole = host_.materialize_parameter(g.parameters[k]);
        for (int64_t r = 0; r < ranks_; ++r) {
          const int64_t count = range_count(g, k, r);
          if (count == 0) continue;
          int64_t a[2], b[2];
          DLTensor to = flat_part(whole, r * g.chunks[k], count, a);
          host_.copy(to, receive.part(r * g.width + g.offsets[k], count, b));
        }
      }
    }
    flying.clear();
    whole_[static_cast<size_t>(stage)] = 1;
  }
  // The stage's whole parameters freed (each rank keeps its range).
  void release(int64_t stage) {
    if (!whole_[static_cast<size_t>(stage)]) return;
    for (const Group& g : stages_[static_cast<size_t>(stage)]) {
      for (int64_t index : g.parameters) host_.release_parameter(index);
    }
    whole_[static_cast<size_t>(stage)] = 0;
  }
  void gather_all() {
    for (int64_t s = 0; s < stages(); ++s) gather(s);
  }
  // Every stage gathered again from the ranges (where the optimizer updated them in place, in the
  // whole parameters the ranges view: an optimizer state FLAT_SHARD under a whole parameter), the next stage's gathers under way while one's copy out.
  void refresh_all() {
    std::fill(whole_.begin(), whole_.end(), 0);
    prefetch(0);
    for (int64_t s = 0; s < stages(); ++s) {
      prefetch(s + 1);
      gather(s);
    }
  }
  void release_all() {
    for (int64_t s = 0; s < stages(); ++s) release(s);
  }


 private:
  struct Group {
    std::vector<int64_t> parameters, offsets, sizes, chunks;
    int64_t width = 0;
  };
  struct InFlight {
    sdk::Buffer send, receive;
    sdk::Work work;
  };
  int64_t range_count(const Group& g, size_t k, int64_t r) const {
    return std::clamp<int64_t>(g.sizes[k] - r * g.chunks[k], 0, g.chunks[k]);
  }

  sdk::Host host_;
  sdk::Group group_;
  int64_t ranks_;
  std::vector<std::vector<Group>> stages_;
  std::vector<char> whole_;
  std::vector<std::vector<InFlight>> flying_;  // each stage's gathers under way
};

}  // namespace weft
