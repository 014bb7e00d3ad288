// The host's step for an ABI 2 plugin that owns the pipeline dimension: the plugin gives where the
// virtual stages live (weft_layout's pipeline fields) and each rank's compute actions
// ("weft_schedule"); the host partitions the model, adds the transfers, verifies the whole
// schedule and runs it with the pipeline runtime that the 1.x pipeline plugins use too
// (plugins/pipeline: its verifier, executor and step, which take the schedule as data).
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/plugin/abi2_context.h"
#include "pipeline_strategy.hpp"
#include "schedule.hpp"
#include "verify.hpp"

namespace weft {
namespace {

// The plugin's instance and what it said at create, kept at one address (services.context points
// into it) for the step's life.
struct PipelinePlugin {
  PipelinePlugin(sdk::Host host, const Abi2Plugin& p) : plugin(p), context{host, p.table.name} {}
  PipelinePlugin(const PipelinePlugin&) = delete;
  PipelinePlugin& operator=(const PipelinePlugin&) = delete;
  ~PipelinePlugin() {
    if (instance != nullptr) plugin.table.destroy(instance);
  }
  Abi2Plugin plugin;
  weft_host_context context;
  weft_host_services services{};
  weft_plugin_instance* instance = nullptr;
  weft_layout layout{};
  weft_schedule_fn schedule = nullptr;
  std::vector<int32_t> chunk_stage;  // copied from the layout (empty: the loop order)
};

std::string plugin_name(const PipelinePlugin& o) { return o.plugin.table.name; }

// A status from the plugin becomes an Error naming it and the function (`what`, unless null).
void check_status(const PipelinePlugin& o, weft_status* status, const char* what) {
  if (status == nullptr) return;
  const weft_host_api* api = o.context.host.api();
  const weft_status_code code = api->status_code(status);
  const std::string message = api->status_message(status);
  api->status_release(status);
  throw sdk::Error(code, what ? fmt::format("{} ({}): {}", plugin_name(o), what, message) : message);
}

[[noreturn]] void refuse_layout(const PipelinePlugin& o, const std::string& problem) {
  throw sdk::Error(WEFT_STATUS_BAD_CONFIG, fmt::format("{}: {}", plugin_name(o), problem));
}

// Every rank's compute actions for a step of `micro_batches` micro-batches, from the plugin, as the
// runtime's schedule with the transfers added (not yet verified).
pipeline::Schedule plugin_schedule(PipelinePlugin& o, int32_t stages, int32_t micro_batches) {
  using pipeline::ActionKind;
  const int32_t chunks = o.layout.pipeline_chunks;
  pipeline::Schedule s;
  s.name = plugin_name(o);
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.chunks = chunks;
  s.chunk_stage = o.chunk_stage;
  s.trains = true;
  // The plugin promises no bound: the verifier measures the peaks (the memory plan uses them).
  s.max_in_flight = micro_batches * chunks;
  s.max_pending_weights = micro_batches * chunks;
  s.actions.resize(static_cast<size_t>(stages));
  bool split = false, whole = false;
  const int64_t most = 3LL * micro_batches * chunks + 1;
  for (int32_t p = 0; p < stages; ++p) {
    weft_schedule_request request{};
    request.struct_size = sizeof request;
    request.rank = p;
    request.stages = stages;
    request.chunks = chunks;
    request.micro_batches = micro_batches;
    const weft_action* actions = nullptr;
    int64_t count = 0;
    check_status(o, o.schedule(o.instance, &request, &actions, &count), "weft_schedule");
    if (count < 0 || count > most || (count > 0 && actions == nullptr)) {
      refuse_layout(o, fmt::format("weft_schedule gave {} actions for rank {} (a step of {} micro-batches x {} chunks has at most {})",
                            count, p, micro_batches, chunks, most));
    }
    for (int64_t i = 0; i < count; ++i) {
      const weft_action& a = actions[i];
      pipeline::Action action{ActionKind::kForward, a.micro_batch, a.chunk};
      switch (a.kind) {
        case WEFT_ACTION_FORWARD: action.kind = ActionKind::kForward; break;
        case WEFT_ACTION_BACKWARD: action.kind = ActionKind::kBackward; whole = true; break;
        case WEFT_ACTION_BACKWARD_INPUT: action.kind = ActionKind::kBackward; split = true; break;
        case WEFT_ACTION_BACKWARD_WEIGHT: action.kind = ActionKind::kBackwardWeight; split = true; break;
        case WEFT_ACTION_OPTIMIZER_STEP: action = {ActionKind::kOptimizerStep, -1, 0}; break;
        default:
          refuse_layout(o, fmt::format("weft_schedule's action {} for rank {} is of kind {}, not one a schedule gives (FORWARD, "
                                "BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, OPTIMIZER_STEP)",
                                i, p, a.kind));
      }
      s.actions[static_cast<size_t>(p)].push_back(action);
    }
  }
  if (split && whole) refuse_layout(o, "weft_schedule mixes whole backwards with split ones (BACKWARD_INPUT/BACKWARD_WEIGHT)");
  s.split_backward = split;
  try {
    pipeline::add_transfers(s);
  } catch (const std::invalid_argument& e) {
    refuse_layout(o, fmt::format("weft_schedule: {}", e.what()));
  }
  return s;
}

class PipelineStep : public pipeline::PipelineStrategy {
 public:
  static constexpr uint32_t mesh_dimensions = 1u << WEFT_MESH_PP;

  // (make_table's requirement; the session creates the step with its plugin.)
  explicit PipelineStep(sdk::Host host) : PipelineStrategy(host, "", Options{}) {
    throw sdk::Error(WEFT_STATUS_INTERNAL, "an ABI 2 plugin's step is created with its plugin");
  }

  static PipelineStep* create(sdk::Host host, const Abi2Plugin& plugin) {
    auto opened = std::make_unique<PipelinePlugin>(host, plugin);
    Options options = open(host, *opened);
    return new PipelineStep(host, std::move(opened), std::move(options));
  }

 protected:
  pipeline::Schedule step_schedule(int32_t micro_batches) override {
    return plugin_schedule(*opened_, placement().stages, micro_batches);
  }

  // The verifier's simulated bubble of the plugin's schedule (forward 1, backward 2, a split
  // backward's weight half 1, free transfers).
  double bubble_formula(int32_t micro_batches) override {
    const auto it = bubbles_.find(micro_batches);
    if (it != bubbles_.end()) return it->second;
    return bubbles_[micro_batches] = pipeline::verify(step_schedule(micro_batches)).bubble;
  }

 private:
  PipelineStep(sdk::Host host, std::unique_ptr<PipelinePlugin> opened, Options options)
      : PipelineStrategy(host, opened->plugin.table.name, std::move(options)), opened_(std::move(opened)) {}

  // Creates the plugin's instance and reads its layout. Collective-free.
  static Options open(sdk::Host host, PipelinePlugin& o) {
    o.services.struct_size = sizeof o.services;
    o.services.abi_major = WEFT_PLUGIN_ABI_MAJOR;
    o.services.abi_minor = WEFT_PLUGIN_ABI_MINOR;
    o.services.context = &o.context;
    o.services.get_proc_address = &abi2_host_proc_address;
    const sdk::Group world = host.world();
    o.context.group = world.get();
    check_status(o, o.plugin.table.create(&o.services, &o.instance), nullptr);  // the session names the plugin and "create"
    const auto proc = [&](const char* name) { return o.plugin.table.get_proc_address(name); };
    o.layout.struct_size = sizeof o.layout;
    o.layout.dimension = WEFT_MESH_PP;
    o.layout.batch_split = WEFT_SPLIT_NONE;
    o.layout.reduce_bucket_bytes = kAbi2DefaultBucketBytes;
    o.layout.shard_group_size = 0;
    o.layout.pipeline_chunks = 1;
    o.layout.chunk_stages = nullptr;
    o.layout.pipeline_micro_batches = 1;
    o.layout.pipeline_balance = nullptr;
    o.layout.pipeline_balance_count = 0;
    o.layout.pipeline_stages = 0;
    if (auto fn = reinterpret_cast<weft_layout_fn>(proc("weft_layout"))) check_status(o, fn(o.instance, &o.layout), "weft_layout");
    if (o.layout.batch_split != WEFT_SPLIT_NONE) {
      refuse_layout(o, fmt::format("weft_layout's batch split {}: a pipeline's ranks all take the whole batch (WEFT_SPLIT_NONE) "
                            "and split it into weft_layout.pipeline_micro_batches",
                            o.layout.batch_split));
    }
    for (const char* later : {"weft_place", "weft_hooks"}) {
      if (proc(later) != nullptr) {
        throw sdk::Error(WEFT_STATUS_UNSUPPORTED,
                         fmt::format("{} provides {}, which this host (ABI 2.{}) does not execute for a plugin that owns "
                                     "the pipeline dimension yet",
                                     plugin_name(o), later, WEFT_PLUGIN_ABI_MINOR));
      }
    }
    o.schedule = reinterpret_cast<weft_schedule_fn>(proc("weft_schedule"));
    if (o.schedule == nullptr) refuse_layout(o, "it owns the pipeline dimension but provides no weft_schedule");
    const int32_t chunks = o.layout.pipeline_chunks;
    const int32_t stages = o.layout.pipeline_stages == 0 ? world.size() : o.layout.pipeline_stages;
    if (stages < 1 || world.size() % stages != 0) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_stages = {} must be >= 1 and divide the {} ranks", stages,
                                   world.size()));
    }
    if (chunks < 1 || chunks > WEFT_MAX_STAGE_CHUNKS) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_chunks = {} (1 to {})", chunks, WEFT_MAX_STAGE_CHUNKS));
    }
    if (o.layout.pipeline_micro_batches < 1 || o.layout.pipeline_micro_batches > 4096) {
      refuse_layout(o, fmt::format("weft_layout's pipeline_micro_batches = {} (1 to 4096)", o.layout.pipeline_micro_batches));
    }
    if (o.layout.chunk_stages != nullptr) {
      o.chunk_stage.assign(o.layout.chunk_stages, o.layout.chunk_stages + static_cast<size_t>(stages) * chunks);
    }
    if (const std::string bad = pipeline::check_chunk_map(stages, chunks, o.chunk_stage); !bad.empty()) {
      refuse_layout(o, "weft_layout's chunk_stages: " + bad);
    }
    Options options;
    options.schedule_name = plugin_name(o);
    options.stages = stages;
    options.microbatches = o.layout.pipeline_micro_batches;
    options.chunks = chunks;
    options.chunk_stage = o.chunk_stage;
    if (o.layout.pipeline_balance_count != 0) {
      if (o.layout.pipeline_balance == nullptr || o.layout.pipeline_balance_count != stages * chunks) {
        refuse_layout(o, fmt::format("weft_layout's pipeline_balance has {} entries for {} virtual stages ({} stages x {} chunks)",
                                     o.layout.pipeline_balance_count, stages * chunks, stages, chunks));
      }
      options.balance.assign(o.layout.pipeline_balance, o.layout.pipeline_balance + o.layout.pipeline_balance_count);
    }
    // Whether the backward is split decides what the model keeps (the plan): ask one list now.
    options.split_backward = plugin_schedule(o, stages, options.microbatches).split_backward;
    return options;
  }

  std::unique_ptr<PipelinePlugin> opened_;
  std::map<int32_t, double> bubbles_;
};

}  // namespace

weft_strategy_api abi2_pipeline_table(const Abi2Plugin& plugin) {
  weft_strategy_api table = sdk::detail::make_table<PipelineStep>(plugin.table.name, plugin.table.version,
                                                                   plugin.table.description);
  table.mesh_dimensions = plugin.table.mesh_dimensions;
  return table;
}

sdk::Strategy* create_abi2_pipeline_step(sdk::Host host, const Abi2Plugin& plugin) {
  return PipelineStep::create(host, plugin);
}

}  // namespace weft
