// Multi-process runs under faults, with real processes: a rank cancelled while it waits at the
// rendezvous, a peer that never comes, SIGTERM under plugins that split the model over ranks (a
// checkpoint of every rank's pieces, resumed), and checkpoint.resume = auto on a fresh run.
#include <chrono>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "common/corpus.h"
#include "common/process.h"
#include "dist/signal_run.h"
#include "test_paths.h"

namespace {

using weft::testing::run_command;
using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_dist_faults", name); }

// The tiny preset on the test corpus, writing to DIR/out.
std::string tiny_args(const std::string& dir) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
         weft::testing::write_word_corpus(dir) + " --set data.cache_dir=" + dir +
         "/cache --set data.seq_len=32 --set log.progress=off --set train.out_dir=" + dir + "/out";
}

std::string free_port() {
  // The kernel's choice of a port free a moment ago (the trainer's own helper is not linked here).
  return weft::testing::last_line(
      run_command("python3 -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])'")
          .output);
}

TEST(DistFaults, ARankWaitingAtTheRendezvousStopsAtOnceOnSigterm) {
  // Rank 0 of 2 waits for rank 1, which never comes; a cancel (SIGTERM, as Slurm and torchrun send)
  // must end it at once, not after train.collective_timeout_s (60 s here).
  const auto dir = fresh_dir("rendezvous_sigterm");
  const std::string script =
      "RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + free_port() + " OMP_NUM_THREADS=1 " +
      WEFT_TRAINER_PATH + " " + tiny_args(dir) + " --plugin ddp --set train.collective_timeout_s=60 > " + dir +
      "/log.txt 2>&1 & pid=$!; for i in $(seq 100); do grep -q 'config' " + dir +
      "/log.txt && break; sleep 0.1; done; sleep 1; start=$(date +%s.%N); kill -TERM $pid; wait $pid; status=$?; "
      "echo $status $(awk \"BEGIN { print $(date +%s.%N) - $start }\")";
  const std::string line = weft::testing::last_line(run_command(script).output);
  std::istringstream in(line);
  std::string status;
  double seconds = 0;
  in >> status >> seconds;
  EXPECT_EQ(status, "143") << line << "\n" << weft::testing::read_text(dir + "/log.txt");
  EXPECT_LT(seconds, 3.0) << weft::testing::read_text(dir + "/log.txt");
}

TEST(DistFaults, AMissingPeerIsNamedWithTheRendezvousAndTheSetting) {
  const auto dir = fresh_dir("missing_peer");
  const std::string port = free_port();
  // Rank 0 hosts the store; rank 1 never arrives.
  const auto alone = run_command("RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                                 " OMP_NUM_THREADS=1 " + WEFT_TRAINER_PATH + " " + tiny_args(dir) +
                                 " --plugin ddp --set train.collective_timeout_s=2");
  EXPECT_EQ(alone.exit_code, 1) << alone.output;
  EXPECT_NE(alone.output.find("rendezvous at 127.0.0.1:" + port + " (hosted by rank 0; MASTER_ADDR and MASTER_PORT "
                              "from torchrun's environment): 1 of 2 ranks did not arrive within 2 s "
                              "(train.collective_timeout_s): rank 1"),
            std::string::npos) << alone.output;
  EXPECT_EQ(alone.output.find("Socket Timeout"), std::string::npos) << alone.output;
  // Rank 1 finds no store: nobody hosts it.
  const auto orphan = run_command("RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                                  " OMP_NUM_THREADS=1 " + WEFT_TRAINER_PATH + " " + tiny_args(dir) +
                                  " --plugin ddp --set train.collective_timeout_s=2");
  EXPECT_EQ(orphan.exit_code, 1) << orphan.output;
  EXPECT_NE(orphan.output.find("rank 1 could not reach the rendezvous store at 127.0.0.1:" + port +
                               " (hosted by rank 0; MASTER_ADDR and MASTER_PORT from torchrun's environment) within "
                               "2 s (train.collective_timeout_s): rank 0 has not started, or the address is wrong"),
            std::string::npos) << orphan.output;
}

TEST(DistFaults, SigtermUnderAPluginThatSplitsTheModelSavesACheckpointThatResumes) {
  // gpipe and tensor_parallel split the model over ranks: a SIGTERM saves every rank's pieces
  // (core/train/named_state.h), and checkpoint.resume = auto continues from them.
  for (const std::string plugin : {"gpipe", "tensor_parallel"}) {
    const auto run = weft::testing::signal_a_rank("sigterm_" + plugin, "TERM", "", /*rank=*/-1, plugin);
    EXPECT_EQ(run.status, "143") << run.log;
    EXPECT_NE(run.log.find("checkpoint saved; continue with checkpoint.resume=auto"), std::string::npos) << run.log;
    const std::string latest = weft::testing::read_text(run.out_dir + "/checkpoints/latest");
    ASSERT_FALSE(latest.empty()) << run.log;
    const std::string checkpoint = run.out_dir + "/checkpoints/" + latest.substr(0, latest.find('\n'));
    EXPECT_TRUE(std::filesystem::exists(checkpoint + "/shards/index.json")) << checkpoint;
    // The run's own command line, resumed for one more step.
    const int64_t step = std::stoll(checkpoint.substr(checkpoint.size() - 8));
    const auto resumed = run_trainer("--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                                     weft::testing::write_word_corpus(run.out_dir + "/..") + " --set data.cache_dir=" +
                                     run.out_dir + "/../cache --set data.seq_len=32 --set train.epochs=100000"
                                     " --set log.progress=off --set train.out_dir=" + run.out_dir + " --plugin " +
                                     plugin + " --nproc 2 --set checkpoint.resume=auto --set train.max_steps=" +
                                     std::to_string(step + 1));
    EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from " + checkpoint + " at step " + std::to_string(step)), std::string::npos)
        << resumed.output;
  }
}

TEST(DistFaults, ResumeAutoOnAFreshRunStartsFreshUnderEveryPlugin) {
  // Nothing to resume means start fresh, under plugins that split the model too.
  const auto dir = fresh_dir("resume_auto");
  for (const std::string plugin : {"gpipe", "tensor_parallel"}) {
    const auto r = run_trainer(tiny_args(dir) + "_" + plugin + " --plugin " + plugin +
                               " --nproc 2 --set checkpoint.resume=auto --set train.max_steps=2");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("checkpoint.resume = auto: no checkpoint in"), std::string::npos) << r.output;
  }
}

}  // namespace
