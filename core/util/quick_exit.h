// Ends a finished process without its teardown.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include <unistd.h>

namespace weft {

// Flushes stdout and stderr (C++ and C streams) and ends the process with `status` without running
// static destructors and atexit handlers. LibTorch's static teardown (unregistering thousands of
// operators, freeing their tables) costs 0.1-0.2 s of CPU per process, and weft's runs start many
// processes: every rank of a --nproc run, its launcher, each test. Call it only where nothing is
// left to finish: the files a command writes are closed by the time its function returns, and
// plugins are never unloaded anyway. Under AddressSanitizer the normal exit stays, so that its leak
// check still runs.
[[noreturn]] inline void exit_without_teardown(int status) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
#if defined(__SANITIZE_ADDRESS__)
  std::exit(status);
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  std::exit(status);
#endif
#endif
  ::_exit(status);
}

}  // namespace weft
