// File-system helpers shared by checkpoints, caches and metrics.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace weft {

// Receives the bytes of a file being written.
using ByteSink = std::function<void(const void* bytes, size_t count)>;

// Replaces `path` atomically: `write_content` writes everything through the sink into
// "<path>.tmp.<pid>", which is fsynced and renamed over `path`, then the directory is fsynced.
// A crash leaves either the old file or the new one. On any failure (including an exception
// thrown by `write_content`) the temp file is removed, `path` is untouched, and the error
// propagates; I/O errors are weft::Error naming the file and errno's text.
void write_file_atomically(const std::string& path,
                           const std::function<void(const ByteSink&)>& write_content);

// The same for contents already in memory.
void write_file_atomically(const std::string& path, const std::string& contents);

// Reads a whole file; throws weft::Error naming the path if it cannot.
std::string read_file(const std::string& path);

// fsyncs a directory so a rename inside it is durable.
void sync_directory(const std::string& dir);

}  // namespace weft
