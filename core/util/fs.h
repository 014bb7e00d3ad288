// File-system helpers shared by checkpoints, caches and metrics.
#pragma once

#include <string>

namespace weft {

// Writes `contents` to `path` atomically: a temporary file in the same directory, flushed and
// fsynced, then renamed over `path`. A crash leaves either the old file or the new one.
void write_file_atomically(const std::string& path, const std::string& contents);

// Reads a whole file; throws weft::Error naming the path if it cannot.
std::string read_file(const std::string& path);

// fsyncs a directory so a rename inside it is durable.
void sync_directory(const std::string& dir);

}  // namespace weft
