#include "core/train/interrupt.h"

#include <atomic>
#include <csignal>

namespace weft {
namespace {

std::atomic<int> pending_signal{0};

extern "C" void on_stop_signal(int signal) {
  if (pending_signal.exchange(signal) != 0 && signal == SIGINT) {
    std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C: stop now
    std::raise(SIGINT);
  }
}

}  // namespace

void install_interrupt_handlers() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}

int interrupt_signal() { return pending_signal.load(); }

void clear_interrupt() { pending_signal.store(0); }

}  // namespace weft
