// A deterministic pseudo-English JSONL corpus for multi-process tests (no data files needed).
#pragma once

#include <fstream>
#include <random>
#include <string>

namespace weft {
namespace testing {

// Writes `documents` lines of 80 words each to <dir>/corpus.jsonl; returns the path.
inline std::string write_word_corpus(const std::string& dir, int documents = 40) {
  static const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog",
                                "and", "runs", "away", "from", "her", "sister", "at", "noon"};
  std::mt19937 rng(42);
  std::ofstream out(dir + "/corpus.jsonl");
  for (int d = 0; d < documents; ++d) {
    std::string text;
    for (int w = 0; w < 80; ++w) text += std::string(w ? " " : "") + words[rng() % 17];
    out << "{\"text\": \"" << text << ".\"}\n";
  }
  return dir + "/corpus.jsonl";
}

// Writes 30 paragraphs of English prose (blank-line separated) to <dir>/corpus.txt; returns the path.
inline std::string write_prose_corpus(const std::string& dir) {
  std::ofstream out(dir + "/corpus.txt");
  for (int p = 0; p < 30; ++p) {
    out << "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
           "must be in want of a wife. Paragraph " << p << ".\n\n";
  }
  return dir + "/corpus.txt";
}

}  // namespace testing
}  // namespace weft
