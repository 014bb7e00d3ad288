// weft's error type. Everything that rejects user input (config, checkpoint, tokenizer, dataset,
// weights) throws weft::Error with one line that names the problem and the file or key at fault;
// the trainer prints that line and exits non-zero before any compute starts.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <fmt/format.h>

namespace weft {

// `text` as one printable line: valid UTF-8 is kept, control characters (newlines included), DEL
// and bytes that are not valid UTF-8 become \xNN. Messages often quote untrusted input (a file's
// bytes in a parse error), which must not reach a terminal raw.
std::string printable(std::string_view text);

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(printable(message)) {}
};

// Throws weft::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace weft

// Checks a condition on user input or file contents; on failure throws weft::Error.
#define WEFT_CHECK(cond, ...)              \
  do {                                     \
    if (!(cond)) ::weft::fail(__VA_ARGS__); \
  } while (0)
