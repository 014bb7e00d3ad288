// What the host's two steps for ABI 2 plugins share (abi2.cpp: one step over data and tensor
// parallelism; abi2_pipeline.cpp: pipeline schedules as data, with the others composed): the host's
// side of an instance, behind weft_host_services, and the services found by name.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <weft/plugin.h>
#include "core/plugin/step/step.hpp"

#include "core/plugin/abi2.h"

// The host's side of one ABI 2 instance (opaque to the plugin).
struct weft_host_context {
  weft::sdk::Host host;
  std::string plugin;
  weft_group* group = nullptr;  // the plugin's dimension: the world alone, its mesh slice composed
  // Where its [plugin] settings are read: the host of its own in a composition (null: `host`).
  weft_host* settings = nullptr;
  weft_parameter_info info{};   // the last one weft_parameter asked for (its name is the host's)
};

namespace weft {

// The host's services for ABI 2 plugins, by name (weft/plugin.h); abi2.cpp.
weft_proc abi2_host_proc_address(const char* name);

// weft_layout.reduce_bucket_bytes's default: PyTorch DDP's bucket (bucket_cap_mb = 25).
constexpr int64_t kAbi2DefaultBucketBytes = 25LL * 1024 * 1024;

// One ABI 2 plugin's instance in a host step: the host's side of it (its context and services, at
// one address for the instance's life: services.context points into it), the instance, which it
// destroys, and its layout. `group`: the plugin's dimension (this rank's mesh slice, or the world);
// `settings`: where its [plugin] settings are read when composed (null: the step's host).
struct Abi2Instance {
  Abi2Instance(sdk::Host host, const Abi2Plugin& p, weft_group* group = nullptr, weft_host* settings = nullptr)
      : plugin(p), context{host, p.table.name} {
    context.group = group;
    context.settings = settings;
    services.struct_size = sizeof services;
    services.abi_major = WEFT_PLUGIN_ABI_MAJOR;
    services.abi_minor = WEFT_PLUGIN_ABI_MINOR;
    services.context = &context;
    services.get_proc_address = &abi2_host_proc_address;
  }
  Abi2Instance(const Abi2Instance&) = delete;
  Abi2Instance& operator=(const Abi2Instance&) = delete;
  ~Abi2Instance() {
    if (instance != nullptr) plugin.table.destroy(instance);
  }
  std::string name() const { return plugin.table.name; }
  weft_proc proc(const char* what) const { return plugin.table.get_proc_address(what); }
  Abi2Plugin plugin;
  weft_host_context context;
  weft_host_services services{};
  weft_plugin_instance* instance = nullptr;
  weft_layout layout{};
};

// What weft_place is told of a built parameter: its name, its full shape (a SLICE placement's
// rank holds less) and whether it trains. The name and shape point into `info`.
inline weft_parameter_desc abi2_parameter_desc(const weft_parameter_info& info) {
  weft_parameter_desc desc{};
  desc.struct_size = sizeof desc;
  desc.name = info.name;
  desc.ndim = info.ndim;
  desc.shape = info.shape;
  desc.trainable = info.trainable;
  return desc;
}

// "REPLICATE", "FLAT_SHARD", ... (weft_placement_kind), in messages.
const char* abi2_placement_name(int32_t kind);
// Placements this host executes: REPLICATE; LOCAL for a parameter, its gradient and its optimizer
// state together; FLAT_SHARD for the optimizer state, for the gradient with it (its state FLAT_SHARD
// too) and for the parameter with both. Throws sdk::Error naming `plugin`, the parameter and the
// placement otherwise.
void check_abi2_placement(const std::string& plugin, const weft_parameter_info& info, const weft_parameter_layout& where);

// weft_layout's FLAT_SHARD options (shard_compute_dtype, shard_keep_after_forward: 0 or 1); throws
// sdk::Error naming `plugin` and the field otherwise.
void check_shard_options(const std::string& plugin, const weft_layout& layout);

// Of the parameters of model stages [first, last) of each range, by elements, the share whose
// parameter, gradient and optimizer state `place` (a plugin's "weft_place", may be null: none)
// puts FLAT_SHARD, asked before the model is built with each parameter's full shape (LoRA
// adapters aside) as trainable: what the memory plan divides over the shard group.
struct Abi2ShardShares {
  double parameter = 0.0, gradient = 0.0, optimizer_state = 0.0;
};
Abi2ShardShares abi2_shard_shares(const sdk::Host& host, const std::string& plugin, weft_place_fn place,
                                  weft_plugin_instance* instance, const std::vector<std::pair<int64_t, int64_t>>& ranges);

// The step for a plugin that owns the pipeline dimension (abi2_pipeline.cpp), over the session's
// host; it creates the plugin.
std::unique_ptr<sdk::Strategy> create_abi2_pipeline_step(sdk::Host host, const Abi2Plugin& plugin);

}  // namespace weft
