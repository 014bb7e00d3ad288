#include "core/plugin/strategy_session.h"

#include <cmath>
#include <cstddef>

#include <fmt/format.h>
#include <torch/torch.h>
#include <weft/strategy_torch.hpp>

#include "core/data/loader.h"
#include "core/plugin/status.h"
#include "core/util/error.h"

namespace weft {

StrategySession::StrategySession(const std::string& path_or_name, toml::table plugin_config,
                                 Communicator& communicator)
    : library_(PluginLibrary::load(path_or_name.empty() ? kBuiltinStrategy : path_or_name)) {
  host_ = std::make_unique<PluginHost>(library_->name(), std::move(plugin_config), communicator);
  weft_strategy* instance = nullptr;
  check(library_->api().create(host_->api(), host_->handle(), &instance), "create");
  WEFT_CHECK(instance != nullptr, "plugin {}: create returned no instance", library_->name());
  instance_ = instance;
}

StrategySession::~StrategySession() {
  if (instance_) library_->api().destroy(instance_);
}

void StrategySession::check(weft_status* status, const char* what) const {
  throw_if_error(status, fmt::format("plugin {} ({}): {}", library_->name(), library_->path(), what));
}

std::string StrategySession::describe() const {
  return fmt::format("{} {} (ABI {}.{}) from {}", library_->name(), library_->version(),
                     library_->negotiated_abi().major, library_->negotiated_abi().minor, library_->path());
}

std::string StrategySession::fingerprint() const {
  return fmt::format("plugin {} {} ABI {}.{}", library_->name(), library_->version(), library_->negotiated_abi().major,
                     library_->negotiated_abi().minor);
}

Placement StrategySession::place(const ModelConfig& config, torch::Dtype compute_dtype, int64_t seq_len,
                                 int64_t batch_rows) {
  host_->set_model_info(config, compute_dtype, seq_len, batch_rows);
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
  if (library_->api().plan) check(library_->api().plan(instance_, &plan), "plan");
  WEFT_CHECK(0 <= plan.first_stage && plan.first_stage < plan.last_stage && plan.last_stage <= num_stages,
             "plugin {}: plan chose stages [{}, {}) of a {}-stage model", library_->name(), plan.first_stage,
             plan.last_stage, num_stages);
  WEFT_CHECK(plan.data_parallel_size >= 1 && 0 <= plan.data_parallel_rank &&
                 plan.data_parallel_rank < plan.data_parallel_size,
             "plugin {}: plan chose data-parallel rank {} of {}", library_->name(), plan.data_parallel_rank,
             plan.data_parallel_size);
  Placement placement{StageRange{plan.first_stage, plan.last_stage}, plan.data_parallel_rank, plan.data_parallel_size};
  if (library_->negotiated_abi().minor >= 10 && plan.stage_chunks != 1) {  // virtual pipeline stages
    const int32_t chunks = plan.stage_chunks;
    WEFT_CHECK(chunks >= 1 && chunks <= WEFT_MAX_STAGE_CHUNKS, "plugin {}: plan chose {} stage chunks (1 to {})",
               library_->name(), chunks, WEFT_MAX_STAGE_CHUNKS);
    std::vector<StageRange> ranges;
    for (int32_t i = 0; i < chunks; ++i) ranges.push_back({plan.chunk_stages[2 * i], plan.chunk_stages[2 * i + 1]});
    try {
      StageSet(ranges).resolved(num_stages);
    } catch (const Error& e) {
      throw Error(fmt::format("plugin {}: plan's stage chunks: {}", library_->name(), e.what()));
    }
    WEFT_CHECK(ranges.front().first == plan.first_stage && ranges.back().last == plan.last_stage,
               "plugin {}: plan's stage chunks span [{}, {}) but first_stage/last_stage say [{}, {})", library_->name(),
               ranges.front().first, ranges.back().last, plan.first_stage, plan.last_stage);
    placement.stages = StageSet(std::move(ranges));
  }
  if (library_->negotiated_abi().minor >= 11) {  // zero-bubble schedules' split backward
    WEFT_CHECK(plan.split_backward == 0 || plan.split_backward == 1, "plugin {}: plan chose split_backward = {} (0 or 1)",
               library_->name(), plan.split_backward);
    placement.split_backward = plan.split_backward == 1;
  }
  const bool every_stage = placement.stages.ranges.size() == 1 && plan.first_stage == 0 && plan.last_stage == num_stages;
  if (library_->negotiated_abi().minor >= 4) {
    const int32_t size = plan.sequence_parallel_size, rank = plan.sequence_parallel_rank;
    WEFT_CHECK(size >= 1 && 0 <= rank && rank < size, "plugin {}: plan chose sequence-parallel rank {} of {}",
               library_->name(), rank, size);
    // 1.5: the layout and who runs the attention core (a 1.4 plugin leaves the pre-filled 0, 0).
    const bool v15 = library_->negotiated_abi().minor >= 5;
    const int32_t layout = v15 ? plan.sequence_parallel_layout : WEFT_SEQUENCE_CONTIGUOUS;
    const bool ring = v15 && plan.sequence_parallel_attention == WEFT_SEQUENCE_ATTENTION_PLUGIN;
    WEFT_CHECK(layout == WEFT_SEQUENCE_CONTIGUOUS || layout == WEFT_SEQUENCE_BALANCED,
               "plugin {}: plan chose sequence layout {}, which is neither contiguous (0) nor balanced (1)",
               library_->name(), layout);
    WEFT_CHECK(!v15 || plan.sequence_parallel_attention == WEFT_SEQUENCE_ATTENTION_EXCHANGE || ring,
               "plugin {}: plan chose sequence attention {}, which is neither the exchange (0) nor the plugin's (1)",
               library_->name(), plan.sequence_parallel_attention);
    if (size > 1) {
      if (ring) {
        WEFT_CHECK(library_->has_slot(offsetof(weft_strategy_api, sequence_attention), 5) &&
                       library_->api().sequence_attention != nullptr,
                   "plugin {}: plan runs the attention core in the plugin but the plugin has no sequence_attention",
                   library_->name());
      } else {
        WEFT_CHECK(library_->has_slot(offsetof(weft_strategy_api, sequence_exchange), 4) &&
                       library_->api().sequence_exchange != nullptr,
                   "plugin {}: plan splits sequences over {} ranks but the plugin has no sequence_exchange",
                   library_->name(), size);
        WEFT_CHECK(layout == WEFT_SEQUENCE_CONTIGUOUS,
                   "plugin {}: the balanced sequence layout needs the plugin's attention (sequence_attention)",
                   library_->name());
        WEFT_CHECK(config.num_attention_heads % size == 0, "the model's {} attention heads cannot be split over {} "
                   "sequence-parallel ranks (plugin {})", config.num_attention_heads, size, library_->name());
      }
      const int64_t parts = layout == WEFT_SEQUENCE_BALANCED ? 2 * size : size;
      WEFT_CHECK(seq_len % parts == 0, "data.seq_len = {} cannot be split over {} sequence-parallel ranks (plugin {}{}): "
                 "choose a multiple of {}", seq_len, size, library_->name(),
                 layout == WEFT_SEQUENCE_BALANCED ? ", balanced layout: 2 chunks per rank" : "", parts);
      WEFT_CHECK(every_stage,
                 "plugin {}: sequence parallelism with a split of the model's stages is not supported", library_->name());
    }
    sequence_ = SequenceSplit{};
    sequence_.rank = rank;
    sequence_.size = size;
    sequence_.layout = static_cast<SequenceLayout>(layout);
    sequence_ring_ = ring;
    if (size > 1) {
      std::string runs;
      for (const auto& [start, count] : sequence_.token_runs(seq_len)) {
        runs += fmt::format("{}[{}, {})", runs.empty() ? "" : " and ", start, start + count);
      }
      spdlog::info("plugin {} splits every sequence over {} ranks ({}): this rank holds tokens {} of each",
                   library_->name(), size, ring ? "attention run by the plugin, e.g. ring" : "all-to-all around attention",
                   runs);
    }
    placement.sequence_parallel_rank = rank;
    placement.sequence_parallel_size = size;
    host_->set_sequence_split(rank, size, sequence_.layout);
  }
  if (library_->negotiated_abi().minor >= 9) {  // Megatron sequence parallelism
    const int32_t size = plan.tensor_sequence_size, rank = plan.tensor_sequence_rank;
    WEFT_CHECK(size >= 1 && 0 <= rank && rank < size, "plugin {}: plan chose tensor-sequence rank {} of {}",
               library_->name(), rank, size);
    if (size > 1) {
      WEFT_CHECK(library_->has_slot(offsetof(weft_strategy_api, sequence_region), 9) &&
                     library_->api().sequence_region != nullptr,
                 "plugin {}: plan shards the residual stream's tokens over {} ranks (tensor_sequence_size) but the "
                 "plugin has no sequence_region",
                 library_->name(), size);
      WEFT_CHECK(placement.sequence_parallel_size == 1,
                 "plugin {}: plan splits sequences both between ranks (sequence_parallel_size {}) and between "
                 "tensor-parallel regions (tensor_sequence_size {}): choose one",
                 library_->name(), placement.sequence_parallel_size, size);
      WEFT_CHECK(seq_len % size == 0, "data.seq_len = {} cannot be split over {} tensor-parallel ranks (plugin {}, "
                 "sequence parallelism): choose a multiple of {}", seq_len, size, library_->name(), size);
      WEFT_CHECK(every_stage,
                 "plugin {}: tensor sequence parallelism with a split of the model's stages is not supported",
                 library_->name());
      spdlog::info("plugin {} shards the residual stream between tensor-parallel regions over {} ranks (Megatron "
                   "sequence parallelism): this rank holds tokens [{}, {}) of each sequence there",
                   library_->name(), size, rank * seq_len / size, (rank + 1) * seq_len / size);
    }
    tensor_sequence_ = SequenceShards{};
    tensor_sequence_.rank = rank;
    tensor_sequence_.size = size;
  }
  return placement;
}

ShardMap StrategySession::shards(const ModelConfig& config, const StageSet& stages) {
  ShardMap shards;
  if (library_->api().shard_parameter == nullptr) return shards;
  for (const auto& [name, shape] : parameter_specs(config, stages.resolved(config.num_hidden_layers + 2))) {
    weft_parameter_info info{};
    info.name = name.c_str();
    info.stage = stage_of_parameter(name, config.num_hidden_layers);
    info.trainable = 1;
    info.ndim = static_cast<int32_t>(shape.size());
    info.shape = shape.data();
    info.dtype = DLDataType{kDLFloat, 32, 1};
    weft_shard shard{0, 1, 0};
    check(library_->api().shard_parameter(instance_, &info, &shard), "shard_parameter");
    WEFT_CHECK(shard.parts >= 1 && 0 <= shard.index && shard.index < shard.parts && 0 <= shard.dim &&
                   shard.dim < info.ndim,
               "plugin {}: shard_parameter({}) returned dim {}, part {} of {}", library_->name(), name, shard.dim,
               shard.index, shard.parts);
    if (shard.parts > 1) shards[name] = ParameterShard{shard.dim, shard.parts, shard.index};
  }
  return shards;
}

MemoryPlan StrategySession::memory_plan(const std::vector<weft_stage_memory>& stages, const StageSet& held,
                                        int32_t micro_batches, int64_t rows, int64_t seq_len) {
  host_->set_stage_memory(stages);
  weft_memory_plan plan{};
  plan.struct_size = sizeof(weft_memory_plan);
  plan.micro_batches = micro_batches;
  plan.rows_per_micro_batch = rows;
  plan.seq_len = seq_len;
  for (int64_t s = 0; s < static_cast<int64_t>(stages.size()); ++s) {  // the one-process layout of what this rank holds
    if (!held.holds(s, static_cast<int64_t>(stages.size()))) continue;
    const auto& stage = stages[static_cast<size_t>(s)];
    plan.parameter_bytes += stage.parameter_bytes;
    plan.gradient_bytes += stage.trainable_bytes;
    plan.optimizer_bytes += 2 * stage.trainable_bytes;  // AdamW's two fp32 moments
    plan.activation_bytes += rows * stage.activation_bytes_per_row + stage.weight_copy_bytes;
  }
  if (library_->has_slot(offsetof(weft_strategy_api, memory_plan), 3) && library_->api().memory_plan) {
    check(library_->api().memory_plan(instance_, &plan), "memory_plan");
  }
  MemoryPlan out{plan.parameter_bytes, plan.gradient_bytes, plan.optimizer_bytes, plan.activation_bytes,
                 plan.buffer_bytes};
  WEFT_CHECK(out.parameters >= 0 && out.gradients >= 0 && out.optimizer >= 0 && out.activations >= 0 && out.buffers >= 0,
             "plugin {}: memory_plan returned a negative size", library_->name());
  return out;
}

std::shared_ptr<const CommHook> StrategySession::comm_hook() {
  if (library_->api().comm_point == nullptr) return nullptr;
  static_assert(static_cast<int>(CommPoint::kHeadInput) == WEFT_COMM_HEAD_INPUT &&
                    static_cast<int>(CommPoint::kRowAbsMax) == WEFT_COMM_ROW_ABSMAX &&
                    static_cast<int>(CommPoint::kAdapterSum) == WEFT_COMM_ADAPTER_SUM,
                "the model's comm points are the ABI's");
  return std::make_shared<const CommHook>([this](CommPoint point, bool backward, int64_t layer, torch::Tensor& tensor) {
    // Job refuses a plugin below 1.7 that splits an int8 layer's input columns before the model
    // is built; a point the plugin cannot know never reaches it.
    WEFT_CHECK(point != CommPoint::kRowAbsMax || library_->negotiated_abi().minor >= 7,
               "plugin {} (ABI 1.{}) cannot all-reduce int8 scales (WEFT_COMM_ROW_ABSMAX, ABI 1.7)", library_->name(),
               library_->negotiated_abi().minor);
    WEFT_CHECK(point != CommPoint::kAdapterSum || library_->negotiated_abi().minor >= 8,
               "plugin {} (ABI 1.{}) cannot sum AdaLoRA's scores over adapter slices (WEFT_COMM_ADAPTER_SUM, ABI 1.8)",
               library_->name(), library_->negotiated_abi().minor);
    if (!tensor.is_contiguous()) tensor = tensor.contiguous();
    DLTensor view = sdk::to_dl_view(tensor);
    check(library_->api().comm_point(instance_, static_cast<weft_comm_point>(point),
                                     backward ? WEFT_BACKWARD : WEFT_FORWARD, layer, &view),
          "comm_point");
  });
}

std::shared_ptr<const SequenceShards> StrategySession::tensor_sequence() {
  if (tensor_sequence_.size <= 1) return nullptr;
  auto shards = std::make_shared<SequenceShards>(tensor_sequence_);
  shards->collective = [this](CommPoint point, bool backward, int64_t layer, const torch::Tensor& input,
                              torch::Tensor& output) {
    const DLTensor in = sdk::to_dl_view(input);
    DLTensor out = sdk::to_dl_view(output);
    check(library_->api().sequence_region(instance_, static_cast<weft_comm_point>(point),
                                          backward ? WEFT_BACKWARD : WEFT_FORWARD, layer, &in, &out),
          "sequence_region");
  };
  return shards;
}

std::shared_ptr<const SequenceSplit> StrategySession::sequence_split() {
  if (sequence_.size <= 1) return nullptr;
  auto split = std::make_shared<SequenceSplit>(sequence_);
  if (sequence_ring_) {
    split->attention = [this](int64_t layer, bool backward, SequenceAttentionTensors& t) {
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
      check(library_->api().sequence_attention(instance_, &call), "sequence_attention");
    };
    return split;
  }
  split->all_to_all = [this](int64_t layer, bool backward, torch::Tensor& send, torch::Tensor& recv) {
    if (!send.is_contiguous()) send = send.contiguous();
    const DLTensor send_view = sdk::to_dl_view(send);
    DLTensor recv_view = sdk::to_dl_view(recv);
    check(library_->api().sequence_exchange(instance_, layer, backward ? WEFT_BACKWARD : WEFT_FORWARD, &send_view,
                                            &recv_view),
          "sequence_exchange");
  };
  return split;
}

void StrategySession::attach(LlamaForCausalLMImpl& model) {
  model_ = &model;
  host_->set_model(&model);
  if (library_->api().setup) check(library_->api().setup(instance_), "setup");
  if (library_->has_slot(offsetof(weft_strategy_api, flat_shard), 3) && library_->api().flat_shard) {
    for (int64_t i = 0; i < host_->parameter_count(); ++i) {
      weft_flat_shard shard{};
      check(library_->api().flat_shard(instance_, i, &shard), "flat_shard");
      try {
        host_->set_flat_shard(i, shard);
      } catch (const Error& e) {
        fail("plugin {}: {}", library_->name(), e.what());
      }
    }
  }
}

void StrategySession::after_optimizer_step() {
  host_->zero_grad_shards();
  if (library_->has_slot(offsetof(weft_strategy_api, after_optimizer_step), 3) &&
      library_->api().after_optimizer_step) {
    check(library_->api().after_optimizer_step(instance_), "after_optimizer_step");
  }
}

void StrategySession::materialize_parameters(bool whole) {
  if (library_->has_slot(offsetof(weft_strategy_api, materialize_parameters), 3) &&
      library_->api().materialize_parameters) {
    host_->set_materialize_masters(whole);  // whole for the host: the fp32 masters (ABI 1.6)
    weft_status* status = library_->api().materialize_parameters(instance_, whole ? 1 : 0);
    host_->set_materialize_masters(false);
    check(status, "materialize_parameters");
  }
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
  StepReport report;
  host_->begin_train_step(&loader, epoch, step_in_epoch, micro_batches);
  try {
    check(library_->api().train_step(instance_, &info, &report.loss), "train_step");
  } catch (...) {
    host_->end_step();
    throw;
  }
  host_->end_step();
  report.comm = host_->take_comm_stats();
  report.compute = host_->take_compute_stats();
  report.metrics = host_->take_step_metrics();
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
  EvalSums sums;
  host_->begin_eval_step(&loader, index);
  try {
    if (library_->api().eval_step == nullptr) {  // the ABI's default (one rank)
      std::tie(sums.loss_sum, sums.tokens) = host_->default_eval_step();
    } else {
      check(library_->api().eval_step(instance_, &info, &sums.loss_sum, &sums.tokens), "eval_step");
    }
  } catch (...) {
    host_->end_step();
    throw;
  }
  host_->end_step();
  return sums;
}

double StrategySession::global_grad_norm_sq(double local_sq) {
  if (!library_->api().global_grad_norm_sq) return local_sq;
  double global = local_sq;
  check(library_->api().global_grad_norm_sq(instance_, local_sq, &global), "global_grad_norm_sq");
  return global;
}

PluginHost::CommStats StrategySession::take_comm_stats() { return host_->take_comm_stats(); }

void StrategySession::record_sequence_losses(int64_t sequences, int64_t outputs) {
  host_->record_sequence_losses(sequences, outputs);
}

at::Tensor StrategySession::take_sequence_outputs() { return host_->take_sequence_outputs(); }

std::pair<at::Tensor, at::Tensor> StrategySession::take_sequence_losses() { return host_->take_sequence_losses(); }

}  // namespace weft
