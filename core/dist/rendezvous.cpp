#include "core/dist/rendezvous.h"

#include <arpa/inet.h>
#include <signal.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/dist/process_groups.h"
#include "core/util/error.h"

namespace weft {
namespace {

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

int env_int(const char* name, int fallback, int min_value) {
  const char* value = env(name);
  if (!value) return fallback;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  WEFT_CHECK(end && *end == '\0' && parsed >= min_value && parsed <= 1 << 24,
             "environment variable {}='{}' is not a valid number (>= {})", name, value, min_value);
  return static_cast<int>(parsed);
}

// The job's TCPStore. Its server uses libuv where this LibTorch was built with it (PyTorch's wheels)
// and the classic one where not (Debian 13's 2.6 refuses libuv);
// USE_LIBUV=0, torchrun's switch, asks for the classic one.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, c10d::TCPStoreOptions options) {
  const char* use_libuv = env("USE_LIBUV");
  const bool libuv = !(use_libuv && std::string(use_libuv) == "0");
  options.useLibUV = libuv;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, options);
  } catch (const std::exception& ex) {
    if (!libuv || std::string(ex.what()).find("libuv") == std::string::npos) throw;
    spdlog::debug("TCPStore: this LibTorch was built without libuv; using the classic server ({})", ex.what());
  }
  options.useLibUV = false;
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

bool is_loopback_interface(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return false;
  bool loopback = false;
  for (const ifaddrs* a = list; a; a = a->ifa_next) {
    if (a->ifa_name && name == a->ifa_name && (a->ifa_flags & IFF_LOOPBACK)) loopback = true;
  }
  ::freeifaddrs(list);
  return loopback;
}

}  // namespace

int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  WEFT_CHECK(fd >= 0, "cannot create a socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  WEFT_CHECK(ok, "cannot find a free port on 127.0.0.1");
  return ntohs(address.sin_port);
}

DistributedEnv detect_distributed_env() {
  DistributedEnv e;
  if (env("WORLD_SIZE") || env("RANK")) {
    WEFT_CHECK(env("WORLD_SIZE") && env("RANK"), "RANK and WORLD_SIZE must be set together (torchrun convention)");
    e.source = "torchrun";
    e.rank = env_int("RANK", 0, 0);
    e.world = env_int("WORLD_SIZE", 1, 1);
    e.local_rank = env_int("LOCAL_RANK", e.rank, 0);
    e.local_world = env_int("LOCAL_WORLD_SIZE", e.world, 1);
    e.spans_nodes = e.local_world < e.world;
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    e.source = "slurm";
    e.rank = env_int("SLURM_PROCID", 0, 0);
    e.world = env_int("SLURM_NTASKS", 1, 1);
    e.local_rank = env_int("SLURM_LOCALID", 0, 0);
    const int nodes = env_int("SLURM_NNODES", 1, 1);
    e.spans_nodes = nodes > 1;
    e.local_world = e.world % nodes == 0 ? e.world / nodes : 0;
    WEFT_CHECK(e.world == 1 || env("MASTER_ADDR"),
               "running under Slurm with {} tasks: set MASTER_ADDR to the first host of SLURM_JOB_NODELIST", e.world);
  } else {
    return e;
  }
  WEFT_CHECK(e.rank < e.world, "rank {} is not below the world size {}", e.rank, e.world);
  if (const char* agent = env("TORCHELASTIC_USE_AGENT_STORE")) e.agent_store = std::string(agent) == "True";
  if (const char* addr = env("MASTER_ADDR")) e.master_addr = addr;
  e.master_port = env_int("MASTER_PORT", 29500, 1);
  WEFT_CHECK(e.master_port <= 65535, "MASTER_PORT {} is not a TCP port", e.master_port);
  return e;
}

GlooNetwork gloo_network(const DistributedEnv& e) {
  GlooNetwork network;
  if (const char* names = env("GLOO_SOCKET_IFNAME")) {
    std::string list = names;
    for (size_t start = 0; start <= list.size();) {
      const size_t end = std::min(list.find(',', start), list.size());
      const std::string name = list.substr(start, end - start);
      WEFT_CHECK(!name.empty() && ::if_nametoindex(name.c_str()) != 0,
                 "GLOO_SOCKET_IFNAME='{}' names '{}', which is not a network interface of this node", list, name);
      WEFT_CHECK(!e.spans_nodes || !is_loopback_interface(name),
                 "GLOO_SOCKET_IFNAME='{}' names the loopback interface '{}', but the job spans nodes: name the "
                 "interface the nodes share", list, name);
      network.interfaces.push_back(name);
      start = end + 1;
    }
    return network;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int status = ::getaddrinfo(e.master_addr.c_str(), nullptr, &hints, &found);
  WEFT_CHECK(status == 0 && found, "MASTER_ADDR '{}' does not resolve to an IPv4 address on this node ({})",
             e.master_addr, ::gai_strerror(status));
  sockaddr_in master = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  if ((ntohl(master.sin_addr.s_addr) >> 24) == 127) {
    WEFT_CHECK(!e.spans_nodes,
               "MASTER_ADDR '{}' is a loopback address on this node, but the job spans nodes: set MASTER_ADDR to an "
               "address the other nodes reach (or GLOO_SOCKET_IFNAME to the interface they share)",
               e.master_addr);
    return network;
  }
  // A connected UDP socket sends nothing; it asks the kernel which source address the route uses.
  master.sin_port = htons(static_cast<uint16_t>(e.master_port));
  const int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  WEFT_CHECK(fd >= 0, "cannot create a socket");
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  const bool routed = ::connect(fd, reinterpret_cast<sockaddr*>(&master), sizeof(master)) == 0 &&
                      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  ::close(fd);
  char text[INET_ADDRSTRLEN] = {};
  WEFT_CHECK(routed && ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)),
             "this node has no route to MASTER_ADDR '{}': set MASTER_ADDR to an address it reaches, or "
             "GLOO_SOCKET_IFNAME to the interface to use", e.master_addr);
  network.address = text;
  return network;
}

namespace {

// "127.0.0.1:29500 (MASTER_ADDR, MASTER_PORT from trainer --nproc)"
std::string describe_rendezvous(const DistributedEnv& e) {
  const char* origin = e.source == "slurm" ? "MASTER_ADDR and MASTER_PORT under Slurm"
                       : std::getenv("WEFT_LAUNCHER") != nullptr ? "set by trainer --nproc"
                                                                 : "MASTER_ADDR and MASTER_PORT from torchrun's environment";
  const char* host = e.agent_store ? "hosted by the launcher" : "hosted by rank 0";
  return fmt::format("{}:{} ({}; {})", e.master_addr, e.master_port, host, origin);
}

}  // namespace

c10::intrusive_ptr<c10d::Store> host_store(const std::string& host, int& port, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = timeout;
  auto store = make_tcp_store(host, options);
  port = static_cast<c10d::TCPStore&>(*store).getPort();
  return store;
}

c10::intrusive_ptr<c10d::Store> connect_store(const std::string& host, int port, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = timeout;
  return make_tcp_store(host, options);
}

std::unique_ptr<Communicator> join_world(const DistributedEnv& e, std::chrono::milliseconds timeout,
                                         const std::string& backend) {
  if (e.world == 1) return Communicator::single_process(timeout);
  // A peer that dies leaves sockets whose next write raises SIGPIPE, and its default action ends
  // this rank on the spot: no message naming the lost rank, exit status 128+13. Ignored (as Python,
  // and so PyTorch's own ranks, do), the write fails with EPIPE and the collective reports it.
  if (struct sigaction current {}; ::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  const GlooNetwork network = gloo_network(e);  // a bad address fails here, before the rendezvous
  spdlog::debug("rank {}: Gloo listens on {}", e.rank, network.describe());
  const double seconds = std::chrono::duration<double>(timeout).count();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Reach the store (or host it: rank 0 without a launcher's store).
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(e.master_port);
  options.isServer = e.rank == 0 && !e.agent_store;
  options.waitWorkers = false;  // arrivals are counted below, so that the missing ones can be named
  options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = make_tcp_store(e.master_addr, options);
  } catch (const std::exception& ex) {
    const std::string cause = std::string(ex.what()).substr(0, std::string(ex.what()).find('\n'));
    if (options.isServer) {
      fail("rank 0 could not host the rendezvous store at {}: {} (is the port in use?)", describe_rendezvous(e), cause);
    }
    fail("rank {} could not reach the rendezvous store at {} within {:.0f} s (train.collective_timeout_s): {} ({})",
         e.rank, describe_rendezvous(e), seconds,
         e.agent_store ? "the launcher is gone, or the address is wrong" : "rank 0 has not started, or the address is wrong",
         cause);
  }
  // Arrive, and wait for the others: the last to arrive opens the door.
  const std::string prefix = "weft/rendezvous/";
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string me = fmt::format("pid {} on {}, Gloo on {}", ::getpid(), host, network.describe());
  store->set(prefix + "rank/" + std::to_string(e.rank), std::vector<uint8_t>(me.begin(), me.end()));
  if (store->add(prefix + "arrived", 1) == e.world) store->set(prefix + "complete", std::vector<uint8_t>{'1'});
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  try {
    store->wait({prefix + "complete"}, std::max(left, std::chrono::milliseconds(1)));
  } catch (const std::exception&) {
    std::vector<int> missing;
    try {
      for (int r = 0; r < e.world; ++r) {
        if (!store->check({prefix + "rank/" + std::to_string(r)})) missing.push_back(r);
      }
    } catch (const std::exception&) {
    }
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 16; ++i) list += (i ? ", " : "") + std::to_string(missing[i]);
    if (missing.size() > 16) list += fmt::format(" and {} more", missing.size() - 16);
    fail("rendezvous at {}: {} of {} ranks did not arrive within {:.0f} s (train.collective_timeout_s){}",
         describe_rendezvous(e), missing.empty() ? std::string("some") : std::to_string(missing.size()), e.world,
         seconds, missing.empty() ? "" : ": rank" + std::string(missing.size() > 1 ? "s " : " ") + list);
  }
  auto communicator = std::make_unique<Communicator>(store, e.rank, e.world, timeout, backend, network);
  communicator->set_store_address(fmt::format("{}:{}", e.master_addr, e.master_port));
  return communicator;
}

void check_same_everywhere(Communicator& communicator, const std::string& what, const std::string& fingerprint) {
  auto& store = communicator.store();
  const int rank = communicator.world().rank, world = communicator.world().size;
  const std::string prefix = "weft/check/" + what + "/";
  store.set(prefix + std::to_string(rank), std::vector<uint8_t>(fingerprint.begin(), fingerprint.end()));
  for (int r = 0; r < world; ++r) {
    const auto bytes = store.get(prefix + std::to_string(r));
    const std::string theirs(bytes.begin(), bytes.end());
    WEFT_CHECK(theirs == fingerprint, "ranks disagree on the {}: rank {} has '{}' but rank {} has '{}'", what, rank,
               fingerprint, r, theirs);
  }
}

}  // namespace weft
