// "Did you mean ...?": the candidate closest to a misspelt word (config keys, plugin names).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace weft {

// Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps.
size_t edit_distance(const std::string& a, const std::string& b);

// The candidate closest to `word`, if within a third of the longer length (at least 1 edit).
std::optional<std::string> closest(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace weft
