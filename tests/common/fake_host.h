// A fake host for the SDK's tests: a weft_host_api whose services record what they were asked
// and count every handle they create and release, with switches to make them fail.
#pragma once

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <weft/strategy.h>

// The ABI's opaque types, defined here for the fake.
struct weft_status {
  weft_status_code code;
  std::string message;
};
struct weft_group {
  int32_t rank;
  int32_t size;
};
struct weft_work {
  bool fail_wait;
};
struct weft_activation {
  std::string what;  // e.g. "inputs0", "logits", "loss"
  double scale;      // for losses: the scale passed to loss()
};
struct weft_buffer {  // ABI 1.2: host memory standing in for the device's
  std::vector<unsigned char> bytes;
  std::vector<int64_t> shape;
};

// A parameter of the fake model: a 1-D fp32 tensor with a gradient.
struct FakeParameter {
  std::string name;
  bool trainable;
  std::vector<float> grad;
  int64_t size;
  int64_t stride = 1;
};

struct weft_host {
  // Configuration: present keys; a key named "wrong_type" is BAD_CONFIG.
  std::map<std::string, int64_t> ints;
  std::map<std::string, std::string> strings;
  std::map<std::string, bool> bools;
  // Switches.
  std::string fail_forward;  // non-empty: forward fails with COMMUNICATION and this message
  bool fail_wait = false;    // works created from now on fail their wait with TIMEOUT
  // Records.
  std::vector<std::pair<weft_log_level, std::string>> logs;
  std::vector<std::pair<int32_t, int32_t>> batches;   // (micro_batch, splits)
  std::vector<uint32_t> forward_flags;
  std::vector<std::pair<int64_t, int64_t>> forward_ranges;
  std::vector<double> loss_scales;
  std::vector<double> backward_scales;  // scale of each loss back-propagated
  int loss_calls = 0;
  // Handles alive and releases seen.
  std::set<const weft_activation*> live_activations;
  std::set<const weft_work*> live_works;
  int activation_releases = 0;
  int work_releases = 0;
  int double_releases = 0;  // releases of a handle that was not alive (must stay 0)
  weft_group world{0, 1};
  // The model's parameters, and what all_reduce(SUM) adds for every other rank of the group
  // (each peer holds `peer_value` in every element).
  std::vector<FakeParameter> parameters;
  double peer_value = 0.0;
  int all_reduces = 0;
  // ABI 1.1: the model shape model_info returns, trace spans opened/closed, reported metrics.
  weft_model_info model{sizeof(weft_model_info), 2, 64, 128, 4, 2, 16, 512, 1, {kDLFloat, 32, 1}};
  std::vector<std::string> trace;  // "+category/name" and "-"
  std::map<std::string, double> metrics;
  // ABI 1.2: buffers alive, and calls of the view operations.
  std::set<const weft_buffer*> live_buffers;
  int buffer_releases = 0;
  int copies = 0, scales = 0, adds = 0, norms = 0;
};

// Status bookkeeping is global (status_create takes no host).
struct FakeStatusCounts {
  int created = 0;
  int released = 0;
};
FakeStatusCounts& fake_status_counts();

// The services table (every slot filled) with the given header minor.
// The fake host implements the ABI up to 1.2 (no sharded training state).
constexpr uint16_t kFakeHostMinor = 2;
weft_host_api make_fake_host_api(uint16_t abi_minor = kFakeHostMinor);

// Reads a status the caller owns and releases it: {code, message}; {OK, ""} for NULL.
std::pair<weft_status_code, std::string> take_status(weft_status* status);
