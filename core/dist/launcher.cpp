#include "core/dist/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/dist/process_groups.h"
#include "core/dist/rendezvous.h"
#include "core/util/error.h"

extern char** environ;

namespace weft {
namespace {

std::vector<pid_t> children;
std::atomic<int> forwarded_signal{0};  // the last SIGTERM or SIGINT that the launcher passed on to its ranks

extern "C" void forward_signal(int signal) {
  forwarded_signal.store(signal);
  for (pid_t pid : children) {
    if (pid > 0) ::kill(pid, signal);
  }
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

LaunchPlan plan_;  // this launcher's

int first_rank() { return plan_.node_rank * plan_.nproc; }
int world_size() { return plan_.nnodes * plan_.nproc; }
std::string store_host() { return plan_.nnodes > 1 ? plan_.master_addr : "127.0.0.1"; }

// torchrun's variables for this node's rank `local` of the job.
std::vector<std::pair<std::string, std::string>> rank_variables(int local, int port) {
  return {{"RANK", std::to_string(first_rank() + local)},
          {"LOCAL_RANK", std::to_string(local)},
          {"WORLD_SIZE", std::to_string(world_size())},
          {"LOCAL_WORLD_SIZE", std::to_string(plan_.nproc)},
          {"GROUP_RANK", std::to_string(plan_.node_rank)},
          {"MASTER_ADDR", store_host()},
          {"MASTER_PORT", std::to_string(port)},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},  // the launchers host the store (node 0's)
          {"WEFT_LAUNCHER", "1"}};
}

// The command line without the launcher's flags (--nproc N, --nproc=N, ...).
std::vector<std::string> rank_arguments(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (is_launcher_flag(arg)) {
      ++i;
      continue;
    }
    if (const auto eq = arg.find('='); eq != std::string::npos && is_launcher_flag(arg.substr(0, eq))) continue;
    args.push_back(arg);
  }
  return args;
}

// A store query on the failure path, bounded: a store on another node whose link is down never
// answers.
bool ask_store(const c10::intrusive_ptr<c10d::Store>& store, std::function<void(c10d::Store&)> query) {
  return query_store_within(store, std::move(query), std::chrono::seconds(5)) == StoreAnswer::kAnswered;
}

// How many threads this process has (/proc/self/task).
int thread_count() {
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/self/task", ec), end; !ec && it != end; it.increment(ec)) ++n;
  return n;
}

// Reads the store's port from the launcher (an int, or end of file if the launcher failed first).
bool read_port(int fd, int& port) {
  auto* bytes = reinterpret_cast<char*>(&port);
  size_t got = 0;
  while (got < sizeof port) {
    const ssize_t n = ::read(fd, bytes + got, sizeof port - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    got += static_cast<size_t>(n);
  }
  return true;
}

// Whether `pid` is stopped (SIGSTOP, a debugger): it cannot act on SIGTERM until continued.
bool is_stopped(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');  // "pid (comm) STATE ..."
  return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'T' || line[close + 2] == 't');
}

// Stops every rank still running: a stopped one is killed at once (it cannot act on SIGTERM), the
// others get SIGTERM and `grace` to exit, then SIGKILL.
// Waits up to `grace` for the ranks still running to exit on their own (reaping them): a rank that
// refuses the run (a configuration it cannot use) closes its connections, and a peer may fail on that
// first; given a moment, the refusing rank prints the error that names the problem before the others
// are stopped.
void settle(const std::vector<pid_t>& pids, std::vector<bool>& done, std::chrono::milliseconds grace) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    bool all = true;
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      if (::waitpid(pids[r], nullptr, WNOHANG) == pids[r]) {
        done[r] = true;
      } else {
        all = false;
      }
    }
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void stop_all(const std::vector<pid_t> pids, std::vector<bool>& done, std::chrono::seconds grace) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (done[r]) continue;
    if (is_stopped(pids[r])) {
      spdlog::error("rank {} is stopped (SIGSTOP or a debugger); killing it", first_rank() + static_cast<int>(r));
      ::kill(pids[r], SIGKILL);
    } else {
      ::kill(pids[r], SIGTERM);
    }
  }
  settle(pids, done, grace);
  for (size_t r = 0; r < pids.size(); ++r) {
    if (!done[r]) {
      ::kill(pids[r], SIGKILL);
      ::waitpid(pids[r], nullptr, 0);
      done[r] = true;
    }
  }
}

// SIGINT or SIGTERM if a rank ended because of it (exit status 128 + the signal after saving its
// work, or killed by it before training started), else 0.
int stop_signal(int status) {
  for (int signal : {SIGINT, SIGTERM}) {
    if ((WIFEXITED(status) && WEXITSTATUS(status) == 128 + signal) ||
        (WIFSIGNALED(status) && WTERMSIG(status) == signal)) {
      return signal;
    }
  }
  return 0;
}

// What the job's ranks left in the store about a collective that timed out (Communicator::wait),
// or "".
std::string reported_faults(const c10::intrusive_ptr<c10d::Store>& store) {
  auto text = std::make_shared<std::string>();
  const int world = world_size();
  const bool answered = ask_store(store, [text, world](c10d::Store& s) {
    for (int r = 0; r < world; ++r) {
      const std::string key = Communicator::fault_key(r);
      if (!s.check({key})) continue;
      const auto bytes = s.get(key);
      *text += (text->empty() ? "" : "; ") + std::string(bytes.begin(), bytes.end());
    }
  });
  return answered ? *text : "";
}

// Whether rank `rank` said its exit status is the command's answer (Communicator::answer_key).
bool declared_an_answer(const c10::intrusive_ptr<c10d::Store>& store, int rank) {
  auto declared = std::make_shared<std::atomic<bool>>(false);
  ask_store(store, [declared, rank](c10d::Store& s) { *declared = s.check({Communicator::answer_key(rank)}); });
  return declared->load();
}

// The job's store: hosted here on one node (127.0.0.1, a free port) and on node 0 of several (at
// --master-addr's port, on every interface); the other nodes' launchers connect to node 0's,
// waiting up to 300 s for it (the nodes need not start together).
c10::intrusive_ptr<c10d::Store> job_store(int& port) {
  if (plan_.nnodes == 1) return host_store("127.0.0.1", port, std::chrono::seconds(30));
  port = plan_.master_port;
  if (plan_.node_rank == 0) return host_store(plan_.master_addr, port, std::chrono::seconds(300));
  try {
    return connect_store(plan_.master_addr, port, std::chrono::seconds(300));
  } catch (const std::exception& e) {
    fail("node {} of {}: the rendezvous store at {}:{} (node 0's launcher) did not answer within 300 s: {}",
         plan_.node_rank, plan_.nnodes, plan_.master_addr, port, e.what());
  }
}

std::string describe_launch(int port) {
  if (plan_.nnodes == 1) return fmt::format("launching {} local ranks (rendezvous 127.0.0.1:{})", plan_.nproc, port);
  return fmt::format("node {} of {}: launching ranks {}-{} of {} (rendezvous {}:{}, {})", plan_.node_rank, plan_.nnodes,
                     first_rank(), first_rank() + plan_.nproc - 1, world_size(), plan_.master_addr, port,
                     plan_.node_rank == 0 ? "hosted here" : "node 0's");
}

int supervise(const c10::intrusive_ptr<c10d::Store>& store);
LaunchResult launch_executed_ranks(const std::vector<std::string>& args);

}  // namespace

bool is_launcher_flag(const std::string& arg) {
  return arg == "--nproc" || arg == "--nnodes" || arg == "--node-rank" || arg == "--master-addr" ||
         arg == "--master-port";
}

LaunchResult launch_local_ranks(const LaunchPlan& plan, int argc, char** argv) {
  const int nproc = plan.nproc;
  WEFT_CHECK(nproc >= 1 && nproc <= 256, "--nproc must be between 1 and 256, got {}", nproc);
  WEFT_CHECK(plan.nnodes >= 1 && plan.nnodes <= 4096, "--nnodes must be between 1 and 4096, got {}", plan.nnodes);
  WEFT_CHECK(plan.node_rank >= 0 && plan.node_rank < plan.nnodes, "--node-rank {} is not a node of --nnodes {} (0 to {})",
             plan.node_rank, plan.nnodes, plan.nnodes - 1);
  WEFT_CHECK(plan.nnodes == 1 || !plan.master_addr.empty(),
             "--nnodes {}: --master-addr must name node 0 (where its launcher hosts the rendezvous)", plan.nnodes);
  WEFT_CHECK(plan.master_port > 0 && plan.master_port < 65536, "--master-port {} is not a port", plan.master_port);
  plan_ = plan;
  if (const int threads = thread_count(); threads != 1) {  // a fork would copy other threads' locks
    spdlog::debug("launcher: {} threads before the ranks start: each rank executes the trainer afresh", threads);
    return launch_executed_ranks(rank_arguments(argc, argv));
  }
  // The ranks are forks of this process, made before it has any thread (the store's server below
  // runs one): each goes on with the command as its rank, with LibTorch already loaded and
  // initialised, instead of executing the trainer again (~0.4 s of CPU per rank, mostly LibTorch's
  // static initialisation). Each waits for the store's port on a pipe.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  children.assign(static_cast<size_t>(nproc), -1);
  std::vector<int> port_pipes;
  const pid_t launcher = ::getpid();
  for (int r = 0; r < nproc; ++r) {
    int fds[2];
    WEFT_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "launcher: pipe failed: {}", std::strerror(errno));
    const pid_t pid = ::fork();
    WEFT_CHECK(pid >= 0, "launcher: fork failed: {}", std::strerror(errno));
    if (pid == 0) {
      ::close(fds[1]);
      for (int fd : port_pipes) ::close(fd);  // the earlier ranks' pipes
      // A rank dies with its launcher (kill -9 of the launcher included), also if the launcher died
      // before the request took effect.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(1);
      // A process group of its own: a signal to the launcher's group (a terminal's Ctrl-C, `timeout`,
      // a scheduler's kill) reaches the launcher alone, which passes it on once. In the launcher's
      // group a rank got Ctrl-C twice, from the terminal and from the launcher, and took the second
      // for "stop now".
      ::setpgid(0, 0);
      int port = 0;
      if (!read_port(fds[0], port)) ::_exit(1);  // the launcher failed before it had a store
      ::close(fds[0]);
      for (const auto& [key, value] : rank_variables(r, port)) ::setenv(key.c_str(), value.c_str(), 1);
      children.clear();
      return LaunchResult{true, 0};
    }
    ::setpgid(pid, pid);  // as the child does: whichever runs first
    ::close(fds[0]);
    port_pipes.push_back(fds[1]);
    children[static_cast<size_t>(r)] = pid;
  }
  // The launcher hosts the job's store, as torchrun's agent does: it outlives any rank, so the
  // ranks can leave word there of what went wrong.
  int port = 0;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = job_store(port);
  } catch (...) {
    for (int fd : port_pipes) ::close(fd);  // each rank reads end of file and exits 1
    for (pid_t pid : children) ::waitpid(pid, nullptr, 0);
    throw;
  }
  for (int fd : port_pipes) {
    [[maybe_unused]] const auto written = ::write(fd, &port, sizeof port);  // a dead rank shows at waitpid
    ::close(fd);
  }
  spdlog::info("{}", describe_launch(port));
  ::signal(SIGINT, forward_signal);  // the ranks are in process groups of their own
  ::signal(SIGTERM, forward_signal);
  return LaunchResult{false, supervise(store)};
}

namespace {

// Waits for the ranks (`children`): the launcher's exit status once every rank ended, or once one
// failed and the others were stopped.
int supervise(const c10::intrusive_ptr<c10d::Store>& store) {
  const int nproc = plan_.nproc;
  std::vector<bool> done(static_cast<size_t>(nproc), false);
  int remaining = nproc;
  int answer = 0;  // the largest exit status a rank declared the command's answer
  while (remaining > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    int rank = -1;
    for (int r = 0; r < nproc; ++r) {
      if (children[static_cast<size_t>(r)] == pid) rank = r;
    }
    if (rank < 0) continue;
    done[static_cast<size_t>(rank)] = true;
    children[static_cast<size_t>(rank)] = -1;  // reaped: its pid may be reused, never signal it again
    --remaining;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
    const int global = first_rank() + rank;  // the job's numbering, as the ranks log it
    if (WIFEXITED(status) && declared_an_answer(store, global)) {  // trainer plan's "does not fit", not a failure
      answer = std::max(answer, WEXITSTATUS(status));
      continue;
    }
    // A rank that stopped on SIGINT/SIGTERM exits with 128 + the signal after saving its work; before
    // training starts (nothing to save) the signal ends it.
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (const int stop = stop_signal(status); stop != 0) {
      spdlog::info("rank {} stopped on signal {}{}", global, stop, code > 0 ? " after saving its work" : "");
      if (forwarded_signal.load() == 0) forward_signal(stop);  // the others stop at the same step
      continue;
    }
    const std::string faults = reported_faults(store);
    if (!faults.empty()) {
      spdlog::error("rank {} failed ({}) because a collective timed out: {}; stopping the other ranks", global,
                    describe_status(status), faults);
    } else {
      spdlog::error("rank {} failed ({}); stopping the other ranks", global, describe_status(status));
    }
    settle(children, done, std::chrono::milliseconds(1500));
    stop_all(children, done, std::chrono::seconds(5));
    return code > 0 ? code : 1;
  }
  const int signal = forwarded_signal.load();
  return signal != 0 ? 128 + signal : answer;
}

// Starts one rank by executing the trainer afresh (the launcher already has threads, so it cannot
// fork ranks that go on running). Everything the child does between fork and exec is
// async-signal-safe: argv and the environment are built before fork.
pid_t spawn_rank(int local, int port, const std::vector<std::string>& args) {
  const auto job = rank_variables(local, port);
  std::vector<std::string> environment;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string variable = *entry;
    const std::string name = variable.substr(0, variable.find('='));
    bool replaced = false;
    for (const auto& [key, value] : job) replaced = replaced || key == name;
    if (!replaced) environment.push_back(variable);
  }
  for (const auto& [key, value] : job) environment.push_back(key + "=" + value);
  std::vector<char*> argv, envp;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& v : environment) envp.push_back(const_cast<char*>(v.c_str()));
  envp.push_back(nullptr);
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  WEFT_CHECK(pid >= 0, "launcher: fork failed: {}", std::strerror(errno));
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);
  ::setpgid(0, 0);
  ::execve("/proc/self/exe", argv.data(), envp.data());
  static const char message[] = "launcher: a rank could not exec the trainer\n";
  [[maybe_unused]] auto ignored = ::write(STDERR_FILENO, message, sizeof(message) - 1);
  ::_exit(127);
}

LaunchResult launch_executed_ranks(const std::vector<std::string>& args) {
  const int nproc = plan_.nproc;
  int port = 0;
  auto store = job_store(port);
  spdlog::info("{}", describe_launch(port));
  children.assign(static_cast<size_t>(nproc), -1);
  ::signal(SIGINT, forward_signal);
  ::signal(SIGTERM, forward_signal);
  for (int r = 0; r < nproc; ++r) children[static_cast<size_t>(r)] = spawn_rank(r, port, args);
  return LaunchResult{false, supervise(store)};
}

}  // namespace

}  // namespace weft
