#include "core/job/job.h"

#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "core/model/weights.h"
#include "core/util/device.h"
#include "core/util/memory.h"
#include "core/util/error.h"
#include "core/util/torch_compat.h"
#include "core/util/trace.h"

namespace weft {
namespace fs = std::filesystem;

torch::Dtype compute_dtype(const std::string& precision) {
  if (precision == "bf16") return torch::kBFloat16;
  if (precision == "fp16") return torch::kHalf;
  return torch::kFloat32;
}

ModelConfig resolve_model_config(const TrainOptions& options, const Tokenizer& tokenizer) {
  const auto& m = options.model;
  ModelConfig config;
  const std::string weights_config = m.weights + "/config.json";
  if (!m.config_path.empty()) {
    config = load_hf_config(m.config_path);
  } else if (!m.weights.empty() && fs::is_directory(m.weights) && fs::exists(weights_config)) {
    config = load_hf_config(weights_config);
  } else {
    WEFT_CHECK(!m.preset.empty(), "no model shape: set model.preset or model.config");
    config = preset_config(m.preset);
  }
  if (m.vocab_size > 0) config.vocab_size = m.vocab_size;
  // A shape without special-token ids (a preset) takes the tokenizer's, so that a saved config.json
  // names them as an HF model directory does.
  if (!config.bos_token_id) {
    if (const auto bos = tokenizer.bos_id()) config.bos_token_id = *bos;
  }
  if (!config.eos_token_id) {
    if (const auto eos = tokenizer.eos_id()) config.eos_token_id = *eos;
  }
  config.attention = resolve_attention_kernel(parse_attention_kernel(m.attention));  // kSdpa or kWeft
  WEFT_CHECK(tokenizer.vocab_size() <= config.vocab_size,
             "tokenizer '{}' has {} tokens but the model's vocab_size is {} (set model.vocab_size)",
             options.tokenizer, tokenizer.vocab_size(), config.vocab_size);
  WEFT_CHECK(options.data.seq_len <= config.max_position_embeddings,
             "data.seq_len {} exceeds the model's max_position_embeddings {}", options.data.seq_len,
             config.max_position_embeddings);
  return config;
}

Job::Job(TrainOptions options, RunContext context, Data data) : options_(std::move(options)), context_(context) {
  WEFT_CHECK(options_.mode == "full" || options_.mode == "lora", "train.mode must be full or lora, got '{}'",
             options_.mode);
  WEFT_CHECK(options_.precision == "fp32" || options_.precision == "bf16" || options_.precision == "fp16",
             "train.precision must be fp32, bf16 or fp16, got '{}'", options_.precision);
  const DeviceInventory devices = this_process_devices();
  device_ = resolve_device(options_.device, context_.env.local_rank, context_.rank, devices);
  nccl_ = device_.is_cuda() && Communicator::nccl_compiled() && !devices.share;
  bind_device(device_);
  WEFT_CHECK(options_.precision != "fp16" || device_.is_cuda() || compat::kCpuComputesFp16,
             "train.precision = fp16 on the CPU needs LibTorch 2.2 or later (this weft is built against {}); use bf16 "
             "or fp32 here, or fp16 on a CUDA device",
             compat::libtorch_version());
  install_memory_tracker();
  at::set_num_threads(static_cast<int>(options_.threads));
  torch::manual_seed(options_.seed);
  tokenizer_ = load_tokenizer(options_.tokenizer);
  join();
  if (!options_.trace_file.empty()) {
    Tracer::instance().enable(Tracer::rank_path(options_.trace_file, context_.rank, context_.world), context_.rank);
  }
  build_model();
  if (data == Data::kSplits) {
    data_ = prepare_dataset(options_.data, *tokenizer_);
    spdlog::info("{}", data_.summary.describe());
  }
}

Job::~Job() = default;

// Joins the run and loads the strategy; every rank must run the same plugin build with the same
// configuration, checked before anything is built.
void Job::join() {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.collective_timeout_s * 1000));
  // CUDA tensors travel over NCCL where this LibTorch has it and each rank has its own GPU (Gloo
  // stages them through host memory otherwise).
  communicator_ = join_world(context_.env, timeout, nccl_ ? "nccl" : "gloo");
  strategy_ = std::make_unique<StrategySession>(options_.plugin, options_.plugin_config, *communicator_);
  check_same_everywhere(*communicator_, "plugin and config",
                        fmt::format("{}, config {}", strategy_->fingerprint(), options_.config_hash));
  spdlog::info("strategy: {}, {} process(es)", strategy_->describe(), context_.world);
  WEFT_CHECK(strategy_->can_evaluate(context_.world), "plugin {} has no eval_step, so it cannot evaluate with {} processes",
             strategy_->library().name(), context_.world);
}

void Job::build_model() {
  const ModelConfig config = resolve_model_config(options_, *tokenizer_);
  ModelOptions model_options;
  model_options.compute_dtype = compute_dtype(options_.precision);
  model_options.activation_checkpointing = options_.model.activation_checkpointing;
  placement_ = strategy_->place(config, model_options.compute_dtype, options_.data.seq_len, options_.batch_size);
  model_options.stages = placement_.stages;
  model_options.shards = strategy_->shards(config, placement_.stages);
  model_options.comm = strategy_->comm_hook();
  model_ = LlamaForCausalLM(config, model_options);
  // On the device before the weights arrive, so that each tensor goes from the memory-mapped file
  // (or its seeded initialisation) to the device on its own: no whole-model copy in host memory.
  if (options_.model.weights.empty()) {
    init_weights(*model_, options_.seed, options_.model.init_std);
    model_->to(device_);
  } else {  // every base weight is in the file (load_weights refuses it otherwise)
    model_->to(device_);
    load_weights(*model_, options_.model.weights);
  }
  if (!options_.model.adapter.empty()) {
    lora_ = read_lora_adapter_config(options_.model.adapter);
  } else if (options_.mode == "lora") {
    lora_ = options_.lora;
  }
  if (lora_) {
    const int64_t adapted = apply_lora(*model_, *lora_, options_.seed);
    model_->to(device_);  // the new adapters
    if (!options_.model.adapter.empty()) load_lora_adapter(*model_, options_.model.adapter);
    spdlog::info("LoRA: {} layers adapted (r={}, alpha={}){}", adapted, lora_->spec.r, lora_->spec.alpha,
                 options_.model.adapter.empty() ? "" : ", adapters from " + options_.model.adapter);
  }
  int64_t total = 0, trainable = 0;
  for (auto& [name, param] : trainable_parameters(*model_)) {
    trainable_.push_back(param);
    trainable += param.numel();
  }
  for (auto& p : model_->parameters()) total += p.numel();
  // Gradients exist from the start (zero until a backward adds to them), so a plugin can
  // communicate a stage's gradient even in a step where that stage had no backward (PipeDream's
  // warm-up, a tied embedding's second copy).
  {
    torch::NoGradGuard no_grad;
    for (auto& p : trainable_) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
  }
  strategy_->attach(*model_);
  spdlog::info("model: {} layers, hidden {}, {} heads ({} kv), vocab {}: {:.2f}M parameters, {:.2f}M trainable, {}, "
               "attention {} on {} (LibTorch {})",
               model_->config().num_hidden_layers, model_->config().hidden_size,
               model_->config().num_attention_heads, model_->config().num_key_value_heads,
               model_->config().vocab_size, total / 1e6, trainable / 1e6, options_.precision,
               attention_kernel_name(model_->config().attention), device_.str(), compat::libtorch_version());
}

}  // namespace weft
