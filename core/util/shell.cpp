#include "core/util/shell.h"

#include <filesystem>

namespace weft {

std::string shell_quote(const std::string& arg) {
  bool safe = !arg.empty();
  for (char c : arg) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       std::string("_./=:,@%+-").find(c) != std::string::npos;
    safe = safe && plain;
  }
  if (safe) return arg;
  std::string quoted = "'";
  for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

std::string shell_join(const std::vector<std::string>& args) {
  std::string out;
  for (const auto& arg : args) out += (out.empty() ? "" : " ") + shell_quote(arg);
  return out;
}

std::string reproducible_command_line(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  return "cd " + shell_quote(std::filesystem::current_path().string()) + " && " + shell_join(args);
}

}  // namespace weft
