// A 2-rank run stopped by a signal, for the launcher and fault tests.
#pragma once

#include <sstream>
#include <string>

#include "common/corpus.h"
#include "common/process.h"
#include "test_paths.h"

namespace weft::testing {

struct SignalledRun {
  std::string status;      // the launcher's exit status
  std::string log;         // everything it and its ranks printed
  double seconds = 0;      // from the signal to the launcher's exit
  std::string out_dir;     // the run's train.out_dir
};

// Starts an endless 2-rank run of `plugin` with `extra` settings in a session of its own, sends
// `signal` to its rank `rank` (to the launcher itself: rank -1; to the launcher's process group, as
// a terminal's Ctrl-C or `timeout` does: rank -2) once training has started, and waits for the
// launcher.
inline SignalledRun signal_a_rank(const std::string& name, const std::string& signal, const std::string& extra,
                                  int rank = 1, const std::string& plugin = "ddp") {
  const auto dir = fresh_dir("weft_test_signal", name);
  const auto corpus = write_word_corpus(dir);
  const std::string args = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" +
                           corpus + " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32"
                           " --set train.max_steps=0 --set train.epochs=100000 --set log.progress=off " + extra +
                           " --set train.out_dir=" + dir + "/out --plugin " + plugin + " --nproc 2";
  const std::string target = rank == -2 ? "-$pid" : rank < 0 ? "$pid" : "$(pgrep -P $pid | sed -n " + std::to_string(rank + 1) + "p)";
  // setsid: the launcher leads a process group of its own (the shell's would get rank -2's signal too).
  const std::string script = "OMP_NUM_THREADS=1 setsid " + std::string(WEFT_TRAINER_PATH) + " " + args + " > " + dir +
                             "/log.txt 2>&1 & pid=$!; for i in $(seq 300); do grep -q 'training:' " + dir +
                             "/log.txt && break; sleep 0.1; done; sleep 0.3; "
                             "start=$(date +%s.%N); kill -" + signal + " " + target + "; "
                             // A launcher that never stops (it ignored the signal) is killed after 60 s.
                             "(sleep 60; kill -KILL $pid) >/dev/null 2>&1 & watchdog=$!; "
                             "wait $pid; status=$?; kill $watchdog 2>/dev/null; "
                             "echo $status $(awk \"BEGIN { print $(date +%s.%N) - $start }\")";
  const std::string line = last_line(run_command(script).output);
  SignalledRun run;
  std::istringstream in(line);
  in >> run.status >> run.seconds;
  run.log = read_text(dir + "/log.txt");
  run.out_dir = dir + "/out";
  return run;
}

}  // namespace weft::testing
