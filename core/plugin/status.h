// The host's weft_status (sdk/include/weft/common.h): the error object that crosses the plugin
// boundary. Every status is allocated here, by the host, whoever reports the error, so whoever
// receives one releases it with status_release. The four status_* functions back the plugins'
// status services and the host's own step services (step/services.h); the helpers bridge statuses and
// C++ exceptions on the host side.
#pragma once

#include <memory>
#include <string>

#include "core/plugin/step/services.h"
#include "core/plugin/step/step.hpp"

// Defined at global scope because weft/common.h declares it there (`typedef struct weft_status`).
struct weft_status {
  weft_status_code code;
  std::string message;
};

namespace weft {

// --- the status services (noexcept: they are called from plugins) ---

// Creates a status with a copy of `message` (NULL is read as ""). A code of WEFT_STATUS_OK is a
// caller bug and is stored as WEFT_STATUS_INTERNAL. Never fails: when memory runs out it returns
// a preallocated WEFT_STATUS_INTERNAL "out of memory" status that status_release ignores.
weft_status* status_create(weft_status_code code, const char* message) noexcept;
// The status's code; WEFT_STATUS_OK for NULL.
weft_status_code status_code(const weft_status* status) noexcept;
// The status's message, valid until the status is released; "" for NULL.
const char* status_message(const weft_status* status) noexcept;
// Frees a status made by status_create. NULL and the out-of-memory status are ignored.
void status_release(weft_status* status) noexcept;

// A short name for a code, e.g. "BAD_CONFIG" (for logs): the SDK's.
using sdk::status_code_name;

// --- host-side helpers ---

struct StatusDeleter {
  void operator()(weft_status* status) const noexcept { status_release(status); }
};
// Owns a status; releases it when it goes out of scope.
using StatusPtr = std::unique_ptr<weft_status, StatusDeleter>;

// Does nothing for NULL (success). Otherwise takes ownership of `status`, releases it and throws
// weft::Error("<context>: <message>"), e.g. context "plugin ddp: create".
void throw_if_error(weft_status* status, const std::string& context);

// For the host's own C trampolines: call inside a catch block (catch (...) { return
// status_from_current_exception(); }). Returns a new WEFT_STATUS_INTERNAL status carrying the
// exception's what() (LibTorch errors without their backtrace), "out of memory" for
// std::bad_alloc, "unknown exception" for anything not derived from std::exception. Never throws.
weft_status* status_from_current_exception() noexcept;

}  // namespace weft
