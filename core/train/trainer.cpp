#include "core/train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "core/model/lora.h"
#include "core/train/classification_eval.h"
#include "core/train/interrupt.h"
#include "core/train/optimizer.h"
#include "core/train/sharded_state.h"
#include "core/train/flops.h"
#include "core/util/device.h"
#include "core/util/error.h"
#include "core/util/memory.h"
#include "core/util/trace.h"

namespace weft {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

Trainer::Trainer(TrainOptions options, RunContext context)
    : options_(options), scaler_(/*enabled=*/options.precision == "fp16", LossScalerOptions{options.loss_scale}) {
  WEFT_CHECK(options_.model.adapter.empty() || options_.mode == "lora" || options_.mode == "prompt_tuning",
             "model.adapter loads adapters, which train further with train.mode = \"lora\" (LoRA's) or "
             "\"prompt_tuning\" (a prompt's); it is \"{}\"",
             options_.mode);
  WEFT_CHECK(parse_quant_format(options_.model.quantize) == QuantFormat::kNone || options_.mode != "full",
             "model.quantize = \"{}\" stores the base weights frozen: training needs adapters (train.mode = \"lora\" "
             "or \"adalora\"), not train.mode = \"{}\"",
             options_.model.quantize, options_.mode);
  WEFT_CHECK(options_.model.frozen_dtype == "fp32" || options_.mode != "full",
             "model.frozen_dtype = \"{}\" stores the frozen base weights of adapter training (train.mode = \"lora\" "
             "or \"adalora\"); train.mode = \"full\" trains them in fp32",
             options_.model.frozen_dtype);
  job_ = std::make_unique<Job>(std::move(options), context, Job::Data::kSplits);
  WEFT_CHECK(options_.model.adapter.empty() || (options_.mode == "prompt_tuning") == job_->prompt_tuning().has_value(),
             "model.adapter '{}' is {} adapter, and train.mode = \"{}\"", options_.model.adapter,
             job_->prompt_tuning() ? "a prompt-tuning" : "a LoRA", options_.mode);
  WEFT_CHECK(options_.model.adapter.empty() || !job_->lora() || !job_->lora()->adalora,
             "model.adapter '{}' is an AdaLoRA adapter: continuing one in training is not supported yet (trainer eval "
             "and generate take it; train.mode = \"adalora\" starts new adapters)",
             options_.model.adapter);
  const auto& data = job_->data();
  const Placement& place = job_->placement();
  gather_ = std::make_unique<ModelGather>(job_->model(), job_->communicator(), job_->lora());
  WEFT_CHECK(!(options_.save_merged && job_->quantize() != QuantFormat::kNone && gather_->split()),
             "lora.save_merged with model.quantize = \"{}\" merges the adapters into the dequantized base on one "
             "process, but {} splits the model over the ranks; save the adapters (lora.save_merged = false) and merge "
             "them under single or ddp, where the whole model is on each process",
             quant_format_name(job_->quantize()), job_->strategy().names());
  train_loader_ = std::make_unique<BatchLoader>(data.train, options_.batch_size, place.data_parallel_rank,
                                                place.data_parallel_size, options_.seed, /*shuffle=*/true);
  steps_per_epoch_ = train_loader_->batches_per_epoch() / options_.grad_accum_steps;
  WEFT_CHECK(steps_per_epoch_ > 0, "the training split has {} batches of {} sequences, fewer than grad_accum_steps = {}",
             train_loader_->batches_per_epoch(), options_.batch_size, options_.grad_accum_steps);
  total_steps_ = options_.epochs * steps_per_epoch_;
  if (options_.max_steps > 0) total_steps_ = std::min(total_steps_, options_.max_steps);
  WEFT_CHECK(data.heldout || options_.eval_every == 0,
             "eval.every_steps is set but data.heldout_fraction is 0: there is nothing to evaluate");
  WEFT_CHECK(data.heldout || !options_.eval_on_start,
             "eval.on_start is set but data.heldout_fraction is 0: there is nothing to evaluate");
  state_.data_identity = fmt::format("{} sequences x {} tokens, {} train tokens", data.train->n_sequences(),
                                     data.train->seq_len(), data.train->n_tokens());
  for (const auto& t : job_->strategy().training_tensors()) optimized_.push_back({t.tensor, t.matrix});
  optimizer_ = make_adamw(optimized_, options_.optim);
  schedule_.peak_lr = options_.optim.lr;
  schedule_.min_lr_ratio = options_.optim.min_lr_ratio;
  schedule_.warmup_steps = options_.optim.warmup_steps;
  schedule_.total_steps = total_steps_;
  schedule_.kind = options_.optim.schedule;
  checkpoints_ = std::make_unique<CheckpointStore>(options_.out_dir, options_.keep_last, job_->lora());
  if (job_->lora() && job_->lora()->adalora) {
    // One budget over the whole model's adapters, from their gradients: every rank needs every
    // layer's scores. Tensor-parallel slices sum theirs over the slices (the model's adapter-sum point);
    // pipeline stages and sharded gradients are not supported.
    WEFT_CHECK(!gather_->staged() && !job_->strategy().shards_training_state(),
               "train.mode = \"adalora\" allocates one rank budget over the whole model's adapters from their "
               "gradients, but {} splits the model into pipeline stages or its training state over the ranks; use "
               "single, ddp, tensor_parallel or context_parallel",
               job_->strategy().names());
    AdaLoraConfig adalora = *job_->lora()->adalora;
    if (adalora.total_step == 0) adalora.total_step = total_steps_;
    allocator_ = std::make_unique<RankAllocator>(job_->model(), adalora);
    checkpoints_->add_state_file(
        "adalora_state.safetensors", [this] { return allocator_->state(); },
        [this](const NamedTensors& state) { allocator_->load_state(state); }, &RankAllocator::state_parameter);
  }
  if (job_->strategy().keeps_plugin_state()) {
    // The plugin's own state (ABI 2's weft_state_tensor), whole and alike on every rank, under names
    // "plugin.<its name>" (checkpoints in pieces mix them with the parameters'). A checkpoint
    // without it (another plugin's) restores none: the plugin starts its state afresh.
    static const std::string prefix = "plugin.";
    checkpoints_->add_state_file(
        "plugin_state.safetensors",
        [this] {
          NamedTensors state;
          for (const auto& [name, tensor] : job_->strategy().plugin_state()) state.emplace_back(prefix + name, tensor);
          return state;
        },
        [this](const NamedTensors& saved) {
          NamedTensors state;
          for (const auto& [name, tensor] : saved) {
            if (name.rfind(prefix, 0) == 0) state.emplace_back(name.substr(prefix.size()), tensor);
          }
          job_->strategy().restore_plugin_state(state);
        },
        [](const std::string& name) {
          return name.rfind(prefix, 0) == 0 ? std::optional<std::string>("") : std::nullopt;
        },
        /*optional=*/true);
  }
  if (job_->context().rank == 0) {
    checkpoints_->remove_leftovers();
    if (!options_.backup.url.empty()) backup_ = std::make_unique<CheckpointBackup>(options_.backup, options_.keep_last);
  }
  maybe_resume();
  materialize_adamw_state(*optimizer_);  // what a resumed checkpoint did not bring: zeros, step 0
  protect_saved_work();
}

Trainer::~Trainer() = default;

// Starting fresh in a run directory would replace its checkpoints and saved models: refuse
// unless the user resumes or says train.overwrite = true. checkpoint.resume = auto with no
// checkpoint to resume continues a run that stopped before its first checkpoint (a crash, a kill):
// only the best model of that attempt is there, and this run replaces it; a finished run (final/)
// is still refused.
void Trainer::protect_saved_work() const {
  if (options_.overwrite || state_.global_step > 0) return;
  const bool restart = options_.resume == "auto";
  for (const char* entry : {"checkpoints/latest", "final", "best"}) {
    const fs::path path = fs::path(options_.out_dir) / entry;
    if (restart && std::string(entry) == "best" && fs::exists(path)) {
      if (job_->context().rank == 0) {
        spdlog::warn("checkpoint.resume = auto: {} holds the best model of a run that stopped before its first "
                     "checkpoint; this run starts it again and replaces that model",
                     options_.out_dir);
      }
      continue;
    }
    if (!fs::exists(path)) continue;
    // The advice follows from what is there: a checkpoint resumes; a finished run without one does not.
    const bool resumable = fs::exists(fs::path(options_.out_dir) / "checkpoints/latest");
    const std::string finished = fs::exists(fs::path(options_.out_dir) / "final")
                                     ? fmt::format("to train its final model further, start a new run from it "
                                                   "(model.weights={}/final, another out_dir); ",
                                                   options_.out_dir)
                                     : "";
    fail("train.out_dir '{}' already holds a run ({} exists); {}{}pick another out_dir, or set train.overwrite=true",
         options_.out_dir, path.string(),
         resumable ? (restart ? "" : "resume it with checkpoint.resume=auto, ")
                   : (restart ? "it has no checkpoint to resume (it finished, or stopped before its first): " : ""),
         finished);
  }
}

// checkpoint.resume = auto on an out_dir without checkpoints (a new machine): rank 0 downloads the
// newest complete checkpoint from the bucket, then every rank opens it. Collective.
std::optional<std::string> Trainer::restore_from_backup() {
  std::string error;
  if (backup_) {
    try {
      backup_->restore_latest(checkpoints_->checkpoints_dir());
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  bool ok = true;
  for (double value : job_->communicator().all_gather(error.empty() ? 1.0 : 0.0)) ok = ok && value > 0;  // and a barrier
  if (!error.empty()) throw Error(error);
  WEFT_CHECK(ok, "checkpoint.resume = auto: rank 0 could not restore the checkpoint from {}", options_.backup.url);
  return checkpoints_->latest();
}

void Trainer::maybe_resume() {
  if (options_.resume.empty()) return;
  std::string dir = options_.resume;
  if (dir == "auto") {
    auto latest = checkpoints_->latest();
    if (!latest && !options_.backup.url.empty()) latest = restore_from_backup();
    if (!latest) {
      spdlog::info("checkpoint.resume = auto: no checkpoint in {}, starting fresh", checkpoints_->checkpoints_dir());
      return;
    }
    dir = *latest;
  }
  TrainerState saved = checkpoints_->read_state(dir);
  WEFT_CHECK(saved.data_identity == state_.data_identity,
             "checkpoint '{}' was made on different data ({}), but this run has {}", dir, saved.data_identity,
             state_.data_identity);
  saved.validate(steps_per_epoch_, options_.epochs, dir + "/trainer_state.json");
  if (job_->strategy().shards_training_state()) {  // the whole state, sliced into this rank's shards
    auto whole = make_adamw(trainable_parameters(job_->model()), options_.optim);
    checkpoints_->restore(dir, job_->model(), *whole, job_->context().rank, job_->context().world);
    scatter_into_shards(*whole, *optimizer_, job_->strategy().trainable_shards());
  } else {
    checkpoints_->restore(dir, job_->model(), *optimizer_, job_->context().rank, job_->context().world);
  }
  // Parameters each rank holds as its own (LOCAL placements): this rank's, where the checkpoint kept
  // every rank's; else rank 0's, said once.
  const std::string why = checkpoints_->restore_local(dir, job_->model(), *optimizer_, job_->strategy().local_parameters(),
                                                      job_->context().rank, job_->context().world);
  if (!why.empty() && job_->context().rank == 0) {
    spdlog::warn("{} places {} parameters LOCAL (each rank's own), but {}: every rank resumes them from rank 0's",
                 job_->strategy().names(), job_->strategy().local_parameters().size(), why);
  }
  state_ = saved;
  if (scaler_.enabled() && state_.loss_scale > 0) scaler_.restore(state_.loss_scale, state_.loss_scale_streak);
  spdlog::info("resumed from {} at step {} (epoch {}, step {} of {})", dir, state_.global_step, state_.epoch + 1,
               state_.step_in_epoch, steps_per_epoch_);
}

TrainResult Trainer::run() {
  install_interrupt_handlers();
  const bool rank0 = job_->context().rank == 0;
  RunRecords records(rank0 ? options_.metrics_file : "", state_.global_step > 0, rank0 ? options_.progress : "off",
                     options_.log_every, options_.batch_size * options_.grad_accum_steps * options_.data.seq_len,
                     run_setting());
  if (rank0) {
    link_ = LinkCounter::for_job(job_->context().env);
    if (link_) spdlog::info("bytes on this node's link counted per step on {}", fmt::join(link_->interfaces(), ", "));
  }
  spdlog::info("training: {} epochs x {} steps (total {}), {} tokens per step, lr {:.2e}, {}", options_.epochs,
               steps_per_epoch_, total_steps_, records.tokens_per_step(), options_.optim.lr,
               options_.mode == "lora" ? "LoRA" : options_.mode == "adalora" ? "AdaLoRA" : options_.mode == "prompt_tuning" ? "prompt tuning" : "full fine-tuning");
  bool stop = state_.early_stopped || state_.global_step >= total_steps_;
  // The starting model's held-out loss (a pretrained checkpoint's, before any update): step 0.
  if (options_.eval_on_start && state_.global_step == 0 && job_->data().heldout && !stop) {
    stop = evaluate_and_track(records);
  }
  while (!stop && state_.epoch < options_.epochs) {
    stop = run_epoch_steps(records);
    if (state_.step_in_epoch < steps_per_epoch_) break;  // max_steps, early stop or interrupt
    stop = complete_epoch(records) || stop;
  }
  TrainResult& result = records.result();
  if (interrupt_ != 0) {
    const bool saved = save_checkpoint(records.progress());
    records.progress().message(fmt::format("interrupted by signal {} at step {}: {}", interrupt_, state_.global_step,
                                           saved ? "checkpoint saved; continue with checkpoint.resume=auto"
                                                 : "no checkpoint was saved, this run cannot be continued"));
    result.interrupted = true;
    result.interrupt_signal = interrupt_;
  }
  if (job_->data().heldout && !result.step_losses.empty()) evaluate_and_track(records);
  result.final_eval = last_eval_;
  if (allocator_) {
    result.adalora_ranks = allocator_->ranks();
    int64_t kept = 0;
    std::string ranks;
    for (const auto& [name, rank] : result.adalora_ranks) {
      kept += rank;
      ranks += fmt::format("{}{} {}", ranks.empty() ? "" : ", ", name, rank);
    }
    spdlog::info("AdaLoRA: {} of {} triplets kept (target {}); ranks: {}", kept, allocator_->initial_budget(),
                 allocator_->target_budget(), ranks);
  }
  if (options_.save_final && !result.interrupted) save_models(records);
  if (backup_) result.backup_failures = backup_->drain() ? 0 : backup_->failed();  // the last upload finishes
  result.steps = state_.global_step;
  result.epochs_completed = state_.epoch;
  result.best_eval_loss = state_.best_eval_loss;
  result.early_stopped = state_.early_stopped;
  tensor_peak_bytes_ = std::max(tensor_peak_bytes_, tensor_bytes_peak());
  result.chunked_loss = job_->strategy().chunked_loss();
  {  // what the training state holds between steps, as stored (whole or sharded)
    constexpr double kMiB = 1024.0 * 1024.0;
    const auto [parameters, gradients] = job_->strategy().parameter_and_gradient_bytes();
    result.state_parameters_mib = static_cast<double>(parameters) / kMiB;
    result.state_gradients_mib = static_cast<double>(gradients) / kMiB;
    result.state_optimizer_mib = static_cast<double>(optimizer_state_bytes(*optimizer_)) / kMiB;
  }
  return records.finish(job_->communicator(), job_->context().rank, steps_per_epoch_, scaler_.skipped_steps(),
                        static_cast<double>(tensor_peak_bytes_) / (1024.0 * 1024.0));
}

RunSetting Trainer::run_setting() {
  RunSetting setting;
  const ModelConfig& config = job_->model().config();
  setting.device = job_->device().str();
  setting.device_name = device_name(job_->device());
  setting.precision = options_.precision;
  setting.world = job_->context().world;
  int64_t adapters = -1;
  if (job_->lora() || job_->prompt_tuning()) {  // the whole model's adapters (or prompt): this rank's, summed over the ranks that hold different ones
    adapters = 0;
    for (const auto& p : job_->trainable()) adapters += p.numel();
    const auto counts = job_->communicator().all_gather(static_cast<double>(adapters));  // collective
    adapters = 0;
    for (double c : counts) adapters += static_cast<int64_t>(c);
    adapters /= std::max(job_->placement().data_parallel_size, 1);  // data-parallel copies hold the same
  }
  setting.flops_per_token = training_flops_per_token(config, job_->model_seq_len(), adapters);
  setting.model_weights = job_->weights_source();
  setting.layers = config.num_hidden_layers;
  setting.hidden = config.hidden_size;
  setting.heads = config.num_attention_heads;
  setting.kv_heads = config.num_key_value_heads;
  setting.vocab = config.vocab_size;
  setting.parameters = config.parameter_count();
  setting.trainable = adapters;
  setting.peak_tflops = peak_tflops(setting.device_name, options_.precision, options_.peak_tflops).value_or(0.0);
  const auto& plans = job_->memory().ranks;
  if (static_cast<size_t>(job_->context().rank) < plans.size()) {
    setting.memory_plan_mib = static_cast<double>(plans[static_cast<size_t>(job_->context().rank)].total()) / (1024.0 * 1024.0);
  }
  return setting;
}

void Trainer::save_models(RunRecords&) {
  with_whole_model([&](LlamaForCausalLMImpl& whole) {
    save_model_atomically(whole, job_->lora(), options_.out_dir + "/final", options_.model.weights);
    if (job_->lora() && options_.save_merged) {
      if (job_->quantize() != QuantFormat::kNone) {
        spdlog::info("final-merged: the adapters merged into the base weights dequantized from {} (the quantized "
                     "values, not the original full-precision weights)",
                     quant_format_name(job_->quantize()));
      }
      merge_lora(whole);
      save_model_atomically(whole, std::nullopt, options_.out_dir + "/final-merged", options_.model.weights);
    }
  });
}

std::map<std::string, torch::Tensor> Trainer::whole_parameters() {
  std::map<std::string, torch::Tensor> copies;
  with_whole_model([&](LlamaForCausalLMImpl& whole) {
    for (auto& item : whole.named_parameters()) {
      copies[item.key()] = item.value().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
    }
  });
  return copies;
}

// The whole model on rank 0: gathered from the ranks a plugin splits it over, and made whole first
// where the plugin releases parameters between steps (FLAT_SHARD parameters); back to the plugin's layout after.
void Trainer::with_whole_model(const std::function<void(LlamaForCausalLMImpl&)>& use) {
  auto& strategy = job_->strategy();
  strategy.materialize_parameters(true);
  if (auto* whole = gather_->gather()) use(*whole);
  strategy.materialize_parameters(false);
}

// SIGINT/SIGTERM may reach the ranks of a job at different steps: they agree after each step
// (the largest signal number any rank has), so that all stop after the same one.
int Trainer::agreed_interrupt() {
  int signal = interrupt_signal();
  if (job_->context().world > 1) {
    for (double value : job_->communicator().all_gather(static_cast<double>(signal))) {
      signal = std::max(signal, static_cast<int>(value));
    }
  }
  interrupt_ = signal;
  return signal;
}

StepReport Trainer::train_step(int64_t epoch, int64_t step_in_epoch) {
  job_->model().train();
  last_lr_ = schedule_.at(state_.global_step);
  set_learning_rate(*optimizer_, last_lr_);
  auto& strategy = job_->strategy();
  strategy.set_loss_scale(scaler_.scale());  // fp16: the backward runs on the scaled loss
  StepReport report = strategy.train_step(*train_loader_, state_.global_step, epoch, step_in_epoch,
                                          static_cast<int32_t>(options_.grad_accum_steps), job_->model_seq_len());
  strategy.set_loss_scale(1.0);
  last_loss_scale_ = scaler_.scale();
  if (allocator_ && allocator_->config().orth_reg_weight > 0) {
    // AdaLoRA's orthogonal regularisation (PEFT adds it to the loss): its gradient once per step,
    // after the plugin's backward, at the loss scale the plugin's gradients carry. The same on
    // every data-parallel rank, so adding it after their average equals adding it before.
    const double weight = allocator_->config().orth_reg_weight * scaler_.scale();
    (adalora_orthogonal_regularization(job_->model()) * weight).backward();
  }
  // The global norm of the unscaled gradients decides on every rank alike whether they are finite.
  // The optimizer's tensors: the parameters, or this rank's shards of them (their gradients the
  // plugin's reduced shards), so the norm is the plugin's sum over the ranks' shares.
  std::vector<torch::Tensor> optimized;
  for (const auto& t : optimized_) optimized.push_back(t.tensor);
  last_grad_norm_ = clip_grad_norm(optimized, options_.optim.grad_clip,
                                   [&](double local_sq) { return strategy.global_grad_norm_sq(local_sq); },
                                   scaler_.scale());
  last_step_skipped_ = !scaler_.update(std::isfinite(last_grad_norm_));
  if (!last_step_skipped_) adamw_step(*optimizer_);
  // AdaLoRA: importance from the gradients (averaged over data-parallel ranks, so every rank masks
  // the same triplets), then the budget's masks, as PEFT's update_and_allocate after the step.
  if (allocator_ && !last_step_skipped_) allocator_->update_and_allocate(state_.global_step);
  zero_gradients(job_->trainable());
  strategy.after_optimizer_step(report);  // zeroes the gradient shards; ZeRO gathers the updated shards; hooks
  return report;
}

bool Trainer::run_epoch_steps(RunRecords& records) {
  const int64_t epoch_end = std::min(total_steps_, state_.global_step + (steps_per_epoch_ - state_.step_in_epoch));
  records.progress().start_epoch(state_.epoch, options_.epochs, epoch_end, total_steps_, state_.global_step);
  bool stop = false;
  while (!stop && state_.step_in_epoch < steps_per_epoch_ && state_.global_step < total_steps_) {
    profile_around_step();
    const int64_t bytes_before = tensor_bytes_live();
    tensor_peak_bytes_ = std::max(tensor_peak_bytes_, tensor_bytes_peak());  // what came before (evaluation)
    reset_tensor_peak();
    const int64_t link_before = link_ ? link_->bytes() : -1;
    const auto step_start = Clock::now();
    StepRecord step;
    {
      TraceSpan span("step", fmt::format("step {}", state_.global_step + 1));
      step.report = train_step(state_.epoch, state_.step_in_epoch);
    }
    synchronize(job_->device());  // a GPU's queued work is part of the step
    step.seconds = seconds_since(step_start);
    if (link_before >= 0) {
      if (const int64_t link_after = link_->bytes(); link_after >= link_before) step.link_bytes = link_after - link_before;
    }
    step.activation_mib = static_cast<double>(tensor_bytes_peak() - bytes_before) / (1024.0 * 1024.0);
    ++state_.global_step;
    ++state_.step_in_epoch;
    state_.epoch_seconds += step.seconds;
    state_.epoch_tokens += records.tokens_per_step();
    step.step = state_.global_step;
    step.epoch = state_.epoch;
    step.lr = last_lr_;
    step.grad_norm = last_grad_norm_;
    if (scaler_.enabled()) {
      step.loss_scale = last_loss_scale_;
      step.skipped = last_step_skipped_;
    }
    records.step(step);
    records.progress().update(state_.global_step, step.report.loss, last_lr_,
                              records.tokens_per_step() / step.seconds);
    WEFT_CHECK(std::isfinite(step.report.loss), "loss became {} at step {}; lower train.lr or check the data",
               step.report.loss, state_.global_step);
    if (periodic_eval_due()) stop = evaluate_and_track(records);
    if (options_.checkpoint_every > 0 && state_.global_step % options_.checkpoint_every == 0) {
      save_checkpoint(records.progress());
    }
    stop = stop || agreed_interrupt() != 0;
  }
  records.progress().finish_epoch();
  if (stop || state_.global_step >= total_steps_) profile_around_step(/*last=*/true);
  return stop;
}

// eval.every_steps: at its multiples, except within half a period after an epoch end, whose
// evaluation stands for it (no "eval @ step 298" then "eval @ step 300" of the same model). Decided
// from the step alone, so that a resumed run evaluates where the uninterrupted one did.
bool Trainer::periodic_eval_due() const {
  const int64_t step = state_.global_step;
  if (options_.eval_every <= 0 || step % options_.eval_every != 0) return false;
  const int64_t epoch_end = step / steps_per_epoch_ * steps_per_epoch_;  // the last epoch end at or before it
  return epoch_end == 0 || epoch_end == step || !job_->data().heldout || 2 * (step - epoch_end) >= options_.eval_every;
}

// log.torch_profile: starts the profiler before step from + 1 and saves it after step from + steps
// (or when the run ends first).
void Trainer::profile_around_step(bool last) {
  if (options_.torch_profile.empty()) return;
  const int64_t done = state_.global_step;
  const bool end = done >= options_.torch_profile_from + options_.torch_profile_steps || last ||
                   done >= total_steps_;
  if (profiler_.running() && end) {
    synchronize(job_->device());
    const auto path = Tracer::rank_path(options_.torch_profile, job_->context().rank, job_->context().world);
    profiler_.stop_and_save(path);
    spdlog::info("torch profile of steps {}-{} written to {}", options_.torch_profile_from + 1, done, path);
  } else if (!profiler_.running() && !end && done == options_.torch_profile_from) {
    synchronize(job_->device());
    profiler_.start(job_->device().is_cuda());
  }
}

bool Trainer::complete_epoch(RunRecords& records) {
  bool stop = false;
  std::string eval_text;
  std::optional<EvalResult> eval;
  if (job_->data().heldout) {
    stop = evaluate_and_track(records);
    eval = last_eval_;
    eval_text = describe_eval(*eval);
  }
  records.epoch(state_.epoch, state_.global_step, state_.epoch_seconds, state_.epoch_tokens, eval);
  records.progress().message(fmt::format("epoch {}/{} done in {}{}", state_.epoch + 1, options_.epochs,
                                         format_duration(state_.epoch_seconds), eval_text));
  ++state_.epoch;
  state_.step_in_epoch = 0;
  state_.epoch_seconds = 0;
  state_.epoch_tokens = 0;
  if (options_.checkpoint_every > 0 || stop) save_checkpoint(records.progress());
  return stop;
}

EvalResult Trainer::evaluate() {
  WEFT_CHECK(job_->data().heldout != nullptr, "no held-out split (data.heldout_fraction = 0)");
  EvalOptions eval;
  eval.batch_size = options_.eval_batch_size > 0 ? options_.eval_batch_size : options_.batch_size;
  eval.max_batches = options_.eval_max_batches;
  eval.global_step = state_.global_step;
  eval.epoch = state_.epoch;
  EvalResult result = weft::evaluate(*job_, job_->data().heldout, eval);
  if (const ClassificationData* data = job_->classification()) {  // the task's metrics, each held-out set's
    add_task_metrics(result, *data, *job_->data().heldout);
    for (const auto& [name, split] : data->extra_heldout) {
      EvalResult extra = weft::evaluate(*job_, split, eval);
      add_task_metrics(extra, *data, *split, name + "_");
      result.metrics.emplace_back(name + "_loss", extra.loss);
      result.metrics.insert(result.metrics.end(), extra.metrics.begin(), extra.metrics.end());
      result.seconds += extra.seconds;
    }
  }
  return result;
}

// ", held-out loss 0.1234, perplexity 3.43", or a classifier's loss and metrics.
std::string Trainer::describe_eval(const EvalResult& eval) const {
  if (job_->classification()) return fmt::format(", held-out loss {:.4f}, {}", eval.loss, describe_task_metrics(eval));
  return fmt::format(", held-out loss {:.4f}, perplexity {:.2f}", eval.loss, eval.perplexity);
}

// Evaluates (once per optimizer step: an epoch end that coincides with eval.every_steps reuses
// that evaluation), keeps the best model and decides early stopping. Returns true to stop.
bool Trainer::evaluate_and_track(RunRecords& records) {
  if (last_eval_step_ == state_.global_step) return state_.early_stopped;
  last_eval_ = evaluate();
  last_eval_step_ = state_.global_step;
  const EvalResult& eval = *last_eval_;
  const bool improved = eval.loss < state_.best_eval_loss;
  if (improved) {
    state_.best_eval_loss = eval.loss;
    state_.best_step = state_.global_step;
    state_.evals_since_best = 0;
    if (options_.keep_best && state_.global_step > 0) {  // step 0 (eval.on_start): the model it started from
      with_whole_model([&](LlamaForCausalLMImpl& whole) {
        save_model_atomically(whole, job_->lora(), options_.out_dir + "/best", options_.model.weights);
      });
    }
  } else {
    ++state_.evals_since_best;
  }
  records.eval(eval, state_.global_step, state_.epoch, improved);
  records.progress().message(fmt::format("eval @ step {}:{}{}", state_.global_step, describe_eval(eval).substr(1),
                                         improved ? " (best)" : ""));
  if (options_.patience > 0 && state_.evals_since_best >= options_.patience) {
    records.progress().message(fmt::format("early stopping: no improvement in {} evaluations (best {:.4f} at step {})",
                                           state_.evals_since_best, state_.best_eval_loss, state_.best_step));
    state_.early_stopped = true;
    return true;
  }
  return false;
}

bool Trainer::save_checkpoint(Progress& progress) {
  if (scaler_.enabled()) {
    state_.loss_scale = scaler_.scale();
    state_.loss_scale_streak = scaler_.finite_streak();
  }
  auto& strategy = job_->strategy();
  const std::vector<std::string> local = strategy.local_parameters();
  WEFT_CHECK(local.empty() || !gather_->split(),
             "{} places parameters LOCAL while the model is split over the ranks: checkpoints cannot keep both",
             strategy.names());
  std::string local_dir;  // every rank's own state of them, staged before rank 0 saves the rest
  if (!local.empty()) {
    std::string cause;
    try {
      local_dir = checkpoints_->save_local(state_, job_->model(), *optimizer_, local, job_->context().rank,
                                           job_->context().world);
    } catch (const std::exception& e) {
      cause = e.what();
    }
    bool ok = cause.empty();
    for (double value : job_->communicator().all_gather(ok ? 1.0 : 0.0)) ok = ok && value > 0;  // collective
    if (!ok) {
      checkpoints_->abandon_local(state_.global_step,
                                  cause.empty() ? std::string("another rank could not write its own state") : cause);
    }
  }
  if (gather_->split()) {  // every rank writes its own pieces, rank 0 the index (named_state.h)
    const int32_t rank = job_->context().rank;
    // Composed with zero (a device mesh): the optimizer state of this rank's stages and slices put
    // together over the data-parallel group first; its lowest rank (the writer) saves it.
    std::unique_ptr<torch::optim::AdamW> whole;
    if (strategy.shards_training_state()) {
      strategy.materialize_parameters(true);
      whole = gather_sharded_optimizer(*optimizer_, strategy.trainable_shards(), job_->model(), options_.optim,
                                       job_->communicator(), strategy.state_group());  // collective
    }
    const auto dir = checkpoints_->save_sharded(
        state_, job_->model(), whole ? *whole : *optimizer_, rank, job_->context().world,
        [&](const std::string& name) { return gather_->writes(name); },
        [&](bool ok) {
          for (double value : job_->communicator().all_gather(ok ? 1.0 : 0.0)) ok = ok && value > 0;
          return ok;
        });
    if (whole) strategy.materialize_parameters(false);
    if (rank == 0) progress.message(fmt::format("checkpoint saved: {}", dir));
    if (backup_) backup_->submit(dir);
    return true;
  }
  if (strategy.shards_training_state()) {  // the ranks' shards put together; rank 0 writes the whole
    strategy.materialize_parameters(true);
    auto whole = gather_sharded_optimizer(*optimizer_, strategy.trainable_shards(), job_->model(), options_.optim,
                                          job_->communicator(), strategy.state_group());  // collective
    std::string dir;
    if (job_->context().rank == 0) dir = checkpoints_->save(state_, job_->model(), *whole, local_dir);
    strategy.materialize_parameters(false);
    if (job_->context().rank == 0) progress.message(fmt::format("checkpoint saved: {}", dir));
    if (backup_) backup_->submit(dir);
    return true;
  }
  if (job_->context().rank != 0) return true;  // replicas hold the same state; rank 0 writes it
  const auto dir = checkpoints_->save(state_, job_->model(), *optimizer_, local_dir);
  progress.message(fmt::format("checkpoint saved: {}", dir));
  if (backup_) backup_->submit(dir);
  return true;
}

}  // namespace weft
