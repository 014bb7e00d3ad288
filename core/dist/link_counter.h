// The bytes a node's network link carried: the kernel's counters (/sys/class/net/IF/statistics,
// rx_bytes + tx_bytes) of the interfaces this rank's Gloo connections use. In a job that spans
// nodes, what crosses between this node and the others; traffic between ranks of one node goes
// over the loopback and is not counted. Other traffic of the node on the same interfaces is.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace weft {

struct DistributedEnv;
struct GlooNetwork;

class LinkCounter {
 public:
  // The interfaces of `network` (GLOO_SOCKET_IFNAME's, or the one holding its address); nullopt
  // where there is none to count (the loopback address of a one-node job, an address no interface
  // of this node holds, counters the kernel does not expose).
  static std::optional<LinkCounter> for_network(const GlooNetwork& network);
  // For a job that spans nodes (env.spans_nodes): for_network(gloo_network(env)); else nullopt.
  static std::optional<LinkCounter> for_job(const DistributedEnv& env);

  // Received + sent bytes so far, summed over the interfaces (-1 where a counter cannot be read).
  int64_t bytes() const;
  const std::vector<std::string>& interfaces() const { return interfaces_; }

 private:
  std::vector<std::string> interfaces_;
};

}  // namespace weft
