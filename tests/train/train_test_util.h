// Shared helpers for the training tests: a small text corpus on disk and tiny-model options.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "core/job/options.h"

namespace weft::testing {

inline std::string fresh_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("weft_test_train_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// A JSONL corpus of `documents` short pseudo-English documents (deterministic).
inline std::string write_corpus(const std::string& dir, int documents = 40) {
  static const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
                                "and", "runs", "away", "from", "her", "sister", "at", "noon"};
  std::mt19937 rng(42);
  const std::string path = dir + "/corpus.jsonl";
  std::ofstream out(path);
  for (int d = 0; d < documents; ++d) {
    std::string text;
    for (int w = 0; w < 60; ++w) text += std::string(w ? " " : "") + words[rng() % 17];
    out << "{\"text\": \"" << text << ".\"}\n";
  }
  return path;
}

inline TrainOptions tiny_options(const std::string& dir) {
  TrainOptions o;
  o.model.preset = "tiny";
  o.model.init_std = 0.02;
  o.data.paths = {write_corpus(dir)};
  o.data.seq_len = 32;
  o.data.heldout_fraction = 0.1;
  o.data.split_seed = 3;
  o.data.cache_dir = "";
  o.data.tokenize_threads = 1;
  o.tokenizer = "byte";
  o.optim.lr = 3e-3;
  o.optim.warmup_steps = 2;
  o.seed = 5;
  o.epochs = 1;
  o.max_steps = 6;
  o.batch_size = 4;
  o.threads = 1;
  o.out_dir = dir + "/run";
  o.metrics_file = dir + "/run/metrics.jsonl";
  o.progress = "off";
  o.save_final = false;
  o.keep_best = false;
  return o;
}

}  // namespace weft::testing
