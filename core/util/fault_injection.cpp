#include "core/util/fault_injection.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include "core/util/error.h"

namespace weft {
namespace {

struct Armed {
  bool on = false;
  std::string point;
  long long nth = 0;
  std::atomic<long long> visits{0};
};

Armed& armed() {
  static Armed* a = [] {
    auto* state = new Armed();
    const char* spec = std::getenv("WEFT_FAULT_INJECT");
    if (spec == nullptr || *spec == '\0') return state;
    const std::string text = spec;
    const auto first = text.find(':'), second = text.rfind(':');
    WEFT_CHECK(first != std::string::npos && second != first,
               "WEFT_FAULT_INJECT='{}' is not <rank>:<point>:<n> (e.g. 1:backward:3)", text);
    const std::string point = text.substr(first + 1, second - first - 1);
    WEFT_CHECK(point == "forward" || point == "backward" || point == "collective" || point == "save" ||
                   point == "save_local" || point == "eval",
               "WEFT_FAULT_INJECT='{}': the point must be forward, backward, collective, save, save_local or eval", text);
    long long rank = 0, nth = 0;
    try {
      rank = std::stoll(text.substr(0, first));
      nth = std::stoll(text.substr(second + 1));
    } catch (const std::exception&) {
      fail("WEFT_FAULT_INJECT='{}' is not <rank>:<point>:<n> (e.g. 1:backward:3)", text);
    }
    WEFT_CHECK(nth >= 1, "WEFT_FAULT_INJECT='{}': n counts from 1", text);
    const char* my_rank = std::getenv("RANK");
    state->on = rank == (my_rank != nullptr ? std::atoll(my_rank) : 0);
    state->point = point;
    state->nth = nth;
    return state;
  }();
  return *a;
}

}  // namespace

bool fault_injection_armed() { return armed().on; }

void fault_point(const char* point) {
  Armed& a = armed();
  if (!a.on || a.point != point) return;
  if (++a.visits != a.nth) return;
  // One line first (async-signal-safe write), so a test can time how soon the others stop.
  const std::string line = "weft: fault injection: SIGKILL at " + a.point + " #" + std::to_string(a.nth) + "\n";
  (void)!::write(STDERR_FILENO, line.data(), line.size());
  ::kill(::getpid(), SIGKILL);
}

}  // namespace weft
