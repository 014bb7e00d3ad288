// The tests' main: GoogleTest's, with a scratch folder of this process's own, and ending without
// the process's static teardown once the tests ran (core/util/quick_exit.h). ctest starts one
// process per test, and LibTorch's teardown was about a quarter of a short test's time.
//
// Scratch: TMPDIR points at a new folder, ${TMPDIR:-/tmp}/weft-test-<pid>, for this process and
// every process it starts (the trainer, torchrun, Python). It is removed when every test passed
// and kept, with its path printed, when one failed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "core/util/quick_exit.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const char* parent = std::getenv("TMPDIR");
  const std::filesystem::path scratch = std::filesystem::path(parent && *parent ? parent : "/tmp") /
                                        ("weft-test-" + std::to_string(::getpid()));
  std::error_code error;
  std::filesystem::create_directories(scratch, error);
  const bool own_scratch = !error;
  if (own_scratch) {
    ::setenv("TMPDIR", scratch.c_str(), 1);
  } else {
    std::fprintf(stderr, "test: cannot make the scratch folder %s (%s); scratch files go to %s\n", scratch.c_str(),
                 error.message().c_str(), parent && *parent ? parent : "/tmp");
  }
  const int status = RUN_ALL_TESTS();
  if (own_scratch) {
    if (status == 0) {
      std::filesystem::remove_all(scratch, error);
    } else {
      std::fprintf(stderr, "test: the scratch files of this run are kept in %s\n", scratch.c_str());
    }
  }
  weft::exit_without_teardown(status);
}
