#include "core/job/job.h"

#include "core/data/chat_data.h"
#include "core/data/chat_template.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "core/data/documents.h"
#include "core/dist/mesh.h"
#include "core/model/gemm.h"
#include "core/model/gguf_model.h"
#include "core/model/memory_estimate.h"
#include "core/model/weights.h"
#include "core/plugin/library.h"
#include "core/util/device.h"
#include "core/util/memory.h"
#include "core/util/error.h"
#include "core/util/libtorch.h"
#include "core/util/trace.h"

namespace weft {
namespace fs = std::filesystem;

torch::Dtype compute_dtype(const std::string& precision) {
  if (precision == "bf16") return torch::kBFloat16;
  if (precision == "fp16") return torch::kHalf;
  return torch::kFloat32;
}

ModelConfig resolve_model_config(const TrainOptions& options, const Tokenizer* tokenizer) {
  const auto& m = options.model;
  ModelConfig config;
  const std::string weights_config = m.weights + "/config.json";
  if (!m.config_path.empty()) {
    config = load_hf_config(m.config_path);
  } else if (!m.weights.empty() && fs::is_directory(m.weights) && fs::exists(weights_config)) {
    config = load_hf_config(weights_config);
  } else if (!m.weights.empty() && is_gguf_path(m.weights) && fs::is_regular_file(m.weights)) {
    config = load_gguf_model_config(m.weights);  // the shape is in the file's metadata
  } else {
    std::error_code ec;
    const bool weights_dir = !m.weights.empty() && fs::is_directory(m.weights, ec);
    WEFT_CHECK(!m.preset.empty(), "no model shape: set model.preset or model.config{}",
               m.weights.empty() ? ""
               : weights_dir   ? fmt::format(" (model.weights = '{}' has no config.json)", m.weights)
                               : fmt::format(" (model.weights = '{}' is not a folder with a config.json)", m.weights));
    config = preset_config(m.preset);
    if (weights_dir) {  // the checkpoint's tensors must then match the preset's shapes
      spdlog::warn("model.weights = '{}' has no config.json: the model's shape is model.preset = '{}'", m.weights,
                   m.preset);
    }
  }
  if (m.vocab_size > 0) config.vocab_size = m.vocab_size;
  // A shape without special-token ids (a preset) takes the tokenizer's, so that a saved config.json
  // names them as an HF model directory does.
  if (tokenizer != nullptr) {
    if (!config.bos_token_id) {
      if (const auto bos = tokenizer->bos_id()) config.bos_token_id = *bos;
    }
    if (!config.eos_token_id) {
      if (const auto eos = tokenizer->eos_id()) config.eos_token_id = *eos;
    }
    WEFT_CHECK(tokenizer->vocab_size() <= config.vocab_size,
               "tokenizer '{}' has {} tokens but the model's vocab_size is {} (set model.vocab_size)",
               options.tokenizer, tokenizer->vocab_size(), config.vocab_size);
  }
  WEFT_CHECK(options.data.seq_len <= config.max_position_embeddings,
             "data.seq_len {} exceeds the model's max_position_embeddings {}", options.data.seq_len,
             config.max_position_embeddings);
  return config;
}

namespace {

// Every file the run will read, checked before anything is built: a wrong path is one error at once,
// not one after the model was built (23 s for a 1B model before a missing data file was found).
void check_input_paths(const TrainOptions& o, bool reads_data) {
  const auto exists = [](const std::string& path) {
    std::error_code ec;
    return fs::exists(path, ec);
  };
  if (!o.plugin.empty()) resolve_plugin_paths(o.plugin);  // an unknown name: the plugins there, the closest
  WEFT_CHECK(o.tokenizer == "byte" || exists(o.tokenizer),
             "data.tokenizer = '{}' does not exist (\"byte\", a tokenizer.json or a folder holding one, or a GGUF file)", o.tokenizer);
  WEFT_CHECK(o.model.weights.empty() || exists(o.model.weights),
             "model.weights = '{}' does not exist: it names the weights to start from (an HF model folder, a "
             ".safetensors or .gguf file, or a finished run's final/ or best/ folder); run the training that writes "
             "it first, or leave model.weights empty for a random initialisation",
             o.model.weights);
  WEFT_CHECK(o.model.adapter.empty() || exists(o.model.adapter),
             "model.adapter = '{}' does not exist: it names a LoRA adapter folder (adapter_config.json, "
             "adapter_model.safetensors), e.g. a LoRA run's final/", o.model.adapter);
  WEFT_CHECK(o.model.config_path.empty() || exists(o.model.config_path),
             "model.config = '{}' does not exist: it names a Hugging Face config.json", o.model.config_path);
  // Text and token data (a classification task's labeled files and GLUE folders have their own reader,
  // which runs before the model is built too).
  if (reads_data && o.task != "classification" && o.data.format != "glue") {
    resolve_inputs(o.data.paths, o.data.format == "chat" ? DataFormat::kJsonl : parse_data_format(o.data.format));
  }
}

// trainer plan works from the shapes: the inputs that only the run reads (the tokenizer, the weights
// whose config.json would give the shape, the text) may be missing, and are named in a note.
std::vector<std::string> missing_run_inputs(const TrainOptions& o) {
  const auto exists = [](const std::string& path) {
    std::error_code ec;
    return fs::exists(path, ec);
  };
  std::vector<std::string> missing;
  if (o.tokenizer != "byte" && !exists(o.tokenizer)) missing.push_back(fmt::format("data.tokenizer = '{}'", o.tokenizer));
  if (!o.model.weights.empty() && !exists(o.model.weights)) {
    missing.push_back(fmt::format("model.weights = '{}'", o.model.weights));
  }
  for (const auto& path : o.data.paths) {
    if (!exists(path)) missing.push_back(fmt::format("data.path = '{}'", path));
  }
  return missing;
}

}  // namespace

Job::Job(TrainOptions options, RunContext context, Data data) : options_(std::move(options)), context_(context) {
  plan_only_ = data == Data::kPlanOnly;
  if (plan_only_) {
    if (!options_.plugin.empty()) resolve_plugin_paths(options_.plugin);
    missing_inputs_ = missing_run_inputs(options_);
  } else {
    check_input_paths(options_, data == Data::kSplits);
  }
  WEFT_CHECK(options_.mode == "full" || options_.mode == "lora" || options_.mode == "adalora" ||
                 options_.mode == "prompt_tuning",
             "train.mode must be full, lora, adalora or prompt_tuning, got '{}'", options_.mode);
  WEFT_CHECK(options_.precision == "fp32" || options_.precision == "bf16" || options_.precision == "fp16",
             "train.precision must be fp32, bf16 or fp16, got '{}'", options_.precision);
  const DeviceInventory devices = this_process_devices();
  device_ = resolve_device(options_.device, context_.env.local_rank, context_.rank, devices);
  nccl_ = device_.is_cuda() && Communicator::nccl_compiled() && !devices.share;
  bind_device(device_);
  install_memory_tracker();
  at::set_num_threads(static_cast<int>(options_.threads));
  set_cpu_fp32_gemm(resolve_cpu_fp32_gemm(options_.fp32_cpu_gemm));
  torch::manual_seed(options_.seed);
  const bool no_tokenizer = plan_only_ && options_.tokenizer != "byte" && !fs::exists(options_.tokenizer);
  if (!no_tokenizer) tokenizer_ = load_tokenizer(options_.tokenizer);
  join();
  if (!options_.trace_file.empty()) {
    Tracer::instance().enable(Tracer::rank_path(options_.trace_file, context_.rank, context_.world), context_.rank);
  }
  const bool classify = options_.task == "classification";
  WEFT_CHECK(!classify || options_.data.format != "chat",
             "data.format = \"chat\" is for train.task = \"causal_lm\" (instruction tuning)");
  WEFT_CHECK(!options_.chat.packing || options_.data.format == "chat",
             "data.packing is for data.format = \"chat\" (text is packed into sequences already)");
  WEFT_CHECK(classify || (options_.data.format != "glue" && options_.classification.glue_task.empty()),
             "data.format = \"glue\" and data.glue_task are for train.task = \"classification\"");
  WEFT_CHECK(!classify || (options_.data.format == "glue") == !options_.classification.glue_task.empty(),
             "train.task = \"classification\": data.format = \"glue\" needs data.glue_task, and data.glue_task "
             "needs data.format = \"glue\"");
  WEFT_CHECK(!classify || options_.classification.glue_task.empty() || !options_.classification.regression,
             "data.regression is for JSONL data; a GLUE task says itself whether it is a regression (stsb)");
  if (classify && data != Data::kNone) {  // the classes size the model's head
    std::vector<std::string> unread;  // what sizing the head needs (the weights it does not)
    for (const auto& m : missing_inputs_) {
      if (m.rfind("data.", 0) == 0) unread.push_back(m);
    }
    WEFT_CHECK(unread.empty(),
               "train.task = \"classification\": the plan reads the labeled data to size the model's head, and "
               "{} does not exist",
               fmt::join(unread, ", "));
    classification_ = prepare_classification(options_.data, options_.classification, *tokenizer_);
    const auto& c = *classification_;
    spdlog::info("classification data{}: {} train and {} held-out examples{}, {} ({} examples cut to seq_len {}) in "
                 "{:.2f}s",
                 c.glue_task.empty() ? "" : " (GLUE " + c.glue_task + ")", c.splits.summary.train_sequences,
                 c.splits.summary.heldout_sequences,
                 c.extra_heldout.empty() ? "" : fmt::format(" (+ {} {})", c.extra_heldout.front().second->n_sequences(),
                                                            c.extra_heldout.front().first),
                 c.regression ? "regression" : fmt::format("{} classes", c.labels.size()), c.truncated,
                 options_.data.seq_len, c.splits.summary.seconds);
  }
  build_model();
  if (classification_) {
    data_ = classification_->splits;
  } else if (data == Data::kSplits && options_.data.format == "chat") {
    const auto chat_template = load_chat_template(options_.tokenizer, *tokenizer_);
    const ChatData chat = prepare_chat(options_.data, options_.chat, *tokenizer_, chat_template.get());
    data_ = chat.splits;
    spdlog::info("chat data: {} examples ({} cut to seq_len + 1 = {}, {} left with no token in the loss and dropped), "
                 "loss on {} tokens, {} | {}: {} examples in {} sequences, {} tokens | held-out: {} examples in {} "
                 "sequences, {} tokens, in {:.2f}s",
                 chat.examples, chat.truncated, options_.data.seq_len + 1, chat.dropped, options_.chat.loss_on,
                 options_.chat.packing ? "packed" : "one per sequence", data_.summary.train_name,
                 data_.summary.train_documents, data_.summary.train_sequences, data_.summary.train_tokens,
                 data_.summary.heldout_documents, data_.summary.heldout_sequences, data_.summary.heldout_tokens,
                 data_.summary.seconds);
  } else if (data == Data::kSplits) {
    DatasetOptions data_options = options_.data;
    // Token files are checked against the model's vocabulary: they need no tokenizer of the model.
    data_options.token_vocab_size = model_->config().vocab_size;
    data_ = prepare_dataset(data_options, *tokenizer_);
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
  if (options_.shared_memory_collectives) communicator_->use_shared_memory(512 << 10);
  // A collective that fails or times out leaves this rank's last operations here.
  if (!options_.out_dir.empty()) {
    communicator_->set_flight_record_path(fmt::format("{}/flight_recorder.rank{}.json", options_.out_dir, context_.rank));
  }
  strategy_ = std::make_unique<StrategySession>(
      options_.plugin, options_.plugin_config, *communicator_,
      std::array<int32_t, 4>{static_cast<int32_t>(options_.mesh_pp), static_cast<int32_t>(options_.mesh_dp),
                             static_cast<int32_t>(options_.mesh_cp), static_cast<int32_t>(options_.mesh_tp)});
  check_same_everywhere(*communicator_, "plugin and config",
                        fmt::format("{}, config {}", strategy_->fingerprint(), options_.config_hash));
  spdlog::info("strategy: {}, {} process(es)", strategy_->describe(), context_.world);
  describe_nodes();
}

// Where a job spans nodes: which mesh dimensions stay within a node and which cross the network.
// The mesh puts tp fastest, then cp, dp and pp, so a tensor- or context-parallel size that divides
// the ranks per node keeps those per-layer collectives on the node; one that does not is warned of.
void Job::describe_nodes() const {
  const auto& e = context_.env;
  if (!e.spans_nodes || e.local_world <= 0) return;
  const Mesh* mesh = strategy_->mesh();
  std::array<int32_t, Mesh::kDims> alone{1, 1, 1, 1};  // one plugin: the world along the dimension it owns
  const uint32_t owns = strategy_->library().plugin().table.mesh_dimensions;
  int dimension = Mesh::kDP;
  for (int d = 0; d < Mesh::kDims; ++d) {
    if (owns == (1u << d)) dimension = d;
  }
  alone[static_cast<size_t>(dimension)] = static_cast<int32_t>(context_.world);
  const Mesh whole = mesh != nullptr ? *mesh : Mesh(alone);
  std::vector<std::string> within, across;
  for (int d : {Mesh::kTP, Mesh::kCP, Mesh::kDP, Mesh::kPP}) {
    if (whole.size(d) <= 1) continue;
    const bool crosses = whole.crosses_nodes(d, e.local_world);
    (crosses ? across : within).push_back(fmt::format("{} {}", Mesh::name(d), whole.size(d)));
    if (crosses && (d == Mesh::kTP || d == Mesh::kCP)) {
      spdlog::warn("the {} groups of {} ranks span nodes of {} ranks: their collectives in every layer cross the "
                   "network; a mesh.{} that divides {} keeps them within a node",
                   d == Mesh::kTP ? "tensor-parallel" : "context-parallel", whole.size(d), e.local_world,
                   Mesh::name(d), e.local_world);
    }
  }
  spdlog::info("nodes: {}, {} rank{} each; within each node: {}; across nodes: {}", context_.world / e.local_world,
               e.local_world, e.local_world == 1 ? "" : "s", within.empty() ? "none" : fmt::format("{}", fmt::join(within, ", ")),
               across.empty() ? "none" : fmt::format("{}", fmt::join(across, ", ")));
}

void Job::build_model() {
  ModelConfig config = resolve_model_config(options_, tokenizer_.get());
  if (classification_) {  // the head's classes: the data's, which a saved classifier must have too
    const auto& c = *classification_;
    const int64_t labels = c.regression ? 1 : static_cast<int64_t>(c.labels.size());
    WEFT_CHECK(!config.classification() || (config.num_labels == labels && (c.regression || config.labels == c.labels)),
               "the model's config.json classifies into {} labels ({}) but the data has {} ({})", config.num_labels,
               fmt::join(config.labels, ", "), labels, c.regression ? "a regression score" : fmt::format("{}", fmt::join(c.labels, ", ")));
    config.num_labels = labels;
    config.labels = c.regression ? std::vector<std::string>{"score"} : c.labels;
    config.pad_token_id = static_cast<int64_t>(c.pad);
  } else {
    WEFT_CHECK(!config.classification() || plan_only_ || options_.task == "classification",
               "the model is a sequence classifier (its config.json has {} labels): set train.task = \"classification\"",
               config.num_labels);
  }
  ModelOptions model_options;
  model_options.compute_dtype = compute_dtype(options_.precision);
  model_options.activation_checkpointing = options_.model.activation_checkpointing;
  model_options.chunked_loss = options_.model.chunked_loss;
  model_options.quantize = QuantConfig(parse_quant_format(options_.model.quantize), options_.model.int8_threshold,
                                       options_.model.int8_gemm);
  if (!options_.model.adapter.empty() && adapter_peft_type(options_.model.adapter) == "PROMPT_TUNING") {
    prompt_ = read_prompt_adapter_config(options_.model.adapter);
  } else if (options_.mode == "prompt_tuning") {
    prompt_ = options_.prompt_tuning;
  }
  WEFT_CHECK(!prompt_ || !config.classification(), "prompt tuning is for train.task = \"causal_lm\"");
  WEFT_CHECK(model_seq_len() <= config.max_position_embeddings,
             "data.seq_len {} and {} virtual tokens exceed the model's max_position_embeddings {}", options_.data.seq_len,
             model_seq_len() - options_.data.seq_len, config.max_position_embeddings);
  model_options.prompt_tokens = prompt_ ? prompt_->num_virtual_tokens : 0;
  placement_ = strategy_->place(config, model_options.compute_dtype, model_seq_len(), options_.batch_size);
  model_options.stages = placement_.stages;
  model_options.deferrable_weight_grads = placement_.split_backward;
  WEFT_CHECK(!options_.chat.packing || !prompt_, "data.packing: prompt tuning prepends its virtual tokens to every "
             "sequence, not to each packed example: set data.packing = false");
  WEFT_CHECK(!options_.chat.packing || !strategy_->plugin_attention(),
             "data.packing keeps packed examples apart with an attention mask, which plugin {} does not take: it "
             "computes the attention core itself; set data.packing = false, or split sequences with the all-to-all",
             strategy_->names());
  WEFT_CHECK(!config.classification() || placement_.context_parallel_size == 1,
             "train.task = \"classification\" pools each sequence at its last token, which one rank holds when "
             "plugin {} splits sequences over {} ranks: not supported (use ddp, tensor_parallel or a pipeline)",
             strategy_->names(), placement_.context_parallel_size);
  model_options.shards = strategy_->shards(config, placement_.stages);
  if (!options_.model.adapter.empty() && adapter_peft_type(options_.model.adapter) == "ADALORA") {
    const AdaLoraConfig adalora = read_adalora_adapter_config(options_.model.adapter);
    lora_ = LoraConfig{adalora.spec, adalora.target_modules, adalora};
  } else if (prompt_) {  // no LoRA adapters
  } else if (!options_.model.adapter.empty()) {
    lora_ = read_lora_adapter_config(options_.model.adapter);
  } else if (options_.mode == "lora") {
    lora_ = options_.lora;
  } else if (options_.mode == "adalora") {  // lora.*'s alpha, dropout and targets, adalora.*'s budget
    lora_ = options_.lora;
    AdaLoraConfig adalora = options_.adalora;
    adalora.spec.alpha = options_.lora.spec.alpha;
    adalora.spec.dropout = options_.lora.spec.dropout;
    adalora.target_modules = options_.lora.target_modules;
    lora_->spec = adalora.spec;
    lora_->adalora = adalora;
  }
  shards_ = model_options.shards;
  quantize_ = model_options.quantize.format;
  plan_memory(config, model_options.compute_dtype);
  if (plan_only_) return;
  WEFT_CHECK(memory_.fits, "{}{}; trainer plan --config ... --plugin {} --nproc {} shows the plan", memory_.problem,
             memory_.advice.empty() ? "; no setting of the host's makes it fit"
                                    : fmt::format("; {}", fmt::join(memory_.advice, "; ")),
             strategy_->names(), context_.world);
  model_options.comm = strategy_->comm_hook();
  model_options.context = strategy_->context_split();
  model_options.sequence_parallel = strategy_->sequence_parallel();
  model_ = LlamaForCausalLM(config, model_options);
  if ((lora_ || prompt_) && options_.model.frozen_dtype == "bf16") {  // before the values arrive: never held in fp32
    torch::NoGradGuard no_grad;
    for (auto& item : model_->named_parameters()) {  // the base's (adapters come later)
      auto& p = item.value();
      if (p.dim() < 2 || item.key().rfind("score.", 0) == 0) continue;  // norms; the trained head
      p.set_data(torch::empty(p.sizes(), p.options().dtype(torch::kBFloat16)));
    }
  }
  // On the device before the weights arrive, so that each tensor goes from the memory-mapped file
  // (or its seeded initialisation) to the device on its own: no whole-model copy in host memory.
  if (options_.model.weights.empty()) {
    init_weights(*model_, options_.seed, options_.model.init_std);
    model_->to(device_);
  } else {  // every base weight is in the file (load_weights refuses it otherwise)
    model_->to(device_);
    try {
      load_weights(*model_, options_.model.weights, options_.seed, options_.model.init_std);
    } catch (const Error& e) {  // a checkpoint folder without config.json: its shape was the preset's
      std::error_code ec;
      const auto& m = options_.model;
      if (!m.config_path.empty() || !fs::is_directory(m.weights, ec) || fs::exists(m.weights + "/config.json", ec)) throw;
      fail("{} (the model's shape is model.preset = '{}' because '{}' has no config.json: set model.config to the "
           "checkpoint's config.json, or the preset it was trained with)",
           e.what(), m.preset, m.weights);
    }
  }
  weights_source_ = options_.model.weights.empty() ? fmt::format("random init (seed {})", options_.seed)
                                                  : options_.model.weights;
  if (!options_.model.adapter.empty()) weights_source_ += ", adapter " + options_.model.adapter;
  spdlog::info("weights: {}", weights_source_);
  if (lora_) {
    const int64_t adapted = apply_lora(*model_, *lora_, options_.seed);
    model_->to(device_);  // the new adapters
    if (!options_.model.adapter.empty()) load_lora_adapter(*model_, options_.model.adapter);
    if (lora_->adalora) {
      spdlog::info("AdaLoRA: {} layers adapted (init_r={}, target_r={}, alpha={}){}", adapted, lora_->spec.r,
                   lora_->adalora->target_r, lora_->spec.alpha,
                   options_.model.adapter.empty() ? "" : ", adapters from " + options_.model.adapter);
    } else {
      spdlog::info("LoRA: {} layers adapted (r={}, alpha={}){}", adapted, lora_->spec.r, lora_->spec.alpha,
                   options_.model.adapter.empty() ? "" : ", adapters from " + options_.model.adapter);
    }
  }
  if (prompt_) {
    std::vector<int32_t> init_ids;
    if (prompt_->init == "text") {  // tokenized as PEFT's tokenizer(init_text) does: with the checkpoint's framing
      if (options_.data.bos_for(*tokenizer_) && tokenizer_->bos_id()) init_ids.push_back(*tokenizer_->bos_id());
      for (int32_t id : tokenizer_->encode(prompt_->init_text)) init_ids.push_back(id);
      if (options_.data.eos_for(*tokenizer_) && tokenizer_->eos_id()) init_ids.push_back(*tokenizer_->eos_id());
    }
    apply_prompt_tuning(*model_, *prompt_, options_.seed, init_ids);
    if (!options_.model.adapter.empty()) load_prompt_adapter(*model_, options_.model.adapter);
    spdlog::info("prompt tuning: {} virtual tokens ({}){}", prompt_->num_virtual_tokens,
                 options_.model.adapter.empty() ? "init " + prompt_->init : "from " + options_.model.adapter,
                 model_->holds_stage(0) ? "" : ", on the embedding's stage");
  }
  int64_t total = 0, trainable = 0;
  for (auto& [name, param] : trainable_parameters(*model_)) {
    trainable_.push_back(param);
    trainable += param.numel();
  }
  for (auto& p : model_->parameters()) total += p.numel();
  int64_t quantized = 0, quantized_bytes = 0;  // frozen base weights held quantized (not parameters)
  for (auto& module : model_->modules(/*include_self=*/false)) {
    const auto* linear = module->as<LinearImpl>();
    if (linear == nullptr || !linear->quantized()) continue;
    quantized += linear->in_features() * linear->out_features();
    quantized_bytes += linear->quantized_weight().bytes();
  }
  total += quantized;
  int64_t frozen_bf16 = 0;
  for (auto& p : model_->parameters()) {
    if (p.scalar_type() == torch::kBFloat16 && !p.requires_grad()) frozen_bf16 += p.numel();
  }
  if (frozen_bf16 > 0) {
    spdlog::info("frozen base: {:.2f}M weights stored as bf16 in {:.1f} MiB (model.frozen_dtype)", frozen_bf16 / 1e6,
                 2.0 * static_cast<double>(frozen_bf16) / 1048576.0);
  }
  if (quantized > 0) {
    spdlog::info("base weights: {:.2f}M of the blocks' linear weights held as {} in {:.1f} MiB ({:.2f} bytes each)",
                 quantized / 1e6, options_.model.quantize, quantized_bytes / 1048576.0,
                 static_cast<double>(quantized_bytes) / static_cast<double>(quantized));
  }
  // Gradients exist from the start (zero until a backward adds to them), so a plugin can
  // communicate a stage's gradient even in a step where that stage had no backward (an asynchronous pipeline's
  // warm-up, a tied embedding's second copy).
  {
    torch::NoGradGuard no_grad;
    for (auto& p : trainable_) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    }
  }
  strategy_->attach(*model_);
  // After the plugin's setup: a plugin that releases parameters between uses (RELEASABLE shards) gathers
  // them again each time, and a kept copy would hold what it frees.
  model_->set_cache_frozen_casts(options_.model.cache_frozen_casts && !strategy_->releases_parameters());
  // The model's size, and this rank's share beside it where the plugin splits the model (tensor
  // slices, pipeline stages): the base's parameters held here against the whole base's.
  int64_t local_base = quantized;
  for (auto& item : model_->named_parameters()) {
    if (item.key().find("lora_") == std::string::npos) local_base += item.value().numel();
  }
  const int64_t whole = model_->config().parameter_count();
  const std::string size =
      local_base == whole ? fmt::format("{:.2f}M parameters, {:.2f}M trainable", total / 1e6, trainable / 1e6)
                          : fmt::format("{:.2f}M parameters, this rank holds {:.2f}M ({:.2f}M trainable)", whole / 1e6,
                                        total / 1e6, trainable / 1e6);
  spdlog::info("model: {} layers, hidden {}, {} heads ({} kv), vocab {}: {}, {}, on {} (LibTorch {})",
               model_->config().num_hidden_layers, model_->config().hidden_size,
               model_->config().num_attention_heads, model_->config().num_key_value_heads,
               model_->config().vocab_size, size, options_.precision, device_.str(), libtorch_version());
}

void Job::warn_if_random_weights(const std::string& command) const {
  if (!random_weights()) return;
  spdlog::warn("trainer {}: the model has random weights (model.weights names none; seed {}), so its numbers are "
               "chance's: point model.weights at a trained model, e.g. a run's final/ or best/ folder",
               command, options_.seed);
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// What a rank's process holds besides the plan's tensors (LibTorch, the allocator's slack, the
// data): measured at ~0.37 GiB peak RSS for a tiny model on one rank (2.11, CPU).
constexpr int64_t kRuntimeBytes = static_cast<int64_t>(0.4 * kGiB);

std::string gib(int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / kGiB); }

std::string describe_rank(const MemoryPlan& p, int64_t runtime) {
  return fmt::format("parameters {}, gradients {}, optimizer {}, activations {}, buffers {}, runtime {} GiB",
                     gib(p.parameters), gib(p.gradients), gib(p.optimizer), gib(p.activations), gib(p.buffers),
                     gib(runtime));
}

}  // namespace

// This rank's plan for the run's shapes with the given settings: the host's estimate of what it
// holds, adjusted by the plugin(s). Local (no collective); the plugin keeps the stage sizes of the
// last call, so the run's own plan is made last.
std::vector<StageMemory> Job::stage_estimate(const ModelConfig& config, torch::Dtype dtype,
                                             const PlanSettings& settings) const {
  // Prompt tuning: the base frozen as under adapters (none of them), and the prompt trained on the embedding's stage.
  std::optional<LoraConfig> frozen = settings.lora;
  if (!frozen && prompt_) {
    frozen = LoraConfig{};
    frozen->target_modules.clear();
  }
  auto estimate = estimate_stage_memory(config, shards_, frozen, dtype, model_seq_len(), settings.checkpointing,
                                        strategy_->plugin_attention(), quantize_,
                                        frozen && options_.model.frozen_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32,
                                        strategy_->sequence_parallel_size(),
                                        frozen && options_.model.cache_frozen_casts,
                                        device_.is_cpu() && (dtype == torch::kFloat32 || dtype == torch::kBFloat16));
  if (prompt_ && !settings.lora) {
    const int64_t elements = prompt_->num_virtual_tokens * config.hidden_size;
    auto& embedding = estimate.front();
    embedding.parameter_bytes += 4 * elements;
    embedding.trainable_bytes += 4 * elements;
    embedding.compute_parameter_bytes += 4 * elements;
    embedding.compute_trainable_bytes += 4 * elements;
  }
  return estimate;
}

MemoryPlan Job::rank_plan(const ModelConfig& config, torch::Dtype dtype, const PlanSettings& settings) {
  const auto estimate = stage_estimate(config, dtype, settings);
  std::vector<weft_stage_memory> stages;
  for (const auto& e : estimate) {
    weft_stage_memory s{};
    s.struct_size = sizeof(weft_stage_memory);
    s.parameter_bytes = e.parameter_bytes;
    s.trainable_bytes = e.trainable_bytes;
    s.activation_bytes_per_row = e.activation_bytes_per_row;
    s.weight_copy_bytes = e.weight_copy_bytes;
    s.output_bytes_per_row = e.output_bytes_per_row;
    s.compute_parameter_bytes = e.compute_parameter_bytes;
    s.compute_trainable_bytes = e.compute_trainable_bytes;
    stages.push_back(s);
  }
  return strategy_->memory_plan(stages, placement_.stages, settings.micro_batches, settings.rows, model_seq_len());
}

// Every rank's plan, gathered, and checked against the limit: on the CPU the ranks of a machine
// share its memory; on CUDA each rank has its device. A plan that does not fit gets advice: the
// host's settings that would make it fit (each tried in the plan), and what the plan's shares say
// a plugin could do.
void Job::plan_memory(const ModelConfig& config, torch::Dtype dtype) {
  PlanSettings run;
  run.lora = lora_;
  run.checkpointing = options_.model.activation_checkpointing;
  run.rows = options_.batch_size / std::max(placement_.data_parallel_size, 1);
  run.micro_batches = static_cast<int32_t>(options_.grad_accum_steps);
  const MemoryPlan mine = rank_plan(config, dtype, run);
  MemoryVerdict& v = memory_;
  v = MemoryVerdict{};
  v.runtime_bytes = kRuntimeBytes;
  v.ranks = gather_plans(mine);
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  const auto machines = communicator_->all_gather(static_cast<double>(std::hash<std::string>{}(host) % (1ull << 50)));
  for (size_t r = 0; r < machines.size(); ++r) {
    v.machine.push_back(static_cast<int>(std::find(machines.begin(), machines.end(), machines[r]) - machines.begin()));
  }
  v.per_device = device_.is_cuda();
  if (options_.memory_limit_gib > 0) {
    v.limit_bytes = static_cast<int64_t>(options_.memory_limit_gib * kGiB);
    v.limit_source = "train.memory_limit_gib";
  } else {
    v.limit_bytes = device_total_bytes(device_);
    v.limit_source = v.per_device ? "the device's memory" : "the machine's memory";
  }
  const int64_t need = bytes_needed_here(v.ranks);
  v.fits = fits_everywhere(need);  // collective: every rank stops if one does not fit
  if (context_.rank == 0 && !plan_only_) {  // trainer plan prints its table instead
    size_t largest = 0;
    for (size_t r = 1; r < v.ranks.size(); ++r) largest = v.ranks[r].total() > v.ranks[largest].total() ? r : largest;
    spdlog::info("memory plan: {} GiB {} ({}; rank {} of {}, the largest), limit {}", gib(need),
                 v.per_device ? "on rank 0's device" : "on this machine", describe_rank(v.ranks[largest], v.runtime_bytes),
                 largest, v.ranks.size(),
                 v.limit_bytes > 0 ? fmt::format("{} GiB ({}): {}", gib(v.limit_bytes), v.limit_source,
                                                 v.fits ? "fits" : "does not fit")
                                   : std::string("unknown"));
  }
  if (v.fits) return;
  if (v.limit_bytes > 0 && need > v.limit_bytes) {
    std::string detail;
    int ranks_here = 0;
    for (size_t r = 0; r < v.ranks.size(); ++r) {
      if (!counted_here(static_cast<int>(r))) continue;
      detail += fmt::format("{}rank {}: {}", ranks_here++ ? "; " : "", r, describe_rank(v.ranks[r], v.runtime_bytes));
    }
    v.problem = fmt::format("the memory plan needs {} GiB {} ({}) but {} allows {} GiB", gib(need),
                            v.per_device ? fmt::format("on rank {}'s device", context_.rank)
                                         : fmt::format("for the {} rank(s) on this machine", ranks_here),
                            detail, v.limit_source, gib(v.limit_bytes));
  } else {
    v.problem = "the memory plan of another rank does not fit its device (its error says why)";
  }
  advise(config, dtype, run, mine);
  rank_plan(config, dtype, run);  // the plugin keeps the run's stage sizes
}

std::vector<MemoryPlan> Job::gather_plans(const MemoryPlan& mine) {
  const auto all = [&](int64_t value) { return communicator_->all_gather(static_cast<double>(value)); };  // collective
  const auto parameters = all(mine.parameters), gradients = all(mine.gradients), optimizer = all(mine.optimizer),
             activations = all(mine.activations), buffers = all(mine.buffers);
  std::vector<MemoryPlan> plans;
  for (size_t r = 0; r < parameters.size(); ++r) {
    plans.push_back(MemoryPlan{static_cast<int64_t>(parameters[r]), static_cast<int64_t>(gradients[r]),
                               static_cast<int64_t>(optimizer[r]), static_cast<int64_t>(activations[r]),
                               static_cast<int64_t>(buffers[r])});
  }
  return plans;
}

// Whether rank r's memory counts against this rank's limit: its own device (CUDA), or every rank
// on this machine (CPU).
bool Job::counted_here(int r) const {
  const auto& v = memory_;
  return v.per_device ? r == context_.rank : v.machine[static_cast<size_t>(r)] == v.machine[static_cast<size_t>(context_.rank)];
}

int64_t Job::bytes_needed_here(const std::vector<MemoryPlan>& plans) const {
  int64_t need = 0;
  for (size_t r = 0; r < plans.size(); ++r) {
    if (counted_here(static_cast<int>(r))) need += plans[r].total() + memory_.runtime_bytes;
  }
  return need;
}

bool Job::fits_everywhere(int64_t need) {
  const bool here = memory_.limit_bytes <= 0 || need <= memory_.limit_bytes;  // unknown: nothing to check against
  const auto fits = communicator_->all_gather(here ? 1.0 : 0.0);  // collective
  return std::all_of(fits.begin(), fits.end(), [](double f) { return f != 0.0; });
}

// Advice for a plan that does not fit (every rank runs it: it is collective). First the host's
// settings, each tried in the plan with the others as configured: activation checkpointing, the
// largest smaller batch per step (train.batch_size divided, train.grad_accum_steps multiplied:
// the same examples per optimizer step), LoRA instead of full fine-tuning. Then what this rank's
// shares say a plugin could do: shard the training state where nothing shards it, shard what is
// still whole on every rank, or spread the sharded state over more ranks.
void Job::advise(const ModelConfig& config, torch::Dtype dtype, const PlanSettings& run, const MemoryPlan& mine) {
  auto& advice = memory_.advice;
  int64_t runtime = 0;  // the processes alone: more than the limit leaves nothing to advise but that
  for (size_t r = 0; r < memory_.ranks.size(); ++r) runtime += counted_here(static_cast<int>(r)) ? memory_.runtime_bytes : 0;
  if (memory_.limit_bytes > 0 && runtime >= memory_.limit_bytes) {
    advice.push_back(fmt::format("the processes alone need {} GiB ({} GiB each for LibTorch and the process): a higher "
                                 "limit{}",
                                 gib(runtime), gib(memory_.runtime_bytes),
                                 memory_.per_device ? "" : ", or fewer ranks on this machine"));
  }
  const auto try_settings = [&](const PlanSettings& s) {  // GiB needed here, or -1 if it does not fit
    const auto plans = gather_plans(rank_plan(config, dtype, s));
    const int64_t need = bytes_needed_here(plans);
    return fits_everywhere(need) ? need : int64_t{-1};
  };
  if (!run.checkpointing) {
    PlanSettings s = run;
    s.checkpointing = true;
    if (const int64_t need = try_settings(s); need >= 0) {
      advice.push_back(fmt::format("--set model.activation_checkpointing=true fits ({} GiB)", gib(need)));
    }
  }
  for (int64_t k = 2; run.rows / k >= 1; k *= 2) {  // the largest that fits
    if (options_.batch_size % k != 0) break;
    PlanSettings s = run;
    s.rows = run.rows / k;
    s.micro_batches = run.micro_batches * static_cast<int32_t>(k);
    if (const int64_t need = try_settings(s); need >= 0) {
      advice.push_back(fmt::format("--set train.batch_size={} --set train.grad_accum_steps={} fits ({} GiB; the same "
                                   "examples per optimizer step)",
                                   options_.batch_size / k, options_.grad_accum_steps * k, gib(need)));
      break;
    }
  }
  if (!run.lora && !prompt_) {
    PlanSettings s = run;
    s.lora = options_.lora;
    if (const int64_t need = try_settings(s); need >= 0) {
      advice.push_back(fmt::format("--set train.mode=lora (adapters of rank {}) fits ({} GiB)", options_.lora.spec.r,
                                   gib(need)));
    }
  }
  // What the plan's shares say a plugin could do, each with the bound it would bring this machine
  // (device) to, said only where that bound fits: a rank's state as its plan has it, measured
  // against the state of the same stages whole (the plan before any plugin).
  const auto estimate = stage_estimate(config, dtype, run);
  const auto stage_count = static_cast<int64_t>(estimate.size());
  int64_t whole_parameters = 0, whole_trainable = 0;
  for (int64_t s = 0; s < stage_count; ++s) {
    if (!placement_.stages.holds(s, stage_count)) return;  // a pipeline stage's share: the comparison is for whole models
    whole_parameters += estimate[static_cast<size_t>(s)].parameter_bytes;
    whole_trainable += estimate[static_cast<size_t>(s)].trainable_bytes;
  }
  const int64_t state = mine.parameters + mine.gradients + mine.optimizer;
  if (4 * state < mine.total()) return;  // a small share: sharding it would not make the difference
  const bool optimizer_sharded = mine.optimizer < 2 * whole_trainable * 9 / 10;
  const bool gradients_sharded = mine.gradients < whole_trainable * 9 / 10;
  const bool parameters_sharded = mine.parameters < whole_parameters * 9 / 10;
  // This machine's (device's) need with `shrink` taken off each of its ranks (the ranks' plans alike).
  const auto need_without = [&](int64_t shrink) {
    int64_t need = 0;
    for (size_t r = 0; r < memory_.ranks.size(); ++r) {
      if (counted_here(static_cast<int>(r))) need += memory_.ranks[r].total() + memory_.runtime_bytes - shrink;
    }
    return need;
  };
  const auto fits = [&](int64_t need) { return memory_.limit_bytes <= 0 || need <= memory_.limit_bytes; };
  const int64_t world = context_.world;
  if (!optimizer_sharded && !gradients_sharded && !parameters_sharded) {
    if (world == 1 && !memory_.per_device) return;  // a machine's ranks share it: more of them hold the same state
    const int64_t over = std::max<int64_t>(world, 2);
    const int64_t need = need_without(state - state / over);
    if (fits(need)) {
      advice.push_back(fmt::format("every rank holds the whole training state ({} GiB): a plugin that shards it over "
                                   "{} ranks (zero, plugin.stage = 3) would need about {} GiB{}",
                                   gib(state), over, gib(need), world == 1 ? " (one rank per device)" : ""));
    }
    return;
  }
  std::vector<std::string> whole;
  int64_t whole_bytes = 0;
  if (!gradients_sharded && mine.gradients > 0) {
    whole.push_back(fmt::format("the gradients ({} GiB)", gib(mine.gradients)));
    whole_bytes += mine.gradients;
  }
  if (!parameters_sharded) {
    whole.push_back(fmt::format("the parameters ({} GiB)", gib(mine.parameters)));
    whole_bytes += mine.parameters;
  }
  if (!whole.empty() && fits(need_without(whole_bytes - whole_bytes / world))) {
    advice.push_back(fmt::format("{} {} whole on every rank: a plugin setting that shards {} too (zero's plugin.stage = "
                                 "{}) would need about {} GiB",
                                 fmt::join(whole, " and "), whole.size() == 1 ? "is" : "are",
                                 whole.size() == 1 ? "it" : "them",
                                 parameters_sharded ? "2" : gradients_sharded || mine.gradients == 0 ? "3" : "2 or 3",
                                 gib(need_without(whole_bytes - whole_bytes / world))));
  }
  const int64_t sharded = state - whole_bytes;  // at twice the ranks, half of it (one per device, or per machine)
  if (fits(need_without(sharded / 2))) {
    advice.push_back(fmt::format("the sharded state divides over the ranks: at {} ranks {} about {} GiB", 2 * world,
                                 memory_.per_device ? "(one per device)" : "(as many per machine, on more machines)",
                                 gib(need_without(sharded / 2))));
  }
}

}  // namespace weft
