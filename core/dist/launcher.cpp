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
#include <string>
#include <thread>
#include <vector>

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

// torchrun's variables for rank `rank` of this job.
std::vector<std::pair<std::string, std::string>> rank_variables(int rank, int nproc, int port) {
  return {{"RANK", std::to_string(rank)},        {"LOCAL_RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(nproc)}, {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
          {"MASTER_ADDR", "127.0.0.1"},          {"MASTER_PORT", std::to_string(port)},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},  // the launcher hosts the store
          {"WEFT_LAUNCHER", "1"}};
}

// The command line without --nproc N / --nproc=N.
std::vector<std::string> rank_arguments(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--nproc") {
      ++i;
      continue;
    }
    if (arg.rfind("--nproc=", 0) == 0) continue;
    args.push_back(arg);
  }
  return args;
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
      spdlog::error("rank {} is stopped (SIGSTOP or a debugger); killing it", r);
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

// What the ranks left in the store about a collective that timed out (Communicator::wait), or "".
std::string reported_faults(c10d::Store& store, int nproc) {
  std::string text;
  try {
    for (int r = 0; r < nproc; ++r) {
      const std::string key = Communicator::fault_key(r);
      if (!store.check({key})) continue;
      const auto bytes = store.get(key);
      text += (text.empty() ? "" : "; ") + std::string(bytes.begin(), bytes.end());
    }
  } catch (const std::exception&) {
  }
  return text;
}

// Whether `rank` said its exit status is the command's answer (Communicator::answer_key).
bool declared_an_answer(c10d::Store& store, int rank) {
  try {
    return store.check({Communicator::answer_key(rank)});
  } catch (const std::exception&) {
    return false;
  }
}

int supervise(int nproc, c10d::Store& store);
LaunchResult launch_executed_ranks(int nproc, const std::vector<std::string>& args);

}  // namespace

LaunchResult launch_local_ranks(int nproc, int argc, char** argv) {
  WEFT_CHECK(nproc >= 1 && nproc <= 256, "--nproc must be between 1 and 256, got {}", nproc);
  if (const int threads = thread_count(); threads != 1) {  // a fork would copy other threads' locks
    spdlog::debug("launcher: {} threads before the ranks start: each rank executes the trainer afresh", threads);
    return launch_executed_ranks(nproc, rank_arguments(argc, argv));
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
      for (const auto& [key, value] : rank_variables(r, nproc, port)) ::setenv(key.c_str(), value.c_str(), 1);
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
    store = host_store("127.0.0.1", port, std::chrono::seconds(30));
  } catch (...) {
    for (int fd : port_pipes) ::close(fd);  // each rank reads end of file and exits 1
    for (pid_t pid : children) ::waitpid(pid, nullptr, 0);
    throw;
  }
  for (int fd : port_pipes) {
    [[maybe_unused]] const auto written = ::write(fd, &port, sizeof port);  // a dead rank shows at waitpid
    ::close(fd);
  }
  spdlog::info("launching {} local ranks (rendezvous 127.0.0.1:{})", nproc, port);
  ::signal(SIGINT, forward_signal);  // the ranks are in process groups of their own
  ::signal(SIGTERM, forward_signal);
  return LaunchResult{false, supervise(nproc, *store)};
}

namespace {

// Waits for the ranks (`children`): the launcher's exit status once every rank ended, or once one
// failed and the others were stopped.
int supervise(int nproc, c10d::Store& store) {
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
    if (WIFEXITED(status) && declared_an_answer(store, rank)) {  // trainer plan's "does not fit", not a failure
      answer = std::max(answer, WEXITSTATUS(status));
      continue;
    }
    // A rank that stopped on SIGINT/SIGTERM exits with 128 + the signal after saving its work; before
    // training starts (nothing to save) the signal ends it.
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (const int stop = stop_signal(status); stop != 0) {
      spdlog::info("rank {} stopped on signal {}{}", rank, stop, code > 0 ? " after saving its work" : "");
      if (forwarded_signal.load() == 0) forward_signal(stop);  // the others stop at the same step
      continue;
    }
    const std::string faults = reported_faults(store, nproc);
    if (!faults.empty()) {
      spdlog::error("rank {} failed ({}) because a collective timed out: {}; stopping the other ranks", rank,
                    describe_status(status), faults);
    } else {
      spdlog::error("rank {} failed ({}); stopping the other ranks", rank, describe_status(status));
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
pid_t spawn_rank(int rank, int nproc, int port, const std::vector<std::string>& args) {
  const auto job = rank_variables(rank, nproc, port);
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

LaunchResult launch_executed_ranks(int nproc, const std::vector<std::string>& args) {
  int port = 0;
  auto store = host_store("127.0.0.1", port, std::chrono::seconds(30));
  spdlog::info("launching {} local ranks (rendezvous 127.0.0.1:{})", nproc, port);
  children.assign(static_cast<size_t>(nproc), -1);
  ::signal(SIGINT, forward_signal);
  ::signal(SIGTERM, forward_signal);
  for (int r = 0; r < nproc; ++r) children[static_cast<size_t>(r)] = spawn_rank(r, nproc, port, args);
  return LaunchResult{false, supervise(nproc, *store)};
}

}  // namespace

}  // namespace weft
