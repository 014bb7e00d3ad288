// PluginHost, which binds the host's step services (core/plugin/step/services.h) to one
// process's run. The services themselves are in host_config.cpp, host_collectives.cpp,
// host_model.cpp, host_memory.cpp and host_telemetry.cpp (declared in host_services.h).
#include "core/plugin/host_api.h"

#include "core/plugin/host_services.h"
#include "core/data/loader.h"

#include <utility>

namespace weft {

static_assert(Mesh::kPP == WEFT_MESH_PP && Mesh::kDP == WEFT_MESH_DP && Mesh::kCP == WEFT_MESH_CP &&
                  Mesh::kTP == WEFT_MESH_TP && Mesh::kDims == WEFT_MESH_DIMS,
              "the host's mesh dimensions are the ABI's");

PluginHost::PluginHost(std::string plugin_name, toml::table plugin_config, Communicator& communicator)
    : state_(std::make_unique<State>()) {
  // [plugin.<name>] overrides [plugin] for this plugin alone: plugins composed in one run may share a
  // key (two plugins' `mode`, say).
  if (const auto* own = plugin_config.get_as<toml::table>(plugin_name)) {
    const toml::table overrides = *own;
    plugin_config.erase(plugin_name);
    for (const auto& [key, value] : overrides) plugin_config.insert_or_assign(key, value);
  }
  state_->plugin_name = std::move(plugin_name);
  state_->config = std::move(plugin_config);
  state_->communicator = &communicator;
  state_->handle.state = state_.get();
}

PluginHost::~PluginHost() = default;

const std::vector<std::pair<std::string, std::string>>& PluginHost::settings_read() const { return state_->settings; }

weft_host* PluginHost::handle() { return &state_->handle; }

void PluginHost::set_context_split(int64_t rank, int64_t size, ContextLayout layout) {
  state_->context.rank = rank;
  state_->context.size = size;
  state_->context.layout = layout;
}

void PluginHost::set_model_info(const ModelConfig& config, torch::Dtype compute_dtype, int64_t seq_len,
                                int64_t batch_rows) {
  state_->model_config = std::make_shared<ModelConfig>(config);
  state_->seq_len = seq_len;
  state_->batch_rows = batch_rows;
  weft_model_info& i = state_->model_info;
  i = weft_model_info{};
  i.struct_size = sizeof(weft_model_info);
  i.num_layers = static_cast<int32_t>(config.num_hidden_layers);
  i.hidden_size = config.hidden_size;
  i.intermediate_size = config.intermediate_size;
  i.num_attention_heads = static_cast<int32_t>(config.num_attention_heads);
  i.num_key_value_heads = static_cast<int32_t>(config.num_key_value_heads);
  i.head_dim = config.head_dim;
  i.vocab_size = config.vocab_size;
  // A classifier's head is `score`, never the embedding: nothing is shared between the first and
  // last stages then.
  i.tie_word_embeddings = config.tie_word_embeddings && !config.classification() ? 1 : 0;
  i.compute_dtype = sdk::to_dl_dtype(compute_dtype);
  state_->has_model_info = true;
}

std::map<std::string, double> PluginHost::take_step_metrics() {
  std::map<std::string, double> taken;
  taken.swap(state_->step_metrics);
  return taken;
}

std::vector<std::pair<std::string, at::Tensor>> PluginHost::plugin_state() const { return state_->plugin_state; }

std::vector<std::string> PluginHost::local_parameters() const { return state_->local_parameters; }

ProcessGroup* PluginHost::flat_shard_group() const { return state_->flat_shard_group; }

void PluginHost::restore_plugin_state(const std::vector<std::pair<std::string, at::Tensor>>& saved) {
  for (const auto& [name, tensor] : saved) {
    const auto made = std::find_if(state_->plugin_state.begin(), state_->plugin_state.end(),
                                   [&](const auto& entry) { return entry.first == name; });
    if (made == state_->plugin_state.end()) {
      state_->restored_state[name] = tensor;
      continue;
    }
    WEFT_CHECK(made->second.sizes() == tensor.sizes() && made->second.scalar_type() == tensor.scalar_type(),
               "checkpoint: plugin {}'s state '{}' is {} [{}] there, {} [{}] in this run", state_->plugin_name, name,
               c10::toString(tensor.scalar_type()), fmt::join(tensor.sizes(), ", "),
               c10::toString(made->second.scalar_type()), fmt::join(made->second.sizes(), ", "));
    made->second.copy_(tensor);
  }
}

void PluginHost::set_loss_scale(double scale) { state_->loss_scale = scale; }

void PluginHost::set_model(LlamaForCausalLMImpl* model) {
  auto& s = *state_;
  s.model = model;
  s.parameters.clear();
  if (!model) return;
  const int64_t layers = model->config().num_hidden_layers;
  const auto parameters = model->parameters();
  s.device = parameters.empty() ? torch::Device(torch::kCPU) : parameters.front().device();
  for (auto& item : model->named_parameters()) {
    ParameterEntry entry;
    entry.name = item.key();
    entry.tensor = item.value();
    entry.stage = stage_of_parameter(entry.name, layers);
    entry.shape = item.value().sizes().vec();  // the full shape (the ABI's), not the local slice
    entry.local_shape = entry.shape;
    const ParameterShard shard = shard_of(model->options().shards, entry.name);
    if (!shard.whole()) entry.shape[shard.dim] *= shard.parts;
    s.parameters.push_back(std::move(entry));
  }
  host::install_grad_hooks(s);
}

void PluginHost::begin_train_step(const BatchLoader* loader, int64_t epoch, int64_t index, int32_t micro_batches) {
  state_->train_loader = loader;
  state_->eval_loader = nullptr;
  state_->epoch = epoch;
  state_->index = index;
  state_->micro_batches = micro_batches;
  const int64_t prompt = state_->model != nullptr ? state_->model->options().prompt_tokens : 0;
  state_->masked_targets = loader->sequences().masked() || prompt > 0;
  state_->loss_weight = 1.0;
  if (state_->masked_targets) {
    int64_t counted = 0;
    for (int32_t m = 0; m < micro_batches; ++m) counted += loader->counted_targets(epoch, index * micro_batches + m);
    const double positions = static_cast<double>(micro_batches) *
                             static_cast<double>(loader->global_batch() * (loader->sequences().seq_len() + prompt));
    state_->loss_weight = counted > 0 ? positions / static_cast<double>(counted) : 0.0;
  }
}

void PluginHost::begin_eval_step(const EvalLoader* loader, int64_t index) {
  state_->train_loader = nullptr;
  state_->eval_loader = loader;
  state_->index = index;
  state_->micro_batches = 1;
  state_->masked_targets = loader->sequences().masked() || (state_->model != nullptr && state_->model->options().prompt_tokens > 0);
  state_->loss_weight = 1.0;
}

void PluginHost::end_step() {
  state_->train_loader = nullptr;
  state_->eval_loader = nullptr;
}

PluginHost::CommStats PluginHost::take_comm_stats() {
  std::lock_guard<std::mutex> lock(state_->comm_mutex);
  const CommStats taken = state_->comm;
  state_->comm = CommStats{};
  return taken;
}

int PluginHost::chunked_loss() const {
  if (state_->logits_head_losses > 0) return 0;
  return state_->chunked_head_losses > 0 ? 1 : -1;
}

PluginHost::ComputeStats PluginHost::take_compute_stats() {
  std::lock_guard<std::mutex> lock(state_->compute_mutex);
  const ComputeStats taken = state_->compute;
  state_->compute = ComputeStats{};
  return taken;
}

void PluginHost::record_sequence_losses(int64_t sequences, int64_t outputs) {
  state_->sequence_loss_sums = torch::zeros({sequences}, torch::kFloat64);
  state_->sequence_counts = torch::zeros({sequences}, torch::kFloat64);
  state_->sequence_outputs = outputs > 0 ? torch::zeros({sequences, outputs}, torch::kFloat64) : at::Tensor();
}

at::Tensor PluginHost::take_sequence_outputs() {
  WEFT_CHECK(state_->sequence_outputs.defined(), "take_sequence_outputs: no head outputs were recorded");
  return std::exchange(state_->sequence_outputs, at::Tensor());
}

std::pair<at::Tensor, at::Tensor> PluginHost::take_sequence_losses() {
  WEFT_CHECK(state_->sequence_loss_sums.defined(), "take_sequence_losses: not recording");
  std::pair<at::Tensor, at::Tensor> taken{state_->sequence_loss_sums, state_->sequence_counts};
  state_->sequence_loss_sums = at::Tensor();
  state_->sequence_counts = at::Tensor();
  return taken;
}

int64_t PluginHost::parameter_count() const { return static_cast<int64_t>(state_->parameters.size()); }

}  // namespace weft
