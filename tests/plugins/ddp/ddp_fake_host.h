// A fake host for ddp.so's tests: the SDK fake host (fake_host.h) with the services a
// data-parallel plugin also needs, replaced or added slot by slot:
//  - config_float reads `floats` (then the base `ints`);
//  - parameter_data views `data`; broadcast(root) records which parameter it was given and
//    leaves the values (a world where rank 0 already holds them);
//  - parameter_grad fails (INVALID_ARGUMENT) until a backward produced the parameter's grad;
//  - backward adds scale * `grad_per_backward[i]` to every trainable parameter that
//    `produces_grad`, then calls the grad-ready callback for it, last parameter first;
//  - all_reduce is the base fake's (adds (size - 1) * peer_value) and also records each call;
//  - activation_view gives inputs of `eval_rows` rows (train rows are irrelevant here).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/fake_host.h"

struct DdpFakeAllReduce {
  int64_t elements;
  int backward_calls;  // backward calls started before this all_reduce
  bool in_backward;    // issued from inside a backward (the grad-ready callback)
};

// Owns a weft_host plus the extra state; registers itself so the slots can find it.
// Non-copyable (the slots keep its address).
struct DdpFakeHost {
  DdpFakeHost();
  ~DdpFakeHost();
  DdpFakeHost(const DdpFakeHost&) = delete;
  DdpFakeHost& operator=(const DdpFakeHost&) = delete;

  // Adds a 1-D parameter: data and per-backward gradient (same length); its grad starts empty
  // (undefined) and is sized on the first backward that produces it.
  void add_parameter(const std::string& name, bool trainable, std::vector<float> data,
                     std::vector<float> grad_per_backward, bool produces_grad = true);

  weft_host host;
  weft_host_api api;
  std::map<std::string, double> floats;
  std::vector<std::vector<float>> data;
  std::vector<std::vector<float>> grad_per_backward;
  std::vector<bool> produces_grad;
  std::vector<bool> grad_defined;
  int64_t eval_rows = 2;
  int64_t eval_seq_len = 5;
  bool fail_all_reduce = false;  // all_reduce returns COMMUNICATION "fake: link down"
  // Records.
  std::vector<int64_t> broadcast_parameters;  // parameter index (-1: not a parameter's data)
  std::vector<int32_t> broadcast_roots;
  std::vector<DdpFakeAllReduce> all_reduce_log;
  weft_grad_ready_fn callback = nullptr;
  void* callback_user = nullptr;
  int backward_calls = 0;
  bool in_backward = false;
};
