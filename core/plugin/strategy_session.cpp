#include "core/plugin/strategy_session.h"

#include <cmath>
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <set>

#include <fmt/format.h>
#include <torch/torch.h>
#include <weft/strategy_torch.hpp>

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
    Member member;
    member.library = PluginLibrary::load(names.front().empty() ? kBuiltinStrategy : names.front());
    member.host = std::make_unique<PluginHost>(member.library->name(), plugin_config, communicator);
    members_.push_back(std::move(member));
  } else {
    compose(names, plugin_config, communicator, mesh);
  }
  library_ = members_.front().library;
  host_ = members_.front().host.get();
  state_host_ = host_;
  try {
    for (auto& member : members_) {  // in order: the driver, then tp, cp, dp (each collective over the world)
      weft_strategy* instance = nullptr;
      check(member, member.library->create(member.host->api(), member.host->handle(), &instance), "create");
      WEFT_CHECK(instance != nullptr, "plugin {}: create returned no instance", member.library->name());
      member.instance = instance;
    }
    check_settings_read(plugin_config);
  } catch (...) {  // the destructor does not run: destroy the instances already made
    for (auto it = members_.rbegin(); it != members_.rend(); ++it) {
      if (it->instance) it->library->api().destroy(it->instance);
    }
    throw;
  }
  instance_ = members_.front().instance;
}

// Each plugin's effective settings, logged; and every [plugin] key read by a plugin of the run (a
// [plugin.<name>] key by plugin <name>): a misspelt key would otherwise leave the plugin at its
// default without a word. Plugins read their settings in create(). A [plugin.<name>] table of a
// plugin this run does not load is left alone (one config may serve several plugins).
void StrategySession::check_settings_read(const toml::table& plugin_config) const {
  std::set<std::string> loaded, read_by_any;
  std::vector<const Member*> everyone;  // the members and the ABI 2 companions
  for (const auto& member : members_) everyone.push_back(&member);
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

void StrategySession::compose(const std::vector<std::string>& names, const toml::table& plugin_config,
                              Communicator& communicator, std::array<int32_t, 4> requested) {
  // Which plugin owns which dimension: the first its table offers that no earlier plugin took.
  std::array<int, Mesh::kDims> owner{-1, -1, -1, -1};
  std::vector<std::shared_ptr<PluginLibrary>> libraries;
  for (const std::string& name : names) {
    WEFT_CHECK(!name.empty(), "train.plugin = \"{}\" names an empty plugin", fmt::join(names, ","));
    libraries.push_back(PluginLibrary::load(name));
  }
  for (const auto& lib : libraries) {
    if (lib->abi2() == nullptr) continue;
    for (const auto& other : libraries) {
      WEFT_CHECK(other->abi2() != nullptr,
                 "plugins {} (ABI {}) and {} (ABI {}) cannot compose: a run composes plugins of one ABI (port {} to "
                 "ABI 2, sdk/DESIGN.md)",
                 lib->name(), lib->abi(), other->name(), other->abi(), other->name());
    }
    compose_abi2(libraries, plugin_config, communicator, requested);
    return;
  }
  std::vector<Member> loaded;
  for (auto& library : libraries) {
    Member member;
    member.library = std::move(library);
    const auto& lib = *member.library;
    WEFT_CHECK(lib.negotiated_abi().minor >= 12 && lib.has_slot(offsetof(weft_strategy_api, mesh_dimensions), 12),
               "plugin {} (ABI 1.{}) cannot compose with others on a device mesh (ABI 1.12): run it alone or rebuild it "
               "against this SDK",
               lib.name(), lib.negotiated_abi().minor);
    const uint32_t offered = lib.api().mesh_dimensions;
    WEFT_CHECK(offered != 0, "plugin {} runs alone only (its table offers no mesh dimension)", lib.name());
    for (int d : {Mesh::kPP, Mesh::kTP, Mesh::kCP, Mesh::kDP}) {
      if ((offered & (1u << d)) != 0 && owner[static_cast<size_t>(d)] < 0) {
        member.dimension = d;
        break;
      }
    }
    if (member.dimension < 0) {
      std::string taken;
      for (int d = 0; d < Mesh::kDims; ++d) {
        if ((offered & (1u << d)) != 0) {
          taken += fmt::format("{}{} ({})", taken.empty() ? "" : ", ", Mesh::name(d),
                               loaded[static_cast<size_t>(owner[static_cast<size_t>(d)])].library->name());
        }
      }
      fail("plugins {}: {} owns the same mesh dimension as another: {}", fmt::join(names, ", "), lib.name(), taken);
    }
    owner[static_cast<size_t>(member.dimension)] = static_cast<int>(loaded.size());
    loaded.push_back(std::move(member));
  }
  std::array<bool, Mesh::kDims> owned{};
  for (int d = 0; d < Mesh::kDims; ++d) owned[static_cast<size_t>(d)] = owner[static_cast<size_t>(d)] >= 0;
  mesh_ = Mesh::resolve(requested, owned, communicator.world().size);
  for (int d = 0; d < Mesh::kDims; ++d) {
    WEFT_CHECK(mesh_->size(d) == 1 || owned[static_cast<size_t>(d)],
               "the device mesh {} has {} = {} but no plugin of train.plugin = \"{}\" owns it{}", mesh_->describe(),
               Mesh::name(d), mesh_->size(d), fmt::join(names, ","),
               d == Mesh::kDP ? ": add ddp" : d == Mesh::kPP ? ": add gpipe or pipedream"
                               : d == Mesh::kTP ? ": add tensor_parallel" : ": add context_parallel");
  }
  // Every slice's group along every dimension a plugin owns (collective: all ranks, same order).
  const int32_t rank = communicator.world().rank;
  std::array<ProcessGroup*, 4> groups{};
  for (int d = 0; d < Mesh::kDims; ++d) {
    if (!owned[static_cast<size_t>(d)] && mesh_->size(d) == 1) continue;
    const auto slices = mesh_->slices(d);
    const int32_t mine = mesh_->slice_of(rank, d);
    for (size_t j = 0; j < slices.size(); ++j) {
      auto& group = communicator.create_group(slices[j]);
      if (static_cast<int32_t>(j) == mine) groups[static_cast<size_t>(d)] = &group;
    }
  }
  groups_ = groups;
  // The driver first (pp, else tp, cp, dp), then the others innermost first: tp, cp, dp.
  const int driver_dim = owned[Mesh::kPP] ? Mesh::kPP : owned[Mesh::kTP] ? Mesh::kTP
                       : owned[Mesh::kCP] ? Mesh::kCP : Mesh::kDP;
  std::vector<int> order{driver_dim};
  for (int d : {Mesh::kTP, Mesh::kCP, Mesh::kDP}) {
    if (d != driver_dim && owned[static_cast<size_t>(d)]) order.push_back(d);
  }
  for (int d : order) {
    Member member = std::move(loaded[static_cast<size_t>(owner[static_cast<size_t>(d)])]);
    const bool driver = d == driver_dim;
    if (!driver) {
      WEFT_CHECK(member.library->api().finish_step && member.library->api().finish_eval,
                 "plugin {} owns mesh dimension {} but cannot finish another plugin's step (no finish_step / "
                 "finish_eval): it can only drive a composed run",
                 member.library->name(), Mesh::name(d));
    }
    member.host = std::make_unique<PluginHost>(member.library->name(), plugin_config, communicator);
    member.host->set_mesh(&*mesh_, d, driver, static_cast<int>(names.size()), groups);
    members_.push_back(std::move(member));
  }
  spdlog::info("device mesh {} ({} ranks): {} drives the step{}", mesh_->describe(), mesh_->world(),
               members_.front().library->name(), [&] {
                 std::string rest;
                 for (size_t i = 0; i < members_.size(); ++i) {
                   rest += fmt::format("{}{} owns {} ({})", i == 0 ? "; " : ", ", members_[i].library->name(),
                                       Mesh::name(members_[i].dimension), mesh_->size(members_[i].dimension));
                 }
                 return rest;
               }());
}

// ABI 2 plugins on a device mesh pp x dp x cp x tp, each owning one dimension (any two or more). The
// session holds one step, that of the pipeline plugin, else the tensor-parallel one, else the
// context-parallel one, which executes the others' layouts over their mesh slices
// (PluginHost::State::abi2_data_parallel, abi2_tensor_parallel, abi2_context_parallel); the others are
// companions: loaded, their settings read through a host of their own, named in logs and fingerprints.
void StrategySession::compose_abi2(const std::vector<std::shared_ptr<PluginLibrary>>& libraries,
                                   const toml::table& plugin_config, Communicator& communicator,
                                   std::array<int32_t, 4> requested) {
  const uint32_t pp_bit = 1u << WEFT_MESH_PP, dp_bit = 1u << WEFT_MESH_DP, tp_bit = 1u << WEFT_MESH_TP,
                 cp_bit = 1u << WEFT_MESH_CP;
  std::vector<std::string> names;
  for (const auto& lib : libraries) names.push_back(lib->name());
  int pp = -1, dp = -1, tp = -1, cp = -1;
  for (size_t i = 0; i < libraries.size(); ++i) {
    const uint32_t offered = libraries[i]->abi2()->table.mesh_dimensions;
    WEFT_CHECK(offered == pp_bit || offered == dp_bit || offered == tp_bit || offered == cp_bit,
               "plugin {} (ABI 2) owns no mesh dimension, so it runs alone, not in train.plugin = \"{}\"",
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
  abi2_mesh_ = Mesh::resolve(requested, owned, communicator.world().size);
  for (int d : {Mesh::kPP, Mesh::kDP, Mesh::kCP, Mesh::kTP}) {
    if (owned[static_cast<size_t>(d)]) continue;
    WEFT_CHECK(abi2_mesh_->size(d) == 1, "the device mesh {} has {} = {} but no plugin of train.plugin = \"{}\" owns it",
               abi2_mesh_->describe(), Mesh::name(d), abi2_mesh_->size(d), fmt::join(names, ","));
  }
  Member step;
  step.library = libraries[static_cast<size_t>(outer)];
  step.host = std::make_unique<PluginHost>(step.library->name(), plugin_config, communicator);
  step.dimension = pp >= 0 ? Mesh::kPP : tp >= 0 ? Mesh::kTP : Mesh::kCP;
  PluginHost::State& state = *step.host->handle()->state;
  state.abi2_mesh = {abi2_mesh_->size(Mesh::kPP), abi2_mesh_->size(Mesh::kDP), abi2_mesh_->size(Mesh::kCP),
                     abi2_mesh_->size(Mesh::kTP)};
  for (const auto& [index, dimension] : {std::pair<int, int>{dp, Mesh::kDP}, {pp >= 0 ? tp : -1, Mesh::kTP},
                                         {outer != cp ? cp : -1, Mesh::kCP}}) {
    if (index < 0) continue;
    Member companion;
    companion.library = libraries[static_cast<size_t>(index)];
    companion.host = std::make_unique<PluginHost>(companion.library->name(), plugin_config, communicator);
    companion.dimension = dimension;
    if (dimension == Mesh::kDP) {
      state.abi2_data_parallel = companion.library->abi2();
      state.abi2_data_parallel_settings = companion.host->handle();
    } else if (dimension == Mesh::kCP) {
      state.abi2_context_parallel = companion.library->abi2();
      state.abi2_context_parallel_settings = companion.host->handle();
    } else {
      state.abi2_tensor_parallel = companion.library->abi2();
      state.abi2_tensor_parallel_settings = companion.host->handle();
    }
    companions_.push_back(std::move(companion));
  }
  members_.push_back(std::move(step));
  std::string others;
  for (const Member& c : companions_) {
    others += fmt::format("{}{}'s layout over {} {}", others.empty() ? "" : " and ", c.library->name(),
                          Mesh::name(c.dimension), abi2_mesh_->size(c.dimension));
  }
  const int runs = pp >= 0 ? Mesh::kPP : tp >= 0 ? Mesh::kTP : Mesh::kCP;
  spdlog::info("device mesh {} ({} ranks): {} runs the step, its {} over {} {}, with {}", abi2_mesh_->describe(),
               abi2_mesh_->world(), names[static_cast<size_t>(outer)],
               pp >= 0 ? "pipeline" : tp >= 0 ? "slices" : "sequence split", Mesh::name(runs), abi2_mesh_->size(runs),
               others);
}

StrategySession::~StrategySession() {
  for (auto it = members_.rbegin(); it != members_.rend(); ++it) {
    if (it->instance) it->library->api().destroy(it->instance);
  }
}

void StrategySession::check(weft_status* status, const char* what) const { check(members_.front(), status, what); }

void StrategySession::check(const Member& member, weft_status* status, const char* what) const {
  throw_if_error(status, fmt::format("plugin {} ({}): {}", member.library->name(), member.library->path(), what));
}

std::string StrategySession::names() const {
  std::string out;
  for (const auto& m : members_) out += (out.empty() ? "" : "+") + m.library->name();
  for (const auto& m : companions_) out += "+" + m.library->name();
  return out;
}

uint16_t StrategySession::min_negotiated_minor() const {
  uint16_t minor = members_.front().library->negotiated_abi().minor;
  for (const auto& m : members_) minor = std::min<uint16_t>(minor, m.library->negotiated_abi().minor);
  return minor;
}

std::string StrategySession::describe() const {
  const Mesh* mesh = mesh_ ? &*mesh_ : abi2_mesh_ ? &*abi2_mesh_ : nullptr;
  std::string out;
  for (const auto* list : {&members_, &companions_}) {
    for (const auto& m : *list) {
      out += fmt::format("{}{} {} (ABI {}) from {}{}", out.empty() ? "" : "; ", m.library->name(), m.library->version(),
                         m.library->abi(), m.library->path(),
                         mesh ? fmt::format(" on {} {}", Mesh::name(m.dimension), mesh->size(m.dimension)) : "");
    }
  }
  return out;
}

std::string StrategySession::fingerprint() const {
  std::string out;
  for (const auto* list : {&members_, &companions_}) {
    for (const auto& m : *list) {
      out += fmt::format("{}plugin {} {} ABI {}", out.empty() ? "" : "; ", m.library->name(), m.library->version(),
                         m.library->abi());
    }
  }
  if (mesh_) out += "; mesh " + mesh_->describe();
  if (abi2_mesh_) out += "; mesh " + abi2_mesh_->describe();
  return out;
}

weft_model_plan StrategySession::merged_plan(const weft_model_plan& prefilled) {
  stages_owner_ = context_owner_ = sequence_parallel_owner_ = 0;
  if (!mesh_) {
    weft_model_plan plan = prefilled;
    if (library_->api().plan) check(library_->api().plan(instance_, &plan), "plan");
    return plan;
  }
  // Composed: each plugin plans on the one-process layout; its changes are merged field by field.
  weft_model_plan merged = prefilled;
  int stages = -1, sequence = -1, tensor_sequence = -1, drives = -1;
  int64_t dp_size = 1, dp_rank = 0;
  for (size_t i = 0; i < members_.size(); ++i) {
    const Member& m = members_[i];
    weft_model_plan plan = prefilled;
    if (m.library->api().plan) check(m, m.library->api().plan(m.instance, &plan), "plan");
    auto take = [&](bool changed, int& owner, const char* what) {
      if (!changed) return false;
      WEFT_CHECK(owner < 0, "plugins {} and {} both set {} in their plans: one plugin per part of the plan",
                 members_[static_cast<size_t>(owner)].library->name(), m.library->name(), what);
      owner = static_cast<int>(i);
      return true;
    };
    const bool staged = plan.first_stage != prefilled.first_stage || plan.last_stage != prefilled.last_stage ||
                        plan.stage_chunks != prefilled.stage_chunks || plan.split_backward != prefilled.split_backward;
    if (take(staged, stages, "the model stages")) {
      merged.first_stage = plan.first_stage;
      merged.last_stage = plan.last_stage;
      merged.stage_chunks = plan.stage_chunks;
      std::memcpy(merged.chunk_stages, plan.chunk_stages, sizeof merged.chunk_stages);
      merged.split_backward = plan.split_backward;
    }
    const bool split = plan.sequence_parallel_size != prefilled.sequence_parallel_size ||
                       plan.sequence_parallel_rank != prefilled.sequence_parallel_rank ||
                       plan.sequence_parallel_layout != prefilled.sequence_parallel_layout ||
                       plan.sequence_parallel_attention != prefilled.sequence_parallel_attention;
    if (take(split, sequence, "the sequence split")) {
      merged.sequence_parallel_size = plan.sequence_parallel_size;
      merged.sequence_parallel_rank = plan.sequence_parallel_rank;
      merged.sequence_parallel_layout = plan.sequence_parallel_layout;
      merged.sequence_parallel_attention = plan.sequence_parallel_attention;
    }
    const bool regions = plan.tensor_sequence_size != prefilled.tensor_sequence_size ||
                         plan.tensor_sequence_rank != prefilled.tensor_sequence_rank;
    if (take(regions, tensor_sequence, "the tensor-sequence split")) {
      merged.tensor_sequence_size = plan.tensor_sequence_size;
      merged.tensor_sequence_rank = plan.tensor_sequence_rank;
    }
    if (m.library->negotiated_abi().minor >= 14 && plan.drives_stages != prefilled.drives_stages) {
      WEFT_CHECK(plan.drives_stages == 1, "plugin {}: plan chose drives_stages = {} (0 or 1)", m.library->name(),
                 plan.drives_stages);
      take(true, drives, "drives_stages");
    }
    WEFT_CHECK(plan.data_parallel_size >= 1 && 0 <= plan.data_parallel_rank &&
                   plan.data_parallel_rank < plan.data_parallel_size,
               "plugin {}: plan chose data-parallel rank {} of {}", m.library->name(), plan.data_parallel_rank,
               plan.data_parallel_size);
    dp_rank = dp_rank * plan.data_parallel_size + plan.data_parallel_rank;
    dp_size *= plan.data_parallel_size;
  }
  // The rows of every global batch split along dp, which is the host's: a plan may leave
  // data_parallel_* as pre-filled or write the same (the dp slice is the dp owner's world).
  const int32_t mesh_dp = mesh_->size(Mesh::kDP);
  const int32_t dp_coord = mesh_->coords(communicator_->world().rank)[Mesh::kDP];
  WEFT_CHECK((dp_size == 1 && dp_rank == 0) || (dp_size == mesh_dp && dp_rank == dp_coord),
             "plugins {}: their plans make this rank data-parallel rank {} of {}, but the device mesh {} makes it "
             "{} of {}",
             names(), dp_rank, dp_size, mesh_->describe(), dp_coord, mesh_dp);
  merged.data_parallel_size = mesh_dp;
  merged.data_parallel_rank = dp_coord;
  if (drives > 0) {  // ABI 1.14: the stage-driving plugin drives; the others finish in their order
    drive_from(static_cast<size_t>(drives), stages);
    const auto moved = [drives](int i) { return i < 0 ? i : i == drives ? 0 : i < drives ? i + 1 : i; };
    stages = moved(stages);
    sequence = moved(sequence);
    tensor_sequence = moved(tensor_sequence);
  } else if (drives == 0) {
    drive_from(0, stages);
  }
  stages_owner_ = std::max(stages, 0);
  context_owner_ = std::max(sequence, 0);
  sequence_parallel_owner_ = std::max(tensor_sequence, 0);
  return merged;
}

// ABI 1.14: members_[index]'s plan said it runs the model stage by stage itself (drives_stages):
// it becomes the driver unless a pipeline splits the stages (`stages`: the member whose plan did).
void StrategySession::drive_from(size_t index, int stages) {
  const Member& runner = members_[index];
  for (const Member& m : members_) {
    WEFT_CHECK(m.dimension != Mesh::kPP && (stages < 0 || stages == static_cast<int>(index)),
               "plugin {} runs the model stage by stage itself (its plan's drives_stages: ZeRO-3 gathers each stage's "
               "parameters around that stage's forward and backward), but plugin {} splits the stages over pipeline "
               "ranks and drives the step with several micro-batches of a stage in flight: a run has one driver "
               "(zero's plugin.stage = 1 or 2 composes with a pipeline)",
               runner.library->name(),
               stages >= 0 ? members_[static_cast<size_t>(stages)].library->name() : m.library->name());
  }
  WEFT_CHECK(runner.library->api().train_step != nullptr,
             "plugin {}: its plan drives the stages (drives_stages) but it has no train_step", runner.library->name());
  for (const Member& m : members_) {  // a finisher built before 1.14 would look for whole gradients
    WEFT_CHECK(&m == &runner || m.library->negotiated_abi().minor >= 14,
               "plugin {} (ABI 1.{}) finishes the step on whole gradients, but plugin {} drives the stages and leaves "
               "them reduce-scattered into its shards (ABI 1.14 parameter_grad_step): rebuild {} against this SDK, "
               "or use a stage of {} that does not drive (zero: plugin.stage = 1 or 2)",
               m.library->name(), m.library->negotiated_abi().minor, runner.library->name(), m.library->name(),
               runner.library->name());
  }
  if (index > 0) {
    Member moved = std::move(members_[index]);
    members_.erase(members_.begin() + static_cast<std::ptrdiff_t>(index));
    members_.insert(members_.begin(), std::move(moved));
    for (const Member& m : members_) {
      WEFT_CHECK(&m == &members_.front() || (m.library->api().finish_step && m.library->api().finish_eval),
                 "plugin {} would drive the step, but plugin {} drives the stages (drives_stages), and {} cannot finish "
                 "another plugin's step (no finish_step / finish_eval)",
                 m.library->name(), members_.front().library->name(), m.library->name());
    }
    for (size_t i = 0; i < members_.size(); ++i) members_[i].host->set_driver(i == 0);
    library_ = members_.front().library;
    host_ = members_.front().host.get();
    state_host_ = host_;
    instance_ = members_.front().instance;
    spdlog::info("plugin {} runs the model stage by stage, so it drives the step; {} finish it", library_->name(),
                 [&] {
                   std::string rest;
                   for (size_t i = 1; i < members_.size(); ++i) rest += (i > 1 ? ", " : "") + members_[i].library->name();
                   return rest;
                 }());
  }
  drives_stages_ = true;
}

Placement StrategySession::place(const ModelConfig& config, torch::Dtype compute_dtype, int64_t seq_len,
                                 int64_t batch_rows) {
  for (auto& m : members_) m.host->set_model_info(config, compute_dtype, seq_len, batch_rows);
  const int64_t num_stages = config.num_hidden_layers + 2;
  weft_model_plan plan{};
  plan.struct_size = sizeof(weft_model_plan);
  plan.first_stage = 0;
  plan.last_stage = num_stages;
  plan.data_parallel_size = 1;
  plan.data_parallel_rank = 0;
  plan.sequence_parallel_size = 1;
  plan.sequence_parallel_rank = 0;
  plan.sequence_parallel_layout = WEFT_SEQUENCE_CONTIGUOUS;
  plan.sequence_parallel_attention = WEFT_SEQUENCE_ATTENTION_EXCHANGE;
  plan.tensor_sequence_size = 1;
  plan.tensor_sequence_rank = 0;
  plan.stage_chunks = 1;
  plan.split_backward = 0;
  plan = merged_plan(plan);
  // Each check below names the plugin whose plan set the fields it checks.
  const PluginLibrary& stages_lib = *members_[static_cast<size_t>(stages_owner_)].library;
  const PluginLibrary& sequence_lib = *members_[static_cast<size_t>(context_owner_)].library;
  const PluginLibrary& sequence_parallel_lib = *members_[static_cast<size_t>(sequence_parallel_owner_)].library;
  WEFT_CHECK(0 <= plan.first_stage && plan.first_stage < plan.last_stage && plan.last_stage <= num_stages,
             "plugin {}: plan chose stages [{}, {}) of a {}-stage model", stages_lib.name(), plan.first_stage,
             plan.last_stage, num_stages);
  WEFT_CHECK(plan.data_parallel_size >= 1 && 0 <= plan.data_parallel_rank &&
                 plan.data_parallel_rank < plan.data_parallel_size,
             "plugin {}: plan chose data-parallel rank {} of {}", stages_lib.name(), plan.data_parallel_rank,
             plan.data_parallel_size);
  Placement placement{StageRange{plan.first_stage, plan.last_stage}, plan.data_parallel_rank, plan.data_parallel_size};
  if (stages_lib.negotiated_abi().minor >= 10 && plan.stage_chunks != 1) {  // virtual pipeline stages
    const int32_t chunks = plan.stage_chunks;
    WEFT_CHECK(chunks >= 1 && chunks <= WEFT_MAX_STAGE_CHUNKS, "plugin {}: plan chose {} stage chunks (1 to {})",
               stages_lib.name(), chunks, WEFT_MAX_STAGE_CHUNKS);
    std::vector<StageRange> ranges;
    for (int32_t i = 0; i < chunks; ++i) ranges.push_back({plan.chunk_stages[2 * i], plan.chunk_stages[2 * i + 1]});
    try {
      StageSet(ranges).resolved(num_stages);
    } catch (const Error& e) {
      throw Error(fmt::format("plugin {}: plan's stage chunks: {}", stages_lib.name(), e.what()));
    }
    WEFT_CHECK(ranges.front().first == plan.first_stage && ranges.back().last == plan.last_stage,
               "plugin {}: plan's stage chunks span [{}, {}) but first_stage/last_stage say [{}, {})", stages_lib.name(),
               ranges.front().first, ranges.back().last, plan.first_stage, plan.last_stage);
    placement.stages = StageSet(std::move(ranges));
  }
  if (stages_lib.negotiated_abi().minor >= 11) {  // zero-bubble schedules' split backward
    WEFT_CHECK(plan.split_backward == 0 || plan.split_backward == 1, "plugin {}: plan chose split_backward = {} (0 or 1)",
               stages_lib.name(), plan.split_backward);
    placement.split_backward = plan.split_backward == 1;
  }
  // A sequence split across a split of the stages needs the stage-splitting plugin to pass this rank's
  // tokens between them (ABI 1.13 stage_tokens); an older one sizes its buffers for whole sequences.
  const bool every_stage = placement.stages.ranges.size() == 1 && plan.first_stage == 0 && plan.last_stage == num_stages;
  const bool split_stages_ok = every_stage || stages_lib.negotiated_abi().minor >= 13;
  if (sequence_lib.negotiated_abi().minor >= 4) {
    const int32_t size = plan.sequence_parallel_size, rank = plan.sequence_parallel_rank;
    WEFT_CHECK(size >= 1 && 0 <= rank && rank < size, "plugin {}: plan chose sequence-parallel rank {} of {}",
               sequence_lib.name(), rank, size);
    // 1.5: the layout and who runs the attention core (a 1.4 plugin leaves the pre-filled 0, 0).
    const bool v15 = sequence_lib.negotiated_abi().minor >= 5;
    const int32_t layout = v15 ? plan.sequence_parallel_layout : WEFT_SEQUENCE_CONTIGUOUS;
    const bool ring = v15 && plan.sequence_parallel_attention == WEFT_SEQUENCE_ATTENTION_PLUGIN;
    WEFT_CHECK(layout == WEFT_SEQUENCE_CONTIGUOUS || layout == WEFT_SEQUENCE_BALANCED,
               "plugin {}: plan chose sequence layout {}, which is neither contiguous (0) nor balanced (1)",
               sequence_lib.name(), layout);
    WEFT_CHECK(!v15 || plan.sequence_parallel_attention == WEFT_SEQUENCE_ATTENTION_EXCHANGE || ring,
               "plugin {}: plan chose sequence attention {}, which is neither the exchange (0) nor the plugin's (1)",
               sequence_lib.name(), plan.sequence_parallel_attention);
    if (size > 1) {
      if (ring) {
        WEFT_CHECK(sequence_lib.has_slot(offsetof(weft_strategy_api, sequence_attention), 5) &&
                       sequence_lib.api().sequence_attention != nullptr,
                   "plugin {}: plan runs the attention core in the plugin but the plugin has no sequence_attention",
                   sequence_lib.name());
      } else {
        WEFT_CHECK(sequence_lib.has_slot(offsetof(weft_strategy_api, sequence_exchange), 4) &&
                       sequence_lib.api().sequence_exchange != nullptr,
                   "plugin {}: plan splits sequences over {} ranks but the plugin has no sequence_exchange",
                   sequence_lib.name(), size);
        WEFT_CHECK(layout == WEFT_SEQUENCE_CONTIGUOUS,
                   "plugin {}: the balanced sequence layout needs the plugin's attention (sequence_attention)",
                   sequence_lib.name());
        WEFT_CHECK(config.num_attention_heads % size == 0, "the model's {} attention heads cannot be split over {} "
                   "sequence-parallel ranks (plugin {})", config.num_attention_heads, size, sequence_lib.name());
      }
      const int64_t parts = layout == WEFT_SEQUENCE_BALANCED ? 2 * size : size;
      WEFT_CHECK(seq_len % parts == 0, "data.seq_len = {} cannot be split over {} sequence-parallel ranks (plugin {}{}): "
                 "choose a multiple of {}", seq_len, size, sequence_lib.name(),
                 layout == WEFT_SEQUENCE_BALANCED ? ", balanced layout: 2 chunks per rank" : "", parts);
      WEFT_CHECK(split_stages_ok,
                 "plugin {} splits every sequence over {} ranks, but plugin {} (ABI 1.{}) splits the model's stages and "
                 "passes whole sequences between them: a sequence split across stages needs ABI 1.13 (rebuild it "
                 "against this SDK)",
                 sequence_lib.name(), size, stages_lib.name(), stages_lib.negotiated_abi().minor);
    }
    context_ = ContextSplit{};
    context_.rank = rank;
    context_.size = size;
    context_.layout = static_cast<SequenceLayout>(layout);
    context_ring_ = ring;
    if (size > 1) {
      std::string runs;
      for (const auto& [start, count] : context_.token_runs(seq_len)) {
        runs += fmt::format("{}[{}, {})", runs.empty() ? "" : " and ", start, start + count);
      }
      spdlog::info("plugin {} splits every sequence over {} ranks ({}): this rank holds tokens {} of each",
                   sequence_lib.name(), size, ring ? "attention run by the plugin, e.g. ring" : "all-to-all around attention",
                   runs);
    }
    placement.context_parallel_rank = rank;
    placement.context_parallel_size = size;
    for (auto& m : members_) m.host->set_context_split(rank, size, context_.layout);
  }
  if (sequence_parallel_lib.negotiated_abi().minor >= 9) {  // Megatron sequence parallelism
    const int32_t size = plan.tensor_sequence_size, rank = plan.tensor_sequence_rank;
    WEFT_CHECK(size >= 1 && 0 <= rank && rank < size, "plugin {}: plan chose tensor-sequence rank {} of {}",
               sequence_parallel_lib.name(), rank, size);
    if (size > 1) {
      WEFT_CHECK(sequence_parallel_lib.has_slot(offsetof(weft_strategy_api, sequence_region), 9) &&
                     sequence_parallel_lib.api().sequence_region != nullptr,
                 "plugin {}: plan shards the residual stream's tokens over {} ranks (tensor_sequence_size) but the "
                 "plugin has no sequence_region",
                 sequence_parallel_lib.name(), size);
      // Beside context parallelism (1.14 hosts) the regions gather this rank's share of each sequence
      // (seq_len / context_parallel_size tokens), which the tensor-parallel ranks then split.
      const int64_t share = seq_len / std::max<int64_t>(1, placement.context_parallel_size);
      WEFT_CHECK(share % size == 0, "data.seq_len = {}{} cannot be split over {} tensor-parallel ranks (plugin {}, "
                 "sequence parallelism): choose a multiple of {}", seq_len,
                 placement.context_parallel_size > 1
                     ? fmt::format(" ({} tokens per context-parallel rank)", share) : std::string(),
                 size, sequence_parallel_lib.name(), size * std::max<int64_t>(1, placement.context_parallel_size));
      WEFT_CHECK(split_stages_ok,
                 "plugin {} shards the residual stream's tokens over {} ranks, but plugin {} (ABI 1.{}) splits the "
                 "model's stages and passes whole sequences between them: sequence parallelism across stages needs "
                 "ABI 1.13 (rebuild it against this SDK)",
                 sequence_parallel_lib.name(), size, stages_lib.name(), stages_lib.negotiated_abi().minor);
      spdlog::info("plugin {} shards the residual stream between tensor-parallel regions over {} ranks (Megatron "
                   "sequence parallelism): this rank holds tokens [{}, {}) of each sequence{} there",
                   sequence_parallel_lib.name(), size, rank * share / size, (rank + 1) * share / size,
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
  for (const Member& m : members_) {  // composed: at most one plugin slices any parameter
  if (m.library->api().shard_parameter == nullptr) continue;
  for (const auto& [name, shape] : parameter_specs(config, stages.resolved(config.num_hidden_layers + 2))) {
    weft_parameter_info info{};
    info.name = name.c_str();
    info.stage = stage_of_parameter(name, config.num_hidden_layers);
    info.trainable = 1;
    info.ndim = static_cast<int32_t>(shape.size());
    info.shape = shape.data();
    info.dtype = DLDataType{kDLFloat, 32, 1};
    weft_shard shard{0, 1, 0};
    check(m, m.library->api().shard_parameter(m.instance, &info, &shard), "shard_parameter");
    WEFT_CHECK(shard.parts >= 1 && 0 <= shard.index && shard.index < shard.parts && 0 <= shard.dim &&
                   shard.dim < info.ndim,
               "plugin {}: shard_parameter({}) returned dim {}, part {} of {}", m.library->name(), name, shard.dim,
               shard.index, shard.parts);
    if (shard.parts == 1) continue;
    WEFT_CHECK(shards.count(name) == 0, "plugins {}: two of them slice {}: one plugin per parameter's slices", names(),
               name);
    shards[name] = ParameterShard{shard.dim, shard.parts, shard.index};
  }
  }
  // Ulysses moves heads: this rank's heads (after a tensor-parallel split of q_proj) must divide
  // over the sequence-parallel ranks, or the first forward would refuse it after compute started.
  if (context_.size > 1 && !context_ring_) {
    int64_t parts = 1;
    for (const auto& [name, shard] : shards) {
      if (name.find("self_attn.q_proj.weight") != std::string::npos) parts = shard.parts;
    }
    const int64_t local = config.num_attention_heads / parts;
    WEFT_CHECK(local % context_.size == 0,
               "the model's {} attention heads, {} per tensor-parallel rank, cannot be split over {} sequence-parallel "
               "ranks (plugin {}, all-to-all around attention): choose sizes that divide the heads, or ring attention "
               "(plugin.mode = \"ring\")",
               config.num_attention_heads, local, context_.size, members_[static_cast<size_t>(context_owner_)].library->name());
  }
  return shards;
}

MemoryPlan StrategySession::memory_plan(const std::vector<weft_stage_memory>& stages, const StageSet& held,
                                        int32_t micro_batches, int64_t rows, int64_t seq_len) {
  for (auto& m : members_) m.host->set_stage_memory(stages);
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
  for (const Member& m : members_) {  // composed: each adjusts it for what it does
    if (m.has(offsetof(weft_strategy_api, memory_plan), 3) && m.library->api().memory_plan) {
      check(m, m.library->api().memory_plan(m.instance, &plan), "memory_plan");
    }
  }
  MemoryPlan out{plan.parameter_bytes, plan.gradient_bytes, plan.optimizer_bytes, plan.activation_bytes,
                 plan.buffer_bytes};
  WEFT_CHECK(out.parameters >= 0 && out.gradients >= 0 && out.optimizer >= 0 && out.activations >= 0 && out.buffers >= 0,
             "plugin {}: memory_plan returned a negative size", names());
  return out;
}

std::shared_ptr<const CommHook> StrategySession::comm_hook() {
  std::vector<const Member*> hooked;  // composed: every plugin with comm points, in order
  for (const Member& m : members_) {
    if (m.library->api().comm_point != nullptr && !m.host->handle()->state->skips_model_points) hooked.push_back(&m);
  }
  if (hooked.empty()) return nullptr;
  static_assert(static_cast<int>(CommPoint::kHeadInput) == WEFT_COMM_HEAD_INPUT &&
                    static_cast<int>(CommPoint::kRowAbsMax) == WEFT_COMM_ROW_ABSMAX &&
                    static_cast<int>(CommPoint::kAdapterSum) == WEFT_COMM_ADAPTER_SUM,
                "the model's comm points are the ABI's");
  return std::make_shared<const CommHook>([this, hooked](CommPoint point, bool backward, int64_t layer,
                                                         torch::Tensor& tensor) {
    for (const Member* m : hooked) {
      const PluginLibrary& lib = *m->library;
      // Job refuses a plugin below 1.7 that splits an int8 layer's input columns before the model
      // is built; a point the plugin cannot know never reaches it.
      WEFT_CHECK(point != CommPoint::kRowAbsMax || lib.negotiated_abi().minor >= 7,
                 "plugin {} (ABI 1.{}) cannot all-reduce int8 scales (WEFT_COMM_ROW_ABSMAX, ABI 1.7)", lib.name(),
                 lib.negotiated_abi().minor);
      WEFT_CHECK(point != CommPoint::kAdapterSum || lib.negotiated_abi().minor >= 8,
                 "plugin {} (ABI 1.{}) cannot sum AdaLoRA's scores over adapter slices (WEFT_COMM_ADAPTER_SUM, ABI 1.8)",
                 lib.name(), lib.negotiated_abi().minor);
      if (!tensor.is_contiguous()) tensor = tensor.contiguous();
      DLTensor view = sdk::to_dl_view(tensor);
      check(*m, lib.api().comm_point(m->instance, static_cast<weft_comm_point>(point),
                                     backward ? WEFT_BACKWARD : WEFT_FORWARD, layer, &view),
            "comm_point");
    }
  });
}

std::shared_ptr<const SequenceShards> StrategySession::sequence_parallel() {
  if (sequence_parallel_.size <= 1) return nullptr;
  auto shards = std::make_shared<SequenceShards>(sequence_parallel_);
  const Member* owner = &members_[static_cast<size_t>(sequence_parallel_owner_)];
  shards->collective = [this, owner](CommPoint point, bool backward, int64_t layer, const torch::Tensor& input,
                              torch::Tensor& output) {
    const DLTensor in = sdk::to_dl_view(input);
    DLTensor out = sdk::to_dl_view(output);
    check(*owner, owner->library->api().sequence_region(owner->instance, static_cast<weft_comm_point>(point),
                                          backward ? WEFT_BACKWARD : WEFT_FORWARD, layer, &in, &out),
          "sequence_region");
  };
  return shards;
}

std::shared_ptr<const ContextSplit> StrategySession::context_split() {
  if (context_.size <= 1) return nullptr;
  auto split = std::make_shared<ContextSplit>(context_);
  const Member* owner = &members_[static_cast<size_t>(context_owner_)];
  if (context_ring_) {
    split->attention = [this, owner](int64_t layer, bool backward, SequenceAttentionTensors& t) {
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
      check(*owner, owner->library->api().sequence_attention(owner->instance, &call), "sequence_attention");
    };
    return split;
  }
  split->all_to_all = [this, owner](int64_t layer, bool backward, torch::Tensor& send, torch::Tensor& recv) {
    if (!send.is_contiguous()) send = send.contiguous();
    const DLTensor send_view = sdk::to_dl_view(send);
    DLTensor recv_view = sdk::to_dl_view(recv);
    check(*owner, owner->library->api().sequence_exchange(owner->instance, layer, backward ? WEFT_BACKWARD : WEFT_FORWARD, &send_view,
                                            &recv_view),
          "sequence_exchange");
  };
  return split;
}

void StrategySession::attach(LlamaForCausalLMImpl& model) {
  model_ = &model;
  for (auto& m : members_) m.host->set_model(&model);
  for (const Member& m : members_) {
    if (m.library->api().setup) check(m, m.library->api().setup(m.instance), "setup");
  }
  for (const Member& m : members_) {  // composed: one plugin at most shards the training state
    if (!(m.has(offsetof(weft_strategy_api, flat_shard), 3) && m.library->api().flat_shard)) continue;
    WEFT_CHECK(state_host_ == host_ || state_host_ == m.host.get(), "plugins {}: two of them shard the training state",
               names());
    for (int64_t i = 0; i < m.host->parameter_count(); ++i) {
      weft_flat_shard shard{};
      check(m, m.library->api().flat_shard(m.instance, i, &shard), "flat_shard");
      try {
        m.host->set_flat_shard(i, shard);
      } catch (const Error& e) {
        fail("plugin {}: {}", m.library->name(), e.what());
      }
    }
    state_host_ = m.host.get();
    if (mesh_) state_group_ = groups_[static_cast<size_t>(m.dimension)];
    if (m.host->flat_shard_group() != nullptr) state_group_ = m.host->flat_shard_group();  // HSDP's group
  }
  if (!mesh_) return;
  if (drives_stages_ && state_host_ == host_) {  // ABI 1.14: the others finish the driver's shards
    for (size_t i = 1; i < members_.size(); ++i) members_[i].host->set_step_gradients(host_);
  }
  // Composed: each training tensor's weight in the gradient norm, 1 / its copies over the plugins.
  norm_weights_.clear();
  const weft_host_api* api = host_->api();
  for (int64_t i = 0; i < host_->parameter_count(); ++i) {
    weft_parameter_info info{};
    check(api->parameter_info(host_->handle(), i, &info), "parameter_info");
    if (!info.trainable) continue;
    double copies = 1.0;
    for (const Member& m : members_) {
      if (!m.library->api().gradient_copies) continue;
      int32_t c = 1;
      check(m, m.library->api().gradient_copies(m.instance, i, &c), "gradient_copies");
      WEFT_CHECK(c >= 1 && c <= mesh_->size(m.dimension),
                 "plugin {}: gradient_copies({}) = {}, but its mesh dimension {} has {} ranks", m.library->name(),
                 info.name, c, Mesh::name(m.dimension), mesh_->size(m.dimension));
      copies *= c;
    }
    norm_weights_.push_back(1.0 / copies);
  }
  WEFT_CHECK(norm_weights_.size() == state_host_->training_tensors().size(),
             "composed run: {} trainable parameters but {} training tensors", norm_weights_.size(),
             state_host_->training_tensors().size());
}

void StrategySession::after_optimizer_step(StepReport& report) {
  state_host_->zero_grad_shards();
  for (const Member& m : members_) {
    if (m.has(offsetof(weft_strategy_api, after_optimizer_step), 3) && m.library->api().after_optimizer_step) {
      check(m, m.library->api().after_optimizer_step(m.instance), "after_optimizer_step");
    }
  }
  // What the plugins did after the optimizer step (ZeRO's gathers, hooks at "step.end") is the step's.
  for (auto& m : members_) {
    const auto comm = m.host->take_comm_stats();
    report.comm.operations += comm.operations;
    report.comm.bytes += comm.bytes;
    report.comm.wait_seconds += comm.wait_seconds;
    for (const auto& [name, value] : m.host->take_step_metrics()) report.metrics[name] = value;
  }
}

void StrategySession::materialize_parameters(bool whole) {
  for (const Member& m : members_) {
    if (m.has(offsetof(weft_strategy_api, materialize_parameters), 3) && m.library->api().materialize_parameters) {
      m.host->set_materialize_masters(whole);  // whole for the host: the fp32 masters (ABI 1.6)
      weft_status* status = m.library->api().materialize_parameters(m.instance, whole ? 1 : 0);
      m.host->set_materialize_masters(false);
      check(m, status, "materialize_parameters");
    }
  }
}

StepReport StrategySession::train_step(const BatchLoader& loader, int64_t global_step, int64_t epoch,
                                       int64_t step_in_epoch, int32_t micro_batches, int64_t seq_len) {
  for (auto& m : members_) {  // not the evaluation's or set-up's
    m.host->take_comm_stats();
    m.host->take_compute_stats();
    m.host->take_step_metrics();
  }
  weft_step_info info{};
  info.struct_size = sizeof(weft_step_info);
  info.step = global_step;
  info.epoch = epoch;
  info.micro_batches = micro_batches;
  info.rows_per_micro_batch = loader.local_batch();
  info.seq_len = seq_len;
  info.stage_tokens = stage_tokens(seq_len);
  StepReport report;
  for (auto& m : members_) m.host->begin_train_step(&loader, epoch, step_in_epoch, micro_batches);
  try {
    check(library_->api().train_step(instance_, &info, &report.loss), "train_step");
    // Composed: the others finish the step along their dimensions, innermost first.
    for (size_t i = 1; i < members_.size(); ++i) {
      const Member& m = members_[i];
      check(m, m.library->api().finish_step(m.instance, &info, &report.loss), "finish_step");
    }
  } catch (...) {
    for (auto& m : members_) m.host->end_step();
    throw;
  }
  for (auto& m : members_) m.host->end_step();
  report.compute = host_->take_compute_stats();
  for (auto& m : members_) {
    const auto comm = m.host->take_comm_stats();
    report.comm.operations += comm.operations;
    report.comm.bytes += comm.bytes;
    report.comm.wait_seconds += comm.wait_seconds;
    for (const auto& [name, value] : m.host->take_step_metrics()) report.metrics[name] = value;
  }
  return report;
}

bool StrategySession::can_evaluate(int world) const { return world == 1 || library_->api().eval_step != nullptr; }

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
  for (auto& m : members_) m.host->begin_eval_step(&loader, index);
  try {
    if (library_->api().eval_step == nullptr) {  // the ABI's default (one rank)
      std::tie(sums.loss_sum, sums.tokens) = host_->default_eval_step();
    } else {
      check(library_->api().eval_step(instance_, &info, &sums.loss_sum, &sums.tokens), "eval_step");
    }
    for (size_t i = 1; i < members_.size(); ++i) {
      const Member& m = members_[i];
      check(m, m.library->api().finish_eval(m.instance, &info, &sums.loss_sum, &sums.tokens), "finish_eval");
    }
  } catch (...) {
    for (auto& m : members_) m.host->end_step();
    throw;
  }
  for (auto& m : members_) m.host->end_step();
  return sums;
}

double StrategySession::global_grad_norm_sq(double local_sq) {
  if (mesh_) {
    // Composed: every gradient once, however many ranks hold it (gradient_copies), over the world.
    auto total = torch::tensor({weighted_grad_norm_sq()}, torch::kDouble);
    auto op = communicator_->all_reduce(communicator_->world(), total, c10d::ReduceOp::SUM);
    communicator_->wait(op);
    return total.item<double>();
  }
  if (!library_->api().global_grad_norm_sq) return local_sq;
  double global = local_sq;
  check(library_->api().global_grad_norm_sq(instance_, local_sq, &global), "global_grad_norm_sq");
  return global;
}

double StrategySession::weighted_grad_norm_sq() const {
  const auto tensors = state_host_->training_tensors();
  double share = 0.0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& grad = tensors[i].tensor.grad();
    if (!grad.defined()) continue;
    share += grad.to(torch::kDouble).pow(2).sum().item<double>() * norm_weights_[i];
  }
  return share;
}

void StrategySession::set_loss_scale(double scale) {
  for (auto& m : members_) m.host->set_loss_scale(scale);
}

PluginHost::CommStats StrategySession::take_comm_stats() {
  PluginHost::CommStats total;
  for (auto& m : members_) {
    const auto comm = m.host->take_comm_stats();
    total.operations += comm.operations;
    total.bytes += comm.bytes;
    total.wait_seconds += comm.wait_seconds;
  }
  return total;
}

void StrategySession::record_sequence_losses(int64_t sequences, int64_t outputs) {
  host_->record_sequence_losses(sequences, outputs);
}

at::Tensor StrategySession::take_sequence_outputs() { return host_->take_sequence_outputs(); }

std::pair<at::Tensor, at::Tensor> StrategySession::take_sequence_losses() { return host_->take_sequence_losses(); }

}  // namespace weft
