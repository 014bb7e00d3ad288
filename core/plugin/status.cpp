#include "core/plugin/status.h"

#include <exception>
#include <new>

#include <c10/util/Exception.h>

#include "core/util/error.h"

namespace weft {
namespace {

// Returned when a status cannot be allocated; never freed.
weft_status out_of_memory_status{WEFT_STATUS_INTERNAL, "out of memory"};

}  // namespace

weft_status* status_create(weft_status_code code, const char* message) noexcept {
  try {
    return new weft_status{code == WEFT_STATUS_OK ? WEFT_STATUS_INTERNAL : code, message ? message : ""};
  } catch (const std::bad_alloc&) {
    return &out_of_memory_status;
  }
}

weft_status_code status_code(const weft_status* status) noexcept {
  return status ? status->code : WEFT_STATUS_OK;
}

const char* status_message(const weft_status* status) noexcept {
  return status ? status->message.c_str() : "";
}

void status_release(weft_status* status) noexcept {
  if (status != &out_of_memory_status) delete status;
}

void throw_if_error(weft_status* status, const std::string& context) {
  if (!status) return;
  const StatusPtr owned(status);
  throw Error(context + ": " + owned->message);
}

weft_status* status_from_current_exception() noexcept {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return &out_of_memory_status;
  } catch (const c10::Error& e) {
    return status_create(WEFT_STATUS_INTERNAL, e.what_without_backtrace());
  } catch (const std::exception& e) {
    return status_create(WEFT_STATUS_INTERNAL, e.what());
  } catch (...) {
    return status_create(WEFT_STATUS_INTERNAL, "unknown exception");
  }
}

}  // namespace weft
