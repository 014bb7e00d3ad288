#include "core/train/conformance.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "core/model/config.h"
#include "core/model/lora.h"
#include "core/model/quantize.h"
#include "core/train/named_state.h"
#include "core/train/trainer.h"
#include "core/util/device.h"
#include "core/util/error.h"

namespace weft {
namespace {

// A deterministic pseudo-English JSONL corpus, so the check needs no data files. Classification:
// 1100 texts of 1 to 12 words (rows of different lengths, some cut to seq_len), each labeled by how
// many animals it names, modulo 3. Chat: 1100 prompt-completion pairs of 1 to 5 and 1 to 8 words (rows
// with different numbers of trained tokens, some cut to seq_len + 1).
std::string write_chat_corpus(const std::string& dir) {
  static const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and"};
  std::mt19937 rng(7);
  const std::string path = dir + "/chat.jsonl";
  std::ofstream out(path);
  const auto text = [&](int most) {
    std::string t;
    for (int w = 0, n = 1 + static_cast<int>(rng() % most); w < n; ++w) t += std::string(w ? " " : "") + words[rng() % 10];
    return t;
  };
  for (int d = 0; d < 1100; ++d) {
    const std::string prompt = text(5);
    out << "{\"prompt\": \"" << prompt << "?\", \"completion\": \" " << text(8) << ".\"}\n";
  }
  return path;
}

std::string write_corpus(const std::string& dir, bool classification) {
  static const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and",
                                "runs", "away", "from", "her", "sister", "at", "noon", "with", "grace"};
  std::mt19937 rng(7);
  const std::string path = dir + "/corpus.jsonl";
  std::ofstream out(path);
  for (int d = 0; d < (classification ? 1100 : 96); ++d) {
    std::string text;
    int animals = 0;
    const int n = classification ? 1 + static_cast<int>(rng() % 12) : 80;
    for (int w = 0; w < n; ++w) {
      const int word = static_cast<int>(rng() % 19);
      animals += word == 3 || word == 8;
      text += std::string(w ? " " : "") + words[word];
    }
    out << "{\"text\": \"" << text << ".\"";
    if (classification) out << ", \"label\": " << animals % 3;
    out << "}\n";
  }
  return path;
}

// The check's model: the tiny preset with 4 layers and a tied head, as a config.json in `dir`.
// Over an nf4 base it is twice as wide (hidden 128, 8 heads, MLP 256), so that a tensor-parallel
// split of 2 keeps nf4's blocks of 64 weights whole.
std::string write_model_config(const std::string& dir, const std::string& quantize) {
  ModelConfig config = preset_config("tiny");
  config.num_hidden_layers = 4;
  config.tie_word_embeddings = true;
  if (quantize == "nf4") {
    config.hidden_size = 128;
    config.num_attention_heads = 8;
    config.num_key_value_heads = 4;
    config.intermediate_size = 256;
  }
  const std::string path = dir + "/config.json";
  std::ofstream out(path);
  out << to_hf_config_json(config);
  WEFT_CHECK(out.good(), "cannot write {}", path);
  return path;
}

// "key=value" (a TOML value) -> the plugin's table; a value that is not TOML is a string. A dotted
// key ("gpipe.schedule=...") goes into the sub-table named by its first part, as --set puts it.
toml::table plugin_table(const std::vector<std::string>& settings) {
  toml::table table;
  for (const auto& setting : settings) {
    const auto eq = setting.find('=');
    WEFT_CHECK(eq != std::string::npos && eq > 0, "plugin setting '{}' is not key=value", setting);
    std::string key = setting.substr(0, eq);
    const std::string value = setting.substr(eq + 1);
    toml::table* into = &table;
    for (auto dot = key.find('.'); dot != std::string::npos; dot = key.find('.')) {
      const std::string part = key.substr(0, dot);
      if (!into->get_as<toml::table>(part)) into->insert_or_assign(part, toml::table{});
      into = into->get_as<toml::table>(part);
      key = key.substr(dot + 1);
    }
    try {
      toml::table parsed = toml::parse("v = " + value);
      into->insert_or_assign(key, *parsed.get("v"));
    } catch (const toml::parse_error&) {
      into->insert_or_assign(key, value);
    }
  }
  return table;
}

// Whether both runs multiply int8 layers in the CPU's int8 GEMM (see int8_gemm_loss_rtol): on the
// CPU, for a causal LM.
bool int8_gemm_checked(const ConformanceOptions& c) { return c.device == "cpu" && c.task == "causal_lm"; }

// The same settings as run_options, as command-line overrides for a multi-process run.
std::string run_arguments(const ConformanceOptions& c, const std::string& corpus, const std::string& model_config,
                          const std::string& out_dir) {
  std::string plugin_settings;
  for (const auto& setting : c.plugin_settings) plugin_settings += " --set 'plugin." + setting + "'";
  for (const auto& setting : c.mesh_settings) plugin_settings += " --set 'mesh." + setting + "'";
  if (c.mode == "lora" || c.mode == "adalora") {
    plugin_settings += fmt::format(" --set train.mode={} --set lora.r=4 --set lora.alpha=8 --set lora.dropout=0"
                                   " --set 'lora.target_modules=[\"{}\"]'",
                                   c.mode, fmt::join(lora_targetable_modules(), "\", \""));
  }
  if (c.mode == "prompt_tuning") plugin_settings += " --set train.mode=prompt_tuning --set prompt_tuning.num_virtual_tokens=8";
  if (c.mode == "adalora") {  // and a checkpoint at the end: its allocator state holds every triplet whole
    plugin_settings += fmt::format(" --set adalora.init_r=4 --set adalora.target_r=2 --set adalora.tinit=2"
                                   " --set adalora.tfinal=4 --set adalora.deltaT=2 --set checkpoint.every_steps={}",
                                   c.steps);
  }
  if (c.quantize != "none") plugin_settings += " --set model.quantize=" + c.quantize;
  if (c.frozen_dtype != "fp32") plugin_settings += " --set model.frozen_dtype=" + c.frozen_dtype;
  if (c.activation_checkpointing) plugin_settings += " --set model.activation_checkpointing=true";
  if (!c.chunked_loss) plugin_settings += " --set model.chunked_loss=false";
  if (c.int8_threshold != 6.0) plugin_settings += fmt::format(" --set model.int8_threshold={}", c.int8_threshold);
  if (c.quantize == "int8" && !int8_gemm_checked(c)) plugin_settings += " --set model.int8_gemm=false";
  if (c.task == "chat") plugin_settings += c.packing ? " --set data.format=chat --set data.packing=true" : " --set data.format=chat";
  else if (c.task != "causal_lm") plugin_settings += " --set train.task=" + c.task;
  return fmt::format(
      "train --plugin {} --nproc {} --set model.config={} --set data.path={} --set data.seq_len=32"
      " --set data.heldout_fraction=0.1 --set data.split_seed=1 --set data.tokenizer=byte --set data.cache_dir="
      " --set train.lr=1e-3 --set train.eps={} --set train.warmup_steps=2 --set train.seed=11 --set train.max_steps={}"
      " --set train.batch_size={} --set train.grad_accum_steps={} --set train.precision={} --set train.threads=1"
      " --set train.device={}"
      " --set train.out_dir={} --set train.overwrite=true --set log.progress=off --set checkpoint.keep_best=false"
      " --set checkpoint.save_final=true --log-level warn{}",
      c.plugin, c.nproc, model_config, corpus, c.adam_eps, c.steps, c.batch_size, c.grad_accum_steps, c.precision,
      c.device, out_dir, plugin_settings);
}

// ": <the first error line of a run's log>", or "" when it has none.
// The error that stopped a run: the first rank error that is not another rank's going away
// (a peer closing its connection, the launcher stopping the others), else the first error.
std::string first_error(const std::string& log) {
  std::ifstream in(log);
  std::string line, first;
  while (std::getline(in, line)) {
    const auto at = line.find(" error ");
    if (at == std::string::npos) continue;
    const std::string error = line.substr(at + 7);
    if (first.empty()) first = error;
    bool consequence = false;
    for (const char* echo : {"Connection closed by peer", "Connection reset by peer", "did not join",
                             "stopping the other ranks"}) {
      consequence = consequence || error.find(echo) != std::string::npos;
    }
    if (!consequence) return ": " + error;
  }
  return first.empty() ? "" : ": " + first;
}

std::vector<double> logged_losses(const std::string& metrics) {
  std::vector<double> losses;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

// Whether some rank of a run computed its LM head's loss from whole logits (its summary's
// chunked_loss_per_rank holds a 0).
bool logged_logits_loss(const std::string& metrics) {
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] != "summary" || !j.contains("chunked_loss_per_rank")) continue;
    for (const auto& rank : j["chunked_loss_per_rank"]) {
      if (rank.get<double>() == 0.0) return true;
    }
  }
  return false;
}

TrainOptions run_options(const ConformanceOptions& c, const std::string& corpus, const std::string& model_config,
                         const std::string& plugin, const std::string& out_dir) {
  TrainOptions o;
  o.model.config_path = model_config;
  o.data.paths = {corpus};
  o.data.seq_len = 32;
  o.data.heldout_fraction = 0.1;
  o.data.split_seed = 1;
  o.data.tokenize_threads = 1;
  o.tokenizer = "byte";
  o.optim.lr = 1e-3;
  o.optim.eps = c.adam_eps;
  o.optim.warmup_steps = 2;
  o.seed = 11;
  o.max_steps = c.steps;
  o.batch_size = c.batch_size;
  o.grad_accum_steps = c.grad_accum_steps;
  o.precision = c.precision;
  o.device = c.device;
  o.threads = 1;
  o.out_dir = out_dir;
  o.metrics_file = "";
  o.progress = "off";
  o.save_final = false;
  o.keep_best = false;
  o.overwrite = true;
  o.plugin = plugin;
  if (c.mode == "lora" || c.mode == "adalora") {
    o.mode = c.mode;
    o.lora.spec.r = 4;
    o.lora.spec.alpha = 8;
    o.lora.spec.dropout = 0;
    o.lora.target_modules = lora_targetable_modules();
  }
  if (c.mode == "prompt_tuning") {  // 8 virtual tokens (random init) before each row of 32
    o.mode = c.mode;
    o.prompt_tuning.num_virtual_tokens = 8;
  }
  if (c.mode == "adalora") {
    o.adalora.spec.r = 4;
    o.adalora.target_r = 2;
    o.adalora.tinit = 2;
    o.adalora.tfinal = 4;
    o.adalora.delta_t = 2;
  }
  o.model.quantize = c.quantize;
  o.model.int8_threshold = c.int8_threshold;
  o.model.frozen_dtype = c.frozen_dtype;
  o.model.activation_checkpointing = c.activation_checkpointing;
  o.model.chunked_loss = c.chunked_loss;
  o.model.int8_gemm = int8_gemm_checked(c);  // the reference computes as the plugin's run does (see int8_gemm_loss_rtol)
  o.task = c.task == "chat" ? "causal_lm" : c.task;
  if (c.task == "chat") o.data.format = "chat";
  o.chat.packing = c.packing;
  return o;
}

}  // namespace

std::string ConformanceReport::describe() const {
  return fmt::format(
      "{}: {} {} steps; largest loss difference {:.3g} (relative, tolerance {:.3g}), largest parameter difference "
      "{:.3g} (absolute, tolerance {:.3g}, {})",
      passed ? "PASS" : "FAIL", steps, precision, max_loss_rel_diff, loss_rtol, max_param_abs_diff, param_atol,
      worst_parameter.empty() ? "-" : worst_parameter) + (note.empty() ? "" : "; " + note);
}

void apply_check_setting(ConformanceOptions& o, const std::string& setting) {
  if (setting == "train.mode=lora" || setting == "train.mode=full" || setting == "train.mode=adalora" ||
      setting == "train.mode=prompt_tuning") {
    o.mode = setting.substr(std::string("train.mode=").size());
    return;
  }
  if (setting == "train.precision=fp32" || setting == "train.precision=bf16" || setting == "train.precision=fp16") {
    o.precision = setting.substr(std::string("train.precision=").size());
    return;
  }
  if (setting == "model.quantize=none" || setting == "model.quantize=int8" || setting == "model.quantize=nf4") {
    o.quantize = setting.substr(std::string("model.quantize=").size());
    return;
  }
  if (setting == "model.frozen_dtype=fp32" || setting == "model.frozen_dtype=bf16") {
    o.frozen_dtype = setting.substr(std::string("model.frozen_dtype=").size());
    return;
  }
  if (setting == "model.activation_checkpointing=true" || setting == "model.activation_checkpointing=false") {
    o.activation_checkpointing = setting == "model.activation_checkpointing=true";
    return;
  }
  if (setting == "model.chunked_loss=true" || setting == "model.chunked_loss=false") {
    o.chunked_loss = setting == "model.chunked_loss=true";
    return;
  }
  if (setting.rfind("model.int8_threshold=", 0) == 0) {
    const auto value = setting.substr(std::string("model.int8_threshold=").size());
    try {
      size_t used = 0;
      o.int8_threshold = std::stod(value, &used);
      if (used != value.size() || !(o.int8_threshold >= 0)) throw std::invalid_argument(value);
    } catch (const std::logic_error&) {
      throw Error(fmt::format("trainer check: model.int8_threshold must be a number >= 0, got '{}'", value));
    }
    return;
  }
  if (setting == "train.task=causal_lm" || setting == "train.task=classification") {
    o.task = setting.substr(std::string("train.task=").size());
    return;
  }
  if (setting == "data.format=chat") {  // instruction tuning: the loss on the completions' tokens
    o.task = "chat";
    return;
  }
  if (setting == "data.packing=true") {  // instruction tuning with several pairs per row
    o.task = "chat";
    o.packing = true;
    return;
  }
  if (setting == "train.device=cpu" || setting == "train.device=cuda" || setting == "train.device=auto") {
    o.device = setting.substr(std::string("train.device=").size());
    return;
  }
  if (setting.rfind("mesh.", 0) == 0) {  // the composed candidate's device mesh
    o.mesh_settings.push_back(setting.substr(std::string("mesh.").size()));
    return;
  }
  if (setting.rfind("plugin.", 0) != 0) {
    throw Error(fmt::format("trainer check takes only --set plugin.KEY=VALUE (the plugin's settings), --set mesh.DIM=N, --set "
                            "train.mode=full|lora|adalora|prompt_tuning, --set train.precision=fp32|bf16|fp16, --set model.quantize=none|int8|nf4, "
                            "--set model.int8_threshold=X, --set model.frozen_dtype=fp32|bf16, --set "
                            "model.activation_checkpointing=true|false, --set model.chunked_loss=true|false, --set "
                            "train.task=causal_lm|classification, --set "
                            "data.format=chat, data.packing=true and "
                            "--set train.device=cpu|cuda|auto, got '{}'",
                            setting));
  }
  o.plugin_settings.push_back(setting.substr(std::string("plugin.").size()));
}

std::string ConformanceCase::label() const {
  return fmt::format("{} x{}{}{}", plugin, nproc, settings.empty() ? "" : " ", fmt::join(settings, ", "));
}

std::vector<ConformanceCase> conformance_matrix(const std::vector<std::string>& plugin_dirs) {
  namespace fs = std::filesystem;
  constexpr const char* kSuffix = ".conformance.toml";
  // Each plugin's file, from the first directory that has one of its name (as plugins are found).
  std::map<std::string, fs::path> files;
  for (const auto& dir : plugin_dirs) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string file = entry.path().filename().string();
      const size_t at = file.size() > std::strlen(kSuffix) ? file.size() - std::strlen(kSuffix) : std::string::npos;
      if (at == std::string::npos || file.compare(at, std::string::npos, kSuffix) != 0) continue;
      files.emplace(file.substr(0, at), entry.path());
    }
  }
  std::vector<ConformanceCase> cases;
  for (const auto& [plugin, path] : files) {
    toml::table table;
    try {
      table = toml::parse_file(path.string());
    } catch (const toml::parse_error& e) {
      throw Error(fmt::format("{}: {} (line {})", path.string(), e.description(), e.source().begin.line));
    }
    const auto* list = table["case"].as_array();
    WEFT_CHECK(list != nullptr && table.size() == 1, "{}: expected only [[case]] tables", path.string());
    for (size_t i = 0; i < list->size(); ++i) {
      const auto* entry = list->get(i)->as_table();
      WEFT_CHECK(entry != nullptr, "{}: case {} is not a table", path.string(), i + 1);
      WEFT_CHECK(!entry->contains("plugins") || entry->get_as<std::string>("plugins") != nullptr,
                 "{}: case {}: plugins is a string (\"ddp,gpipe\")", path.string(), i + 1);
      ConformanceCase c;
      c.plugin = (*entry)["plugins"].value_or(plugin);
      c.nproc = static_cast<int>((*entry)["nproc"].value_or(int64_t{0}));
      WEFT_CHECK(c.nproc >= 1, "{}: case {} needs nproc, a positive integer", path.string(), i + 1);
      if (const auto* settings = (*entry)["settings"].as_array()) {
        for (const auto& setting : *settings) {
          const auto value = setting.value<std::string>();
          WEFT_CHECK(value.has_value(), "{}: case {}: settings are strings", path.string(), i + 1);
          c.settings.push_back(*value);
        }
      }
      for (const auto& [key, value] : *entry) {
        WEFT_CHECK(key == "plugins" || key == "nproc" || key == "settings",
                   "{}: case {}: unknown key '{}' (plugins, nproc, settings)", path.string(), i + 1, key.str());
      }
      cases.push_back(c);  // full fine-tuning as written, then LoRA
      c.settings.push_back("train.mode=lora");
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

ConformanceReport check_conformance(const ConformanceOptions& c) {
  WEFT_CHECK(!c.plugin.empty(), "conformance check: no plugin given");
  WEFT_CHECK(c.precision == "fp32" || c.precision == "bf16" || c.precision == "fp16",
             "conformance check: precision must be fp32, bf16 or fp16, got '{}'", c.precision);
  resolve_device(c.device, 0, 0, this_process_devices());  // a device the candidate cannot have: before any run
  const std::string dir = c.work_dir.empty()
                              ? (std::filesystem::temp_directory_path() / ("weft-check-" + std::to_string(::getpid()))).string()
                              : c.work_dir;
  std::filesystem::create_directories(dir);
  // A temporary folder goes whatever happens, unless it holds the log of a candidate run that failed.
  struct RemoveUnlessKept {
    std::string dir;
    bool keep = false;
    ~RemoveUnlessKept() {
      std::error_code ignored;
      if (!keep && !dir.empty()) std::filesystem::remove_all(dir, ignored);
    }
  } work{c.work_dir.empty() ? dir : std::string()};
  WEFT_CHECK(c.task == "causal_lm" || c.task == "classification" || c.task == "chat",
             "conformance check: task must be causal_lm, classification or chat, got '{}'", c.task);
  const std::string corpus = c.task == "chat" ? write_chat_corpus(dir) : write_corpus(dir, c.task == "classification");
  const std::string model_config = write_model_config(dir, c.quantize);
  TrainOptions reference_options = run_options(c, corpus, model_config, c.reference, dir + "/reference");
  reference_options.device = "cpu";  // the reference computes on the CPU whatever the candidate's device
  auto reference = std::make_unique<Trainer>(reference_options);
  auto r = reference->run();
  std::map<std::string, torch::Tensor> candidate_params;
  bool candidate_logits = false;  // some rank of the candidate computed the head's loss from whole logits
  std::vector<double> candidate_losses;
  if (c.nproc > 1) {
    // The plugin under test in real processes; rank 0 saves the final model.
    WEFT_CHECK(!c.trainer_path.empty(), "conformance check with {} ranks needs the trainer executable", c.nproc);
    const std::string out = dir + "/candidate";
    const std::string command =
        c.trainer_path + " " + run_arguments(c, corpus, model_config, out) + " > " + dir + "/candidate.log 2>&1";
    const int status = std::system(command.c_str());
    work.keep = status != 0;
    WEFT_CHECK(status == 0, "the {}-rank run of {} failed{} (see {}/candidate.log)", c.nproc, c.plugin,
               first_error(dir + "/candidate.log"), dir);
    candidate_losses = logged_losses(out + "/metrics.jsonl");
    candidate_logits = logged_logits_loss(out + "/metrics.jsonl");
    if (c.mode == "adalora") {  // the last checkpoint's allocator state: "adalora.param." + the parameter name
      // (in pieces of the rank files when the plugin splits the model)
      const std::string checkpoint = out + "/checkpoints/step-" + fmt::format("{:08}", c.steps);
      const std::string prefix = "adalora.param.";
      const NamedState pieces = NamedState::open(checkpoint);
      if (pieces.sharded()) {
        for (const auto& name : pieces.names()) {
          if (name.rfind(prefix, 0) == 0) candidate_params[name.substr(prefix.size())] = *pieces.whole(name);
        }
      } else {
        const auto state = SafetensorsFile::open(checkpoint + "/adalora_state.safetensors");
        for (const auto& info : state->tensors()) {
          if (info.name.rfind(prefix, 0) == 0) candidate_params[info.name.substr(prefix.size())] = state->load(info.name);
        }
      }
      if (c.task == "classification") {  // the head, saved beside the adapters
        const auto adapter = SafetensorsFile::open(out + "/final/adapter_model.safetensors");
        candidate_params["score.weight"] = adapter->load("base_model.model.score.weight");
      }
    } else if (c.mode == "prompt_tuning") {  // PEFT's adapter file: "prompt_embeddings"
      const auto adapter = SafetensorsFile::open(out + "/final/adapter_model.safetensors");
      candidate_params["model.prompt_embeddings"] = adapter->load("prompt_embeddings");
    } else if (c.mode == "lora") {  // PEFT's adapter file: "base_model.model." + the parameter name
      const auto adapter = SafetensorsFile::open(out + "/final/adapter_model.safetensors");
      const std::string prefix = "base_model.model.";
      for (const auto& info : adapter->tensors()) candidate_params[info.name.substr(prefix.size())] = adapter->load(info.name);
    } else {
      const auto weights = SafetensorsFile::open(out + "/final/model.safetensors");
      for (const auto& info : weights->tensors()) candidate_params[info.name] = weights->load(info.name);
    }
  } else {
    TrainOptions options = run_options(c, corpus, model_config, c.plugin, dir + "/candidate");
    options.plugin_config = plugin_table(c.plugin_settings);
    Trainer candidate(options);
    const auto result = candidate.run();
    candidate_losses = result.step_losses;
    candidate_logits = result.chunked_loss == 0;
    candidate_params = candidate.whole_parameters();  // as its save would write them
  }
  if (candidate_logits && r.chunked_loss == 1) {
    // The candidate's head could not be left to the loss (a plugin that releases it between the
    // two: a releasable flat shard): the reference computes the loss from whole logits too, as it did.
    reference_options.model.chunked_loss = false;
    reference_options.out_dir = dir + "/reference-logits";
    reference = std::make_unique<Trainer>(reference_options);
    r = reference->run();
  }

  ConformanceReport report;
  report.reference_losses = r.step_losses;
  report.plugin_losses = candidate_losses;
  const auto& p_losses = candidate_losses;
  report.steps = static_cast<int64_t>(std::min(r.step_losses.size(), p_losses.size()));
  bool same_steps = r.step_losses.size() == p_losses.size();
  for (int64_t i = 0; i < report.steps; ++i) {
    const double a = r.step_losses[i], b = p_losses[i];
    report.max_loss_rel_diff = std::max(report.max_loss_rel_diff, std::abs(a - b) / std::max(std::abs(a), 1e-12));
  }
  bool all_parameters = true;
  for (auto& item : reference->model().named_parameters()) {
    if (!item.value().requires_grad()) continue;  // frozen under LoRA (the same by construction)
    const auto it = candidate_params.find(item.key());
    if (it == candidate_params.end()) {
      all_parameters = false;
      report.worst_parameter = item.key() + " (missing)";
      continue;
    }
    const double diff = (it->second - item.value()).abs().max().item<double>();
    if (diff > report.max_param_abs_diff) {
      report.max_param_abs_diff = diff;
      report.worst_parameter = item.key();
    }
  }
  report.precision = c.precision;
  report.loss_rtol = c.precision == "fp32" ? c.loss_rtol : c.bf16_loss_rtol;
  report.param_atol = c.precision == "fp32" ? c.param_atol : c.bf16_param_atol;
  if (c.precision == "fp32" && c.quantize == "int8" && int8_gemm_checked(c) && cpu_int8_gemm_available()) {
    report.loss_rtol = c.int8_gemm_loss_rtol;
    report.param_atol = c.int8_gemm_param_atol;
    report.note = "int8 in the CPU's int8 GEMM rounds activations to 7 bits, so the int8 tolerances apply";
  }
  report.passed = same_steps && all_parameters && report.steps == c.steps &&
                  report.max_loss_rel_diff <= report.loss_rtol && report.max_param_abs_diff <= report.param_atol;
  return report;
}

}  // namespace weft
