// The trainer under faults, end to end: a disk that fills while a checkpoint is written (on one
// rank of a split model too), a read-only checkpoint folder, a kill in the middle of deleting an
// old checkpoint, and the refusals and output discipline of the
// commands around training (generate, report, --nproc).
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/corpus.h"
#include "common/process.h"
#include "test_paths.h"

namespace faults_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

namespace fs = std::filesystem;
using weft::testing::read_text;
using weft::testing::run_command;
using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_faults", name); }

std::string write_corpus(const std::string& dir) { return weft::testing::write_prose_corpus(dir); }

// The tiny preset on a small corpus, writing to DIR/out.
std::string tiny_args(const std::string& dir) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + write_corpus(dir) +
         " --set data.cache_dir=" + dir + "/cache --set train.out_dir=" + dir +
         "/out --set data.seq_len=32 --set log.progress=off";
}

// The step-* checkpoint folders under DIR/out/checkpoints that lack one of a checkpoint's files.
std::vector<std::string> incomplete_checkpoints(const std::string& dir) {
  std::vector<std::string> incomplete;
  for (const auto& entry : fs::directory_iterator(dir + "/out/checkpoints")) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    const bool sharded = fs::exists(entry.path() / "shards");
    for (const char* file : {"config.json", sharded ? "shards/index.json" : "model.safetensors",
                             sharded ? "config.json" : "optimizer.safetensors", "rng.pt", "trainer_state.json"}) {
      if (!fs::exists(entry.path() / file)) incomplete.push_back(name + " (no " + file + ")");
    }
  }
  return incomplete;
}

std::vector<std::string> temporaries(const std::string& folder) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp") != std::string::npos || name.find(".old-") != std::string::npos) found.push_back(name);
  }
  return found;
}

// A command prefix that runs the rest with files limited to `bytes`: a write beyond fails with EFBIG
// (SIGXFSZ ignored), as ENOSPC would on a full disk.
std::string file_size_limited(int64_t bytes) {
  const std::string b = std::to_string(bytes);
  return "python3 -c 'import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
         "resource.setrlimit(resource.RLIMIT_FSIZE, (" + b + ", " + b + ")); os.execv(sys.argv[1], sys.argv[1:])' ";
}

std::string latest(const std::string& dir) {
  std::ifstream in(dir + "/out/checkpoints/latest");
  std::string name;
  in >> name;
  return name;
}

TEST(Faults, AFullDiskWhileSavingIsOneErrorAndKeepsThePreviousCheckpoint) {
  // The disk fills while optimizer.safetensors is written (a per-file size limit: the model's 0.6 MB fit,
  // the optimizer's 1.3 MB do not). Before: LibTorch's zip writer threw from a destructor and the
  // process aborted (rc 134), leaving a .tmp-step-* folder that kept the disk full.
  const auto dir = fresh_dir("full_disk");
  const std::string args = tiny_args(dir) + " --set checkpoint.every_steps=5";
  const auto first = run_trainer(args + " --set train.max_steps=5");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(latest(dir), "step-00000005");
  // Files may grow to 1,000,000 bytes; a write beyond fails with EFBIG (SIGXFSZ ignored), as ENOSPC would.
  const std::string limited = file_size_limited(1000000);
  const auto full = run_command("OMP_NUM_THREADS=1 " + limited + WEFT_TRAINER_PATH + " " + args +
                                " --set checkpoint.resume=auto --set train.max_steps=10");
  EXPECT_EQ(full.exit_code, 1) << full.output;
  EXPECT_NE(full.output.find("error checkpoint of step 10 not saved in " + dir + "/out/checkpoints: "),
            std::string::npos) << full.output;
  EXPECT_NE(full.output.find("optimizer.safetensors"), std::string::npos) << full.output;
  EXPECT_NE(full.output.find("the latest checkpoint is still " + dir + "/out/checkpoints/step-00000005"),
            std::string::npos) << full.output;
  EXPECT_EQ(full.output.find("terminate called"), std::string::npos) << full.output;
  EXPECT_TRUE(temporaries(dir + "/out/checkpoints").empty()) << testing::PrintToString(temporaries(dir + "/out/checkpoints"));
  EXPECT_EQ(latest(dir), "step-00000005");
  EXPECT_TRUE(incomplete_checkpoints(dir).empty()) << testing::PrintToString(incomplete_checkpoints(dir));
  // With room again, the run continues from the checkpoint that was kept.
  const auto resumed = run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=10");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + dir + "/out/checkpoints/step-00000005 at step 5"),
            std::string::npos) << resumed.output;
  EXPECT_EQ(latest(dir), "step-00000010");
}

TEST(Faults, AFullDiskWhileRanksWriteTheirOwnStateLeavesNoCheckpointAndKeepsThePreviousOne) {
  // DiLoCo over 2 ranks places its trainable state LOCAL: every rank writes its own values and moments
  // (local/rank-<r>.safetensors, 1.9 MB) before rank 0 saves the rest. Files may grow to 1,000,000
  // bytes, so neither rank's fits: each says the checkpoint was not saved, nothing staged is left, and
  // step 5's stays the latest, from which the run continues once there is room.
  const auto dir = fresh_dir("full_disk_local");
  const std::string args = tiny_args(dir) + " --nproc 2 --set checkpoint.every_steps=5 --plugin " +
                           std::string(WEFT_PLUGIN_FIXTURE_DIR) + "/diloco.so --set plugin.inner_steps=3";
  const auto first = run_trainer(args + " --set train.max_steps=5");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  ASSERT_EQ(latest(dir), "step-00000005");
  ASSERT_TRUE(fs::exists(dir + "/out/checkpoints/step-00000005/local/rank-00001.safetensors"));
  const std::string limited = file_size_limited(1000000);
  const auto full = run_command("OMP_NUM_THREADS=1 " + limited + WEFT_TRAINER_PATH + " " + args +
                                " --set checkpoint.resume=auto --set train.max_steps=10");
  EXPECT_EQ(full.exit_code, 1) << full.output;
  EXPECT_NE(full.output.find("checkpoint of step 10 not saved in " + dir + "/out/checkpoints: "), std::string::npos)
      << full.output;
  EXPECT_NE(full.output.find("rank-0000"), std::string::npos) << full.output;  // the file that did not fit
  EXPECT_NE(full.output.find("the latest checkpoint is still " + dir + "/out/checkpoints/step-00000005"),
            std::string::npos) << full.output;
  EXPECT_TRUE(temporaries(dir + "/out/checkpoints").empty()) << testing::PrintToString(temporaries(dir + "/out/checkpoints"));
  EXPECT_EQ(latest(dir), "step-00000005");
  EXPECT_TRUE(incomplete_checkpoints(dir).empty()) << testing::PrintToString(incomplete_checkpoints(dir));
  const auto resumed = run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=10");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(latest(dir), "step-00000010");
  EXPECT_TRUE(fs::exists(dir + "/out/checkpoints/step-00000010/local/index.json"));
}

TEST(Faults, AReadOnlyCheckpointFolderWhileSavingIsOneErrorAndKeepsThePreviousCheckpoint) {
  // checkpoints/ becomes read-only (a read-only bind mount in a mount namespace of its own: root
  // ignores permission bits) before the save of step 4.
  if (run_command("unshare -m true").exit_code != 0) {
    GTEST_SKIP() << "unshare -m is not permitted here: no read-only mount to test with";
  }
  const auto dir = fresh_dir("read_only");
  const std::string args = tiny_args(dir) + " --set checkpoint.every_steps=2";
  ASSERT_EQ(run_trainer(args + " --set train.max_steps=2").exit_code, 0);
  const std::string checkpoints = dir + "/out/checkpoints";
  const auto ro = run_command("unshare -m sh -c 'mount --bind " + checkpoints + " " + checkpoints +
                              " && mount -o remount,ro,bind " + checkpoints + " && OMP_NUM_THREADS=1 " +
                              WEFT_TRAINER_PATH + " " + args + " --set checkpoint.resume=auto --set train.max_steps=4'");
  EXPECT_EQ(ro.exit_code, 1) << ro.output;
  EXPECT_NE(ro.output.find("checkpoint of step 4 not saved in " + checkpoints + ": "), std::string::npos) << ro.output;
  EXPECT_NE(ro.output.find("Read-only file system"), std::string::npos) << ro.output;
  EXPECT_NE(ro.output.find("the latest checkpoint is still " + checkpoints + "/step-00000002"), std::string::npos)
      << ro.output;
  EXPECT_EQ(latest(dir), "step-00000002");
  EXPECT_TRUE(temporaries(checkpoints).empty()) << testing::PrintToString(temporaries(checkpoints));
  EXPECT_TRUE(incomplete_checkpoints(dir).empty()) << testing::PrintToString(incomplete_checkpoints(dir));
  const auto resumed = run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=4");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(latest(dir), "step-00000004");
}

TEST(Faults, AFullDiskOnOneRankOfASplitModelLeavesNoCheckpointAndKeepsThePreviousOne) {
  // gpipe over 2 ranks (a 4-layer model): each writes its own stages. Files may grow to 4.8 MB:
  // rank 0's pieces (the embedding and layers 0-1 with their moments, 5.2 MB) do not fit, rank 1's
  // (layers 2-3 and the norm, 4.4 MB) do. Every rank must then say the checkpoint was not saved,
  // and step 2's stays the latest.
  const auto dir = fresh_dir("full_disk_split");
  const std::string args = tiny_args(dir) + " --plugin gpipe --nproc 2 --set checkpoint.every_steps=2 --set model.config=" +
                           WEFT_SOURCE_DIR + "/configs/models/austen-mini/config.json";
  ASSERT_EQ(run_trainer(args + " --set train.max_steps=2").exit_code, 0);
  const std::string limited = file_size_limited(4800000);
  const auto full = run_command("OMP_NUM_THREADS=1 " + limited + WEFT_TRAINER_PATH + " " + args +
                                " --set checkpoint.resume=auto --set train.max_steps=4");
  const std::string checkpoints = dir + "/out/checkpoints";
  EXPECT_NE(full.exit_code, 0) << full.output;
  EXPECT_NE(full.output.find("checkpoint of step 4 not saved in " + checkpoints + ": rank 0: "), std::string::npos)
      << full.output;
  EXPECT_NE(full.output.find("rank-00000.safetensors"), std::string::npos) << full.output;
  EXPECT_NE(full.output.find("the latest checkpoint is still " + checkpoints + "/step-00000002"), std::string::npos)
      << full.output;
  EXPECT_NE(full.output.find("not saved in " + checkpoints + ": another rank could not write its part"),
            std::string::npos) << full.output;  // rank 1, whose file fitted
  EXPECT_EQ(latest(dir), "step-00000002");
  EXPECT_TRUE(temporaries(checkpoints).empty()) << testing::PrintToString(temporaries(checkpoints));
  EXPECT_TRUE(fs::exists(checkpoints + "/step-00000002/shards/index.json"));
  const auto resumed = run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=4");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(latest(dir), "step-00000004");
}

TEST(Faults, AKillWhileDeletingAnOldCheckpointNeverLeavesAHalfDeletedOne) {
  // keep_last = 1: saving step 4 deletes step 2. The process is killed (SIGKILL) at the second
  // file the deletion removes. Before: step-00000002 stayed, one file short, as a checkpoint.
  const auto dir = fresh_dir("kill_prune");
  const std::string args = tiny_args(dir) + " --set checkpoint.every_steps=2 --set checkpoint.keep_last=1";
  const std::string files = "config.json,model.safetensors,optimizer.safetensors,rng.pt,trainer_state.json";
  const auto killed = run_command("WEFT_TEST_KILL_ON_UNLINK=2:" + files + " LD_PRELOAD=" +
                                  std::string(WEFT_KILL_ON_UNLINK_LIB) + " OMP_NUM_THREADS=1 " + WEFT_TRAINER_PATH +
                                  " " + args + " --set train.max_steps=4; echo status $?");
  ASSERT_NE(killed.output.find("status 137"), std::string::npos) << killed.output;  // killed in the deletion
  EXPECT_TRUE(incomplete_checkpoints(dir).empty()) << testing::PrintToString(incomplete_checkpoints(dir));
  EXPECT_EQ(latest(dir), "step-00000004");
  // The next run removes what the deletion left and resumes from the newest checkpoint.
  const auto resumed = run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=6");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from " + dir + "/out/checkpoints/step-00000004"), std::string::npos)
      << resumed.output;
  EXPECT_TRUE(temporaries(dir + "/out/checkpoints").empty()) << testing::PrintToString(temporaries(dir + "/out/checkpoints"));
  EXPECT_TRUE(incomplete_checkpoints(dir).empty());
}

TEST(Faults, ACheckpointStateOutOfRangeIsRefusedBeforeTraining) {
  // trainer_state.json is untrusted input: a position no run can be at is refused, naming the file.
  const auto dir = fresh_dir("state");
  const std::string args = tiny_args(dir) + " --set checkpoint.every_steps=4";
  ASSERT_EQ(run_trainer(args + " --set train.max_steps=4").exit_code, 0);
  const std::string state_path = dir + "/out/checkpoints/step-00000004/trainer_state.json";
  const auto saved = nlohmann::json::parse(read_text(state_path));
  struct Case {
    const char* key;
    int64_t value;
    const char* problem;
  };
  for (const Case& c : {Case{"step_in_epoch", 1000000000, "step_in_epoch 1000000000 is past the end of an epoch"},
                        Case{"global_step", 99999999, "global_step 99999999 is not epoch 0 x "},
                        Case{"global_step", -5, "must not be negative"}, Case{"epoch", 7, "is in epoch 8 but train.epochs is 1"},
                        Case{"best_step", 50, "best_step 50 is not between -1 and global_step 4"}}) {
    auto edited = saved;
    edited[c.key] = c.value;
    std::ofstream(state_path) << edited.dump();
    const auto r = run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=8");
    EXPECT_EQ(r.exit_code, 1) << c.key << "\n" << r.output;
    EXPECT_NE(r.output.find(state_path + ": "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(c.problem), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("training:"), std::string::npos) << "training started: " << c.key;
  }
  std::ofstream(state_path) << saved.dump();
  EXPECT_EQ(run_trainer(args + " --set checkpoint.resume=auto --set train.max_steps=8").exit_code, 0);
}

TEST(Faults, NprocBelowOneIsRefused) {
  for (const char* n : {"0", "-2"}) {
    const auto r = run_trainer("--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --nproc " + n);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("--nproc " + std::string(n) + ": the number of processes must be at least 1"),
              std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("training:"), std::string::npos) << r.output;
  }
}

TEST(Faults, GeneratePrintsTheTextOnStdoutAndStopsAtTheModelsPositions) {
  // stdout carries the text alone (logs go to stderr), and generation stops where the model's
  // positions end (tiny: 1024), saying so, instead of running past them.
  const auto dir = fresh_dir("generate");
  const std::string command = "OMP_NUM_THREADS=1 " + std::string(WEFT_TRAINER_PATH) + " generate " + tiny_args(dir) +
                              " --prompt 'It is a truth' --set generate.max_new_tokens=5000 --set generate.temperature=1"
                              " 2> " + dir + "/stderr.txt";
  const auto r = run_command("(" + command + ")");  // stdout alone: run_command adds 2>&1 after the group
  const std::string err = read_text(dir + "/stderr.txt");
  ASSERT_EQ(r.exit_code, 0) << r.output << err;
  EXPECT_EQ(r.output.find(" info "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.rfind("tokens: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find("\nIt is a truth"), std::string::npos) << r.output;
  EXPECT_NE(err.find("at most 1010 new tokens after the 14-token prompt: the model has 1024 positions"),
            std::string::npos) << err;
  std::istringstream ids(r.output.substr(8, r.output.find('\n') - 8));
  int count = 0;
  for (std::string id; ids >> id;) ++count;
  EXPECT_LE(count, 1010);
  EXPECT_GT(count, 0);
}

TEST(Faults, ReportRefusesToOverwriteTheRunsInputsAndExplainsBadMetrics) {
  const auto dir = fresh_dir("report");
  ASSERT_EQ(run_trainer(tiny_args(dir) + " --set train.max_steps=3").exit_code, 0);
  const std::string metrics = read_text(dir + "/out/metrics.jsonl");
  for (const char* target : {"/out/metrics.jsonl", "/out/config.toml", "/out/command.txt"}) {
    const auto r = run_trainer("report " + dir + "/out --out " + dir + target);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("is an input of the report"), std::string::npos) << r.output;
  }
  EXPECT_EQ(read_text(dir + "/out/metrics.jsonl"), metrics);
  // Bytes that are not UTF-8 in metrics.jsonl: one line naming the file and the line, no traceback.
  std::ofstream(dir + "/out/metrics.jsonl", std::ios::app) << "{\"type\": \"step\", \"loss\": \"\xff\xfe\"}\n";
  const auto bad = run_trainer("report " + dir + "/out");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(dir + "/out/metrics.jsonl"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("not UTF-8"), std::string::npos) << bad.output;
  EXPECT_EQ(bad.output.find("Traceback"), std::string::npos) << bad.output;
}

}  // namespace faults_test
