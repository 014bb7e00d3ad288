#include "core/train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "core/model/lora.h"
#include "core/model/parallel.h"
#include "core/plugin/dlpack_view.h"
#include "core/model/weights.h"
#include "core/train/interrupt.h"
#include "core/train/memory.h"
#include "core/train/optimizer.h"
#include "core/util/trace.h"
#include "core/util/error.h"
#include "core/util/torch_compat.h"

namespace weft {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

torch::Dtype compute_dtype(const std::string& precision) {
  if (precision == "bf16") return torch::kBFloat16;
  WEFT_CHECK(precision == "fp32", "train.precision must be fp32 or bf16, got '{}'", precision);
  return torch::kFloat32;
}

}  // namespace

Trainer::Trainer(TrainOptions options, RunContext context)
    : options_(std::move(options)), context_(context) {
  WEFT_CHECK(options_.mode == "full" || options_.mode == "lora",
             "train.mode must be full or lora, got '{}'", options_.mode);
  install_memory_tracker();
  at::set_num_threads(static_cast<int>(options_.threads));
  torch::manual_seed(options_.seed);
  tokenizer_ = load_tokenizer(options_.tokenizer);
  WEFT_CHECK(context_.world == 1 || !options_.plugin.empty(),
             "a run with {} processes needs a strategy plugin (e.g. --plugin ddp)", context_.world);
  if (!options_.plugin.empty()) start_strategy();
  if (!options_.trace_file.empty()) {
    Tracer::instance().enable(Tracer::rank_path(options_.trace_file, context_.rank, context_.world), context_.rank);
  }
  build_model();
  if (options_.inference_only) return;  // trainer generate: no data, optimizer or run directory
  build_data();
  build_optimizer();
  checkpoints_ = std::make_unique<CheckpointStore>(options_.out_dir, options_.keep_last, lora());
  if (context_.rank == 0) checkpoints_->remove_leftovers();
  maybe_resume();
  protect_saved_work();
}

// The whole vocabulary's logits of the last position, on every rank (a vocabulary-parallel
// model sums its shards through the loss-sum communication point).
static torch::Tensor full_vocabulary(LlamaForCausalLMImpl& model, const torch::Tensor& last) {
  if (!model.vocab_parallel()) return last.to(torch::kFloat32);
  WEFT_CHECK(model.options().comm != nullptr && *model.options().comm,
             "the vocabulary is split over ranks but the plugin has no comm_point to combine it");
  auto full = torch::zeros({model.config().vocab_size}, torch::kFloat32);
  full.narrow(0, model.local_shape().vocab_start, model.local_shape().vocab).copy_(last);
  (*model.options().comm)(CommPoint::kLossSum, /*backward=*/false, -1, full);
  return full;
}

// Greedy (temperature 0) or temperature + nucleus (top-p) sampling with `generator`.
static int32_t pick_token(const torch::Tensor& logits, double temperature, double top_p, at::Generator& generator) {
  if (temperature <= 0.0) return static_cast<int32_t>(logits.argmax().item<int64_t>());
  auto probs = (logits / temperature).softmax(0);
  auto [sorted, order] = probs.sort(0, /*descending=*/true);
  auto cumulative = sorted.cumsum(0);
  // Keep the smallest prefix whose mass reaches top_p (at least one token).
  auto keep = (cumulative - sorted) < top_p;
  auto kept = sorted * keep.to(torch::kFloat32);
  const int64_t choice = torch::multinomial(kept / kept.sum(), 1, false, generator).item<int64_t>();
  return static_cast<int32_t>(order[choice].item<int64_t>());
}

GenerateResult Trainer::generate(const std::string& prompt) {
  torch::NoGradGuard no_grad;
  model_->eval();
  std::vector<int32_t> ids;
  if (const auto bos = tokenizer_->bos_id()) ids.push_back(*bos);
  const auto encoded = tokenizer_->encode(prompt);
  ids.insert(ids.end(), encoded.begin(), encoded.end());
  WEFT_CHECK(!ids.empty(), "trainer generate: the prompt encodes to no tokens");
  // The model has positions for max_position_embeddings tokens, prompt included.
  const int64_t positions = model_->config().max_position_embeddings;
  const int64_t prompt_tokens = static_cast<int64_t>(ids.size());
  WEFT_CHECK(prompt_tokens < positions,
             "trainer generate: the prompt is {} tokens, but the model has {} positions "
             "(max_position_embeddings) and needs one more for the first new token",
             prompt_tokens, positions);
  int64_t max_new_tokens = options_.max_new_tokens;
  if (prompt_tokens + max_new_tokens > positions) {
    max_new_tokens = positions - prompt_tokens;
    spdlog::warn("trainer generate: at most {} new tokens after the {}-token prompt: the model has {} positions "
                 "(max_position_embeddings), fewer than generate.max_new_tokens = {} needs",
                 max_new_tokens, prompt_tokens, positions, options_.max_new_tokens);
  }
  const std::optional<int32_t> stop = tokenizer_->eos_id();
  auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.generate_seed);
  std::vector<LayerKvCache> cache;
  GenerateResult result;
  if (strategy_) strategy_->host().take_comm_stats();  // count generation's communication only
  const auto start = Clock::now();
  auto input = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()), torch::kLong).unsqueeze(0);
  for (int64_t n = 0; n < max_new_tokens; ++n) {
    const auto logits = model_->forward_cached(input, cache);
    // Only ids the tokenizer can decode (a model's vocabulary may be padded beyond them).
    const auto last = full_vocabulary(*model_, logits[0][logits.size(1) - 1]).narrow(0, 0, tokenizer_->vocab_size());
    const int32_t next = pick_token(last, options_.temperature, options_.top_p, generator);
    if (n == 0) result.first_token_seconds = seconds_since(start);
    if (stop && next == *stop) break;
    result.tokens.push_back(next);
    input = torch::tensor({static_cast<int64_t>(next)}, torch::kLong).unsqueeze(0);
  }
  result.seconds = seconds_since(start);
  if (strategy_) {
    const auto comm = strategy_->host().take_comm_stats();
    result.comm_operations = comm.operations;
    result.comm_bytes = comm.bytes;
    result.comm_wait_seconds = comm.wait_seconds;
  }
  result.prompt_tokens = static_cast<int64_t>(ids.size());
  result.text = tokenizer_->decode(result.tokens);
  return result;
}

// Starting fresh in a run directory would replace its checkpoints and saved models: refuse
// unless the user resumes or says train.overwrite = true.
void Trainer::protect_saved_work() const {
  if (options_.overwrite || state_.global_step > 0) return;
  for (const char* entry : {"checkpoints/latest", "final", "best"}) {
    const fs::path path = fs::path(options_.out_dir) / entry;
    WEFT_CHECK(!fs::exists(path),
               "train.out_dir '{}' already holds a run ({} exists); resume it with "
               "checkpoint.resume=auto, pick another out_dir, or set train.overwrite=true",
               options_.out_dir, path.string());
  }
}

Trainer::~Trainer() = default;

// Joins the job, loads the plugin and checks that every rank runs the same plugin build with the
// same configuration, before anything is built.
void Trainer::start_strategy() {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options_.collective_timeout_s * 1000));
  communicator_ = join_world(context_.env, timeout);
  strategy_ = std::make_unique<StrategySession>(options_.plugin, options_.plugin_config, *communicator_);
  const auto& library = strategy_->library();
  const std::string fingerprint =
      fmt::format("plugin {} {} ABI {}.{}, config {}", library.name(), library.version(),
                  library.negotiated_abi().major, library.negotiated_abi().minor, options_.config_hash);
  check_same_everywhere(*communicator_, "plugin and config", fingerprint);
  spdlog::info("strategy: {} {} (ABI {}.{}) from {}, {} process(es)", library.name(), library.version(),
               library.negotiated_abi().major, library.negotiated_abi().minor, library.path(), context_.world);
  WEFT_CHECK(context_.world == 1 || strategy_->has_eval_step(),
             "plugin {} has no eval_step, so it cannot evaluate with {} processes", library.name(), context_.world);
}

std::optional<LoraConfig> Trainer::lora() const {
  if (options_.mode == "lora") return options_.lora;
  return std::nullopt;
}

ModelConfig Trainer::resolve_model_config() const { return weft::resolve_model_config(options_, *tokenizer_); }

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

// The plugin's shard of every parameter this rank builds (empty: every tensor whole).
ShardMap Trainer::ask_shards(const ModelConfig& config, int64_t first_stage, int64_t last_stage) {
  ShardMap shards;
  if (!strategy_->has_shard_parameter()) return shards;
  for (const auto& [name, shape] : parameter_specs(config, first_stage, last_stage)) {
    weft_parameter_info info{};
    info.name = name.c_str();
    info.stage = stage_of_parameter(name, config.num_hidden_layers);
    info.trainable = 1;
    info.ndim = static_cast<int32_t>(shape.size());
    info.shape = shape.data();
    info.dtype = DLDataType{kDLFloat, 32, 1};
    const weft_shard shard = strategy_->shard_parameter(info);
    if (shard.parts > 1) shards[name] = ParameterShard{shard.dim, shard.parts, shard.index};
  }
  return shards;
}

void Trainer::build_model() {
  ModelOptions model_options;
  model_options.compute_dtype = compute_dtype(options_.precision);
  model_options.activation_checkpointing = options_.model.activation_checkpointing;
  const ModelConfig config = resolve_model_config();
  if (strategy_) {
    strategy_->host().set_model_info(config, model_options.compute_dtype == torch::kBFloat16, options_.data.seq_len,
                                     options_.batch_size);
    const auto plan = strategy_->plan(config.num_hidden_layers + 2);
    model_options.stages = {plan.first_stage, plan.last_stage};
    data_parallel_rank_ = plan.data_parallel_rank;
    data_parallel_size_ = plan.data_parallel_size;
    model_options.shards = ask_shards(config, plan.first_stage, plan.last_stage);
    if (strategy_->has_comm_point()) {
      StrategySession* session = strategy_.get();
      model_options.comm = std::make_shared<const CommHook>(
          [session](CommPoint point, bool backward, int64_t layer, torch::Tensor& tensor) {
            if (!tensor.is_contiguous()) tensor = tensor.contiguous();
            DLTensor view = dl_view(tensor);
            session->comm_point(static_cast<weft_comm_point>(point), backward ? WEFT_BACKWARD : WEFT_FORWARD, layer,
                                view);
          });
    }
  }
  model_ = LlamaForCausalLM(config, model_options);
  init_weights(*model_, options_.seed, options_.model.init_std);
  if (!options_.model.weights.empty()) load_weights(*model_, options_.model.weights);
  if (auto l = lora()) {
    const int64_t adapted = apply_lora(*model_, *l, options_.seed);
    spdlog::info("LoRA: {} layers adapted (r={}, alpha={})", adapted, l->spec.r, l->spec.alpha);
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
  if (strategy_) {
    strategy_->host().set_model(model_.get());
    strategy_->setup();
    gather_ = std::make_unique<ModelGather>(*model_, *communicator_, lora());
    WEFT_CHECK(!gather_->split() || options_.checkpoint_every == 0,
               "checkpoint.every_steps is not supported yet when plugin {} splits the model over ranks (the best "
               "and final models are saved whole); set it to 0",
               strategy_->library().name());
  }
  spdlog::info("model: {} layers, hidden {}, {} heads ({} kv), vocab {}: {:.2f}M parameters, {:.2f}M trainable, {}, "
               "attention {} (LibTorch {})",
               model_->config().num_hidden_layers, model_->config().hidden_size,
               model_->config().num_attention_heads, model_->config().num_key_value_heads,
               model_->config().vocab_size, total / 1e6, trainable / 1e6, options_.precision,
               attention_kernel_name(model_->config().attention), compat::libtorch_version());
}

void Trainer::build_data() {
  dataset_ = prepare_dataset(options_.data, *tokenizer_);
  spdlog::info("{}", dataset_.summary.describe());
  const int64_t micro = options_.batch_size;
  train_loader_ = std::make_unique<BatchLoader>(dataset_.train, micro, data_parallel_rank_, data_parallel_size_,
                                                options_.seed, /*shuffle=*/true);
  steps_per_epoch_ = train_loader_->batches_per_epoch() / options_.grad_accum_steps;
  WEFT_CHECK(steps_per_epoch_ > 0,
             "the training split has {} batches of {} sequences, fewer than grad_accum_steps = {}",
             train_loader_->batches_per_epoch(), micro, options_.grad_accum_steps);
  total_steps_ = options_.epochs * steps_per_epoch_;
  if (options_.max_steps > 0) total_steps_ = std::min(total_steps_, options_.max_steps);
  WEFT_CHECK(dataset_.heldout || options_.eval_every == 0,
             "eval.every_steps is set but data.heldout_fraction is 0: there is nothing to evaluate");
  state_.data_identity = fmt::format("{} sequences x {} tokens, {} train tokens",
                                     dataset_.train->n_sequences(), dataset_.train->seq_len(),
                                     dataset_.train->n_tokens());
}

void Trainer::build_optimizer() {
  optimizer_ = make_adamw(trainable_parameters(*model_), options_.optim);
  schedule_.peak_lr = options_.optim.lr;
  schedule_.min_lr_ratio = options_.optim.min_lr_ratio;
  schedule_.warmup_steps = options_.optim.warmup_steps;
  schedule_.total_steps = total_steps_;
  schedule_.kind = options_.optim.schedule;
}

void Trainer::maybe_resume() {
  if (options_.resume.empty()) return;
  std::string dir = options_.resume;
  if (dir == "auto") {
    const auto latest = checkpoints_->latest();
    if (!latest) {
      spdlog::info("checkpoint.resume = auto: no checkpoint in {}, starting fresh", checkpoints_->checkpoints_dir());
      return;
    }
    dir = *latest;
  }
  WEFT_CHECK(!gather_ || !gather_->split(),
             "checkpoint.resume: plugin {} splits the model over ranks and cannot resume a checkpoint yet ({}); "
             "resume it under single or ddp, or start fresh",
             strategy_->library().name(), dir);
  TrainerState saved = checkpoints_->read_state(dir);
  WEFT_CHECK(saved.data_identity == state_.data_identity,
             "checkpoint '{}' was made on different data ({}), but this run has {}", dir, saved.data_identity,
             state_.data_identity);
  saved.validate(steps_per_epoch_, options_.epochs, dir + "/trainer_state.json");
  checkpoints_->restore(dir, *model_, *optimizer_);
  state_ = saved;
  spdlog::info("resumed from {} at step {} (epoch {}, step {} of {})", dir, state_.global_step,
               state_.epoch + 1, state_.step_in_epoch, steps_per_epoch_);
}

double Trainer::train_step(int64_t epoch, int64_t step_in_epoch) {
  model_->train();
  last_lr_ = schedule_.at(state_.global_step);
  set_learning_rate(*optimizer_, last_lr_);
  const int64_t accum = options_.grad_accum_steps;
  double loss_sum = 0.0;
  if (strategy_) {
    weft_step_info info{};
    info.struct_size = sizeof(weft_step_info);
    info.step = state_.global_step;
    info.epoch = epoch;
    info.micro_batches = static_cast<int32_t>(accum);
    info.rows_per_micro_batch = train_loader_->local_batch();
    info.seq_len = options_.data.seq_len;
    strategy_->host().begin_train_step(train_loader_.get(), epoch, step_in_epoch, info.micro_batches);
    loss_sum = strategy_->train_step(info);
    strategy_->host().end_step();
  }
  for (int64_t micro = 0; micro < (strategy_ ? 0 : accum); ++micro) {
    const Batch batch = train_loader_->batch(epoch, step_in_epoch * accum + micro);
    auto loss = cross_entropy(model_->forward(batch.inputs), batch.targets) / static_cast<double>(accum);
    loss.backward();
    loss_sum += loss.item<double>();
  }
  std::function<double(double)> globalize;
  if (strategy_) globalize = [this](double local_sq) { return strategy_->global_grad_norm_sq(local_sq); };
  last_grad_norm_ = clip_grad_norm(trainable_, options_.optim.grad_clip, globalize);
  optimizer_->step();
  zero_gradients(trainable_);
  return loss_sum;
}

EvalResult Trainer::evaluate() {
  WEFT_CHECK(dataset_.heldout != nullptr, "no held-out split (data.heldout_fraction = 0)");
  TraceSpan span("eval", "evaluation");
  const auto start = Clock::now();
  const int64_t batch = options_.eval_batch_size > 0 ? options_.eval_batch_size : options_.batch_size;
  EvalLoader loader(dataset_.heldout, batch, data_parallel_rank_, data_parallel_size_);
  int64_t batches = loader.num_batches();
  if (options_.eval_max_batches > 0) batches = std::min(batches, options_.eval_max_batches);
  model_->eval();
  torch::NoGradGuard no_grad;
  double loss_sum = 0.0;
  int64_t tokens = 0;
  for (int64_t i = 0; i < batches; ++i) {
    if (strategy_ && strategy_->has_eval_step()) {
      weft_step_info info{};
      info.struct_size = sizeof(weft_step_info);
      info.step = state_.global_step;
      info.epoch = state_.epoch;
      info.micro_batches = 1;
      info.seq_len = options_.data.seq_len;
      strategy_->host().begin_eval_step(&loader, i);
      const auto [sum, count] = strategy_->eval_step(info);
      strategy_->host().end_step();
      loss_sum += sum;
      tokens += count;
      continue;
    }
    const Batch b = loader.batch(i);
    if (b.rows() == 0) continue;
    loss_sum += cross_entropy_sum(model_->forward(b.inputs), b.targets).item<double>();
    tokens += b.target_tokens();
  }
  model_->train();
  EvalResult result;
  result.tokens = tokens;
  result.loss = tokens > 0 ? loss_sum / tokens : 0.0;
  result.perplexity = std::exp(result.loss);
  result.seconds = seconds_since(start);
  return result;
}

bool Trainer::after_eval(const EvalResult& eval, Progress& progress, MetricsWriter& metrics) {
  const bool improved = eval.loss < state_.best_eval_loss;
  if (improved) {
    state_.best_eval_loss = eval.loss;
    state_.best_step = state_.global_step;
    state_.evals_since_best = 0;
    if (options_.keep_best) {
      if (auto* whole = model_to_save()) {
        save_model_atomically(*whole, lora(), options_.out_dir + "/best", options_.model.weights);
      }
    }
  } else {
    ++state_.evals_since_best;
  }
  metrics.write("eval", {{"step", state_.global_step}, {"epoch", state_.epoch + 1}, {"loss", eval.loss},
                         {"perplexity", eval.perplexity}, {"tokens", eval.tokens}, {"seconds", eval.seconds},
                         {"best", improved}});
  progress.message(fmt::format("eval @ step {}: held-out loss {:.4f}, perplexity {:.2f}{}", state_.global_step,
                               eval.loss, eval.perplexity, improved ? " (best)" : ""));
  if (options_.patience > 0 && state_.evals_since_best >= options_.patience) {
    progress.message(fmt::format("early stopping: no improvement in {} evaluations (best {:.4f} at step {})",
                                 state_.evals_since_best, state_.best_eval_loss, state_.best_step));
    state_.early_stopped = true;
    return true;
  }
  return false;
}

LlamaForCausalLMImpl* Trainer::model_to_save() {
  if (gather_) return gather_->gather();
  return context_.rank == 0 ? model_.get() : nullptr;
}

bool Trainer::save_checkpoint(Progress& progress) {
  if (gather_ && gather_->split()) {
    progress.message(fmt::format("no checkpoint: plugin {} splits the model and its optimizer state over ranks, "
                                 "which cannot be saved as a checkpoint yet",
                                 strategy_->library().name()));
    return false;
  }
  if (context_.rank != 0) return true;  // replicas hold the same state; rank 0 writes it
  const auto dir = checkpoints_->save(state_, *model_, *optimizer_);
  progress.message(fmt::format("checkpoint saved: {}", dir));
  return true;
}

// What one call of run() accumulates.
struct Trainer::Session {
  Session(const std::string& metrics_file, bool resumed, const std::string& progress_mode, int64_t log_every)
      : metrics(metrics_file, /*append=*/resumed), progress(progress_mode, log_every) {}
  MetricsWriter metrics;
  Progress progress;
  TrainResult result;
  double seconds = 0.0;
  int64_t tokens = 0;
  int64_t tokens_per_step = 0;
  std::map<std::string, std::pair<double, int64_t>> plugin_metric_sums;  // name -> (sum, steps)
  double activation_peak_mib = 0.0;  // most tensor memory a step added on this rank (MiB)
  double comm_wait_seconds = 0.0;  // this rank's time blocked on the plugin's communication
  int64_t comm_bytes = 0;
  int64_t last_eval_step = -1;
  std::optional<EvalResult> last_eval;
};

TrainResult Trainer::run() {
  install_interrupt_handlers();
  Session session(context_.rank == 0 ? options_.metrics_file : "", state_.global_step > 0,
                  context_.rank == 0 ? options_.progress : "off", options_.log_every);
  session.tokens_per_step = options_.batch_size * options_.grad_accum_steps * options_.data.seq_len;
  spdlog::info("training: {} epochs x {} steps (total {}), {} tokens per step, lr {:.2e}, {}",
               options_.epochs, steps_per_epoch_, total_steps_, session.tokens_per_step,
               options_.optim.lr, options_.mode == "lora" ? "LoRA" : "full fine-tuning");
  bool stop = state_.early_stopped || state_.global_step >= total_steps_;
  while (!stop && state_.epoch < options_.epochs) {
    stop = run_epoch_steps(session);
    if (state_.step_in_epoch < steps_per_epoch_) break;  // max_steps, early stop or interrupt
    stop = complete_epoch(session) || stop;
  }
  if (interrupt_ != 0) {
    const bool saved = save_checkpoint(session.progress);
    session.progress.message(fmt::format("interrupted by signal {} at step {}: {}", interrupt_,
                                         state_.global_step,
                                         saved ? "checkpoint saved; continue with checkpoint.resume=auto"
                                               : "no checkpoint was saved, this run cannot be continued"));
    session.result.interrupted = true;
    session.result.interrupt_signal = interrupt_;
  }
  return finish_run(session);
}

// SIGINT/SIGTERM may reach the ranks of a job at different steps: they agree after each step
// (the largest signal number any rank has), so that all stop after the same one.
int Trainer::agreed_interrupt() {
  int signal = interrupt_signal();
  if (communicator_ && context_.world > 1) {
    for (double value : communicator_->all_gather(static_cast<double>(signal))) {
      signal = std::max(signal, static_cast<int>(value));
    }
  }
  interrupt_ = signal;
  return signal;
}

bool Trainer::run_epoch_steps(Session& session) {
  const int64_t epoch_steps =
      std::min(steps_per_epoch_, state_.step_in_epoch + (total_steps_ - state_.global_step));
  session.progress.start_epoch(state_.epoch, options_.epochs, epoch_steps, state_.step_in_epoch);
  bool stop = false;
  while (!stop && state_.step_in_epoch < steps_per_epoch_ && state_.global_step < total_steps_) {
    if (strategy_) {  // not the evaluation's or set-up's
      strategy_->host().take_comm_stats();
      strategy_->host().take_step_metrics();
    }
    const int64_t bytes_before = tensor_bytes_live();
    reset_tensor_peak();
    const auto step_start = Clock::now();
    double loss = 0.0;
    {
      TraceSpan span("step", fmt::format("step {}", state_.global_step + 1));
      loss = train_step(state_.epoch, state_.step_in_epoch);
    }
    const double step_seconds = seconds_since(step_start);
    const double activation_mib = static_cast<double>(tensor_bytes_peak() - bytes_before) / (1024.0 * 1024.0);
    session.activation_peak_mib = std::max(session.activation_peak_mib, activation_mib);
    const auto comm = strategy_ ? strategy_->host().take_comm_stats() : PluginHost::CommStats{};
    session.comm_wait_seconds += comm.wait_seconds;
    session.comm_bytes += comm.bytes;
    ++state_.global_step;
    ++state_.step_in_epoch;
    state_.epoch_seconds += step_seconds;
    state_.epoch_tokens += session.tokens_per_step;
    session.seconds += step_seconds;
    session.tokens += session.tokens_per_step;
    session.result.step_losses.push_back(loss);
    const double tokens_per_s = session.tokens_per_step / step_seconds;
    nlohmann::json record = {{"step", state_.global_step}, {"epoch", state_.epoch + 1},
                             {"loss", loss}, {"lr", last_lr_}, {"grad_norm", last_grad_norm_},
                             {"tokens_per_s", tokens_per_s}, {"step_time_s", step_seconds},
                             {"activation_peak_mib", activation_mib}};
    if (strategy_) {
      record["comm_wait_s"] = comm.wait_seconds;
      record["comm_bytes"] = comm.bytes;
      for (const auto& [name, value] : strategy_->host().take_step_metrics()) {
        record["plugin." + name] = value;
        auto& sum = session.plugin_metric_sums[name];
        sum.first += value;
        sum.second += 1;
      }
    }
    session.metrics.write("step", record);
    session.progress.update(state_.step_in_epoch - 1, loss, last_lr_, tokens_per_s);
    WEFT_CHECK(std::isfinite(loss), "loss became {} at step {}; lower train.lr or check the data",
               loss, state_.global_step);
    if (options_.eval_every > 0 && state_.global_step % options_.eval_every == 0) {
      stop = evaluate_and_track(session);
    }
    if (options_.checkpoint_every > 0 && state_.global_step % options_.checkpoint_every == 0) {
      save_checkpoint(session.progress);
    }
    stop = stop || agreed_interrupt() != 0;
  }
  session.progress.finish_epoch();
  return stop;
}

bool Trainer::complete_epoch(Session& session) {
  nlohmann::json record = {{"epoch", state_.epoch + 1}, {"step", state_.global_step},
                           {"time_s", state_.epoch_seconds},
                           {"tokens_per_s", state_.epoch_tokens / std::max(state_.epoch_seconds, 1e-9)}};
  std::string eval_text;
  bool stop = false;
  if (dataset_.heldout) {
    stop = evaluate_and_track(session);
    record["eval_loss"] = session.last_eval->loss;
    record["perplexity"] = session.last_eval->perplexity;
    eval_text = fmt::format(", held-out loss {:.4f}, perplexity {:.2f}", session.last_eval->loss,
                            session.last_eval->perplexity);
  }
  session.metrics.write("epoch", record);
  session.progress.message(fmt::format("epoch {}/{} done in {}{}", state_.epoch + 1, options_.epochs,
                                       format_duration(state_.epoch_seconds), eval_text));
  session.result.epoch_seconds.push_back(state_.epoch_seconds);
  ++state_.epoch;
  state_.step_in_epoch = 0;
  state_.epoch_seconds = 0;
  state_.epoch_tokens = 0;
  if (options_.checkpoint_every > 0 || stop) save_checkpoint(session.progress);
  return stop;
}

// Evaluates (once per optimizer step: an epoch end that coincides with eval.every_steps reuses
// that evaluation), tracks the best model and early stopping. Returns true to stop.
bool Trainer::evaluate_and_track(Session& session) {
  if (session.last_eval_step == state_.global_step) return state_.early_stopped;
  session.last_eval = evaluate();
  session.last_eval_step = state_.global_step;
  return after_eval(*session.last_eval, session.progress, session.metrics);
}

TrainResult Trainer::finish_run(Session& session) {
  TrainResult& result = session.result;
  if (dataset_.heldout && !result.step_losses.empty()) evaluate_and_track(session);
  result.final_eval = session.last_eval;
  if (options_.save_final && !result.interrupted) {
    if (auto* whole = model_to_save()) {
      save_model_atomically(*whole, lora(), options_.out_dir + "/final", options_.model.weights);
      if (lora() && options_.save_merged) {
        merge_lora(*whole);
        save_model_atomically(*whole, std::nullopt, options_.out_dir + "/final-merged", options_.model.weights);
      }
    }
  }
  result.steps = state_.global_step;
  result.epochs_completed = state_.epoch;
  result.tokens_per_second = session.seconds > 0 ? session.tokens / session.seconds : 0.0;
  result.best_eval_loss = state_.best_eval_loss;
  result.early_stopped = state_.early_stopped;
  result.peak_rss_mib = peak_rss_mib();
  nlohmann::json summary = {{"steps", result.steps}, {"epochs", result.epochs_completed},
                            {"steps_per_epoch", steps_per_epoch_},
                            {"epoch_seconds", result.epoch_seconds},
                            {"tokens_per_s", result.tokens_per_second},
                            {"peak_rss_mib", result.peak_rss_mib},
                            {"early_stopped", result.early_stopped},
                            {"interrupted", result.interrupted},
                            {"libtorch", compat::libtorch_version()},
                            {"attention", attention_kernel_name(model_->config().attention)}};
  if (strategy_ && session.seconds > 0) {
    const double steps = static_cast<double>(std::max<size_t>(result.step_losses.size(), 1));
    summary["comm_wait_fraction"] = session.comm_wait_seconds / session.seconds;
    summary["comm_bytes_per_step"] = static_cast<double>(session.comm_bytes) / steps;
    spdlog::info("communication: waiting {:.1f}% of step time ({:.3f} s per step), {:.2f} MB per step (rank {})",
                 100.0 * session.comm_wait_seconds / session.seconds, session.comm_wait_seconds / steps,
                 session.comm_bytes / steps / 1e6, context_.rank);
  }
  summary["activation_peak_mib"] = session.activation_peak_mib;
  if (communicator_) {
    summary["peak_rss_mib_per_rank"] = communicator_->all_gather(result.peak_rss_mib);  // collective
    const auto per_rank = communicator_->all_gather(session.activation_peak_mib);  // collective
    summary["activation_peak_mib_per_rank"] = per_rank;
    std::string text;
    for (double mib : per_rank) text += fmt::format("{}{:.1f}", text.empty() ? "" : ", ", mib);
    spdlog::info("step activation memory (peak tensor MiB above the step's start) per rank: {}", text);
  }
  std::string plugin_text;
  for (const auto& [name, sum] : session.plugin_metric_sums) {
    const double mean = sum.first / static_cast<double>(std::max<int64_t>(sum.second, 1));
    summary["plugin." + name] = mean;
    plugin_text += fmt::format("{}{} {:.4g}", plugin_text.empty() ? "" : ", ", name, mean);
  }
  if (!plugin_text.empty()) spdlog::info("plugin metrics (mean over steps): {}", plugin_text);
  if (const std::string trace = Tracer::instance().write(); !trace.empty()) {
    spdlog::info("trace written to {}", trace);
  }
  if (result.final_eval) {
    summary["eval_loss"] = result.final_eval->loss;
    summary["perplexity"] = result.final_eval->perplexity;
  }
  session.metrics.write("summary", summary);
  return result;
}

}  // namespace weft
