#include "core/app/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>

#include "core/plugin/rendezvous.h"
#include "core/util/error.h"

namespace weft {
namespace {

std::vector<pid_t> children;

extern "C" void forward_signal(int signal) {
  for (pid_t pid : children) {
    if (pid > 0) ::kill(pid, signal);
  }
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

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + ::strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

pid_t spawn_rank(int rank, int nproc, int port, const std::vector<std::string>& args) {
  const pid_t pid = ::fork();
  WEFT_CHECK(pid >= 0, "launcher: fork failed: {}", std::strerror(errno));
  if (pid != 0) return pid;
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv("/proc/self/exe", argv.data());
  std::fprintf(stderr, "launcher: rank %d: exec failed: %s\n", rank, std::strerror(errno));
  std::_Exit(127);
}

void stop_all(const std::vector<pid_t>& pids, std::vector<bool>& done) {
  for (size_t r = 0; r < pids.size(); ++r) {
    if (!done[r]) ::kill(pids[r], SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    bool all = true;
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
      } else {
        all = false;
      }
    }
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (size_t r = 0; r < pids.size(); ++r) {
    if (!done[r]) {
      ::kill(pids[r], SIGKILL);
      ::waitpid(pids[r], nullptr, 0);
      done[r] = true;
    }
  }
}

}  // namespace

int launch_local_ranks(int nproc, int argc, char** argv) {
  WEFT_CHECK(nproc >= 1 && nproc <= 256, "--nproc must be between 1 and 256, got {}", nproc);
  const int port = free_local_port();
  const auto args = rank_arguments(argc, argv);
  spdlog::info("launching {} local ranks (rendezvous 127.0.0.1:{})", nproc, port);
  children.assign(static_cast<size_t>(nproc), -1);
  for (int r = 0; r < nproc; ++r) children[static_cast<size_t>(r)] = spawn_rank(r, nproc, port, args);
  ::signal(SIGINT, SIG_IGN);  // Ctrl-C reaches the ranks directly (same process group)
  ::signal(SIGTERM, forward_signal);

  std::vector<bool> done(static_cast<size_t>(nproc), false);
  int remaining = nproc;
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
    --remaining;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed) {
      spdlog::error("rank {} failed ({}); stopping the other ranks", rank, describe_status(status));
      stop_all(children, done);
      return WIFEXITED(status) && WEXITSTATUS(status) != 0 ? WEXITSTATUS(status) : 1;
    }
  }
  return 0;
}

}  // namespace weft
