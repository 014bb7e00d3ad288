#include "core/dist/link_counter.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <fstream>

#include "core/dist/process_groups.h"
#include "core/dist/rendezvous.h"

namespace weft {
namespace {

int64_t read_counter(const std::string& interface, const char* name) {
  std::ifstream in("/sys/class/net/" + interface + "/statistics/" + name);
  int64_t value = -1;
  if (!(in >> value)) return -1;
  return value;
}

// The interface that holds IPv4 `address`, or "".
std::string interface_holding(const std::string& address) {
  in_addr wanted{};
  if (::inet_pton(AF_INET, address.c_str(), &wanted) != 1) return "";
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (const ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == wanted.s_addr) found = a->ifa_name;
  }
  ::freeifaddrs(list);
  return found;
}

}  // namespace

std::optional<LinkCounter> LinkCounter::for_network(const GlooNetwork& network) {
  LinkCounter counter;
  counter.interfaces_ = network.interfaces;
  if (counter.interfaces_.empty()) {
    const std::string interface = interface_holding(network.address);
    if (interface.empty() || interface == "lo") return std::nullopt;
    counter.interfaces_.push_back(interface);
  }
  if (counter.bytes() < 0) return std::nullopt;
  return counter;
}

std::optional<LinkCounter> LinkCounter::for_job(const DistributedEnv& env) {
  if (!env.spans_nodes) return std::nullopt;
  return for_network(gloo_network(env));
}

int64_t LinkCounter::bytes() const {
  int64_t total = 0;
  for (const auto& interface : interfaces_) {
    const int64_t rx = read_counter(interface, "rx_bytes"), tx = read_counter(interface, "tx_bytes");
    if (rx < 0 || tx < 0) return -1;
    total += rx + tx;
  }
  return total;
}

}  // namespace weft
