// context_parallel.so: context parallelism (weft/plugin.h): a sequence split and a
// hook at the attention, nothing else. Every rank of the dimension takes the same rows and its share
// of every sequence's tokens (weft_layout.batch_split); the host runs everything but the attention on
// those tokens, at their global positions, and averages the replicated gradients over the dimension.
// Two modes ([plugin] mode):
//  - "ulysses" (DeepSpeed-Ulysses): at "attention.exchange" the host hands over q, k, v (and after the
//    core its output) laid out for an all-to-all, which this plugin runs; the host then computes the
//    core over the whole sequence for 1/N of the heads. The contiguous split only.
//  - "ring" (ring attention, Liu et al. 2023): at "attention.core" this plugin computes the attention
//    of its queries itself, with LibTorch (blockwise_attention.hpp): key/value blocks travel around
//    the ranks (ring_schedule.hpp) while the current one is computed, and in the backward their
//    gradients travel one step behind them. With layout = "balanced" (the default) rank r holds
//    chunks r and 2N - 1 - r of every sequence, so that every rank computes as many causal blocks;
//    "contiguous" gives rank r the r-th share (its work grows with r), for comparison. After each
//    step, metrics.jsonl shows each rank's seconds in the blocks' arithmetic since the previous one
//    (plugin.ring_attention_seconds_rank<i>, _max, _min).
// Settings ([plugin]): mode = "ulysses" | "ring"; layout = "balanced" | "contiguous" (ring only);
// bucket_mb (float, 25): the host's gradient all-reduce buckets. It owns the context-parallel dimension:
// alone, the whole world is one sequence group; on a mesh it composes with a data-parallel plugin
// (ddp, zero) and a tensor-parallel one (train.plugin = "context_parallel,ddp",
// [mesh] cp, dp), its world then its cp slice.
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <weft/plugin_torch.hpp>

#include "blockwise_attention.hpp"
#include "ring_schedule.hpp"

namespace {

using weft::context_parallel::AttentionBlockSpan;
using weft::context_parallel::RingBlock;
using weft::context_parallel::RingStep;

constexpr int32_t kKvTag = 0;            // + step: the key/value blocks
constexpr int32_t kGradKvTag = 1 << 16;  // + step: their travelling gradients

struct Instance {
  weft_host_context* context = nullptr;
  weft_status_create_fn status = nullptr;
  weft_all_to_all_fn all_to_all = nullptr;
  weft_all_gather_fn all_gather = nullptr;
  weft_send_fn send = nullptr;
  weft_recv_fn recv = nullptr;
  weft_transfer_wait_fn wait = nullptr;
  weft_report_metric_fn report = nullptr;
  weft_model_config_int_fn model_config = nullptr;
  int32_t rank = 0, size = 1;
  bool ring = false, balanced = false;
  double bucket_mb = 25.0;
  std::vector<RingStep> schedule;
  at::Tensor kv[2];            // [2 (k, v), B, Hkv, s, D], compute dtype: the block held, the next
  at::Tensor grad_kv[2];       // fp32: the travelling key/value gradients (alternating)
  at::Tensor grad_kv_in;       // fp32: the gradients received from rank r - 1
  double compute_seconds = 0.0;

  // A send to `to` and a receive from `from`, started in the order both ends of a pair agree on:
  // NCCL pairs two ranks' transfers in starting order, and two ranks that are each other's both
  // neighbours (a ring of 2) must not both start with the send, so even ranks send first.
  void exchange(const at::Tensor& out, int32_t to, at::Tensor& in, int32_t from, int32_t tag, weft_transfer** sent,
                weft_transfer** received) const {
    const DLTensor out_view = weft::sdk::to_dl_view(out);
    DLTensor in_view = weft::sdk::to_dl_view(in);
    if (rank % 2 == 0) {
      ok(send(context, &out_view, to, tag, sent));
      ok(recv(context, &in_view, from, tag, received));
    } else {
      ok(recv(context, &in_view, from, tag, received));
      ok(send(context, &out_view, to, tag, sent));
    }
  }
  void finish(weft_transfer*& transfer) const {
    weft_transfer* t = transfer;
    transfer = nullptr;
    ok(wait(context, t));
  }
  // A host status becomes an exception here, and a status again at the boundary (hook()).
  static void ok(weft_status* status) {
    if (status != nullptr) throw StatusError{status};
  }
  struct StatusError {
    weft_status* status;
  };
};

Instance* self_of(weft_plugin_instance* instance) { return reinterpret_cast<Instance*>(instance); }

// Runs `body`, turning what it throws into a status (no exception crosses the ABI).
template <class F>
weft_status* guarded(Instance* self, const char* what, F&& body) {
  try {
    body();
    return nullptr;
  } catch (const Instance::StatusError& e) {
    return e.status;
  } catch (const std::exception& e) {
    return self->status(WEFT_STATUS_INTERNAL, (std::string("context_parallel: ") + what + ": " + e.what()).c_str());
  }
}

at::Tensor view(const DLTensor* t) { return weft::sdk::from_dl_view(*t); }

// This rank's k and v into the first block buffer; returns the chunk length.
int64_t start_pass(Instance& self, const weft_attention_core& core) {
  const at::Tensor k = view(core.k), v = view(core.v);
  const int32_t runs = weft::context_parallel::runs_per_rank(self.balanced);
  const int64_t s = k.size(2);
  TORCH_CHECK(s % runs == 0, "ring attention: ", s, " local tokens are not ", runs, " equal runs");
  if (!self.kv[0].defined() || !self.kv[0].sizes().slice(1).equals(k.sizes()) || self.kv[0].scalar_type() != k.scalar_type()) {
    for (auto& b : self.kv) b = at::empty({2, k.size(0), k.size(1), k.size(2), k.size(3)}, k.options());
  }
  self.kv[0][0].copy_(k);
  self.kv[0][1].copy_(v);
  return s / runs;
}

AttentionBlockSpan span_of(const RingBlock& b, int64_t c, double scale) {
  return AttentionBlockSpan{b.q_chunk * c, b.k_chunk * c, b.causal, scale};
}

void ring_forward(Instance& self, const weft_attention_core& core) {
  const at::Tensor q = view(core.q);
  at::Tensor out = view(core.out), lse = view(core.lse);
  const int64_t c = start_pass(self, core);
  const int32_t n = self.size, next = (self.rank + 1) % n, prev = (self.rank + n - 1) % n;
  std::vector<bool> written(static_cast<size_t>(weft::context_parallel::runs_per_rank(self.balanced)), false);
  for (int32_t t = 0; t < n; ++t) {
    const at::Tensor& held = self.kv[t % 2];
    at::Tensor& incoming = self.kv[(t + 1) % 2];
    weft_transfer *sent = nullptr, *received = nullptr;
    if (t + 1 < n) self.exchange(held, next, incoming, prev, kKvTag + t, &sent, &received);  // overlaps the blocks
    const auto start = std::chrono::steady_clock::now();
    for (const RingBlock& b : self.schedule[static_cast<size_t>(t)].blocks) {
      at::Tensor o = out.narrow(2, b.q_run * c, c), l = lse.narrow(2, b.q_run * c, c);
      weft::context_parallel::attention_block_forward(q.narrow(2, b.q_run * c, c), held[0].narrow(2, b.k_run * c, c),
                                                      held[1].narrow(2, b.k_run * c, c), span_of(b, c, core.scale), o, l,
                                                      written[static_cast<size_t>(b.q_run)]);
      written[static_cast<size_t>(b.q_run)] = true;
    }
    self.compute_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    self.finish(sent);
    self.finish(received);
  }
}

void ring_backward(Instance& self, const weft_attention_core& core) {
  const at::Tensor q = view(core.q), out = view(core.out), lse = view(core.lse), grad_out = view(core.grad_out);
  at::Tensor grad_q = view(core.grad_q), grad_k = view(core.grad_k), grad_v = view(core.grad_v);
  const int64_t c = start_pass(self, core);
  const auto f32 = self.kv[0].options().dtype(at::kFloat);
  if (!self.grad_kv_in.defined() || self.grad_kv_in.sizes() != self.kv[0].sizes()) {
    for (auto& b : self.grad_kv) b = at::empty(self.kv[0].sizes(), f32);
    self.grad_kv_in = at::empty(self.kv[0].sizes(), f32);
  }
  const int32_t n = self.size, next = (self.rank + 1) % n, prev = (self.rank + n - 1) % n;
  for (int32_t t = 0; t < n; ++t) {
    const at::Tensor& held = self.kv[t % 2];
    at::Tensor& incoming = self.kv[(t + 1) % 2];
    weft_transfer *sent = nullptr, *received = nullptr, *grad_sent = nullptr, *grad_received = nullptr;
    // First the gradients of the block held at step t - 1 go on to rank r + 1 (which holds that
    // block now) while those of the block held now arrive from rank r - 1; then the blocks move.
    // Every rank starts them in this order, so both ends of a pair agree.
    if (t > 0) self.exchange(self.grad_kv[(t - 1) % 2], next, self.grad_kv_in, prev, kGradKvTag + t, &grad_sent, &grad_received);
    if (t + 1 < n) self.exchange(held, next, incoming, prev, kKvTag + t, &sent, &received);
    at::Tensor& grad = self.grad_kv[t % 2];  // its send (started at step t - 1) was waited for there
    grad.zero_();
    at::Tensor grad_held_k = grad[0], grad_held_v = grad[1];
    const auto start = std::chrono::steady_clock::now();
    for (const RingBlock& b : self.schedule[static_cast<size_t>(t)].blocks) {
      at::Tensor gq = grad_q.narrow(2, b.q_run * c, c), gk = grad_held_k.narrow(2, b.k_run * c, c),
                 gv = grad_held_v.narrow(2, b.k_run * c, c);
      weft::context_parallel::attention_block_backward(
          q.narrow(2, b.q_run * c, c), held[0].narrow(2, b.k_run * c, c), held[1].narrow(2, b.k_run * c, c),
          span_of(b, c, core.scale), out.narrow(2, b.q_run * c, c), lse.narrow(2, b.q_run * c, c),
          grad_out.narrow(2, b.q_run * c, c), gq, gk, gv);
    }
    self.compute_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (grad_received != nullptr) {  // what ranks r - 1, r - 2, ... computed for the block held now
      self.finish(grad_received);
      grad.add_(self.grad_kv_in);
    }
    self.finish(grad_sent);  // grad_kv[(t - 1) % 2] is zeroed again at step t + 1
    self.finish(sent);
    self.finish(received);
  }
  at::Tensor own = self.grad_kv[(n - 1) % 2];  // one rank: its own gradients, no hop
  if (n > 1) {  // the last hop: every block's summed gradients go home to its owner
    weft_transfer *grad_sent = nullptr, *grad_received = nullptr;
    self.exchange(own, next, self.grad_kv_in, prev, kGradKvTag + n, &grad_sent, &grad_received);
    self.finish(grad_received);
    self.finish(grad_sent);
    own = self.grad_kv_in;
  }
  grad_k.add_(own[0]);
  grad_v.add_(own[1]);
}

// --- the hooks ---

weft_status* exchange_hook(weft_plugin_instance* instance, const weft_hook_event* event) {
  Instance* self = self_of(instance);
  return self->all_to_all(self->context, event->tensor, event->source);
}

weft_status* core_hook(weft_plugin_instance* instance, const weft_hook_event* event) {
  Instance* self = self_of(instance);
  return guarded(self, "attention.core", [&] {
    TORCH_CHECK(event->attention != nullptr, "no weft_attention_core in the event");
    at::NoGradGuard no_grad;
    if (event->backward) {
      ring_backward(*self, *event->attention);
    } else {
      ring_forward(*self, *event->attention);
    }
  });
}

// Every rank's attention seconds since the last step (all-gathered), so that rank 0's metrics show
// the balance.
weft_status* report_hook(weft_plugin_instance* instance, const weft_hook_event*) {
  Instance* self = self_of(instance);
  return guarded(self, "step.end", [&] {
    at::Tensor mine = at::full({1}, self->compute_seconds, at::kDouble);
    self->compute_seconds = 0.0;
    at::Tensor all = at::zeros({self->size, 1}, at::kDouble);
    DLTensor in = weft::sdk::to_dl_view(mine), out = weft::sdk::to_dl_view(all);
    Instance::ok(self->all_gather(self->context, &out, &in));
    for (int32_t i = 0; i < self->size; ++i) {
      self->report(self->context, ("ring_attention_seconds_rank" + std::to_string(i)).c_str(), all[i][0].item<double>());
    }
    self->report(self->context, "ring_attention_seconds_max", all.max().item<double>());
    self->report(self->context, "ring_attention_seconds_min", all.min().item<double>());
  });
}

const weft_hook* hooks(weft_plugin_instance* instance, int32_t* count) {
  static const weft_hook ulysses[] = {{"attention.exchange", exchange_hook}};
  static const weft_hook ring[] = {{"attention.core", core_hook}, {"step.end", report_hook}};
  if (self_of(instance)->ring) {
    *count = 2;
    return ring;
  }
  *count = 1;
  return ulysses;
}

// Ring attention's buffers at their peak (the backward): two key/value blocks in the compute dtype and
// three fp32 gradient blocks, each [2, B, Hkv, s, D].
weft_status* memory(weft_plugin_instance* instance, const weft_memory_request* request, int64_t* bytes) {
  Instance* self = self_of(instance);
  if (!self->ring) return nullptr;
  int64_t hidden = 0, heads = 0, kv_heads = 0;
  for (const auto& [key, out] : {std::pair<const char*, int64_t*>{"hidden_size", &hidden},
                                 {"num_attention_heads", &heads}, {"num_key_value_heads", &kv_heads}}) {
    if (weft_status* s = self->model_config(self->context, key, out)) return s;
  }
  const int64_t kv = 2 * request->rows_per_micro_batch * kv_heads * (hidden / heads) * request->tokens;
  *bytes = 2 * kv * request->compute_bytes + 3 * kv * 4;
  return nullptr;
}

weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const Instance* self = self_of(instance);
  out->batch_split = self->balanced ? WEFT_SPLIT_SEQUENCE_BALANCED : WEFT_SPLIT_SEQUENCE;
  out->reduce_bucket_bytes = static_cast<int64_t>(self->bucket_mb * 1024.0 * 1024.0);
  return nullptr;
}

template <class T>
T find(const weft_host_services* host, const char* name) {
  return reinterpret_cast<T>(host->get_proc_address(name));
}

weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  auto status_create = find<weft_status_create_fn>(host, "weft_status_create");
  if (status_create == nullptr) return nullptr;  // cannot happen on a 2.x host
  const auto refuse = [&](const std::string& message) {
    return status_create(WEFT_STATUS_BAD_CONFIG, ("context_parallel: " + message).c_str());
  };
  if (host->abi_minor < 4) {
    return refuse("needs a host of ABI 2.4 (context parallelism), this one speaks 2." + std::to_string(host->abi_minor));
  }
  auto self = std::make_unique<Instance>();
  self->context = host->context;
  self->status = status_create;
  self->all_to_all = find<weft_all_to_all_fn>(host, "weft_all_to_all");
  self->all_gather = find<weft_all_gather_fn>(host, "weft_all_gather");
  self->send = find<weft_send_fn>(host, "weft_send");
  self->recv = find<weft_recv_fn>(host, "weft_recv");
  self->wait = find<weft_transfer_wait_fn>(host, "weft_transfer_wait");
  self->report = find<weft_report_metric_fn>(host, "weft_report_metric");
  self->model_config = find<weft_model_config_int_fn>(host, "weft_model_config_int");
  find<weft_world_fn>(host, "weft_world")(host->context, &self->rank, &self->size);
  const char *mode = nullptr, *layout_name = nullptr;
  if (weft_status* s = find<weft_config_string_fn>(host, "weft_config_string")(host->context, "mode", "ulysses", &mode)) return s;
  const std::string m = mode;
  if (m != "ulysses" && m != "ring") return refuse("plugin.mode = \"" + m + "\": \"ulysses\" or \"ring\"");
  self->ring = m == "ring";
  if (weft_status* s = find<weft_config_string_fn>(host, "weft_config_string")(host->context, "layout",
                                                                              self->ring ? "balanced" : "contiguous",
                                                                              &layout_name)) {
    return s;
  }
  const std::string l = layout_name;
  if (l != "balanced" && l != "contiguous") return refuse("plugin.layout = \"" + l + "\": \"balanced\" or \"contiguous\"");
  if (!self->ring && l == "balanced") {
    return refuse("plugin.layout = \"balanced\" needs plugin.mode = \"ring\" (Ulysses exchanges contiguous shares)");
  }
  self->balanced = l == "balanced";
  if (weft_status* s = find<weft_config_float_fn>(host, "weft_config_float")(host->context, "bucket_mb", 25.0, &self->bucket_mb)) {
    return s;
  }
  if (!(self->bucket_mb > 0.0)) return refuse("plugin.bucket_mb must be positive");
  self->schedule = weft::context_parallel::ring_schedule(self->size, self->rank, self->balanced);
  *out = reinterpret_cast<weft_plugin_instance*>(self.release());
  return nullptr;
}

void destroy(weft_plugin_instance* instance) { delete self_of(instance); }

WEFT_PLUGIN_TORCH_BUILD(torch_build)

weft_proc proc(const char* name) {
  if (std::strcmp(name, "weft_layout") == 0) return reinterpret_cast<weft_proc>(layout);
  if (std::strcmp(name, "weft_hooks") == 0) return reinterpret_cast<weft_proc>(hooks);
  if (std::strcmp(name, "weft_memory") == 0) return reinterpret_cast<weft_proc>(memory);
  if (std::strcmp(name, "weft_torch_build") == 0) return reinterpret_cast<weft_proc>(torch_build);
  return nullptr;
}

}  // namespace

extern "C" WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t) {
  static const weft_plugin table = {sizeof(weft_plugin),
                                    WEFT_PLUGIN_ABI_MAJOR,
                                    WEFT_PLUGIN_ABI_MINOR,
                                    "context_parallel",
                                    "0.1.0",
                                    "context parallelism: Ulysses all-to-all or ring attention, as a sequence split and a hook",
                                    1u << WEFT_MESH_CP,
                                    create,
                                    destroy,
                                    proc};
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : nullptr;
}
