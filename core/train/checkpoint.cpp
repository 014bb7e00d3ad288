#include "core/train/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>
#ifdef WEFT_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "core/model/config.h"
#include "core/model/parallel.h"
#include "core/model/prompt_tuning.h"
#include "core/model/weights.h"
#include "core/train/named_state.h"
#include "core/util/error.h"
#include "core/util/fault_injection.h"
#include "core/util/fs.h"

namespace weft {
namespace fs = std::filesystem;

CheckpointStore::CheckpointStore(std::string out_dir, int64_t keep_last, std::optional<LoraConfig> lora)
    : out_dir_(std::move(out_dir)), keep_last_(keep_last), lora_(std::move(lora)) {}

namespace {

void write_model_files(LlamaForCausalLMImpl& model, const std::optional<LoraConfig>& lora,
                       const std::string& dir, const std::string& base_model) {
  if (has_prompt_tuning(model)) {
    save_prompt_adapter(model, dir, base_model);
  } else if (lora) {
    save_lora_adapter(model, *lora, dir, base_model);
  } else {
    save_pretrained(model, dir);
  }
}

// Moves `staged` into place at `target`, replacing an existing directory. Where the file system
// can exchange two names atomically (renameat2 RENAME_EXCHANGE: ext4, xfs, btrfs, tmpfs) `target`
// always names a complete directory; elsewhere the old one is renamed aside first, and
// remove_leftovers puts it back if a crash comes between the two renames.
void swap_in_directory(const fs::path& staged, const fs::path& target) {
  if (fs::exists(target)) {
    if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      sync_directory(target.parent_path().string());
      fs::remove_all(staged);  // now the old directory
      return;
    }
    const fs::path old = target.string() + ".old-" + std::to_string(::getpid());
    fs::rename(target, old);
    fs::rename(staged, target);
    sync_directory(target.parent_path().string());
    fs::remove_all(old);
    return;
  }
  fs::rename(staged, target);
  sync_directory(target.parent_path().string());
}

// Writes what `save_to(writer)` produces (a LibTorch archive) to `path` atomically. LibTorch's zip
// writer must never see a failed write: it may throw from a destructor, and the process aborts.
// So the writer takes every byte, keeps the first error (a full disk) and drops what follows, and
// the error is thrown once the archive is complete.
template <typename SaveTo>
void save_archive(const std::string& path, SaveTo&& save_to) {
  write_file_atomically(path, [&](const ByteSink& sink) {
    std::exception_ptr error;
    const std::function<size_t(const void*, size_t)> writer = [&](const void* bytes, size_t count) -> size_t {
      if (!error) {
        try {
          sink(bytes, count);
        } catch (...) {
          error = std::current_exception();
        }
      }
      return count;
    };
    save_to(writer);
    if (error) std::rethrow_exception(error);
  });
}

// Deletes a directory so that it is never seen half-deleted: renamed to a .tmp- name in the same
// folder first (what remove_leftovers removes if a crash interrupts the deletion).
void remove_directory_atomically(const fs::path& dir) {
  const fs::path doomed = dir.parent_path() / fmt::format(".tmp-delete-{}-{}", dir.filename().string(), ::getpid());
  fs::rename(dir, doomed);
  sync_directory(dir.parent_path().string());
  fs::remove_all(doomed);
}

// "best.old-1234" -> "best"; "" when `name` is not a directory renamed aside by swap_in_directory.
std::string renamed_aside(const std::string& name) {
  const auto at = name.rfind(".old-");
  if (at == std::string::npos || at == 0) return "";
  const std::string pid = name.substr(at + 5);
  if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) return "";
  return name.substr(0, at);
}

// Cleans one folder (see CheckpointStore::remove_leftovers): entries `temporary` names are
// removed; a directory renamed aside by swap_in_directory ("<name>.old-<pid>", `name` accepted
// by `saved`) is put back if nothing replaced it, and removed otherwise.
void remove_leftovers_in(const fs::path& folder, const std::function<bool(const std::string&)>& temporary,
                         const std::function<bool(const std::string&)>& saved) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return;
  std::vector<fs::path> entries;
  for (const auto& entry : fs::directory_iterator(folder, ec)) entries.push_back(entry.path());
  for (const auto& path : entries) {
    const std::string name = path.filename().string();
    if (const std::string original = renamed_aside(name); !original.empty() && saved(original)) {
      if (!fs::exists(folder / original)) {
        spdlog::warn("{}: restoring {} (a save was interrupted after moving it aside)", (folder / original).string(),
                     name);
        fs::rename(path, folder / original);
      } else {
        fs::remove_all(path);
      }
    } else if (temporary(name)) {
      spdlog::info("removing {}, left by an interrupted save", path.string());
      fs::remove_all(path);
    }
  }
}

// This process's random generators: the CPU's, and the CUDA device's where the model computes
// there (dropout draws from the generator of the tensors' device).
std::vector<torch::Tensor> generator_states(const c10::Device& device) {
  std::vector<torch::Tensor> states{at::detail::getDefaultCPUGenerator().get_state()};
#ifdef WEFT_WITH_CUDA
  if (device.is_cuda()) states.push_back(at::cuda::detail::getDefaultCUDAGenerator(device.index()).get_state());
#else
  (void)device;
#endif
  return states;
}

void set_generator_states(const std::vector<torch::Tensor>& states, const c10::Device& device) {
  WEFT_CHECK(!states.empty(), "no generator state");
  auto cpu = at::detail::getDefaultCPUGenerator();
  cpu.set_state(states[0]);
#ifdef WEFT_WITH_CUDA
  if (device.is_cuda() && states.size() > 1) {
    auto cuda = at::cuda::detail::getDefaultCUDAGenerator(device.index());
    cuda.set_state(states[1]);
  }
#else
  (void)device;
#endif
}

c10::Device device_of(LlamaForCausalLMImpl& model) {
  const auto parameters = model.parameters();
  return parameters.empty() ? c10::Device(c10::kCPU) : parameters.front().device();
}

std::string rank_rng_file(int32_t rank) { return fmt::format("rng-rank-{:05}.pt", rank); }
constexpr const char* kGeneratorsFile = "rng-generators.pt";  // a whole checkpoint's: CPU (+ CUDA)

}  // namespace

// The last steps of every save: RNG and trainer state into the staged folder, which is then
// swapped in as `name`, and `latest` pointed at it.
void CheckpointStore::publish(const std::string& staged_dir, const std::string& name, const TrainerState& state) const {
  const fs::path staged = staged_dir, root = checkpoints_dir();
  save_archive((staged / "rng.pt").string(), [&](const auto& writer) {
    torch::save(at::detail::getDefaultCPUGenerator().get_state(), writer);
  });
  write_file_atomically((staged / "trainer_state.json").string(), state.to_json().dump(2) + "\n");
  sync_directory(staged.string());
  swap_in_directory(staged, root / name);
  write_file_atomically((root / "latest").string(), name + "\n");
}

// Removes the staged folder and throws one error naming the step, the cause and what is still the
// latest checkpoint.
void CheckpointStore::fail_save(const std::string& staged, int64_t step, const std::string& cause) const {
  std::error_code ignored;
  fs::remove_all(staged, ignored);
  std::optional<std::string> previous;
  try {
    previous = latest();
  } catch (const std::exception&) {
  }
  fail("checkpoint of step {} not saved in {}: {} (removed its partial copy; {})", step, checkpoints_dir(), cause,
       previous ? fmt::format("the latest checkpoint is still {}", *previous) : std::string("no earlier checkpoint"));
}

// The folder save_local stages a step's per-rank state in: one name every rank knows.
namespace {
fs::path staged_local(const fs::path& root, int64_t step) { return root / fmt::format(".tmp-step-{:08}-local", step); }
std::string local_rank_file(int32_t rank) { return fmt::format("rank-{:05}.safetensors", rank); }
std::string local_generators_file(int32_t rank) { return fmt::format("rank-{:05}.generators.pt", rank); }
}  // namespace

std::string CheckpointStore::save_local(const TrainerState& state, LlamaForCausalLMImpl& model,
                                        torch::optim::AdamW& optimizer, const std::vector<std::string>& parameters,
                                        int32_t rank, int32_t world_size) const {
  const fs::path folder = staged_local(checkpoints_dir(), state.global_step);
  fs::create_directories(folder);  // every rank; a leftover of a crash is replaced file by file
  save_local_state((folder / local_rank_file(rank)).string(), model, optimizer, parameters);
  const auto generators = generator_states(device_of(model));
  save_archive((folder / local_generators_file(rank)).string(), [&](const auto& writer) { torch::save(generators, writer); });
  if (rank == 0) {
    const nlohmann::json index{{"format", "weft-local"}, {"version", 1}, {"world_size", world_size}, {"parameters", parameters}};
    write_file_atomically((folder / "index.json").string(), index.dump(2) + "\n");
  }
  fault_point("save_local");
  return folder.string();
}

void CheckpointStore::abandon_local(int64_t step, const std::string& cause) const {
  fail_save(staged_local(checkpoints_dir(), step).string(), step, cause);
}

std::string CheckpointStore::restore_local(const std::string& dir, LlamaForCausalLMImpl& model,
                                           torch::optim::AdamW& optimizer, const std::vector<std::string>& parameters,
                                           int32_t rank, int32_t world_size) const {
  if (parameters.empty()) return "";
  const fs::path folder = fs::path(dir) / "local";
  const fs::path index_path = folder / "index.json";
  if (!fs::exists(index_path)) return "the checkpoint holds no rank's own state (it was saved under another layout)";
  nlohmann::json index = nlohmann::json::parse(read_file(index_path.string()), nullptr, /*allow_exceptions=*/false);
  WEFT_CHECK(index.is_object() && index.value("format", "") == "weft-local" && index.contains("world_size") &&
                 index["world_size"].is_number_integer() && index.contains("parameters") && index["parameters"].is_array(),
             "{} is not a weft-local index", index_path.string());
  const int64_t saved = index["world_size"].get<int64_t>();
  if (saved != world_size) {
    return fmt::format("the checkpoint holds the own state of {} ranks, this run has {}", saved, world_size);
  }
  std::vector<std::string> names;
  for (const auto& name : index["parameters"]) {
    WEFT_CHECK(name.is_string(), "{}: a parameter name is not a string", index_path.string());
    names.push_back(name.get<std::string>());
  }
  std::vector<std::string> mine = parameters;
  std::sort(mine.begin(), mine.end());
  std::sort(names.begin(), names.end());
  if (names != mine) return "the checkpoint's ranks kept other parameters as their own";
  restore_local_state((folder / local_rank_file(rank)).string(), model, optimizer, parameters);
  try {
    std::vector<torch::Tensor> states;
    torch::load(states, (folder / local_generators_file(rank)).string());
    set_generator_states(states, device_of(model));
  } catch (const c10::Error& e) {
    fail("checkpoint '{}': cannot restore rank {}'s generators ({})", dir, rank, e.what_without_backtrace());
  }
  return "";
}

std::string CheckpointStore::save(const TrainerState& state, LlamaForCausalLMImpl& model,
                                  torch::optim::AdamW& optimizer, const std::string& local) {
  const fs::path root = checkpoints_dir();
  const std::string name = fmt::format("step-{:08}", state.global_step);
  const fs::path staged = root / fmt::format(".tmp-{}-{}", name, ::getpid());
  try {
    fs::create_directories(root);
    fs::remove_all(staged);
    fs::create_directories(staged);
    write_model_files(model, lora_, staged.string(), "");
    save_optimizer_state((staged / "optimizer.safetensors").string(), model, optimizer);
    for (const auto& extra : state_files_) save_safetensors((staged / extra.file).string(), extra.collect());
    // The generators of the device too (rng.pt holds the CPU's alone, as before): on CUDA dropout
    // draws from the device's.
    const auto generators = generator_states(device_of(model));
    save_archive((staged / kGeneratorsFile).string(), [&](const auto& writer) { torch::save(generators, writer); });
    if (!local.empty()) fs::rename(local, staged / "local");  // every rank's own state (save_local)
    fault_point("save");
    publish(staged.string(), name, state);
  } catch (const std::exception& e) {
    fail_save(staged.string(), state.global_step, e.what());
  }
  prune();
  return (root / name).string();
}

std::string CheckpointStore::save_sharded(const TrainerState& state, LlamaForCausalLMImpl& model,
                                          torch::optim::AdamW& optimizer, int32_t rank, int32_t world_size,
                                          const std::function<bool(const std::string&)>& writes,
                                          const std::function<bool(bool)>& all_ok) {
  const fs::path root = checkpoints_dir();
  const std::string name = fmt::format("step-{:08}", state.global_step);
  // One name every rank knows; a folder of that name left by a crash is removed first.
  const fs::path staged = root / fmt::format(".tmp-{}-shards", name);
  std::string cause;
  const auto attempt = [&](const std::function<void()>& work) {
    if (cause.empty()) {
      try {
        work();
      } catch (const std::exception& e) {
        cause = fmt::format("rank {}: {}", rank, e.what());
      }
    }
    if (!all_ok(cause.empty()) && cause.empty()) cause = "another rank could not write its part";
    return cause.empty();
  };
  bool ok = attempt([&] {
    if (rank != 0) return;
    fs::create_directories(root);
    fs::remove_all(staged);
    fs::create_directories(staged / "shards");
    write_file_atomically((staged / "config.json").string(), to_hf_config_json(model.config()));
  });
  ok = ok && attempt([&] {
    std::vector<StatePiece> extra;
    for (const auto& state_file : state_files_) {
      WEFT_CHECK(state_file.follows, "checkpoint: the training state of {} cannot be saved in pieces", state_file.file);
      for (auto& [name, tensor] : state_file.collect()) {
        const auto parameter = state_file.follows(name);
        WEFT_CHECK(parameter.has_value(), "checkpoint: {}'s tensor '{}' belongs to no parameter", state_file.file, name);
        extra.push_back({name, tensor, *parameter});
      }
    }
    save_rank_shard((staged / "shards").string(), rank, model, optimizer, lora_.has_value() || has_prompt_tuning(model),
                    writes, extra);
    // Each rank's generators: a pipeline's stages (and the ranks of any split) draw dropout masks
    // of their own layers, so their generators differ.
    const auto states = generator_states(device_of(model));
    save_archive((staged / "shards" / rank_rng_file(rank)).string(), [&](const auto& writer) { torch::save(states, writer); });
    fault_point("save");
  });
  ok = ok && attempt([&] {
    if (rank != 0) return;
    write_shard_index((staged / "shards").string(), world_size);
    publish(staged.string(), name, state);
  });
  if (!ok) {
    if (rank == 0) fail_save(staged.string(), state.global_step, cause);
    fail("checkpoint of step {} not saved in {}: {}", state.global_step, root.string(), cause);
  }
  if (rank == 0) prune();
  return (root / name).string();
}

std::optional<std::string> CheckpointStore::latest() const {
  const fs::path pointer = fs::path(checkpoints_dir()) / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = read_file(pointer.string());
  name.erase(std::remove_if(name.begin(), name.end(), ::isspace), name.end());
  const fs::path dir = fs::path(checkpoints_dir()) / name;
  WEFT_CHECK(fs::is_directory(dir), "{} names checkpoint '{}', which does not exist", pointer.string(), name);
  return dir.string();
}

TrainerState CheckpointStore::read_state(const std::string& dir) const {
  WEFT_CHECK(fs::is_directory(dir), "checkpoint '{}' is not a directory", dir);
  const std::string state_path = dir + "/trainer_state.json";
  WEFT_CHECK(fs::exists(state_path), "checkpoint '{}' has no trainer_state.json", dir);
  return TrainerState::parse(read_file(state_path), state_path);
}

void CheckpointStore::restore(const std::string& dir, LlamaForCausalLMImpl& model, torch::optim::AdamW& optimizer,
                              int32_t rank, int32_t world_size) const {
  const NamedState state = NamedState::open(dir);
  if (state.sharded()) {
    state.restore_parameters(model, lora_.has_value() || has_prompt_tuning(model));
  } else if (has_prompt_tuning(model)) {
    WEFT_CHECK(fs::exists(dir + "/adapter_model.safetensors"),
               "checkpoint '{}' has no prompt-tuning adapter, but train.mode is prompt_tuning", dir);
    load_prompt_adapter(model, dir);
  } else if (lora_) {
    WEFT_CHECK(fs::exists(dir + "/adapter_model.safetensors"),
               "checkpoint '{}' has no LoRA adapter, but train.mode is lora", dir);
    load_lora_adapter(model, dir);
  } else {
    WEFT_CHECK(fs::exists(dir + "/model.safetensors") || fs::exists(dir + "/model.safetensors.index.json"),
               "checkpoint '{}' has no model weights (was it saved with train.mode = lora?)", dir);
    load_weights(model, dir);
  }
  try {
    if (state.has_moments()) {
      state.restore_optimizer(model, optimizer);
    } else {  // written before optimizer.safetensors: a LibTorch archive of a whole model's AdamW
      const std::string optimizer_path = dir + "/optimizer.pt";
      WEFT_CHECK(fs::exists(optimizer_path), "checkpoint '{}' has no optimizer.safetensors", dir);
      torch::serialize::InputArchive archive;
      archive.load_from(optimizer_path);
      optimizer.load(archive);
    }
    // This rank's own generators where as many ranks saved theirs; else a whole checkpoint's (its
    // ranks' were the same), else rank 0's CPU generator.
    const fs::path shards = fs::path(dir) / "shards";
    const bool same_world = fs::exists(shards / rank_rng_file(world_size - 1)) && !fs::exists(shards / rank_rng_file(world_size));
    const fs::path own = shards / rank_rng_file(rank), whole = fs::path(dir) / kGeneratorsFile;
    if ((same_world && fs::exists(own)) || fs::exists(whole)) {
      std::vector<torch::Tensor> states;
      torch::load(states, (same_world && fs::exists(own) ? own : whole).string());
      set_generator_states(states, device_of(model));
    } else {  // saved before the generator files
      torch::Tensor rng;
      torch::load(rng, dir + "/rng.pt");
      auto generator = at::detail::getDefaultCPUGenerator();
      generator.set_state(rng);
    }
  } catch (const c10::Error& e) {
    fail("checkpoint '{}': cannot restore optimizer/RNG state ({})", dir, e.what_without_backtrace());
  }
  for (const auto& extra : state_files_) {
    NamedTensors tensors;
    if (state.sharded()) {  // pieces of the rank files: this rank's part of each
      for (const auto& name : state.names()) {
        const auto parameter = extra.follows ? extra.follows(name) : std::nullopt;
        if (parameter) tensors.emplace_back(name, state.part_like(model, *parameter, name));
      }
      if (tensors.empty() && extra.optional) continue;
      WEFT_CHECK(!tensors.empty(), "checkpoint '{}' holds none of the {} state, which this run's training needs", dir,
                 extra.file);
    } else {
      const std::string path = dir + "/" + extra.file;
      if (!fs::exists(path) && extra.optional) continue;
      WEFT_CHECK(fs::exists(path), "checkpoint '{}' has no {}, which this run's training state needs", dir, extra.file);
      auto file = SafetensorsFile::open(path);
      for (const auto& info : file->tensors()) {
        auto values = file->load(info.name);
        const auto parameter = extra.follows ? extra.follows(info.name) : std::nullopt;
        if (parameter && !parameter->empty()) {  // the whole tensor; this rank may hold a slice
          const ParameterShard shard = shard_of(model.options().shards, *parameter);
          if (!shard.whole()) {
            WEFT_CHECK(shard.dim < values.dim(), "checkpoint '{}': {}'s '{}' has {} dimensions", dir, extra.file,
                       info.name, values.dim());
            values = shard_slice(values, shard).contiguous();
          }
        }
        tensors.emplace_back(info.name, values);
      }
    }
    extra.restore(tensors);
  }
}

void CheckpointStore::add_state_file(std::string file, std::function<NamedTensors()> collect,
                                     std::function<void(const NamedTensors&)> restore, StateFollows follows,
                                     bool optional) {
  state_files_.push_back({std::move(file), std::move(collect), std::move(restore), std::move(follows), optional});
}

void CheckpointStore::remove_leftovers() const {
  // In the run directory only the saved models' staging folders ("best.tmp-<pid>"): other ranks
  // may be writing their own files there (config.toml, metrics).
  static const char* models[] = {"best", "final", "final-merged"};
  remove_leftovers_in(
      out_dir_,
      [](const std::string& name) {
        for (const char* model : models) {
          if (name.rfind(std::string(model) + ".tmp-", 0) == 0) return true;
        }
        return false;
      },
      [](const std::string& name) { return std::find(std::begin(models), std::end(models), name) != std::end(models); });
  // In checkpoints/, written by rank 0 alone: staged checkpoints and deletions (".tmp-..."), the
  // `latest` pointer's temporary file, and checkpoints moved aside ("step-00000010.old-<pid>").
  remove_leftovers_in(
      checkpoints_dir(),
      [](const std::string& name) { return name.rfind(".tmp-", 0) == 0 || name.rfind("latest.tmp.", 0) == 0; },
      [](const std::string& name) { return name.rfind("step-", 0) == 0; });
}

// Deletes all but the newest keep_last checkpoints. A deletion that fails (a busy or read-only
// file system) is a warning: the new checkpoint is saved either way.
void CheckpointStore::prune() const {
  std::vector<fs::path> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir(), ec)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("step-", 0) == 0 && renamed_aside(name).empty() && entry.is_directory()) {
      steps.push_back(entry.path());
    }
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + keep_last_ < steps.size(); ++i) {
    try {
      remove_directory_atomically(steps[i]);
    } catch (const std::exception& e) {
      spdlog::warn("could not delete the old checkpoint {}: {}", steps[i].string(), e.what());
    }
  }
}

void save_model_atomically(LlamaForCausalLMImpl& model, const std::optional<LoraConfig>& lora,
                           const std::string& dir, const std::string& base_model) {
  const fs::path target = dir;
  const fs::path staged = target.string() + ".tmp-" + std::to_string(::getpid());
  try {
    if (target.has_parent_path()) fs::create_directories(target.parent_path());
    fs::remove_all(staged);
    write_model_files(model, lora, staged.string(), base_model);
    swap_in_directory(staged, target);
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(staged, ignored);
    fail("model not saved in {}: {} (removed its partial copy; {} is as it was)", dir, e.what(), dir);
  }
}

}  // namespace weft
