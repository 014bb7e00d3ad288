#include "ring_attention.hpp"

#include <chrono>
#include <cstring>
#include <string>

namespace weft {
namespace context_parallel {

using weft::sdk::Error;
using weft::sdk::Work;

namespace {

constexpr int32_t kKvTag = 0;          // + step: the key/value blocks
constexpr int32_t kGradKvTag = 1 << 16;  // + step: their travelling gradients

// A view of part of another (its shape and strides stored here; the memory is the other's).
struct View {
  int64_t shape[6] = {};
  int64_t strides[6] = {};
  DLTensor tensor{};
  View() = default;
  View(const View& other) { *this = other; }
  View& operator=(const View& other) {  // the copy's tensor points at the copy's own shape and strides
    std::memcpy(shape, other.shape, sizeof shape);
    std::memcpy(strides, other.strides, sizeof strides);
    tensor = other.tensor;
    tensor.shape = shape;
    tensor.strides = strides;
    return *this;
  }
};

int64_t element_bytes(const DLTensor& t) { return (t.dtype.bits * t.dtype.lanes + 7) / 8; }

View view_of(const DLTensor& base) {
  if (base.ndim > 6) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "ring attention: a view of more than 6 dimensions");
  View v;
  v.tensor = base;
  int64_t stride = 1;
  for (int32_t d = base.ndim - 1; d >= 0; --d) {
    v.shape[d] = base.shape[d];
    v.strides[d] = base.strides != nullptr ? base.strides[d] : stride;
    stride *= base.shape[d];
  }
  v.tensor.shape = v.shape;
  v.tensor.strides = v.strides;
  return v;
}

// Elements [start, start + count) of dimension `dim`.
View narrow(const DLTensor& base, int32_t dim, int64_t start, int64_t count) {
  View v = view_of(base);
  v.tensor.byte_offset += static_cast<uint64_t>(start * v.strides[dim] * element_bytes(base));
  v.shape[dim] = count;
  return v;
}

// Index `index` of dimension 0, which goes away ([2, ...] -> [...]).
View select(const DLTensor& base, int64_t index) {
  View v = narrow(base, 0, index, 1);
  for (int32_t d = 0; d + 1 < base.ndim; ++d) {
    v.shape[d] = v.shape[d + 1];
    v.strides[d] = v.strides[d + 1];
  }
  v.tensor.ndim = base.ndim - 1;
  return v;
}

// Tokens [run * c, (run + 1) * c) of a [B, heads, s, D] or [B, heads, s] tensor.
View run_of(const DLTensor& base, int32_t run, int64_t c) { return narrow(base, 2, run * c, c); }

// The host call for block `b` of chunks of `c` tokens (its tensors set by the caller).
weft_attention_block block_of(const RingBlock& b, int64_t c, double scale) {
  weft_attention_block block{};
  block.struct_size = sizeof(weft_attention_block);
  block.causal = b.causal ? 1 : 0;
  block.q_position = b.q_chunk * c;
  block.k_position = b.k_chunk * c;
  block.scale = scale;
  return block;
}

}  // namespace

RingAttention::RingAttention(weft::sdk::Host host, weft::sdk::Group group, int32_t size, int32_t rank, bool balanced)
    : host_(host), group_(group), size_(size), rank_(rank), balanced_(balanced),
      schedule_(ring_schedule(size, rank, balanced)) {}

void RingAttention::ensure(weft::sdk::Buffer& buffer, const std::vector<int64_t>& shape, DLDataType dtype) {
  const DLTensor& v = buffer.view();
  bool same = v.data != nullptr && v.ndim == static_cast<int32_t>(shape.size()) && v.dtype.code == dtype.code &&
              v.dtype.bits == dtype.bits;
  for (size_t d = 0; same && d < shape.size(); ++d) same = v.shape[d] == shape[d];
  if (!same) buffer = host_.buffer(shape, dtype);
}

// Posts a send of `out` to `to` and a receive into `in` from `from`, ordered so that the two ends of
// every pair of ranks post their transfers in the same order: NCCL matches a pair's sends and
// receives in posting order (tags are Gloo's only), and two ranks that are each other's both
// neighbours (a ring of 2) must not both start with a send on their shared stream, so even ranks
// send first and odd ranks receive first.
void RingAttention::exchange(const DLTensor& out, int32_t to, DLTensor& in, int32_t from, int32_t tag, Work& send,
                             Work& recv) const {
  if (rank_ % 2 == 0) {
    send = host_.send(group_, out, to, tag);
    recv = host_.recv(group_, in, from, tag);
  } else {
    recv = host_.recv(group_, in, from, tag);
    send = host_.send(group_, out, to, tag);
  }
}

int64_t RingAttention::blocks_per_pass() const {
  int64_t n = 0;
  for (const auto& step : schedule_) n += static_cast<int64_t>(step.blocks.size());
  return n;
}

int64_t RingAttention::bytes_per_layer(const weft_attention_call& call) const {
  const DLTensor& k = *call.k;
  const int64_t kv = 2 * k.shape[0] * k.shape[1] * k.shape[2] * k.shape[3];
  // forward and backward: N - 1 key/value hops each; backward: N gradient hops (fp32)
  return (size_ - 1) * 2 * kv * element_bytes(k) + size_ * kv * 4;
}

int64_t RingAttention::start_pass(const weft_attention_call& call) {
  const DLTensor &q = *call.q, &k = *call.k, &v = *call.v;
  const int32_t runs = runs_per_rank(balanced_);
  const int64_t s = q.shape[2];
  if (s % runs != 0) throw Error(WEFT_STATUS_INVALID_ARGUMENT, "ring attention: " + std::to_string(s) + " local tokens");
  const std::vector<int64_t> kv_shape{2, k.shape[0], k.shape[1], k.shape[2], k.shape[3]};
  for (auto& b : kv_) ensure(b, kv_shape, k.dtype);
  View k_dst = select(kv_[0].view(), 0), v_dst = select(kv_[0].view(), 1);
  host_.copy(k_dst.tensor, k);
  host_.copy(v_dst.tensor, v);
  return s / runs;
}

double RingAttention::take_compute_seconds() {
  const double s = compute_seconds_;
  compute_seconds_ = 0.0;
  return s;
}

void RingAttention::forward(const weft_attention_call& call) {
  const DLTensor& q = *call.q;
  const int32_t runs = runs_per_rank(balanced_);
  const int64_t c = start_pass(call);
  const int32_t next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  std::vector<bool> written(static_cast<size_t>(runs), false);
  for (int32_t t = 0; t < size_; ++t) {
    const DLTensor held = kv_[t % 2].view();
    DLTensor incoming = kv_[(t + 1) % 2].view();
    Work send, recv;
    if (t + 1 < size_) exchange(held, next, incoming, prev, kKvTag + t, send, recv);  // overlaps the blocks
    const auto start = std::chrono::steady_clock::now();
    const View held_k = select(held, 0), held_v = select(held, 1);
    for (const RingBlock& b : schedule_[static_cast<size_t>(t)].blocks) {
      const View qv = run_of(q, b.q_run, c), kv = run_of(held_k.tensor, b.k_run, c), vv = run_of(held_v.tensor, b.k_run, c);
      View out = run_of(*call.out, b.q_run, c), lse = run_of(*call.lse, b.q_run, c);
      weft_attention_block block = block_of(b, c, call.scale);
      block.accumulate = written[static_cast<size_t>(b.q_run)] ? 1 : 0;
      block.q = &qv.tensor;
      block.k = &kv.tensor;
      block.v = &vv.tensor;
      block.out = &out.tensor;
      block.lse = &lse.tensor;
      host_.attention_block(WEFT_FORWARD, block);
      written[static_cast<size_t>(b.q_run)] = true;
    }
    compute_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (send) send.wait();
    if (recv) recv.wait();
  }
  for (int32_t r = 0; r < runs; ++r) {
    if (!written[static_cast<size_t>(r)]) throw Error(WEFT_STATUS_INTERNAL, "ring attention: a query run saw no keys");
  }
}

void RingAttention::backward(const weft_attention_call& call) {
  const DLTensor& q = *call.q;
  const int64_t c = start_pass(call);
  const std::vector<int64_t> kv_shape(kv_[0].view().shape, kv_[0].view().shape + 5);
  const DLDataType f32{kDLFloat, 32, 1};
  for (auto& b : grad_kv_) ensure(b, kv_shape, f32);
  ensure(grad_kv_in_, kv_shape, f32);
  const int32_t next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  DLTensor grad_in = grad_kv_in_.view();
  for (int32_t t = 0; t < size_; ++t) {
    const DLTensor held = kv_[t % 2].view();
    DLTensor incoming = kv_[(t + 1) % 2].view();
    Work send, recv, grad_send, grad_recv;
    // First the gradients of the block held at step t - 1 go on to rank r + 1 (which holds that
    // block now) while those of the block held now arrive from rank r - 1; then the blocks move.
    // Every rank posts in this order, so both ends of a pair agree (see exchange).
    if (t > 0) exchange(grad_kv_[(t - 1) % 2].view(), next, grad_in, prev, kGradKvTag + t, grad_send, grad_recv);
    if (t + 1 < size_) exchange(held, next, incoming, prev, kKvTag + t, send, recv);
    DLTensor grad = grad_kv_[t % 2].view();  // its send (posted at step t - 1) was waited for there
    host_.scale(grad, 0.0);
    const auto start = std::chrono::steady_clock::now();
    const View held_k = select(held, 0), held_v = select(held, 1), grad_k = select(grad, 0), grad_v = select(grad, 1);
    for (const RingBlock& b : schedule_[static_cast<size_t>(t)].blocks) {
      const View qv = run_of(q, b.q_run, c), kv = run_of(held_k.tensor, b.k_run, c), vv = run_of(held_v.tensor, b.k_run, c);
      View out = run_of(*call.out, b.q_run, c), lse = run_of(*call.lse, b.q_run, c);
      const View grad_out = run_of(*call.grad_out, b.q_run, c);
      View gq = run_of(*call.grad_q, b.q_run, c), gk = run_of(grad_k.tensor, b.k_run, c), gv = run_of(grad_v.tensor, b.k_run, c);
      weft_attention_block block = block_of(b, c, call.scale);
      block.q = &qv.tensor;
      block.k = &kv.tensor;
      block.v = &vv.tensor;
      block.out = &out.tensor;
      block.lse = &lse.tensor;
      block.grad_out = &grad_out.tensor;
      block.grad_q = &gq.tensor;
      block.grad_k = &gk.tensor;
      block.grad_v = &gv.tensor;
      host_.attention_block(WEFT_BACKWARD, block);
    }
    compute_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (grad_recv) {  // what ranks r - 1, r - 2, ... computed for the block held now
      grad_recv.wait();
      host_.add(grad, grad_in, 1.0);
    }
    if (grad_send) grad_send.wait();  // grad_kv_[(t - 1) % 2] is zeroed again at step t + 1
    if (send) send.wait();
    if (recv) recv.wait();
  }
  DLTensor own = grad_kv_[(size_ - 1) % 2].view();  // one process: its own gradients, no hop
  if (size_ > 1) {  // the last hop: every block's summed gradients go home to its owner
    Work grad_send, grad_recv;
    exchange(own, next, grad_in, prev, kGradKvTag + size_, grad_send, grad_recv);
    grad_recv.wait();
    grad_send.wait();
    own = grad_in;
  }
  View own_k = select(own, 0), own_v = select(own, 1);
  host_.add(*call.grad_k, own_k.tensor, 1.0);
  host_.add(*call.grad_v, own_v.tensor, 1.0);
}

}  // namespace context_parallel
}  // namespace weft
