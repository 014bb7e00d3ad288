#include "core/train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "core/model/weights.h"
#include "core/util/error.h"
#include "core/util/fs.h"

namespace weft {
namespace fs = std::filesystem;

nlohmann::json TrainerState::to_json() const {
  return {
      {"global_step", global_step},
      {"epoch", epoch},
      {"step_in_epoch", step_in_epoch},
      {"best_eval_loss", std::isfinite(best_eval_loss) ? nlohmann::json(best_eval_loss) : nlohmann::json(nullptr)},
      {"best_step", best_step},
      {"evals_since_best", evals_since_best},
      {"epoch_seconds", epoch_seconds},
      {"epoch_tokens", epoch_tokens},
      {"data_identity", data_identity},
      {"early_stopped", early_stopped},
  };
}

TrainerState TrainerState::from_json(const nlohmann::json& j, const std::string& origin) {
  TrainerState s;
  try {
    s.global_step = j.at("global_step").get<int64_t>();
    s.epoch = j.at("epoch").get<int64_t>();
    s.step_in_epoch = j.at("step_in_epoch").get<int64_t>();
    if (!j.at("best_eval_loss").is_null()) s.best_eval_loss = j.at("best_eval_loss").get<double>();
    s.best_step = j.at("best_step").get<int64_t>();
    s.evals_since_best = j.at("evals_since_best").get<int64_t>();
    s.epoch_seconds = j.at("epoch_seconds").get<double>();
    s.epoch_tokens = j.at("epoch_tokens").get<int64_t>();
    s.data_identity = j.at("data_identity").get<std::string>();
    s.early_stopped = j.value("early_stopped", false);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed trainer state ({})", origin, e.what());
  }
  return s;
}

CheckpointStore::CheckpointStore(std::string out_dir, int64_t keep_last, std::optional<LoraConfig> lora)
    : out_dir_(std::move(out_dir)), keep_last_(keep_last), lora_(std::move(lora)) {}

namespace {

void write_model_files(LlamaForCausalLMImpl& model, const std::optional<LoraConfig>& lora,
                       const std::string& dir, const std::string& base_model) {
  if (lora) {
    save_lora_adapter(model, *lora, dir, base_model);
  } else {
    save_pretrained(model, dir);
  }
}

// Moves `staged` into place at `target`, replacing an existing directory.
void swap_in_directory(const fs::path& staged, const fs::path& target) {
  const fs::path old = target.string() + ".old-" + std::to_string(::getpid());
  if (fs::exists(target)) fs::rename(target, old);
  fs::rename(staged, target);
  sync_directory(target.parent_path().string());
  fs::remove_all(old);
}

}  // namespace

std::string CheckpointStore::save(const TrainerState& state, LlamaForCausalLMImpl& model,
                                  torch::optim::Optimizer& optimizer) {
  const fs::path root = checkpoints_dir();
  fs::create_directories(root);
  const std::string name = fmt::format("step-{:08}", state.global_step);
  const fs::path staged = root / fmt::format(".tmp-{}-{}", name, ::getpid());
  fs::remove_all(staged);
  fs::create_directories(staged);

  write_model_files(model, lora_, staged.string(), "");
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  optimizer_archive.save_to((staged / "optimizer.pt").string());
  torch::save(at::detail::getDefaultCPUGenerator().get_state(), (staged / "rng.pt").string());
  write_file_atomically((staged / "trainer_state.json").string(), state.to_json().dump(2) + "\n");
  sync_directory(staged.string());

  swap_in_directory(staged, root / name);
  write_file_atomically((root / "latest").string(), name + "\n");
  prune();
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

TrainerState CheckpointStore::load(const std::string& dir, LlamaForCausalLMImpl& model,
                                   torch::optim::Optimizer& optimizer) const {
  WEFT_CHECK(fs::is_directory(dir), "checkpoint '{}' is not a directory", dir);
  const std::string state_path = dir + "/trainer_state.json";
  WEFT_CHECK(fs::exists(state_path), "checkpoint '{}' has no trainer_state.json", dir);
  nlohmann::json state_json;
  try {
    state_json = nlohmann::json::parse(read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", state_path, e.what());
  }
  auto state = TrainerState::from_json(state_json, state_path);
  if (lora_) {
    WEFT_CHECK(fs::exists(dir + "/adapter_model.safetensors"),
               "checkpoint '{}' has no LoRA adapter, but train.mode is lora", dir);
    load_lora_adapter(model, dir);
  } else {
    WEFT_CHECK(fs::exists(dir + "/model.safetensors") || fs::exists(dir + "/model.safetensors.index.json"),
               "checkpoint '{}' has no model weights (was it saved with train.mode = lora?)", dir);
    load_weights(model, dir);
  }
  const std::string optimizer_path = dir + "/optimizer.pt";
  WEFT_CHECK(fs::exists(optimizer_path), "checkpoint '{}' has no optimizer.pt", dir);
  try {
    torch::serialize::InputArchive archive;
    archive.load_from(optimizer_path);
    optimizer.load(archive);
    torch::Tensor rng;
    torch::load(rng, dir + "/rng.pt");
    auto generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(rng);
  } catch (const c10::Error& e) {
    fail("checkpoint '{}': cannot restore optimizer/RNG state ({})", dir, e.what_without_backtrace());
  }
  return state;
}

void CheckpointStore::prune() const {
  std::vector<fs::path> steps;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir())) {
    const auto name = entry.path().filename().string();
    if (name.rfind("step-", 0) == 0 && entry.is_directory()) steps.push_back(entry.path());
    if (name.rfind(".tmp-", 0) == 0 && name.find(fmt::format("-{}", ::getpid())) == std::string::npos) {
      fs::remove_all(entry.path());  // left by a crashed save
    }
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + keep_last_ < steps.size(); ++i) fs::remove_all(steps[i]);
}

void save_model_atomically(LlamaForCausalLMImpl& model, const std::optional<LoraConfig>& lora,
                           const std::string& dir, const std::string& base_model) {
  const fs::path target = dir;
  if (target.has_parent_path()) fs::create_directories(target.parent_path());
  const fs::path staged = target.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(staged);
  write_model_files(model, lora, staged.string(), base_model);
  swap_in_directory(staged, target);
}

}  // namespace weft
