// The local launcher (trainer --nproc) with real processes: a rank that dies, hangs or is
// signalled, the launcher killed, a clean SIGTERM, and joining a job the torchrun way.
#include <filesystem>
#include <vector>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/corpus.h"
#include "common/metrics.h"
#include "common/process.h"
#include "dist/signal_run.h"
#include "test_paths.h"

namespace launcher_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_launcher", name); }

std::string write_corpus(const std::string& dir) { return weft::testing::write_word_corpus(dir); }

TEST(Launcher, AKilledRankStopsTheRunWithItsRankAndStatus) {
  // Rank 1 dies once training starts; the launcher must stop rank 0 and name rank 1.
  const auto run = weft::testing::signal_a_rank("kill", "KILL", "");
  EXPECT_NE(run.status, "0") << run.log;
  EXPECT_NE(run.log.find("rank 1 failed (signal"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("stopping the other ranks"), std::string::npos) << run.log;
}

TEST(Launcher, AHungRankIsNamedAndTheRunEndsWithinTheTimeout) {
  // Rank 1 is stopped (SIGSTOP: alive, connections open, never joins the next all-reduce). Rank 0
  // must give up after train.collective_timeout_s naming the operation, the setting and rank 1
  // (it asks the store who reached the all-reduce); the launcher must name rank 1 too (not the
  // healthy rank that noticed), kill the stopped rank at once, and end the run within the timeout
  // plus a small margin (it took the timeout plus a fixed 10 s grace before).
  const auto run = weft::testing::signal_a_rank("hang", "STOP", "--set train.collective_timeout_s=3");
  EXPECT_NE(run.status, "0") << run.log;
  EXPECT_NE(run.log.find("timed out after 3 s (train.collective_timeout_s): rank 1 did not join it"),
            std::string::npos) << run.log;
  EXPECT_NE(run.log.find("because a collective timed out: rank 0: all_reduce #"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("rank 1 is stopped (SIGSTOP or a debugger); killing it"), std::string::npos) << run.log;
  EXPECT_GT(run.seconds, 2.5) << run.log;
  EXPECT_LT(run.seconds, 3 + 3.5) << "the run did not end within the timeout and a small margin\n" << run.log;
  // Rank 0's flight record (the stopped rank writes none): its last operation is the all-reduce
  // that timed out, on the world group, after the ones that completed; the log names the file.
  const std::string record = run.out_dir + "/flight_recorder.rank0.json";
  EXPECT_NE(run.log.find("this rank's last operations: " + record), std::string::npos) << run.log;
  const auto flight = nlohmann::json::parse(weft::testing::read_text(record));
  EXPECT_EQ(flight["rank"], 0);
  const auto& operations = flight["operations"];
  ASSERT_GE(operations.size(), 2u) << flight.dump();
  EXPECT_EQ(operations.back()["operation"], "all_reduce") << flight.dump();
  EXPECT_EQ(operations.back()["group"], "world");
  EXPECT_EQ(operations.back()["state"], "timed out");
  EXPECT_EQ(operations[operations.size() - 2]["state"], "completed") << flight.dump();
  EXPECT_FALSE(std::filesystem::exists(run.out_dir + "/flight_recorder.rank1.json"));
}

TEST(Launcher, KillingTheLauncherKillsItsRanks) {
  // kill -9 of the launcher: its ranks must not live on (they would train to the end and write
  // checkpoints nobody asked for).
  const auto dir = fresh_dir("orphans");
  const auto corpus = write_corpus(dir);
  const std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                           corpus + " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32"
                           " --set train.max_steps=0 --set train.epochs=100000 --set log.progress=off"
                           " --set train.out_dir=" + dir + "/out --plugin ddp --nproc 2";
  const std::string script = "OMP_NUM_THREADS=1 " + std::string(WEFT_TRAINER_PATH) + " " + args + " > " + dir +
                             "/log.txt 2>&1 & pid=$!; for i in $(seq 300); do grep -q 'training:' " + dir +
                             "/log.txt && break; sleep 0.1; done; ranks=$(pgrep -P $pid | tr '\\n' ' '); "
                             "kill -KILL $pid; wait $pid; for i in $(seq 50); do alive=0; for r in $ranks; do "
                             "kill -0 $r 2>/dev/null && alive=$((alive+1)); done; [ $alive = 0 ] && break; sleep 0.1; "
                             "done; echo ranks $(echo $ranks | wc -w) alive $alive";
  const std::string line = weft::testing::last_line(weft::testing::run_command(script).output);
  EXPECT_EQ(line, "ranks 2 alive 0") << weft::testing::read_text(dir + "/log.txt");
}

TEST(Launcher, ASigtermIsACleanStopNotAFailure) {
  // SIGTERM to the launcher: it passes it on, every rank stops after the same step (rank 0 saves a
  // checkpoint), the launcher reports it as a stop, not as a failed rank, and exits 128 + 15.
  const auto run = weft::testing::signal_a_rank("sigterm", "TERM", "", /*rank=*/-1);
  EXPECT_EQ(run.status, "143") << run.log;
  EXPECT_NE(run.log.find("interrupted by signal 15"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("checkpoint saved"), std::string::npos) << run.log;
  EXPECT_NE(run.log.find("stopped on signal 15 after saving its work"), std::string::npos) << run.log;
  EXPECT_EQ(run.log.find("failed"), std::string::npos) << run.log;
  EXPECT_EQ(run.log.find("error"), std::string::npos) << run.log;
}

// SIGINT to the launcher (a scheduler, `kill -INT`), or to its whole process group (a terminal's
// Ctrl-C, `timeout -s INT`): each rank gets it once, from the launcher, and stops as on SIGTERM after
// the same step: a checkpoint is saved, the summary says interrupted, the launcher exits 128 + 2.
// Before, the launcher ignored SIGINT (the run trained on to its end), and a group's SIGINT reached
// each rank twice, whose second "stop now" lost the checkpoint.
TEST(Launcher, ASigintToTheLauncherOrItsGroupStopsEachRankOnceWithACheckpoint) {
  for (const int target : {-1, -2}) {
    const auto run = weft::testing::signal_a_rank(target == -1 ? "sigint" : "sigint_group", "INT", "", target);
    SCOPED_TRACE(target == -1 ? "the launcher" : "its process group");
    EXPECT_EQ(run.status, "130") << run.log;
    const std::string latest = run.out_dir + "/checkpoints/latest";
    ASSERT_TRUE(std::filesystem::exists(latest)) << run.log;
    EXPECT_TRUE(std::filesystem::is_directory(run.out_dir + "/checkpoints/" + weft::testing::last_line(weft::testing::read_text(latest))))
        << run.log;
    nlohmann::json summary;
    std::istringstream metrics(weft::testing::read_text(run.out_dir + "/metrics.jsonl"));
    for (std::string line; std::getline(metrics, line);) {
      if (line.empty()) continue;
      const auto record = nlohmann::json::parse(line);
      if (record.value("type", "") == "summary") summary = record;
    }
    ASSERT_FALSE(summary.is_null()) << run.log;
    EXPECT_EQ(summary["interrupted"], true) << summary.dump();
  }
}

TEST(Launcher, TorchrunStyleEnvironmentJoinsTheJob) {
  const auto dir = fresh_dir("torchrun");
  const auto corpus = write_corpus(dir);
  const std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                           corpus + " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32"
                           " --set train.max_steps=3 --set log.progress=off --set train.out_dir=" + dir +
                           "/out --plugin ddp";
  // Two processes started by hand with torchrun's variables (no --nproc).
  const std::string env = "MASTER_ADDR=127.0.0.1 MASTER_PORT=29631 WORLD_SIZE=2 OMP_NUM_THREADS=1";
  const std::string script = env + " RANK=1 LOCAL_RANK=1 " + std::string(WEFT_TRAINER_PATH) + " " + args + " > " +
                             dir + "/r1.txt 2>&1 & " + env + " RANK=0 LOCAL_RANK=0 " + WEFT_TRAINER_PATH + " " + args +
                             " > " + dir + "/r0.txt 2>&1; a=$?; wait %1; b=$?; echo $a$b";
  const std::string status = weft::testing::last_line(weft::testing::run_command(script).output);
  const std::string log = weft::testing::read_text(dir + "/r0.txt");
  EXPECT_EQ(status, "00") << log;
  EXPECT_NE(log.find("2 process(es)"), std::string::npos) << log;
}

// The ranks are forks of the launcher, which has LibTorch loaded already (each rank saves ~0.4 s
// of CPU, LibTorch's start); a launcher that already has threads (here a preloaded library's) cannot
// fork ranks that go on running, and executes the trainer afresh for each. Both train the same.
TEST(Launcher, RanksForkedOrExecutedAfreshTrainTheSame) {
  const auto dir = fresh_dir("fork_or_exec");
  const auto corpus = write_corpus(dir);
  const std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                           corpus + " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32" +
                           " --set train.max_steps=3 --set log.progress=off --plugin ddp --nproc 2 --log-level debug";
  const auto forked = weft::testing::run_trainer(args + " --set train.out_dir=" + dir + "/forked");
  const auto executed = weft::testing::run_command("LD_PRELOAD=" + std::string(WEFT_THREAD_AT_LOAD_LIB) +
                                                   " OMP_NUM_THREADS=1 " + WEFT_TRAINER_PATH + " " + args +
                                                   " --set train.out_dir=" + dir + "/executed");
  ASSERT_EQ(forked.exit_code, 0) << forked.output;
  ASSERT_EQ(executed.exit_code, 0) << executed.output;
  const std::string afresh = "each rank executes the trainer afresh";
  EXPECT_EQ(forked.output.find(afresh), std::string::npos) << forked.output;
  EXPECT_NE(executed.output.find(afresh), std::string::npos) << executed.output;
  const auto a = weft::testing::step_losses(dir + "/forked/metrics.jsonl");
  const auto b = weft::testing::step_losses(dir + "/executed/metrics.jsonl");
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);  // the same processes' arithmetic, bit for bit
}

}  // namespace launcher_test
