// Shell command lines: quoting arguments so that a recorded or spawned command means exactly
// what its argument vector did (run reports' "reproduce" line, trainer bench's child runs).
#pragma once

#include <string>
#include <vector>

namespace weft {

// `arg` as one POSIX shell word: unchanged when it has only [A-Za-z0-9_./=:,@%+-] (and is not
// empty), otherwise in single quotes with every ' written as '\''.
std::string shell_quote(const std::string& arg);

// The arguments quoted and joined by spaces.
std::string shell_join(const std::vector<std::string>& args);

// "cd <current directory> && <argv quoted>": the command line this process was started with,
// runnable from anywhere.
std::string reproducible_command_line(int argc, char** argv);

}  // namespace weft
