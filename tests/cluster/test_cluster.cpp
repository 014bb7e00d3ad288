// weft across nodes: each node a network namespace that tools/cluster.sh makes (its own loopback,
// one interface through a bridge, an optional rate limit), the job started in every node the way
// users start it on machines (torchrun --nnodes --node-rank --master-addr). Needs root and
// namespaces; where the machine has neither the tests skip with the tool's reason.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <sstream>
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "core/io/safetensors.h"
#include "common/corpus.h"
#include "common/metrics.h"
#include "common/process.h"
#include "test_paths.h"

namespace cluster_test {  // named: its helpers share a unity-build unit with other files' (CMAKE_UNITY_BUILD)

using weft::testing::run_command;

const std::string kTool = std::string(WEFT_SOURCE_DIR) + "/tools/cluster.sh";

// Why this machine cannot make a cluster, or "" where it can.
std::string unavailable() {
  const auto r = run_command(kTool + " check");
  return r.exit_code == 0 ? "" : "tools/cluster.sh check: " + r.output;
}

// A cluster for one test: made by the constructor, removed by the destructor whatever happened
// (and by `up` itself if a previous run of this process id left one behind).
class Cluster {
 public:
  explicit Cluster(int nodes, const std::string& rate = "none")
      : name_("wt" + std::to_string(::getpid()) + "x" + std::to_string(count_++)), nodes_(nodes) {
    remove_orphans();
    const auto r = run_command(kTool + " up " + name_ + " " + std::to_string(nodes) + " " + rate);
    made_ = r.exit_code == 0;
    output_ = r.output;
  }
  ~Cluster() { run_command(kTool + " down " + name_); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  bool made() const { return made_; }
  const std::string& output() const { return output_; }
  const std::string& name() const { return name_; }
  std::string namespace_of(int node) const { return name_ + "-n" + std::to_string(node); }
  static std::string address(int node) { return "10.99.0." + std::to_string(node + 1); }
  // A shell command prefix that runs what follows in `node`.
  std::string in(int node) const { return kTool + " exec " + name_ + " " + std::to_string(node) + " "; }
  // Bytes sent and received so far on the node's interface.
  std::pair<int64_t, int64_t> bytes(int node) const {
    const auto r = run_command(kTool + " bytes " + name_ + " " + std::to_string(node));
    int64_t tx = -1, rx = -1;
    EXPECT_TRUE(r.exit_code == 0 && std::sscanf(r.output.c_str(), "%ld %ld", &tx, &rx) == 2)
        << "the byte counters of node " << node << ": " << r.output;
    return {tx, rx};
  }

 private:
  // Clusters of test processes that are gone (killed by a timeout before their destructor ran).
  static void remove_orphans() {
    std::istringstream lines(run_command("ip netns list").output);
    std::string line;
    while (std::getline(lines, line)) {
      const auto dash = line.find('-');
      const auto x = line.find('x');
      if (line.rfind("wt", 0) != 0 || dash == std::string::npos || x == std::string::npos || x > dash) continue;
      const std::string pid = line.substr(2, x - 2);
      if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) continue;
      if (!std::filesystem::exists("/proc/" + pid)) run_command(kTool + " down " + line.substr(0, dash));
    }
  }
  static inline std::atomic<int> count_{0};
  std::string name_;
  int nodes_;
  bool made_ = false;
  std::string output_;
};

std::vector<std::string> namespaces() {
  std::vector<std::string> names;
  std::istringstream lines(run_command("ip netns list").output);
  std::string line;
  while (std::getline(lines, line)) names.push_back(line.substr(0, line.find(' ')));
  return names;
}

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

nlohmann::json ip_json(const std::string& command) {
  const auto r = run_command(command);
  EXPECT_EQ(r.exit_code, 0) << command << ": " << r.output;
  return nlohmann::json::parse(r.output, nullptr, /*allow_exceptions=*/false);
}

TEST(Cluster, TheToolMakesIsolatedRateLimitedNodesAndRemovesThemWithTheirProcesses) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  const auto links_before = ip_json("ip -j link show").size();
  std::string name;
  {
    Cluster cluster(3, "100mbit");
    ASSERT_TRUE(cluster.made()) << cluster.output();
    name = cluster.name();
    const auto names = namespaces();
    for (int node = 0; node < 3; ++node) {
      ASSERT_TRUE(has(names, cluster.namespace_of(node))) << node;
      // One interface besides loopback, with the node's address.
      const auto addresses = ip_json("ip -n " + cluster.namespace_of(node) + " -j -4 addr show");
      std::vector<std::string> seen;
      for (const auto& link : addresses) {
        for (const auto& a : link["addr_info"]) seen.push_back(link["ifname"].get<std::string>() + " " +
                                                               a["local"].get<std::string>());
      }
      EXPECT_EQ(seen, (std::vector<std::string>{"lo 127.0.0.1", "eth0 " + Cluster::address(node)}));
      // Its link limited to the rate, in both directions.
      for (const auto& [ns, device] : {std::pair{cluster.namespace_of(node), std::string("eth0")},
                                       std::pair{name + "-sw", "p" + std::to_string(node)}}) {
        const auto qdiscs = ip_json("tc -n " + ns + " -j qdisc show dev " + device);
        ASSERT_FALSE(qdiscs.empty()) << ns << " " << device;
        EXPECT_EQ(qdiscs[0]["kind"], "tbf") << qdiscs.dump();
        EXPECT_EQ(qdiscs[0]["options"]["rate"].get<int64_t>(), 100000000 / 8) << qdiscs.dump();
      }
    }
    // Nodes reach each other over their links (node 2 fetches from node 0's listener) ...
    const std::string listen = cluster.in(0) + "python3 -c \"import socket; s=socket.socket(); s.bind(('" +
                               Cluster::address(0) + "', 7001)); s.listen(); c, _ = s.accept(); c.sendall(b'weft')\" &";
    const auto fetched = run_command(listen + " sleep 0.5; " + cluster.in(2) +
                                     "python3 -c \"import socket; print(socket.create_connection(('" +
                                     Cluster::address(0) + "', 7001), timeout=10).recv(4).decode())\"; wait");
    EXPECT_EQ(weft::testing::last_line(fetched.output), "weft") << fetched.output;
    // ... and nothing of the cluster is in this machine's own namespace.
    EXPECT_EQ(ip_json("ip -j link show").size(), links_before);
    // A process left running in a node goes with the cluster.
    // (Once it runs there: `ip netns exec` enters the node after the shell has returned, and a
    // process still entering when the node is removed would land in a namespace without a name.)
    ASSERT_EQ(run_command(cluster.in(1) + "sleep 600 > /dev/null 2>&1 & for i in $(seq 100); do ip netns pids " +
                          cluster.namespace_of(1) + " | grep -q . && break; sleep 0.05; done")
                  .exit_code,
              0);
  }
  const auto names = namespaces();
  for (const auto& ns : {name + "-n0", name + "-n1", name + "-n2", name + "-sw"}) EXPECT_FALSE(has(names, ns)) << ns;
  EXPECT_EQ(run_command("pgrep -f '^sleep 600$'").exit_code, 1) << "the node's sleep outlived its cluster";
}

// The tiny preset for 10 fp32 steps; `out` is the run directory.
std::string tiny_args(const std::string& dir, const std::string& corpus, const std::string& out) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + corpus +
         " --set data.cache_dir=" + dir + "/cache --set data.seq_len=32 --set train.batch_size=6"
         " --set train.max_steps=10 --set train.precision=fp32 --set log.progress=off --set train.out_dir=" +
         out + " --set train.collective_timeout_s=60";
}

// The command that starts node `node`'s part of a 2-node job (`per_node` ranks in each) the
// torchrun way, node 0 hosting the rendezvous; its output goes to `log`.
std::string torchrun(const Cluster& cluster, int node, const std::string& trainer_args, const std::string& log,
                     int per_node = 1) {
  return cluster.in(node) + "env OMP_NUM_THREADS=1 " + WEFT_TEST_TORCHRUN + " --nnodes 2 --nproc-per-node " +
         std::to_string(per_node) + " --node-rank " + std::to_string(node) + " --master-addr " + Cluster::address(0) +
         " --master-port 29400 --no-python " + WEFT_TRAINER_PATH + " " + trainer_args + " > " + log + " 2>&1";
}

// The same with the trainer's own launcher: trainer --nproc --nnodes 2 --node-rank r --master-addr.
std::string own_launcher(const Cluster& cluster, int node, const std::string& trainer_args, const std::string& log,
                         int per_node = 1) {
  return cluster.in(node) + "env OMP_NUM_THREADS=1 " + WEFT_TRAINER_PATH + " " + trainer_args + " --nproc " +
         std::to_string(per_node) + " --nnodes 2 --node-rank " + std::to_string(node) + " --master-addr " +
         Cluster::address(0) + " --master-port 29400 > " + log + " 2>&1";
}

using Launch = std::string (*)(const Cluster&, int, const std::string&, const std::string&, int);

// `plugin` over two nodes of `per_node` ranks, started by `launch` (torchrun by default) in each
// node with node 0's address as the rendezvous: the same losses and parameters as one process (the conformance
// tolerances: 1e-5), each node's first rank's Gloo on its node's address, rank 0's account of
// which mesh dimensions stay within a node containing `placement`, and the collectives crossed
// node 1's interface (at least `min_bytes` each way). Returns rank 0's log.
std::string expect_one_process_across_nodes(const std::string& name, const std::string& plugin, int per_node,
                                            const std::string& placement, int64_t min_bytes = 0,
                                            Launch launch = torchrun, const std::string& extra = "",
                                            int64_t max_bytes = 0) {
  const auto dir = weft::testing::fresh_dir("weft_test_cluster", name);
  const auto corpus = weft::testing::write_word_corpus(dir);
  const auto reference = weft::testing::run_trainer(tiny_args(dir, corpus, dir + "/reference") + extra);
  EXPECT_EQ(reference.exit_code, 0) << reference.output;

  Cluster cluster(2);
  EXPECT_TRUE(cluster.made()) << cluster.output();
  if (!cluster.made()) return "";
  const auto before = cluster.bytes(1);
  // One shared run directory, as on machines that share a file system.
  const std::string args = tiny_args(dir, corpus, dir + "/run") + extra + " --plugin " + plugin + " --log-level debug";
  const auto run = run_command(launch(cluster, 1, args, dir + "/node1.txt", per_node) + " & " +
                               launch(cluster, 0, args, dir + "/node0.txt", per_node) + "; a=$?; wait %1; echo $a$?");
  const std::string log0 = weft::testing::read_text(dir + "/node0.txt");
  const std::string log1 = weft::testing::read_text(dir + "/node1.txt");
  EXPECT_EQ(weft::testing::last_line(run.output), "00")
      << "node 0's and node 1's exit statuses, after: " << run.output << "\n--- node 0:\n" << log0
      << "\n--- node 1:\n" << log1;
  // Each rank's Gloo listened on its node's address, not on loopback.
  EXPECT_NE(log0.find("rank 0: Gloo listens on " + Cluster::address(0)), std::string::npos) << log0;
  EXPECT_NE(log1.find("rank " + std::to_string(per_node) + ": Gloo listens on " + Cluster::address(1)),
            std::string::npos) << log1;
  EXPECT_NE(log0.find("nodes: 2, " + std::to_string(per_node) + (per_node == 1 ? " rank" : " ranks") + " each; " +
                      placement),
            std::string::npos)
      << log0;
  EXPECT_EQ(log0.find("span nodes"), std::string::npos) << log0;

  const auto a = weft::testing::step_losses(dir + "/reference/metrics.jsonl");
  const auto b = weft::testing::step_losses(dir + "/run/metrics.jsonl");
  EXPECT_EQ(a.size(), 10u);
  EXPECT_EQ(b.size(), 10u);
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
  }
  auto ra = weft::SafetensorsFile::open(dir + "/reference/final/model.safetensors");
  auto rb = weft::SafetensorsFile::open(dir + "/run/final/model.safetensors");
  EXPECT_EQ(ra->tensors().size(), rb->tensors().size());
  double worst = 0;
  for (const auto& info : ra->tensors()) {
    worst = std::max(worst, (ra->load(info.name) - rb->load(info.name)).abs().max().item<double>());
  }
  EXPECT_LT(worst, 1e-5);
  const auto after = cluster.bytes(1);
  EXPECT_GT(after.first - before.first, min_bytes)
      << "bytes sent by node 1 (its counter " << before.first << " -> " << after.first << ")";
  EXPECT_GT(after.second - before.second, min_bytes)
      << "bytes received by node 1 (its counter " << before.second << " -> " << after.second << ")";
  const int64_t moved = after.first - before.first + after.second - before.second;
  std::printf("%s: %.2f MB over node 1's link\n", name.c_str(), moved / 1e6);
  if (max_bytes > 0) {
    EXPECT_LT(moved, max_bytes);
  }
  return log0;
}

// The tiny preset's parameter count.
int64_t tiny_parameters() {
  const auto dir = weft::testing::fresh_dir("weft_test_cluster", "count");
  const auto corpus = weft::testing::write_word_corpus(dir);
  const auto r = weft::testing::run_trainer(tiny_args(dir, corpus, dir + "/run") + " --set train.max_steps=1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto weights = weft::SafetensorsFile::open(dir + "/run/final/model.safetensors");
  int64_t parameters = 0;
  for (const auto& info : weights->tensors()) parameters += weights->load(info.name).numel();
  return parameters;
}

bool skip_without_torchrun() { return std::string(WEFT_TEST_TORCHRUN).empty(); }
const char* const kNoTorchrun = "no torchrun of this LibTorch's version (WEFT_PYTHON; tests/CMakeLists.txt)";

// ddp over two nodes, one rank each: the gradients' all-reduces crossed node 1's link (an
// all-reduce of two ranks moves each rank's buffer, 4 bytes per parameter, out and back about
// once each way per step: at least half of that, far beyond the rendezvous' few kilobytes).
TEST(Cluster, DdpAcrossTwoNodesStartedByTorchrunMatchesOneProcess) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (skip_without_torchrun()) GTEST_SKIP() << kNoTorchrun;
  expect_one_process_across_nodes("ddp", "ddp", 1, "within each node: none; across nodes: dp 2",
                                  10 * 2 * tiny_parameters());
}

// ZeRO stage 3 over two nodes: parameters gathered and gradients reduce-scattered across them.
// Per step, two all-gathers of the fp32 parameters (forward, backward) and a reduce-scatter of the
// gradients each move half of 4 bytes per parameter each way: 12 bytes per parameter on node 1's
// link (bounded at 15 with the rest: losses, evaluation, headers), which a reduce-scatter made of an
// all-reduce (as Gloo's own is) raises to 16.
TEST(Cluster, ZeroAcrossTwoNodesMatchesOneProcess) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (skip_without_torchrun()) GTEST_SKIP() << kNoTorchrun;
  const int64_t parameters = tiny_parameters();
  expect_one_process_across_nodes("zero", "zero", 1, "within each node: none; across nodes: dp 2", 10 * parameters,
                                  torchrun, "", 10 * 15 * parameters);
}

// Two nodes of two ranks: tensor parallelism within each node (over its loopback), data
// parallelism across them, and a pipeline across them with tensor parallelism within; the mesh
// puts tp fastest, so its groups are each node's ranks. And a pipeline alone over two nodes.
TEST(Cluster, TensorParallelWithinNodesAndDataOrPipelineAcrossMatchOneProcess) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (skip_without_torchrun()) GTEST_SKIP() << kNoTorchrun;
  expect_one_process_across_nodes("tp_dp", "tensor_parallel,ddp --set mesh.tp=2", 2,
                                  "within each node: tp 2; across nodes: dp 2");
  expect_one_process_across_nodes("tp_pp", "tensor_parallel,gpipe --set mesh.tp=2 --set plugin.microbatches=2", 2,
                                  "within each node: tp 2; across nodes: pp 2");
  // A pipeline alone: its stages are the nodes.
  expect_one_process_across_nodes("pp", "gpipe --set plugin.microbatches=2", 1, "within each node: none; across nodes: pp 2");
}

// The trainer's own launcher across two nodes of two ranks (no torchrun): node 0's launcher hosts
// the rendezvous at its address, node 1's ranks are 2 and 3; ddp over the four equals one process.
// When rank 3 dies (fault injection), node 1's launcher names it and both launchers exit non-zero,
// node 0's ranks naming rank 3.
TEST(Cluster, TheTrainersOwnLauncherRunsAJobAcrossNodes) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  const auto log0 = expect_one_process_across_nodes("launcher", "ddp", 2, "within each node: none; across nodes: dp 4",
                                                    0, own_launcher, " --set train.batch_size=8");
  EXPECT_NE(log0.find("node 0 of 2: launching ranks 0-1 of 4 (rendezvous " + Cluster::address(0) +
                      ":29400, hosted here)"), std::string::npos) << log0;

  const auto dir = weft::testing::fresh_dir("weft_test_cluster", "launcher_fault");
  const auto corpus = weft::testing::write_word_corpus(dir);
  Cluster cluster(2);
  ASSERT_TRUE(cluster.made()) << cluster.output();
  const std::string args = tiny_args(dir, corpus, dir + "/run") + " --set train.max_steps=200 --set train.epochs=100" +
                           " --set train.batch_size=8" +
                           " --set train.collective_timeout_s=10 --plugin ddp";
  const std::string node1 = cluster.in(1) + "env OMP_NUM_THREADS=1 WEFT_FAULT_INJECT=3:backward:20 " +
                            WEFT_TRAINER_PATH + " " + args + " --nproc 2 --nnodes 2 --node-rank 1 --master-addr " +
                            Cluster::address(0) + " --master-port 29400 > " + dir + "/node1.txt 2>&1";
  run_command("(" + node1 + "; echo $? > " + dir + "/end1) & " + own_launcher(cluster, 0, args, dir + "/node0.txt", 2) +
              "; echo $? > " + dir + "/end0; wait");
  const std::string out0 = weft::testing::read_text(dir + "/node0.txt");
  const std::string out1 = weft::testing::read_text(dir + "/node1.txt");
  const auto killed = out1.find("fault injection: SIGKILL");
  ASSERT_NE(killed, std::string::npos) << out1;
  EXPECT_NE(out1.find("rank 3 failed"), std::string::npos) << out1;
  for (int node = 0; node < 2; ++node) {
    int status = 0;
    std::sscanf(weft::testing::read_text(dir + "/end" + std::to_string(node)).c_str(), "%d", &status);
    EXPECT_NE(status, 0) << "node " << node << "\n" << (node ? out1 : out0);
  }
  // Node 0's ranks name rank 3 as the one that did not join their collective.
  EXPECT_NE(out0.find("rank 3"), std::string::npos) << out0;
}

// trainer bench across two nodes of one rank each, the same command in each node (--nnodes 2
// --node-rank r --master-addr node 0's address; node 0's links rate-limited to 1 Gbit/s): ddp and
// zero run in order on both nodes, each run's rendezvous on a port of its own. Node 0's bench.json
// and table hold each variant's bytes on rank 0's node's link per step (an fp32 all-reduce of two
// ranks moves 4 bytes per parameter out and 4 in; ZeRO stage 3 gathers the parameters twice and
// reduce-scatters the gradients: about 12) and the held-out losses (equal: both train as one
// process would); node 1 records that it took part in both runs.
TEST(Cluster, TrainerBenchTimesStrategiesAcrossNodes) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  const auto dir = weft::testing::fresh_dir("weft_test_cluster", "bench");
  const auto corpus = weft::testing::write_word_corpus(dir);
  const double parameters = static_cast<double>(tiny_parameters());
  Cluster cluster(2, "1gbit");
  ASSERT_TRUE(cluster.made()) << cluster.output();
  const std::string args = std::string(WEFT_TRAINER_PATH) + " bench --config " + WEFT_SOURCE_DIR +
                           "/configs/tiny.toml --set data.path=" + corpus + " --set data.cache_dir=" + dir +
                           "/cache --set data.seq_len=32 --set train.batch_size=6 --set train.precision=fp32"
                           " --set train.collective_timeout_s=60 --plugin ddp --plugin 'zero --set plugin.stage=3'"
                           " --nproc 1 --nnodes 2 --master-addr " + Cluster::address(0) +
                           " --master-port 29400 --warmup 1 --steps 3 --repetitions 1 --eval-every 2 --out " + dir +
                           "/bench";
  auto node = [&](int n) {
    return "(" + cluster.in(n) + "env OMP_NUM_THREADS=1 " + args + " --node-rank " + std::to_string(n) + " > " + dir +
           "/node" + std::to_string(n) + ".txt 2>&1; echo $? > " + dir + "/end" + std::to_string(n) + ")";
  };
  run_command(node(1) + " & " + node(0) + "; wait");
  const std::string out0 = weft::testing::read_text(dir + "/node0.txt");
  const std::string out1 = weft::testing::read_text(dir + "/node1.txt");
  EXPECT_EQ(weft::testing::read_text(dir + "/end0"), "0\n") << out0;
  EXPECT_EQ(weft::testing::read_text(dir + "/end1"), "0\n") << out1;
  const auto json = nlohmann::json::parse(weft::testing::read_text(dir + "/bench/bench.json"), nullptr, false);
  ASSERT_TRUE(json.is_object()) << out0;
  EXPECT_EQ(json["nnodes"], 2);
  ASSERT_EQ(json["variants"].size(), 2u) << json.dump(1);
  const auto& ddp = json["variants"][0];
  const auto& zero = json["variants"][1];
  EXPECT_EQ(ddp["name"], "ddp x2");
  EXPECT_EQ(zero["name"], "zero stage=3 x2");
  EXPECT_EQ(ddp["nproc"], 2);
  ASSERT_TRUE(ddp["link_bytes_per_step"].is_number()) << ddp.dump(1);
  ASSERT_TRUE(zero["link_bytes_per_step"].is_number()) << zero.dump(1);
  const double ddp_bytes = ddp["link_bytes_per_step"].get<double>() / parameters;
  const double zero_bytes = zero["link_bytes_per_step"].get<double>() / parameters;
  std::printf("bench across nodes: link bytes per parameter per step: ddp %.2f, zero-3 %.2f\n", ddp_bytes, zero_bytes);
  EXPECT_GT(ddp_bytes, 7.0);
  EXPECT_LT(ddp_bytes, 10.0);
  EXPECT_GT(zero_bytes, 11.0);
  EXPECT_LT(zero_bytes, 15.0);
  ASSERT_EQ(ddp["held_out"].size(), 2u) << ddp.dump(1);
  ASSERT_EQ(zero["held_out"].size(), 2u) << zero.dump(1);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_EQ(ddp["held_out"][e]["step"], 2 * static_cast<int>(e) + 2);
    const double loss = ddp["held_out"][e]["loss"].get<double>();
    EXPECT_NEAR(zero["held_out"][e]["loss"].get<double>(), loss, 1e-5 * loss);
  }
  EXPECT_NE(weft::testing::read_text(dir + "/bench/bench.md").find("link MB per step"), std::string::npos);
  const auto node1 = nlohmann::json::parse(weft::testing::read_text(dir + "/bench/bench.node1.json"), nullptr, false);
  ASSERT_TRUE(node1.is_object()) << out1;
  ASSERT_EQ(node1["runs"].size(), 2u) << node1.dump(1);
  for (const auto& run : node1["runs"]) EXPECT_TRUE(run["ok"].get<bool>()) << node1.dump(1);
  // Each run met at its own port: node 0's second run's command names 29401.
  EXPECT_NE(weft::testing::read_text(dir + "/bench/runs/zero_stage_3_x2/rep1/command.node1.txt")
                .find("--master-port 29401"),
            std::string::npos);
}

// The (step, loss) records of a run's metrics.jsonl in file order, across restarts.
std::vector<std::pair<int64_t, double>> step_records(const std::string& metrics) {
  std::vector<std::pair<int64_t, double>> steps;
  for (const auto& j : weft::testing::records_of(metrics, "step")) {
    steps.emplace_back(j["step"].get<int64_t>(), j["loss"].get<double>());
  }
  return steps;
}

// A 2-node ddp run whose node 1 fails after the checkpoint of step 100, by `fault`: "link" (its
// cable unplugged) or "kill" (every process in it killed). The surviving ranks stop with an error
// within train.collective_timeout_s (+ 3 s) naming what they lost, the checkpoints stay whole,
// and checkpoint.resume=auto, once the node is back, finishes the run with exactly the losses of
// the same run uninterrupted.
void fail_a_node_then_resume(const std::string& fault) {
  const auto dir = weft::testing::fresh_dir("weft_test_cluster", fault);
  const auto corpus = weft::testing::write_word_corpus(dir);
  const double timeout_s = 10;
  auto args = [&](const std::string& out) {
    return tiny_args(dir, corpus, out) + " --set train.max_steps=300 --set train.epochs=100" +
           " --set checkpoint.every_steps=10 --set checkpoint.keep_last=2 --set checkpoint.resume=auto" +
           " --set train.collective_timeout_s=" + std::to_string(timeout_s) + " --plugin ddp";
  };
  Cluster cluster(2);
  ASSERT_TRUE(cluster.made()) << cluster.output();
  auto both = [&](const std::string& out, const std::string& tag) {
    return run_command(torchrun(cluster, 1, args(out), dir + "/" + tag + "1.txt") + " & " +
                       torchrun(cluster, 0, args(out), dir + "/" + tag + "0.txt") + "; a=$?; wait %1; echo $a$?");
  };
  const auto reference = both(dir + "/reference", "reference");
  ASSERT_EQ(weft::testing::last_line(reference.output), "00") << weft::testing::read_text(dir + "/reference0.txt");

  // Each node's job ends by writing "exit status, time" to end<node>; the fault comes once the
  // checkpoint of step 100 is there.
  const std::string out = dir + "/run";
  std::string script;
  for (int node = 1; node >= 0; --node) {
    const std::string n = std::to_string(node);
    script += "(" + torchrun(cluster, node, args(out), dir + "/cut" + n + ".txt") + "; echo $? $(date +%s.%N) > " +
              dir + "/end" + n + ") & ";
  }
  script += "for i in $(seq 600); do [ -e " + out + "/checkpoints/step-00000100 ] && break; sleep 0.05; done; " +
            (fault == "link" ? kTool + " link " + cluster.name() + " 1 down" : kTool + " kill " + cluster.name() + " 1") +
            "; date +%s.%N > " + dir + "/cut; wait";
  run_command(script);
  const std::string log0 = weft::testing::read_text(dir + "/cut0.txt");
  const std::string log1 = weft::testing::read_text(dir + "/cut1.txt");
  double cut = 0;
  std::sscanf(weft::testing::read_text(dir + "/cut").c_str(), "%lf", &cut);
  for (int node = 0; node < 2; ++node) {
    int status = -1;
    double end = 0;
    std::sscanf(weft::testing::read_text(dir + "/end" + std::to_string(node)).c_str(), "%d %lf", &status, &end);
    EXPECT_NE(status, 0) << "node " << node << "\n" << (node ? log1 : log0);
    EXPECT_LT(end - cut, timeout_s + 3) << "node " << node << "\n" << (node ? log1 : log0);
  }
  // Rank 0 names the rank it lost and that rank's node address; rank 1, cut off from node 0,
  // names the rendezvous it can no longer reach.
  // (After a timeout: "rank 1 did not join it (rank 1: pid ..."; after a failed collective: "(rank 1
  // did not join it) (rank 1: pid ...".)
  EXPECT_NE(log0.find("rank 1 did not join it"), std::string::npos) << log0;
  EXPECT_NE(log0.find("(rank 1: pid"), std::string::npos) << log0;
  EXPECT_NE(log0.find("Gloo on " + Cluster::address(1)), std::string::npos) << log0;
  if (fault == "link") {
    EXPECT_NE(log1.find("the rendezvous store at " + Cluster::address(0) + ":29400 did not answer"),
              std::string::npos)
        << log1;
  }
  // The checkpoints are whole: latest names a folder with the model, optimizer and trainer state.
  const std::string latest = weft::testing::read_text(out + "/checkpoints/latest");
  const std::string folder = out + "/checkpoints/" + latest.substr(0, latest.find_last_not_of(" \n") + 1);
  for (const char* file : {"trainer_state.json", "model.safetensors", "optimizer.safetensors"}) {
    EXPECT_TRUE(std::filesystem::exists(folder + "/" + file)) << folder << " lacks " << file;
  }
  const int64_t saved = std::stoll(latest.substr(latest.find('-') + 1));
  ASSERT_GE(saved, 100) << latest;

  if (fault == "link") {
    ASSERT_EQ(run_command(kTool + " link " + cluster.name() + " 1 up").exit_code, 0);
  }
  const auto resumed = both(out, "resume");
  ASSERT_EQ(weft::testing::last_line(resumed.output), "00") << weft::testing::read_text(dir + "/resume0.txt");
  const auto expected = step_records(dir + "/reference/metrics.jsonl");
  const auto got = step_records(out + "/metrics.jsonl");
  ASSERT_EQ(expected.size(), 300u);
  // The resumed run's records are the last 300 - saved: steps saved + 1 ... 300, each with the
  // uninterrupted run's loss.
  const auto resumed_steps = static_cast<size_t>(300 - saved);
  ASSERT_GE(got.size(), resumed_steps);
  for (size_t i = got.size() - resumed_steps, step = static_cast<size_t>(saved) + 1; i < got.size(); ++i, ++step) {
    ASSERT_EQ(got[i].first, static_cast<int64_t>(step)) << "record " << i;
    EXPECT_EQ(got[i].second, expected[step - 1].second) << "step " << step;
  }
}

TEST(Cluster, ALinkThatGoesDownStopsEveryRankAndTheRunResumesExactly) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (skip_without_torchrun()) GTEST_SKIP() << kNoTorchrun;
  fail_a_node_then_resume("link");
}

TEST(Cluster, ANodeKilledOutrightStopsTheOthersAndTheRunResumesExactly) {
  if (const auto why = unavailable(); !why.empty()) GTEST_SKIP() << why;
  if (skip_without_torchrun()) GTEST_SKIP() << kNoTorchrun;
  fail_a_node_then_resume("kill");
}

}  // namespace cluster_test
