// The host's weft_status: its status services and the status <-> exception bridges.
#include <cstring>
#include <new>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/plugin/status.h"
#include "core/util/error.h"

namespace weft {
namespace {

TEST(Status, CreateCopiesCodeAndMessage) {
  char message[] = "bucket 3 failed";
  weft_status* status = status_create(WEFT_STATUS_COMMUNICATION, message);
  std::strcpy(message, "overwritten!!!");
  EXPECT_EQ(status_code(status), WEFT_STATUS_COMMUNICATION);
  EXPECT_STREQ(status_message(status), "bucket 3 failed");
  status_release(status);
}

TEST(Status, OkCodeBecomesInternalAndNullMessageIsEmpty) {
  StatusPtr status(status_create(WEFT_STATUS_OK, nullptr));
  EXPECT_EQ(status_code(status.get()), WEFT_STATUS_INTERNAL);
  EXPECT_STREQ(status_message(status.get()), "");
}

TEST(Status, NullIsSuccess) {
  EXPECT_EQ(status_code(nullptr), WEFT_STATUS_OK);
  EXPECT_STREQ(status_message(nullptr), "");
  status_release(nullptr);
  EXPECT_NO_THROW(throw_if_error(nullptr, "never"));
}

TEST(Status, CodeNames) {
  EXPECT_STREQ(status_code_name(WEFT_STATUS_BAD_CONFIG), "BAD_CONFIG");
  EXPECT_STREQ(status_code_name(WEFT_STATUS_TIMEOUT), "TIMEOUT");
  EXPECT_STREQ(status_code_name(static_cast<weft_status_code>(42)), "UNKNOWN");
}

TEST(Status, ThrowIfErrorPrefixesTheContext) {
  try {
    throw_if_error(status_create(WEFT_STATUS_BAD_CONFIG, "world size 3 is odd"), "plugin tp: create");
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "plugin tp: create: world size 3 is odd");
  }
}

weft_status* status_of(void (*thrower)()) {
  try {
    thrower();
  } catch (...) {
    return status_from_current_exception();
  }
  return nullptr;
}

TEST(Status, FromCurrentExceptionKeepsWhat) {
  StatusPtr error(status_of([] { fail("config key {} is missing", "plugin.bucket_mb"); }));
  EXPECT_EQ(status_code(error.get()), WEFT_STATUS_INTERNAL);
  EXPECT_STREQ(status_message(error.get()), "config key plugin.bucket_mb is missing");

  StatusPtr torch_error(status_of([] { TORCH_CHECK(false, "shapes [2] and [3] differ"); }));
  EXPECT_STREQ(status_message(torch_error.get()), "shapes [2] and [3] differ");  // no backtrace

  StatusPtr unknown(status_of([] { throw 7; }));
  EXPECT_STREQ(status_message(unknown.get()), "unknown exception");
}

TEST(Status, OutOfMemoryStatusIsStaticAndSurvivesRelease) {
  weft_status* oom = status_of([] { throw std::bad_alloc(); });
  EXPECT_EQ(status_code(oom), WEFT_STATUS_INTERNAL);
  EXPECT_STREQ(status_message(oom), "out of memory");
  status_release(oom);  // ignored: deleting the static status would crash or corrupt the heap
  status_release(oom);
  EXPECT_EQ(status_of([] { throw std::bad_alloc(); }), oom);  // the same preallocated object
  EXPECT_STREQ(status_message(oom), "out of memory");
}

}  // namespace
}  // namespace weft
