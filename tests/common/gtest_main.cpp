// The tests' main: GoogleTest's, ending without the process's static teardown once the tests ran
// (core/util/quick_exit.h). ctest starts one process per test, and LibTorch's teardown was about a
// quarter of a short test's time.
#include <gtest/gtest.h>

#include "core/util/quick_exit.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
  weft::exit_without_teardown(status);
}
