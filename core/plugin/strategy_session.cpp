#include "core/plugin/strategy_session.h"

#include <cmath>
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <torch/torch.h>
#include <weft/plugin_torch.hpp>
#include "core/plugin/step/step.hpp"

#include "core/data/loader.h"
#include "core/dist/process_groups.h"
#include "core/plugin/status.h"
#include "core/util/error.h"

namespace weft {

namespace {

std::vector<std::string> split_names(const std::string& list) {
  std::vector<std::string> names;
  size_t start = 0;
  while (true) {
    const size_t comma = list.find(',', start);
    std::string name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const auto first = name.find_first_not_of(" \t"), last = name.find_last_not_of(" \t");
    names.push_back(first == std::string::npos ? "" : name.substr(first, last - first + 1));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return names;
}

}  // namespace

StrategySession::StrategySession(const std::string& path_or_name, toml::table plugin_config,
                                 Communicator& communicator, std::array<int32_t, 4> mesh)
    : communicator_(&communicator) {
  const std::vector<std::string> names = split_names(path_or_name);
  if (names.size() == 1) {
    for (int d = 0; d < Mesh::kDims; ++d) {
      WEFT_CHECK(mesh[static_cast<size_t>(d)] <= 1 || (d == Mesh::kDP && mesh[d] == communicator.world().size),
                 "[mesh] {} = {} lays the ranks on a device mesh, which needs several plugins (train.plugin = "
                 "\"tensor_parallel,gpipe\", one per dimension); {} runs alone over all {} ranks",
                 Mesh::name(d), mesh[static_cast<size_t>(d)], names.front().empty() ? kBuiltinStrategy : names.front(),
                 communicator.world().size);
    }
    step_.library = PluginLibrary::load(names.front().empty() ? kBuiltinStrategy : names.front());
    step_.host = std::make_unique<PluginHost>(step_.library->name(), plugin_config, communicator);
  } else {
    std::vector<std::shared_ptr<PluginLibrary>> libraries;
    for (const std::string& name : names) {
      WEFT_CHECK(!name.empty(), "train.plugin = \"{}\" names an empty plugin", fmt::join(names, ","));
      libraries.push_back(PluginLibrary::load(name));
    }
    compose(libraries, plugin_config, communicator, mesh);
  }
  library_ = step_.library;
  host_ = step_.host.get();
  state_host_ = host_;
  call("create", [&] { step_.step = create_abi2_step(step_.library->plugin(), sdk::Host(host_->handle())); });
  check_settings_read(plugin_config);
  instance_ = step_.step.get();
}

// Each plugin's effective settings, logged; and every [plugin] key read by a plugin of the run (a
// [plugin.<name>] key by plugin <name>): a misspelt key would otherwise leave the plugin at its
// default without a word. Plugins read their settings in create(). A [plugin.<name>] table of a
// plugin this run does not load is left alone (one config may serve several plugins).
void StrategySession::check_settings_read(const toml::table& plugin_config) const {
  std::set<std::string> loaded, read_by_any;
  std::vector<const Member*> everyone{&step_};  // the step's plugin and its companions
  for (const auto& member : companions_) everyone.push_back(&member);
  for (const Member* m : everyone) {
    const Member& member = *m;
    const auto& settings = member.host->settings_read();
    loaded.insert(member.library->name());
    std::string text;
    for (const auto& [key, value] : settings) {
      text += fmt::format("{}{} = {}", text.empty() ? "" : ", ", key, value);
      read_by_any.insert(key);
    }
    if (!text.empty()) spdlog::info("plugin {} settings: {}", member.library->name(), text);
  }
  const auto keys_of = [&](const PluginHost& host) {
    std::string keys;
    for (const auto& [key, value] : host.settings_read()) keys += (keys.empty() ? "" : ", ") + key;
    return keys.empty() ? std::string("none") : keys;
  };
  const auto all_keys = [&] {
    std::string text;
    for (const Member* member : everyone) {
      text += fmt::format("{}{} reads {}", text.empty() ? "" : "; ", member->library->name(), keys_of(*member->host));
    }
    return text;
  };
  for (const auto& [key, value] : plugin_config) {
    const std::string name(key.str());
    if (value.is_table()) {
      if (!loaded.count(name)) continue;
      for (const Member* member : everyone) {
        if (member->library->name() != name) continue;
        for (const auto& [sub, unused] : *value.as_table()) {
          const std::string sub_key(sub.str());
          bool read = false;
          for (const auto& [k, v] : member->host->settings_read()) read = read || k == sub_key;
          WEFT_CHECK(read, "plugin.{}.{} is not a setting of plugin {} (it reads {})", name, sub_key, name,
                     keys_of(*member->host));
        }
      }
      continue;
    }
    WEFT_CHECK(read_by_any.count(name), "plugin.{} is not a setting of any plugin of this run ({})", name, all_keys());
  }
}

// Plugins on a device mesh pp x dp x cp x tp, each owning one dimension (any two or more). The
// session holds one step, that of the pipeline plugin, else the tensor-parallel one, else the
// context-parallel one, which executes the others' layouts over their mesh slices
// (PluginHost::State::abi2_data_parallel, abi2_tensor_parallel, abi2_context_parallel); the others are
// companions: loaded, their settings read through a host of their own, named in logs and fingerprints.
void StrategySession::compose(const std::vector<std::shared_ptr<PluginLibrary>>& libraries,
                              const toml::table& plugin_config, Communicator& communicator,
                              std::array<int32_t, 4> requested) {
  const uint32_t pp_bit = 1u << WEFT_MESH_PP, dp_bit = 1u << WEFT_MESH_DP, tp_bit = 1u << WEFT_MESH_TP,
                 cp_bit = 1u << WEFT_MESH_CP;
  std::vector<std::string> names;
  for (const auto& lib : libraries) names.push_back(lib->name());
  int pp = -1, dp = -1, tp = -1, cp = -1;
  for (size_t i = 0; i < libraries.size(); ++i) {
    const uint32_t offered = libraries[i]->plugin().table.mesh_dimensions;
    WEFT_CHECK(offered == pp_bit || offered == dp_bit || offered == tp_bit || offered == cp_bit,
               "plugin {} owns no mesh dimension, so it runs alone, not in train.plugin = \"{}\"",
               names[i], fmt::join(names, ","));
    int& slot = offered == pp_bit ? pp : offered == dp_bit ? dp : offered == tp_bit ? tp : cp;
    WEFT_CHECK(slot < 0, "plugins {} and {} both own the {} dimension", names[static_cast<size_t>(std::max(slot, 0))],
               names[i], offered == pp_bit ? "pipeline" : offered == dp_bit ? "data-parallel"
                         : offered == tp_bit ? "tensor-parallel" : "context-parallel");
    slot = static_cast<int>(i);
  }

  const int outer = pp >= 0 ? pp : tp >= 0 ? tp : cp;  // the plugin whose step runs; the others compose with it
  std::array<bool, Mesh::kDims> owned{};
  owned[Mesh::kPP] = pp >= 0;
  owned[Mesh::kDP] = dp >= 0;
  owned[Mesh::kTP] = tp >= 0;
  owned[Mesh::kCP] = cp >= 0;
  mesh_ = Mesh::resolve(requested, owned, communicator.world().size);
  for (int d : {Mesh::kPP, Mesh::kDP, Mesh::kCP, Mesh::kTP}) {
    if (owned[static_cast<size_t>(d)]) continue;
    WEFT_CHECK(mesh_->size(d) == 1, "the device mesh {} has {} = {} but no plugin of train.plugin = \"{}\" owns it",
               mesh_->describe(), Mesh::name(d), mesh_->size(d), fmt::join(names, ","));
  }
  step_.library = libraries[static_cast<size_t>(outer)];
  step_.host = std::make_unique<PluginHost>(step_.library->name(), plugin_config, communicator);
  step_.dimension = pp >= 0 ? Mesh::kPP : tp >= 0 ? Mesh::kTP : Mesh::kCP;
  PluginHost::State& state = *step_.host->handle()->state;
  state.abi2_mesh = {mesh_->size(Mesh::kPP), mesh_->size(Mesh::kDP), mesh_->size(Mesh::kCP),
                     mesh_->size(Mesh::kTP)};
  for (const auto& [index, dimension] : {std::pair<int, int>{dp, Mesh::kDP}, {pp >= 0 ? tp : -1, Mesh::kTP},
                                         {outer != cp ? cp : -1, Mesh::kCP}}) {
    if (index < 0) continue;
    Member companion;
    companion.library = libraries[static_cast<size_t>(index)];
    companion.host = std::make_unique<PluginHost>(companion.library->name(), plugin_config, communicator);
    companion.dimension = dimension;
    if (dimension == Mesh::kCP) context_plugin_ = companion.library->name();
    if (dimension == Mesh::kDP) {
      state.abi2_data_parallel = &companion.library->plugin();
      state.abi2_data_parallel_settings = companion.host->handle();
    } else if (dimension == Mesh::kCP) {
      state.abi2_context_parallel = &companion.library->plugin();
      state.abi2_context_parallel_settings = companion.host->handle();
    } else {
      state.abi2_tensor_parallel = &companion.library->plugin();
      state.abi2_tensor_parallel_settings = companion.host->handle();
    }
    companions_.push_back(std::move(companion));
  }
  std::string others;
  for (const Member& c : companions_) {
    others += fmt::format("{}{}'s layout over {} {}", others.empty() ? "" : " and ", c.library->name(),
                          Mesh::name(c.dimension), mesh_->size(c.dimension));
  }
  const int runs = pp >= 0 ? Mesh::kPP : tp >= 0 ? Mesh::kTP : Mesh::kCP;
  spdlog::info("device mesh {} ({} ranks): {} runs the step, its {} over {} {}, with {}", mesh_->describe(),
               mesh_->world(), names[static_cast<size_t>(outer)],
               pp >= 0 ? "pipeline" : tp >= 0 ? "slices" : "sequence split", Mesh::name(runs), mesh_->size(runs),
               others);
}

StrategySession::~StrategySession() = default;

void StrategySession::check(weft_status* status, const char* what) const {
  throw_if_error(status, fmt::format("plugin {} ({}): {}", step_.library->name(), step_.library->path(), what));
}

void StrategySession::call(const char* what, const std::function<void()>& body) const {
  check(sdk::detail::guarded(body), what);
}

std::string StrategySession::names() const {
  std::string out = step_.library->name();
  for (const auto& m : companions_) out += "+" + m.library->name();
  return out;
}

std::string StrategySession::describe() const {
  std::string out;
  for (const Member* m : members()) {
    out += fmt::format("{}{} {} (ABI {}) from {}{}", out.empty() ? "" : "; ", m->library->name(), m->library->version(),
                       m->library->abi(), m->library->path(),
                       mesh_ ? fmt::format(" on {} {}", Mesh::name(m->dimension), mesh_->size(m->dimension)) : "");
  }
  return out;
}

std::string StrategySession::fingerprint() const {
  std::string out;
  for (const Member* m : members()) {
    out += fmt::format("{}plugin {} {} ABI {}", out.empty() ? "" : "; ", m->library->name(), m->library->version(),
                       m->library->abi());
  }
  if (mesh_) out += "; mesh " + mesh_->describe();
  return out;
}

std::vector<const StrategySession::Member*> StrategySession::members() const {
  std::vector<const Member*> out{&step_};
  for (const auto& m : companions_) out.push_back(&m);
  return out;
}

const std::string& StrategySession::context_plugin() const {
  return context_plugin_.empty() ? step_.library->name() : context_plugin_;
}

Placement StrategySession::place(const ModelConfig& config, torch::Dtype compute_dtype, int64_t seq_len,
                                 int64_t batch_rows) {
  step_.host->set_model_info(config, compute_dtype, seq_len, batch_rows);
  const int64_t num_stages = config.num_hidden_layers + 2;
  weft_model_plan plan{};
  plan.struct_size = sizeof(weft_model_plan);
  plan.first_stage = 0;
  plan.last_stage = num_stages;
  plan.data_parallel_size = 1;
  plan.data_parallel_rank = 0;
  plan.context_parallel_size = 1;
  plan.context_parallel_rank = 0;
  plan.context_parallel_layout = WEFT_CONTEXT_CONTIGUOUS;
  plan.context_parallel_attention = WEFT_CONTEXT_ATTENTION_EXCHANGE;
  plan.sequence_parallel_size = 1;
  plan.sequence_parallel_rank = 0;
  plan.stage_chunks = 1;
  plan.split_backward = 0;
  call("plan", [&] { instance_->plan(plan); });
  // The host's step wrote the plan from the plugins' layouts; messages name the plugin that chose.
  const std::string& stages_name = library_->name();
  const std::string& sequence_name = context_plugin();
  const std::string& sequence_parallel_name = library_->name();
  WEFT_CHECK(0 <= plan.first_stage && plan.first_stage < plan.last_stage && plan.last_stage <= num_stages,
             "plugin {}: plan chose stages [{}, {}) of a {}-stage model", stages_name, plan.first_stage,
             plan.last_stage, num_stages);
  WEFT_CHECK(plan.data_parallel_size >= 1 && 0 <= plan.data_parallel_rank &&
                 plan.data_parallel_rank < plan.data_parallel_size,
             "plugin {}: plan chose data-parallel rank {} of {}", stages_name, plan.data_parallel_rank,
             plan.data_parallel_size);
  Placement placement{StageRange{plan.first_stage, plan.last_stage}, plan.data_parallel_rank, plan.data_parallel_size};
  if (plan.stage_chunks != 1) {  // virtual pipeline stages
    const int32_t chunks = plan.stage_chunks;
    WEFT_CHECK(chunks >= 1 && chunks <= WEFT_MAX_STAGE_CHUNKS, "plugin {}: plan chose {} stage chunks (1 to {})",
               stages_name, chunks, WEFT_MAX_STAGE_CHUNKS);
    std::vector<StageRange> ranges;
    for (int32_t i = 0; i < chunks; ++i) ranges.push_back({plan.chunk_stages[2 * i], plan.chunk_stages[2 * i + 1]});
    try {
      StageSet(ranges).resolved(num_stages);
    } catch (const Error& e) {
      throw Error(fmt::format("plugin {}: plan's stage chunks: {}", stages_name, e.what()));
    }
    WEFT_CHECK(ranges.front().first == plan.first_stage && ranges.back().last == plan.last_stage,
               "plugin {}: plan's stage chunks span [{}, {}) but first_stage/last_stage say [{}, {})", stages_name,
               ranges.front().first, ranges.back().last, plan.first_stage, plan.last_stage);
    placement.stages = StageSet(std::move(ranges));
  }
  // zero-bubble schedules' split backward
  WEFT_CHECK(plan.split_backward == 0 || plan.split_backward == 1, "plugin {}: plan chose split_backward = {} (0 or 1)",
             stages_name, plan.split_backward);
  placement.split_backward = plan.split_backward == 1;
  {
    const int32_t size = plan.context_parallel_size, rank = plan.context_parallel_rank;
    WEFT_CHECK(size >= 1 && 0 <= rank && rank < size, "plugin {}: plan chose sequence-parallel rank {} of {}",
               sequence_name, rank, size);
    // The layout and who runs the attention core.
    const int32_t layout = plan.context_parallel_layout;
    const bool ring = plan.context_parallel_attention == WEFT_CONTEXT_ATTENTION_PLUGIN;
    WEFT_CHECK(layout == WEFT_CONTEXT_CONTIGUOUS || layout == WEFT_CONTEXT_BALANCED,
               "plugin {}: plan chose sequence layout {}, which is neither contiguous (0) nor balanced (1)",
               sequence_name, layout);
    WEFT_CHECK(plan.context_parallel_attention == WEFT_CONTEXT_ATTENTION_EXCHANGE || ring,
               "plugin {}: plan chose sequence attention {}, which is neither the exchange (0) nor the plugin's (1)",
               sequence_name, plan.context_parallel_attention);
    if (size > 1) {
      if (!ring) {
        WEFT_CHECK(layout == WEFT_CONTEXT_CONTIGUOUS,
                   "plugin {}: the balanced sequence layout needs the plugin's attention (context_attention)",
                   sequence_name);
        WEFT_CHECK(config.num_attention_heads % size == 0, "the model's {} attention heads cannot be split over {} "
                   "sequence-parallel ranks (plugin {})", config.num_attention_heads, size, sequence_name);
      }
      const int64_t parts = layout == WEFT_CONTEXT_BALANCED ? 2 * size : size;
      WEFT_CHECK(seq_len % parts == 0, "data.seq_len = {} cannot be split over {} sequence-parallel ranks (plugin {}{}): "
                 "choose a multiple of {}", seq_len, size, sequence_name,
                 layout == WEFT_CONTEXT_BALANCED ? ", balanced layout: 2 chunks per rank" : "", parts);
    }
    context_ = ContextSplit{};
    context_.rank = rank;
    context_.size = size;
    context_.layout = static_cast<ContextLayout>(layout);
    plugin_attention_ = ring;
    if (size > 1) {
      std::string runs;
      for (const auto& [start, count] : context_.token_runs(seq_len)) {
        runs += fmt::format("{}[{}, {})", runs.empty() ? "" : " and ", start, start + count);
      }
      spdlog::info("plugin {} splits every sequence over {} ranks ({}): this rank holds tokens {} of each",
                   sequence_name, size, ring ? "attention core computed by the plugin" : "all-to-all around attention",
                   runs);
    }
    placement.context_parallel_rank = rank;
    placement.context_parallel_size = size;
    step_.host->set_context_split(rank, size, context_.layout);
  }
  {  // Megatron sequence parallelism
    const int32_t size = plan.sequence_parallel_size, rank = plan.sequence_parallel_rank;
    WEFT_CHECK(size >= 1 && 0 <= rank && rank < size, "plugin {}: plan chose tensor-sequence rank {} of {}",
               sequence_parallel_name, rank, size);
    if (size > 1) {
      // Beside context parallelism (1.14 hosts) the regions gather this rank's share of each sequence
      // (seq_len / context_parallel_size tokens), which the tensor-parallel ranks then split.
      const int64_t share = seq_len / std::max<int64_t>(1, placement.context_parallel_size);
      WEFT_CHECK(share % size == 0, "data.seq_len = {}{} cannot be split over {} tensor-parallel ranks (plugin {}, "
                 "sequence parallelism): choose a multiple of {}", seq_len,
                 placement.context_parallel_size > 1
                     ? fmt::format(" ({} tokens per context-parallel rank)", share) : std::string(),
                 size, sequence_parallel_name, size * std::max<int64_t>(1, placement.context_parallel_size));
      spdlog::info("plugin {} shards the residual stream between tensor-parallel regions over {} ranks (Megatron "
                   "sequence parallelism): this rank holds tokens [{}, {}) of each sequence{} there",
                   sequence_parallel_name, size, rank * share / size, (rank + 1) * share / size,
                   placement.context_parallel_size > 1 ? "'s context-parallel share" : "");
    }
    sequence_parallel_ = SequenceShards{};
    sequence_parallel_.rank = rank;
    sequence_parallel_.size = size;
  }
  return placement;
}

ShardMap StrategySession::shards(const ModelConfig& config, const StageSet& stages) {
  ShardMap shards;
  for (const auto& [name, shape] : parameter_specs(config, stages.resolved(config.num_hidden_layers + 2))) {
    weft_parameter_info info{};
    info.name = name.c_str();
    info.stage = stage_of_parameter(name, config.num_hidden_layers);
    info.trainable = 1;
    info.ndim = static_cast<int32_t>(shape.size());
    info.shape = shape.data();
    info.dtype = DLDataType{kDLFloat, 32, 1};
    weft_shard shard{0, 1, 0};
    call("shard_parameter", [&] { shard = instance_->shard_parameter(info); });
    WEFT_CHECK(shard.parts >= 1 && 0 <= shard.index && shard.index < shard.parts && 0 <= shard.dim &&
                   shard.dim < info.ndim,
               "plugin {}: shard_parameter({}) returned dim {}, part {} of {}", library_->name(), name, shard.dim,
               shard.index, shard.parts);
    if (shard.parts == 1) continue;
    shards[name] = ParameterShard{shard.dim, shard.parts, shard.index};
  }
  return shards;
}

MemoryPlan StrategySession::memory_plan(const std::vector<weft_stage_memory>& stages, const StageSet& held,
                                        int32_t micro_batches, int64_t rows, int64_t seq_len) {
  step_.host->set_stage_memory(stages);
  weft_memory_plan plan{};
  plan.struct_size = sizeof(weft_memory_plan);
  plan.micro_batches = micro_batches;
  plan.rows_per_micro_batch = rows;
  plan.seq_len = seq_len;
  plan.stage_tokens = stage_tokens(seq_len);
  for (int64_t s = 0; s < static_cast<int64_t>(stages.size()); ++s) {  // the one-process layout of what this rank holds
    if (!held.holds(s, static_cast<int64_t>(stages.size()))) continue;
    const auto& stage = stages[static_cast<size_t>(s)];
    plan.parameter_bytes += stage.parameter_bytes;
    plan.gradient_bytes += stage.trainable_bytes;
    plan.optimizer_bytes += 2 * stage.trainable_bytes;  // AdamW's two fp32 moments
    plan.activation_bytes += rows * stage.activation_bytes_per_row + stage.weight_copy_bytes;
  }
  call("memory_plan", [&] { instance_->memory_plan(plan); });
  MemoryPlan out{plan.parameter_bytes, plan.gradient_bytes, plan.optimizer_bytes, plan.activation_bytes,
                 plan.buffer_bytes};
  WEFT_CHECK(out.parameters >= 0 && out.gradients >= 0 && out.optimizer >= 0 && out.activations >= 0 && out.buffers >= 0,
             "plugin {}: memory_plan returned a negative size", names());
  return out;
}

std::shared_ptr<const CommHook> StrategySession::comm_hook() {
  if (!instance_->runs_model_points() || host_->handle()->state->skips_model_points) return nullptr;
  static_assert(static_cast<int>(CommPoint::kHeadInput) == WEFT_COMM_HEAD_INPUT &&
                    static_cast<int>(CommPoint::kRowAbsMax) == WEFT_COMM_ROW_ABSMAX &&
                    static_cast<int>(CommPoint::kAdapterSum) == WEFT_COMM_ADAPTER_SUM,
                "the model's comm points are the step's");
  return std::make_shared<const CommHook>([this](CommPoint point, bool backward, int64_t layer, torch::Tensor& tensor) {
    if (!tensor.is_contiguous()) tensor = tensor.contiguous();
    DLTensor view = sdk::to_dl_view(tensor);
    call("comm_point", [&] {
      instance_->comm_point(static_cast<weft_comm_point>(point), backward ? WEFT_BACKWARD : WEFT_FORWARD, layer, view);
    });
  });
}

std::shared_ptr<const SequenceShards> StrategySession::sequence_parallel() {
  if (sequence_parallel_.size <= 1) return nullptr;
  auto shards = std::make_shared<SequenceShards>(sequence_parallel_);
  shards->collective = [this](CommPoint point, bool backward, int64_t layer, const torch::Tensor& input,
                               torch::Tensor& output) {
    const DLTensor in = sdk::to_dl_view(input);
    DLTensor out = sdk::to_dl_view(output);
    call("sequence_region", [&] {
      instance_->sequence_region(static_cast<weft_comm_point>(point), backward ? WEFT_BACKWARD : WEFT_FORWARD, layer,
                                 in, out);
    });
  };
  return shards;
}

std::shared_ptr<const ContextSplit> StrategySession::context_split() {
  if (context_.size <= 1) return nullptr;
  auto split = std::make_shared<ContextSplit>(context_);
  if (plugin_attention_) {
    split->attention = [this](int64_t layer, bool backward, ContextAttentionTensors& t) {
      const DLTensor q = sdk::to_dl_view(t.q), k = sdk::to_dl_view(t.k), v = sdk::to_dl_view(t.v);
      DLTensor out = sdk::to_dl_view(t.out), lse = sdk::to_dl_view(t.lse);
      DLTensor grad_out{}, grad_q{}, grad_k{}, grad_v{};
      weft_attention_call call{};
      call.struct_size = sizeof(weft_attention_call);
      call.direction = backward ? WEFT_BACKWARD : WEFT_FORWARD;
      call.layer = layer;
      call.scale = 1.0 / std::sqrt(static_cast<double>(t.q.size(3)));
      call.q = &q;
      call.k = &k;
      call.v = &v;
      call.out = &out;
      call.lse = &lse;
      if (backward) {
        grad_out = sdk::to_dl_view(t.grad_out);
        grad_q = sdk::to_dl_view(t.grad_q);
        grad_k = sdk::to_dl_view(t.grad_k);
        grad_v = sdk::to_dl_view(t.grad_v);
        call.grad_out = &grad_out;
        call.grad_q = &grad_q;
        call.grad_k = &grad_k;
        call.grad_v = &grad_v;
      }
      this->call("context_attention", [&] { instance_->context_attention(call); });
    };
    return split;
  }
  split->all_to_all = [this](int64_t layer, bool backward, torch::Tensor& send, torch::Tensor& recv) {
    if (!send.is_contiguous()) send = send.contiguous();
    const DLTensor send_view = sdk::to_dl_view(send);
    DLTensor recv_view = sdk::to_dl_view(recv);
    call("context_exchange", [&] {
      instance_->context_exchange(layer, backward ? WEFT_BACKWARD : WEFT_FORWARD, send_view, recv_view);
    });
  };
  return split;
}

void StrategySession::attach(LlamaForCausalLMImpl& model) {
  model_ = &model;
  host_->set_model(&model);
  call("setup", [&] { instance_->setup(); });
  {  // the step's flat shards of the training state (a whole range without flags: not sharded)
    for (int64_t i = 0; i < host_->parameter_count(); ++i) {
      weft_flat_shard shard{};
      call("flat_shard", [&] { shard = instance_->flat_shard(i); });
      try {
        host_->set_flat_shard(i, shard);
      } catch (const Error& e) {
        fail("plugin {}: {}", library_->name(), e.what());
      }
    }
    if (host_->flat_shard_group() != nullptr) state_group_ = host_->flat_shard_group();
  }
}

void StrategySession::after_optimizer_step(StepReport& report) {
  state_host_->zero_grad_shards();
  call("after_optimizer_step", [&] { instance_->after_optimizer_step(); });
  // What the plugins did after the optimizer step (ZeRO's gathers, hooks at "step.end") is the step's.
  const auto comm = host_->take_comm_stats();
  report.comm.operations += comm.operations;
  report.comm.bytes += comm.bytes;
  report.comm.wait_seconds += comm.wait_seconds;
  for (const auto& [name, value] : host_->take_step_metrics()) report.metrics[name] = value;
}

void StrategySession::materialize_parameters(bool whole) {
  host_->set_materialize_masters(whole);  // whole for the host: the fp32 masters
  weft_status* status = sdk::detail::guarded([&] { instance_->materialize_parameters(whole); });
  host_->set_materialize_masters(false);
  check(status, "materialize_parameters");
}

StepReport StrategySession::train_step(const BatchLoader& loader, int64_t global_step, int64_t epoch,
                                       int64_t step_in_epoch, int32_t micro_batches, int64_t seq_len) {
  host_->take_comm_stats();  // not the evaluation's or set-up's
  host_->take_compute_stats();
  host_->take_step_metrics();
  weft_step_info info{};
  info.struct_size = sizeof(weft_step_info);
  info.step = global_step;
  info.epoch = epoch;
  info.micro_batches = micro_batches;
  info.rows_per_micro_batch = loader.local_batch();
  info.seq_len = seq_len;
  info.stage_tokens = stage_tokens(seq_len);
  StepReport report;
  host_->begin_train_step(&loader, epoch, step_in_epoch, micro_batches);
  try {
    call("train_step", [&] { report.loss = instance_->train_step(info); });
  } catch (...) {
    host_->end_step();
    throw;
  }
  host_->end_step();
  report.compute = host_->take_compute_stats();
  report.comm = host_->take_comm_stats();
  report.metrics = host_->take_step_metrics();
  return report;
}

EvalSums StrategySession::eval_batch(const EvalLoader& loader, int64_t index, int64_t global_step, int64_t epoch,
                                     int64_t seq_len) {
  WEFT_CHECK(model_ != nullptr, "plugin {}: evaluation before the model is attached", library_->name());
  weft_step_info info{};
  info.struct_size = sizeof(weft_step_info);
  info.step = global_step;
  info.epoch = epoch;
  info.micro_batches = 1;
  info.seq_len = seq_len;
  info.stage_tokens = stage_tokens(seq_len);
  EvalSums sums;
  host_->begin_eval_step(&loader, index);
  try {
    call("eval_step", [&] {
      const sdk::EvalResult result = instance_->eval_step(info);
      sums.loss_sum = result.loss_sum;
      sums.tokens = result.tokens;
    });
  } catch (...) {
    host_->end_step();
    throw;
  }
  host_->end_step();
  return sums;
}

double StrategySession::global_grad_norm_sq(double local_sq) {
  double global = local_sq;
  call("global_grad_norm_sq", [&] { global = instance_->global_grad_norm_sq(local_sq); });
  return global;
}

void StrategySession::set_loss_scale(double scale) {
  host_->set_loss_scale(scale);
}

PluginHost::CommStats StrategySession::take_comm_stats() {
  return host_->take_comm_stats();
}

void StrategySession::record_sequence_losses(int64_t sequences, int64_t outputs) {
  host_->record_sequence_losses(sequences, outputs);
}

at::Tensor StrategySession::take_sequence_outputs() { return host_->take_sequence_outputs(); }

std::pair<at::Tensor, at::Tensor> StrategySession::take_sequence_losses() { return host_->take_sequence_losses(); }

}  // namespace weft
