// gpipe.so: pipeline parallelism as data alone (weft/plugin.h), with the synchronous schedules
// GPipe, 1F1B, interleaved 1F1B and ZB-H1: the layout says how many chunks each rank holds (the loop
// placement: chunk c of rank p is virtual stage c x S + p) and how many micro-batches a host
// micro-batch splits into; weft_schedule gives each rank's compute actions from the generators of
// schedules.hpp. The host partitions the model, adds the transfers, verifies and
// runs the schedule; with fewer stages than ranks it replicates the pipeline and averages the
// replicas' gradients.
//
// [plugin] settings:
//   stages        int >= 1 dividing the world, default: the world (one pipeline, no replicas)
//   schedule      "gpipe" (default), "1f1b", "interleaved1f1b" or "zbh1"
//   microbatches  int in [1, 4096], default 4: pipeline micro-batches per host micro-batch
//   chunks        int, default 2 with interleaved1f1b (1 otherwise, and only 1)
//   balance       [int, ...]: decoder layers per virtual stage (ranks x chunks entries); default:
//                 the host's balance, as `partition` says
//   partition     "parameters" (default) or "time": the host balances the virtual stages by parameter
//                 count, or by each model stage's forward + backward time measured before the run
//   mode          "flush" (default): the schedules above, with a flush before each optimizer step;
//                 "async": PipeDream's asynchronous 1F1B with weight stashing, the host's runtime
//                 (weft_layout.pipeline_asynchronous; schedule "1f1b", its default there, only)
// Recomputation is the host's model.activation_checkpointing.
//
// Built twice: gpipe.so, and pipedream.so (plugins/pipedream), the same with PipeDream's
// 1F1B as its default schedule (WEFT_PIPELINE_NAME, WEFT_PIPELINE_SCHEDULE).
#include <cstddef>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <weft/plugin.h>

#include "schedules.hpp"

#ifndef WEFT_PIPELINE_NAME
#define WEFT_PIPELINE_NAME "gpipe"
#endif
#ifndef WEFT_PIPELINE_SCHEDULE
#define WEFT_PIPELINE_SCHEDULE "gpipe"
#endif

namespace {

constexpr const char* kName = WEFT_PIPELINE_NAME;

struct Gpipe {
  weft_status_create_fn status_create = nullptr;
  std::string schedule;
  int32_t stages = 1, microbatches = 4, chunks = 1;
  std::vector<int64_t> balance;  // plugin.balance (weft_layout.pipeline_balance)
  int32_t partition = WEFT_PARTITION_PARAMETERS;  // plugin.partition (weft_layout.pipeline_partition)
  bool asynchronous = false;  // plugin.mode = "async" (weft_layout.pipeline_asynchronous)
  std::vector<weft_action> list;  // the last list asked for (weft_schedule's storage)
};

weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  const auto status_create = reinterpret_cast<weft_status_create_fn>(host->get_proc_address("weft_status_create"));
  const auto config_int = reinterpret_cast<weft_config_int_fn>(host->get_proc_address("weft_config_int"));
  const auto config_string = reinterpret_cast<weft_config_string_fn>(host->get_proc_address("weft_config_string"));
  const auto config_list = reinterpret_cast<weft_config_int_list_fn>(host->get_proc_address("weft_config_int_list"));
  const auto world = reinterpret_cast<weft_world_fn>(host->get_proc_address("weft_world"));
  if (status_create == nullptr) return nullptr;  // cannot happen on a 2.x host
  if (host->abi_minor < 2 || config_int == nullptr || config_string == nullptr || config_list == nullptr || world == nullptr) {
    return status_create(WEFT_STATUS_UNSUPPORTED, (std::string(kName) + " needs a host of ABI 2.2 or later (pipeline schedules)").c_str());
  }
  try {
    auto self = std::make_unique<Gpipe>();
    self->status_create = status_create;
    const char* mode = nullptr;
    if (weft_status* s = config_string(host->context, "mode", "flush", &mode)) return s;
    if (std::strcmp(mode, "flush") != 0 && std::strcmp(mode, "async") != 0) {
      return status_create(WEFT_STATUS_BAD_CONFIG,
                           ("plugin.mode must be \"flush\" or \"async\", got \"" + std::string(mode) + "\"").c_str());
    }
    self->asynchronous = std::strcmp(mode, "async") == 0;
    if (self->asynchronous && host->abi_minor < 4) {
      return status_create(WEFT_STATUS_UNSUPPORTED, (std::string(kName) + ": plugin.mode = \"async\" needs a host of ABI 2.4 or later").c_str());
    }
    const char* name = nullptr;
    if (weft_status* s = config_string(host->context, "schedule", self->asynchronous ? "1f1b" : WEFT_PIPELINE_SCHEDULE, &name)) return s;
    self->schedule = name;
    if (self->asynchronous && self->schedule != "1f1b") {
      return status_create(WEFT_STATUS_BAD_CONFIG, (std::string(kName) + ": plugin.mode = \"async\" runs PipeDream's 1F1B without a "
                                                    "flush; plugin.schedule = \"" + self->schedule + "\" needs mode \"flush\"").c_str());
    }
    const char* partition = nullptr;
    if (weft_status* s = config_string(host->context, "partition", "parameters", &partition)) return s;
    if (std::strcmp(partition, "parameters") != 0 && std::strcmp(partition, "time") != 0) {
      return status_create(WEFT_STATUS_BAD_CONFIG,
                           ("plugin.partition must be \"parameters\" or \"time\", got \"" + std::string(partition) + "\"").c_str());
    }
    if (std::strcmp(partition, "time") == 0) {
      if (host->abi_minor < 3) {
        return status_create(WEFT_STATUS_UNSUPPORTED, (std::string(kName) + ": plugin.partition = \"time\" needs a host of ABI 2.3 or later").c_str());
      }
      self->partition = WEFT_PARTITION_TIME;
    }
    int64_t microbatches = 4, chunks = 1, stages = 0;
    if (weft_status* s = config_int(host->context, "microbatches", 4, &microbatches)) return s;
    const bool interleaved = self->schedule == "interleaved1f1b";
    if (weft_status* s = config_int(host->context, "chunks", interleaved ? 2 : 1, &chunks)) return s;
    if (microbatches < 1 || microbatches > 4096) {
      return status_create(WEFT_STATUS_BAD_CONFIG,
                           ("plugin.microbatches must be in [1, 4096], got " + std::to_string(microbatches)).c_str());
    }
    if (chunks < 1 || chunks > 16) {
      return status_create(WEFT_STATUS_BAD_CONFIG, ("plugin.chunks must be in [1, 16], got " + std::to_string(chunks)).c_str());
    }
    int32_t rank = 0, size = 1;
    world(host->context, &rank, &size);
    if (weft_status* s = config_int(host->context, "stages", size, &stages)) return s;
    if (stages < 1 || size % stages != 0) {
      return status_create(WEFT_STATUS_BAD_CONFIG, ("plugin.stages = " + std::to_string(stages) +
                                                    " must be >= 1 and divide the world size " + std::to_string(size)).c_str());
    }
    self->stages = static_cast<int32_t>(stages);
    self->microbatches = static_cast<int32_t>(microbatches);
    self->chunks = static_cast<int32_t>(chunks);
    if (self->chunks > 1 && self->stages < 2) {
      return status_create(WEFT_STATUS_BAD_CONFIG, "interleaved 1F1B needs at least 2 ranks (its chunks would pass to themselves)");
    }
    gpipe::make_schedule(self->schedule, self->stages, self->microbatches, self->chunks);  // refuses a bad one
    int32_t count = 0;
    if (weft_status* s = config_list(host->context, "balance", nullptr, 0, &count)) return s;
    self->balance.resize(static_cast<size_t>(count));
    if (count > 0) {
      if (weft_status* s = config_list(host->context, "balance", self->balance.data(), count, &count)) return s;
      if (count != self->stages * self->chunks) {
        return status_create(WEFT_STATUS_BAD_CONFIG, ("plugin.balance has " + std::to_string(count) + " entries for " +
                                                      std::to_string(self->stages * self->chunks) +
                                                      " virtual stages (ranks x chunks)").c_str());
      }
    }
    *out = reinterpret_cast<weft_plugin_instance*>(self.release());
    return nullptr;
  } catch (const std::exception& e) {
    return status_create(WEFT_STATUS_BAD_CONFIG, e.what());
  }
}

void destroy(weft_plugin_instance* instance) { delete reinterpret_cast<Gpipe*>(instance); }

weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const auto* self = reinterpret_cast<const Gpipe*>(instance);
  out->pipeline_chunks = self->chunks;
  out->pipeline_stages = self->stages;
  out->pipeline_micro_batches = self->microbatches;
  out->pipeline_balance = self->balance.empty() ? nullptr : self->balance.data();
  out->pipeline_balance_count = static_cast<int32_t>(self->balance.size());
  if (out->struct_size >= offsetof(weft_layout, pipeline_partition) + sizeof out->pipeline_partition) {
    out->pipeline_partition = self->partition;
  }
  if (out->struct_size >= offsetof(weft_layout, pipeline_asynchronous) + sizeof out->pipeline_asynchronous) {
    out->pipeline_asynchronous = self->asynchronous ? 1 : 0;
  }
  return nullptr;
}

weft_status* schedule(weft_plugin_instance* instance, const weft_schedule_request* request, const weft_action** actions,
                      int64_t* count) {
  auto* self = reinterpret_cast<Gpipe*>(instance);
  try {
    self->list = gpipe::make_schedule(self->schedule, request->stages, request->micro_batches, request->chunks)
                     .at(static_cast<size_t>(request->rank));
    *actions = self->list.data();
    *count = static_cast<int64_t>(self->list.size());
    return nullptr;
  } catch (const std::exception& e) {
    return self->status_create(WEFT_STATUS_INTERNAL, (std::string(kName) + ": " + std::string(e.what())).c_str());
  }
}

weft_proc get_proc_address(const char* name) {
  if (name == nullptr) return nullptr;
  if (std::strcmp(name, "weft_layout") == 0) return reinterpret_cast<weft_proc>(layout);
  if (std::strcmp(name, "weft_schedule") == 0) return reinterpret_cast<weft_proc>(schedule);
  return nullptr;
}

}  // namespace

extern "C" WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t) {
  static const weft_plugin table = {sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, WEFT_PIPELINE_NAME, "2.0.0",
                                    "pipeline schedules as data (GPipe, 1F1B, interleaved, ZB-H1; PipeDream's async)", 1u << WEFT_MESH_PP,
                                    create, destroy, get_proc_address};
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : nullptr;
}
