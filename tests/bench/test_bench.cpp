// trainer bench: the plan of variants (names, process counts, the baseline, refusals), the
// figures from metrics files with hand-computed medians and ratios, and a real two-plugin
// bench end to end (runs alternated, bench.json, the table, the run report of a child run).
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/corpus.h"
#include "common/process.h"
#include "core/bench/bench.h"
#include "core/bench/bench_stats.h"
#include "core/bench/gemm_peak.h"
#include "core/model/config.h"
#include "core/util/error.h"

namespace {

using weft::testing::fresh_dir;
using weft::testing::read_text;
using weft::testing::run_trainer;

std::vector<std::string> names(const std::vector<weft::BenchVariant>& variants) {
  std::vector<std::string> out;
  for (const auto& v : variants) out.push_back(v.name);
  return out;
}

std::string plan_error(const weft::BenchOptions& options) {
  try {
    weft::plan_bench(options);
  } catch (const weft::Error& e) {
    return e.what();
  }
  return "";
}

TEST(BenchPlan, OneCountForAllPluginsOrOnePerPluginAndTheBaselineAtEveryCount) {
  // Beside the baseline the plugins are loaded (their mesh dimensions choose PyTorch's baselines):
  // bare names are found where the trainer's plugins are.
  ::setenv("WEFT_PLUGIN_PATH", WEFT_BINARY_DIR "/plugins", 1);
  weft::BenchOptions o;
  const std::string ddp_path = std::string(WEFT_BINARY_DIR) + "/plugins/ddp.so";  // a path, not a name
  o.plugins = {"single", ddp_path, "gpipe --set plugin.microbatches=8"};
  o.nproc = {"1", "1,2", "2"};
  o.pytorch_baseline = true;
  const auto variants = weft::plan_bench(o);
  // Beside a pipeline, PyTorch's three pipeline schedules with its micro-batches.
  EXPECT_EQ(names(variants),
            (std::vector<std::string>{"single x1", "ddp x1", "ddp x2", "gpipe microbatches=8 x2", "pytorch-ddp x1",
                                      "pytorch-ddp x2", "pytorch-gpipe microbatches=8 x2",
                                      "pytorch-1f1b microbatches=8 x2", "pytorch-interleaved1f1b microbatches=8 x2"}));
  EXPECT_EQ(variants[7].pytorch_parallel, "pp");
  EXPECT_EQ(variants[7].pytorch_schedule, "1f1b");
  EXPECT_EQ(variants[7].pytorch_microbatches, 8);
  EXPECT_EQ(variants[1].plugin, ddp_path);
  EXPECT_EQ(variants[3].settings, (std::vector<std::string>{"plugin.microbatches=8"}));
  EXPECT_TRUE(variants[5].pytorch);
  EXPECT_EQ(variants[5].nproc, 2);

  // Beside tensor_parallel, PyTorch's DTensor tensor parallelism at each of its split counts.
  weft::BenchOptions tp;
  tp.plugins = {"tensor_parallel"};
  tp.nproc = {"1,2"};
  tp.pytorch_baseline = true;
  const auto with_tp = weft::plan_bench(tp);
  EXPECT_EQ(names(with_tp), (std::vector<std::string>{"tensor_parallel x1", "tensor_parallel x2", "pytorch-ddp x1",
                                                      "pytorch-ddp x2", "pytorch-tp x2"}));
  EXPECT_EQ(with_tp[4].pytorch_parallel, "tp");
  EXPECT_EQ(with_tp[3].pytorch_parallel, "ddp");

  weft::BenchOptions all;
  all.plugins = {"single", "ddp"};
  all.nproc = {"2"};
  EXPECT_EQ(names(weft::plan_bench(all)), (std::vector<std::string>{"single x2", "ddp x2"}));
}

TEST(BenchPlan, RefusesWhatItCannotRun) {
  weft::BenchOptions none;
  EXPECT_NE(plan_error(none).find("at least one --plugin"), std::string::npos);
  weft::BenchOptions counts;
  counts.plugins = {"a", "b", "c"};
  counts.nproc = {"1", "2"};
  EXPECT_NE(plan_error(counts).find("2 --nproc values for 3 --plugin values"), std::string::npos);
  weft::BenchOptions bad;
  bad.plugins = {"ddp"};
  bad.nproc = {"two"};
  EXPECT_NE(plan_error(bad).find("--nproc 'two'"), std::string::npos);
  weft::BenchOptions zero = bad;
  zero.nproc = {"1,0"};
  EXPECT_NE(plan_error(zero).find("--nproc '1,0'"), std::string::npos);
  weft::BenchOptions spec;
  spec.plugins = {"gpipe microbatches=8"};
  EXPECT_NE(plan_error(spec).find("only '--set KEY=VALUE' pairs"), std::string::npos);
  weft::BenchOptions twice;
  twice.plugins = {"ddp", "ddp"};
  EXPECT_NE(plan_error(twice).find("'ddp x1' is listed twice"), std::string::npos);
  // Across nodes: a node rank in range, node 0's address, no PyTorch baseline (it runs on one node).
  weft::BenchOptions nodes;
  nodes.plugins = {"ddp"};
  nodes.nnodes = 2;
  nodes.node_rank = 2;
  nodes.master_addr = "10.0.0.1";
  EXPECT_NE(plan_error(nodes).find("--nnodes 2 --node-rank 2: the node rank must be 0 to 1"), std::string::npos);
  nodes.node_rank = 1;
  nodes.master_addr = "";
  EXPECT_NE(plan_error(nodes).find("node 0's --master-addr"), std::string::npos);
  nodes.master_addr = "10.0.0.1";
  nodes.pytorch_baseline = true;
  EXPECT_NE(plan_error(nodes).find("--baseline pytorch runs on one node only"), std::string::npos);
  nodes.pytorch_baseline = false;
  nodes.eval_every = -1;
  EXPECT_NE(plan_error(nodes).find("--eval-every -1"), std::string::npos);
  nodes.eval_every = 0;
  // A run of 2 ranks per node on 2 nodes is named by its 4 processes.
  nodes.nproc = {"2"};
  EXPECT_EQ(names(weft::plan_bench(nodes)), (std::vector<std::string>{"ddp x4"}));
}

// The held-out loss against training time and the link's bytes, as read from a run's metrics:
// the train time of an evaluation is every step's time before it (warm-up included), the final
// evaluation at the last step is one point with a periodic one there, and link bytes are the
// measured steps' mean over repetitions (bytes add up: a step that syncs once in H counts 1/H).
TEST(BenchStats, HeldOutLossIsPlacedAtTheTrainingTimeBeforeItAndLinkBytesAreMeans) {
  const auto dir = fresh_dir("weft_bench", "held_out");
  auto write = [&](const std::string& name, double scale) {
    const std::string path = dir + "/" + name + ".jsonl";
    std::ofstream out(path);
    for (int step = 1; step <= 4; ++step) {
      out << nlohmann::json{{"type", "step"}, {"step", step}, {"step_time_s", scale * step},
                            {"link_bytes", 1000.0 * step * scale}}.dump() << "\n";
      if (step % 2 == 0) {
        out << nlohmann::json{{"type", "eval"}, {"step", step}, {"loss", 5.0 - step}, {"seconds", 0.5}}.dump() << "\n";
      }
    }
    out << nlohmann::json{{"type", "eval"}, {"step", 4}, {"loss", 1.0}, {"seconds", 0.25}}.dump() << "\n";  // the final one
    out << nlohmann::json{{"type", "summary"}, {"steps_per_epoch", 10}}.dump() << "\n";
    return path;
  };
  const auto one = weft::read_run(write("one", 1.0), 1);
  ASSERT_EQ(one.held_out.size(), 2u);
  EXPECT_EQ(one.held_out[0].step, 2);
  EXPECT_DOUBLE_EQ(one.held_out[0].train_seconds, 1.0 + 2.0);
  EXPECT_DOUBLE_EQ(one.held_out[1].train_seconds, 1.0 + 2.0 + 3.0 + 4.0);
  EXPECT_DOUBLE_EQ(one.held_out[1].loss, 1.0);
  EXPECT_DOUBLE_EQ(one.held_out[0].wall_seconds, 3.0 + 0.5);  // with the evaluations' time
  EXPECT_DOUBLE_EQ(one.held_out[1].wall_seconds, 10.0 + 0.5 + 0.5 + 0.25);
  EXPECT_EQ(one.link_bytes, (std::vector<double>{2000.0, 3000.0, 4000.0}));  // after the warm-up step
  const auto two = weft::read_run(write("two", 3.0), 1);
  const auto v = weft::summarise("ddp x2", "ddp", 2, false, {one, two}, 100);
  ASSERT_TRUE(v.link_bytes_per_step.has_value());
  EXPECT_DOUBLE_EQ(*v.link_bytes_per_step, 6000.0);  // the mean of {2, 3, 4, 6, 9, 12} thousand
  ASSERT_EQ(v.held_out.size(), 2u);
  EXPECT_DOUBLE_EQ(v.held_out[1].train_seconds, (10.0 + 30.0) / 2);
  const std::string table = weft::format_bench_table({v}, {});
  EXPECT_NE(table.find("| ddp x2 | 6.000 s | 0.01 | 1.0000 (step 4, 20.0 s) |"), std::string::npos) << table;
  EXPECT_EQ(weft::to_json(v)["held_out"][1]["step"], 4);
}

// A metrics.jsonl with the given step times (steps 1..n), comm on every step, and a summary.
std::string write_metrics(const std::string& dir, const std::string& name, const std::vector<double>& steps,
                          bool comm) {
  const std::string path = dir + "/" + name + ".jsonl";
  std::ofstream out(path);
  for (size_t i = 0; i < steps.size(); ++i) {
    nlohmann::json j = {{"type", "step"}, {"step", i + 1}, {"step_time_s", steps[i]}, {"tokens_per_s", 1000 / steps[i]}};
    if (comm) {
      j["comm_wait_s"] = 0.25 * steps[i];
      j["comm_bytes"] = 1000.0 * static_cast<double>(i + 1);
      j["plugin.bubble"] = 0.1 * static_cast<double>(i + 1);
      j["plugin.bubble_formula"] = 0.2;
      j["forward_s"] = 0.4 * steps[i];
      j["backward_s"] = 0.5 * steps[i];
    }
    out << j.dump() << "\n";
  }
  nlohmann::json summary = {{"type", "summary"}, {"steps_per_epoch", 100}, {"peak_rss_mib_per_rank", {300.0, 200.0}}};
  // The tensor bytes a step added at its peak (weft's runs): rank 0 grows with the run's first step.
  if (comm) summary["activation_peak_mib_per_rank"] = {40.0 + steps.front(), 30.0};
  if (comm) summary["model_flops_per_token"] = 6.0e8;
  out << summary.dump() << "\n";
  return path;
}

TEST(BenchStats, WarmUpIsDroppedAndEveryFigureFollowsFromTheMeasuredSteps) {
  const auto dir = fresh_dir("weft_bench", "stats");
  // Step 1 (warm-up) is slow and must not count; measured steps 2..4.
  const auto a1 = weft::read_run(write_metrics(dir, "a1", {9.0, 1.0, 3.0, 2.0}, true), 1);
  const auto a2 = weft::read_run(write_metrics(dir, "a2", {9.0, 4.0, 1.5, 2.5}, true), 1);
  ASSERT_EQ(a1.step_seconds, (std::vector<double>{1.0, 3.0, 2.0}));
  EXPECT_EQ(a1.flops_per_token, 6.0e8);
  const auto a = weft::summarise("a x2", "a", 2, false, {a1, a2}, 1000);
  // Pooled measured steps {1, 3, 2, 4, 1.5, 2.5}: median 2.25, min 1, max 4.
  EXPECT_DOUBLE_EQ(a.step_seconds.median, 2.25);
  EXPECT_DOUBLE_EQ(a.step_seconds.min, 1.0);
  EXPECT_DOUBLE_EQ(a.step_seconds.max, 4.0);
  // Percentiles of the same steps, interpolated as numpy.percentile: sorted {1, 1.5, 2, 2.5, 3, 4},
  // p95 at rank 4.75 (3 + 0.75), p99 at rank 4.95.
  EXPECT_DOUBLE_EQ(a.step_percentiles.p50, 2.25);
  EXPECT_DOUBLE_EQ(a.step_percentiles.p95, 3.75);
  EXPECT_DOUBLE_EQ(a.step_percentiles.p99, 3.95);
  EXPECT_DOUBLE_EQ(weft::to_json(a)["step_time_percentiles_s"]["p95"].get<double>(), 3.75);
  EXPECT_DOUBLE_EQ(a.tokens_per_second.median, 1000 / 2.25);
  EXPECT_DOUBLE_EQ(a.tokens_per_second.min, 250.0);  // the slowest step
  EXPECT_DOUBLE_EQ(a.epoch_seconds.median, 225.0);   // 100 steps per epoch
  EXPECT_EQ(a.run_step_seconds, (std::vector<double>{2.0, 2.5}));
  ASSERT_TRUE(a.comm_wait_fraction.has_value());
  EXPECT_DOUBLE_EQ(*a.comm_wait_fraction, 0.25);
  EXPECT_DOUBLE_EQ(*a.comm_bytes_per_step, 3000.0);  // bytes {2000, 3000, 4000} twice
  EXPECT_DOUBLE_EQ(*a.bubble, 0.3);
  EXPECT_DOUBLE_EQ(*a.bubble_formula, 0.2);
  EXPECT_EQ(a.peak_rss_mib_per_rank, (std::vector<double>{300.0, 200.0}));
  EXPECT_EQ(a.activation_peak_mib_per_rank, (std::vector<double>{49.0, 30.0}));  // the largest per rank
  EXPECT_DOUBLE_EQ(*a.forward_seconds, 0.4 * 2.25);  // medians of the measured steps' times
  EXPECT_DOUBLE_EQ(*a.backward_seconds, 0.5 * 2.25);

  const auto b1 = weft::read_run(write_metrics(dir, "b1", {9.0, 4.0, 4.0, 4.0}, false), 1);
  const auto b2 = weft::read_run(write_metrics(dir, "b2", {9.0, 5.0, 5.0, 5.0}, false), 1);
  auto b = weft::summarise("b x1", "b", 1, false, {b1, b2}, 1000);
  EXPECT_FALSE(b1.flops_per_token.has_value());
  EXPECT_FALSE(b.mfu.has_value());  // the bench sets it where it measured a peak
  EXPECT_TRUE(weft::to_json(b)["mfu"].is_null());
  b.mfu = 0.4567;
  EXPECT_DOUBLE_EQ(weft::to_json(b)["mfu"].get<double>(), 0.4567);
  EXPECT_FALSE(b.comm_wait_fraction.has_value());
  EXPECT_FALSE(b.forward_seconds.has_value());
  EXPECT_TRUE(b.activation_peak_mib_per_rank.empty());
  const auto ratios = weft::pair_ratios({a, b});
  ASSERT_EQ(ratios.size(), 1u);
  EXPECT_DOUBLE_EQ(ratios[0].tokens_per_second, 2.25 / 4.5);  // b's tokens/s over a's
  EXPECT_EQ(ratios[0].per_repetition, (std::vector<double>{0.5, 0.5}));
  const std::string table = weft::format_bench_table({a, b}, ratios);
  EXPECT_NE(table.find("| a x2 | 2 | 2.250 s [1.000-4.000] | 2.250 / 3.750 / 3.950 s | 444 [250-1000] | 03:45 "
                       "[01:40-06:40] | 0.900 / 1.125 s | 300/200 | 49/30 | 25.0% | "
                       "0.00 | 0.300 (0.200) |"),
            std::string::npos)
      << table;
  EXPECT_NE(table.find("| b x1 vs a x2 | 0.50x | 0.50, 0.50 |"), std::string::npos) << table;
  EXPECT_NE(table.find("| - | 45.7% |\n"), std::string::npos) << table;  // b's bubble, then its MFU
  EXPECT_NE(table.find("| 0.300 (0.200) | - |\n"), std::string::npos) << table;  // a has none
  // Beyond 3 variants the table lists each against the first only (all pairs stay in JSON).
  auto c = b, d = b;
  c.name = "c x1";
  d.name = "d x1";
  const auto four = weft::pair_ratios({a, b, c, d});
  EXPECT_EQ(four.size(), 6u);
  const std::string long_table = weft::format_bench_table({a, b, c, d}, four);
  EXPECT_NE(long_table.find("| d x1 vs a x2 |"), std::string::npos) << long_table;
  EXPECT_EQ(long_table.find("| d x1 vs b x1 |"), std::string::npos) << long_table;
  EXPECT_NE(long_table.find("| per repetition (each against the first variant; every pair is in bench.json) |"),
            std::string::npos)
      << long_table;
}

// The products trainer bench measures its CPU peak on are the model's, as weft multiplies them
// (q/k/v and gate/up stacked, the head on its chunk of rows), and the peak is the best of their
// rates, timed in the asked dtype with the asked threads (the caller's setting restored).
TEST(GemmPeak, TheModelsOwnProductsAndTheBestOfTheirRates) {
  weft::ModelConfig smol;  // SmolLM2-135M's shape
  smol.vocab_size = 49152;
  smol.hidden_size = 576;
  smol.intermediate_size = 1536;
  smol.num_hidden_layers = 30;
  smol.num_attention_heads = 9;
  smol.num_key_value_heads = 3;
  smol.head_dim = 64;
  auto shapes = weft::model_gemm_shapes(smol, 1024, 1360);
  ASSERT_EQ(shapes.size(), 5u);
  auto mkn = [](const weft::GemmShape& s) { return std::vector<int64_t>{s.m, s.k, s.n}; };
  EXPECT_EQ(mkn(shapes[0]), (std::vector<int64_t>{1024, 576, 960}));   // q/k/v: 576 + 2 x 192
  EXPECT_EQ(mkn(shapes[1]), (std::vector<int64_t>{1024, 576, 576}));   // o
  EXPECT_EQ(mkn(shapes[2]), (std::vector<int64_t>{1024, 576, 3072}));  // gate/up
  EXPECT_EQ(mkn(shapes[3]), (std::vector<int64_t>{1024, 1536, 576}));  // down
  EXPECT_EQ(mkn(shapes[4]), (std::vector<int64_t>{1024, 576, 49152})); // the head: one chunk holds all rows
  EXPECT_EQ(weft::model_gemm_shapes(smol, 1024, 256)[4].m, 256);
  EXPECT_DOUBLE_EQ(shapes[1].flops(), 2.0 * 1024 * 576 * 576);
  smol.num_labels = 2;  // a classifier: no LM head product
  EXPECT_EQ(weft::model_gemm_shapes(smol, 1024).size(), 4u);

  const int previous = at::get_num_threads();
  at::set_num_threads(2);  // the caller's setting, other than the 1 thread measured with
  const int threads = at::get_num_threads();
  const std::vector<weft::GemmShape> small{{32, 64, 48, "a"}, {64, 96, 128, "b"}};
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const auto peak = weft::measure_gemm_peak(small, dtype, 1, 0.01);
    EXPECT_EQ(peak.dtype, dtype == torch::kFloat32 ? "fp32" : "bf16");
    EXPECT_EQ(peak.threads, 1);
    ASSERT_EQ(peak.rates.size(), 2u);
    EXPECT_EQ(peak.rates[1].shape.what, "b");
    EXPECT_GT(peak.rates[0].gflops, 0.0);
    EXPECT_GT(peak.rates[1].gflops, 0.0);
    EXPECT_DOUBLE_EQ(peak.gflops, std::max(peak.rates[0].gflops, peak.rates[1].gflops));
    const auto json = weft::to_json(peak);
    EXPECT_EQ(json["shapes"][1]["n"], 128);
    EXPECT_DOUBLE_EQ(json["gflops"].get<double>(), peak.gflops);
  }
  EXPECT_EQ(at::get_num_threads(), threads);
  EXPECT_THROW(weft::measure_gemm_peak({}, torch::kFloat32, 1), weft::Error);
  EXPECT_THROW(weft::measure_gemm_peak({{0, 4, 4, "empty"}}, torch::kFloat32, 1), weft::Error);
  EXPECT_THROW(weft::measure_gemm_peak(small, torch::kFloat32, 0), weft::Error);
  EXPECT_EQ(at::get_num_threads(), threads);
  at::set_num_threads(previous);

  // Several measurements as one: each product's median rate, the peak the best of those.
  const auto measured = [&](double a, double b) {
    weft::GemmPeak p;
    p.dtype = "bf16";
    p.rates = {{small[0], a}, {small[1], b}};
    p.gflops = std::max(a, b);
    return p;
  };
  const auto three = weft::median_peak({measured(100, 300), measured(400, 200), measured(250, 260)});
  EXPECT_DOUBLE_EQ(three.rates[0].gflops, 250);
  EXPECT_DOUBLE_EQ(three.rates[1].gflops, 260);
  EXPECT_DOUBLE_EQ(three.gflops, 260);  // not 400, one measurement's luck
  EXPECT_EQ(three.measurements, (std::vector<double>{300, 400, 260}));
  EXPECT_EQ(weft::to_json(three)["measurements"].size(), 3u);
  const auto two = weft::median_peak({measured(100, 300), measured(400, 200)});
  EXPECT_DOUBLE_EQ(two.rates[0].gflops, 250);
  EXPECT_DOUBLE_EQ(two.gflops, 250);
  EXPECT_THROW(weft::median_peak({}), weft::Error);
  auto other = measured(1, 2);
  other.rates[1].shape.n += 1;
  EXPECT_THROW(weft::median_peak({measured(1, 2), other}), weft::Error);
  other = measured(1, 2);
  other.dtype = "fp32";
  EXPECT_THROW(weft::median_peak({measured(1, 2), other}), weft::Error);
}

TEST(BenchStats, PercentilesInterpolateBetweenTheClosestRanksAsNumpyDoes) {
  EXPECT_DOUBLE_EQ(weft::percentile_of({4, 1, 3, 2}, 95), 3.85);  // numpy.percentile([1, 2, 3, 4], 95)
  EXPECT_DOUBLE_EQ(weft::percentile_of({4, 1, 3, 2}, 50), 2.5);
  EXPECT_DOUBLE_EQ(weft::percentile_of({4, 1, 3, 2}, 0), 1.0);
  EXPECT_DOUBLE_EQ(weft::percentile_of({4, 1, 3, 2}, 100), 4.0);
  EXPECT_DOUBLE_EQ(weft::percentile_of({7}, 99), 7.0);
  EXPECT_DOUBLE_EQ(weft::percentile_of({}, 99), 0.0);
}

TEST(BenchStats, ARunWithoutMeasuredStepsOrSummaryIsAnError) {
  const auto dir = fresh_dir("weft_bench", "errors");
  const auto path = write_metrics(dir, "short", {1.0, 1.0}, false);
  EXPECT_THROW(weft::read_run(path, 2), weft::Error);
  std::ofstream(dir + "/nosummary.jsonl") << R"({"type": "step", "step": 3, "step_time_s": 1.0})" << "\n";
  EXPECT_THROW(weft::read_run(dir + "/nosummary.jsonl", 1), weft::Error);
  EXPECT_THROW(weft::read_run(dir + "/missing.jsonl", 1), weft::Error);
}

// `trainer bench` on the tiny config and a generated corpus in `dir`, 1 warm-up + 2 counted
// steps per run, writing to dir/bench; `variants` adds the plugins, counts and repetitions.
weft::testing::Outcome run_tiny_bench(const std::string& dir, const std::string& variants) {
  const std::string corpus = weft::testing::write_word_corpus(dir);
  return run_trainer("bench --config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + corpus +
                     " --set data.cache_dir= --set data.seq_len=32 --warmup 1 --steps 2 --out " + dir + "/bench " +
                     variants);
}

TEST(BenchCommand, AlternatesTwoPluginsAndWritesTheTableJsonAndRunReports) {
  const auto dir = fresh_dir("weft_bench", "e2e");
  const std::string out = dir + "/bench";
  const auto result = run_tiny_bench(dir, "--plugin single --plugin ddp --nproc 1 --nproc 2 --repetitions 2");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("| ddp x2 vs single x1 |"), std::string::npos) << result.output;
  const auto json = nlohmann::json::parse(read_text(out + "/bench.json"));
  ASSERT_EQ(json["variants"].size(), 2u);
  EXPECT_EQ(json["variants"][0]["name"], "single x1");
  EXPECT_EQ(json["variants"][1]["nproc"], 2);
  EXPECT_EQ(json["variants"][1]["runs"].size(), 2u);
  EXPECT_EQ(json["variants"][1]["peak_rss_mib_per_rank"].size(), 2u);
  EXPECT_GT(json["variants"][1]["comm_bytes_per_step"].get<double>(), 0.0);
  EXPECT_EQ(json["tokens_per_step"], 4 * 32);
  // Alternation: repetition 1 of both variants finished before repetition 2 of either began.
  auto finished = [&](const std::string& variant, int rep) {
    return std::filesystem::last_write_time(out + "/runs/" + variant + "/rep" + std::to_string(rep) + "/metrics.jsonl");
  };
  EXPECT_LT(finished("ddp_x2", 1), finished("single_x1", 2));
  EXPECT_LT(finished("single_x1", 1), finished("ddp_x2", 1));
  // A CPU job: the GEMM peak of the tiny model's five products (q/k/v, o, gate/up, down, the head)
  // in fp32 on one thread, measured before each repetition (each product's median rate), and each
  // variant's MFU against it: its median tokens/s per process times the FLOPs per token its runs'
  // summaries give, over the peak.
  const auto& peak = json["gemm_peak"];
  ASSERT_TRUE(peak.is_object()) << json.dump(2);
  EXPECT_EQ(peak["dtype"], "fp32");
  EXPECT_EQ(peak["threads"], 1);
  ASSERT_EQ(peak["measurements"].size(), 2u);
  for (const auto& m : peak["measurements"]) EXPECT_GT(m.get<double>(), 0.0);
  ASSERT_EQ(peak["shapes"].size(), 5u);
  EXPECT_EQ(peak["shapes"][4]["what"], "head");
  EXPECT_EQ(peak["shapes"][0]["m"], 4 * 32);  // single x1 multiplies the whole batch
  double best = 0;
  for (const auto& shape : peak["shapes"]) best = std::max(best, shape["gflops"].get<double>());
  EXPECT_GT(best, 0.0);
  EXPECT_DOUBLE_EQ(peak["gflops"].get<double>(), best);
  nlohmann::json run_summary;
  std::ifstream metrics(out + "/runs/ddp_x2/rep1/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    if (const auto j = nlohmann::json::parse(line); j["type"] == "summary") run_summary = j;
  }
  const double flops = run_summary["model_flops_per_token"].get<double>();
  EXPECT_GT(flops, 0.0);
  const auto& ddp = json["variants"][1];
  EXPECT_NEAR(ddp["mfu"].get<double>(), ddp["tokens_per_s"]["median"].get<double>() / 2 * flops / (best * 1e9),
              1e-12);
  EXPECT_NE(result.output.find(" MFU (of the measured GEMM peak) |"), std::string::npos) << result.output;
  // Every run records the command that reproduces it.
  EXPECT_NE(read_text(out + "/runs/ddp_x2/rep1/command.txt").find("--plugin ddp --nproc 2"), std::string::npos);
  // A plugin that does not exist is refused before anything runs.
  const auto missing = run_trainer("bench --config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --plugin nosuch"
                                   " --out " + dir + "/bench2");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("nosuch"), std::string::npos) << missing.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/bench2/runs"));
}

// A variant whose own settings change the global batch (here half the job's sequences) is timed on
// its own tokens per step: its tokens/s is what its runs logged, not the job's batch over its step
// time; the GEMM peak is measured on the largest micro-batch of one process. A variant setting the
// job cannot take is refused before any run, naming the variant.
TEST(BenchCommand, AVariantsOwnBatchSetsItsTokensPerStep) {
  const auto dir = fresh_dir("weft_bench", "variant_batch");
  const auto result = run_tiny_bench(dir, "--plugin single --plugin 'single --set train.batch_size=2' --nproc 1 "
                                          "--repetitions 1");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto json = nlohmann::json::parse(read_text(dir + "/bench/bench.json"));
  ASSERT_EQ(json["variants"].size(), 2u);
  EXPECT_EQ(json["tokens_per_step"], 4 * 32);
  EXPECT_EQ(json["variants"][0]["tokens_per_step"], 4 * 32);
  EXPECT_EQ(json["variants"][1]["tokens_per_step"], 2 * 32);
  EXPECT_EQ(json["gemm_peak"]["shapes"][0]["m"], 4 * 32);
  for (const auto* name : {"single_x1", "single_train.batch_size_2_x1"}) {
    const auto& v = json["variants"][std::string(name) == "single_x1" ? 0 : 1];
    std::vector<double> logged;  // the run's own tokens/s over the counted steps (after the 1 warm-up)
    std::ifstream metrics(dir + "/bench/runs/" + name + "/rep1/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step" && j["step"].get<int>() > 1) logged.push_back(j["tokens_per_s"].get<double>());
    }
    ASSERT_EQ(logged.size(), 2u) << name;
    std::sort(logged.begin(), logged.end());
    // The median of two steps' times: tokens / (mean of the times), between the two logged rates.
    const double tokens_per_s = v["tokens_per_s"]["median"].get<double>();
    EXPECT_GE(tokens_per_s, logged[0] * (1 - 1e-9)) << name;
    EXPECT_LE(tokens_per_s, logged[1] * (1 + 1e-9)) << name;
    EXPECT_NEAR(tokens_per_s * v["step_time_s"]["median"].get<double>(), v["tokens_per_step"].get<double>(), 1e-6);
  }
  const auto bad_dir = fresh_dir("weft_bench", "variant_batch_bad");
  const auto bad = run_tiny_bench(bad_dir, "--plugin single --plugin 'single --set train.batch_size=0' --nproc 1 "
                                           "--repetitions 1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("variant 'single train.batch_size=0 x1'"), std::string::npos) << bad.output;
  EXPECT_FALSE(std::filesystem::exists(bad_dir + "/bench/runs"));
}

// --eval-every: the held-out loss every N steps, the same for two plugins that train alike, placed at
// increasing training times, in bench.json, the table and held_out_loss.png.
TEST(BenchCommand, EvalEveryRecordsHeldOutLossAgainstTrainingTime) {
  const auto dir = fresh_dir("weft_bench", "eval_every");
  const auto result = run_tiny_bench(dir, "--plugin single --plugin ddp --nproc 1 --nproc 2 --repetitions 1 "
                                          "--eval-every 1 --set data.heldout_fraction=0.2");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto json = nlohmann::json::parse(read_text(dir + "/bench/bench.json"));
  EXPECT_EQ(json["eval_every"], 1);
  ASSERT_EQ(json["variants"].size(), 2u);
  const auto& single = json["variants"][0]["held_out"];
  const auto& ddp = json["variants"][1]["held_out"];
  ASSERT_EQ(single.size(), 3u) << json.dump();  // steps 1, 2, 3
  ASSERT_EQ(ddp.size(), 3u) << json.dump();
  for (size_t e = 0; e < 3; ++e) {
    EXPECT_EQ(single[e]["step"], static_cast<int>(e) + 1);
    EXPECT_NEAR(ddp[e]["loss"].get<double>(), single[e]["loss"].get<double>(), 1e-4);
    if (e > 0) {
      EXPECT_GT(single[e]["train_seconds"].get<double>(), single[e - 1]["train_seconds"].get<double>());
    }
  }
  EXPECT_NE(result.output.find("last held-out loss"), std::string::npos) << result.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/bench/held_out_loss.png")) << read_text(dir + "/bench/plots.log");
  EXPECT_NE(read_text(dir + "/bench/runs/ddp_x2/rep1/command.txt").find("eval.every_steps=1"), std::string::npos);
}

TEST(BenchCommand, AFailingVariantIsNamedAndTheOthersAreStillMeasured) {
  // gpipe with 3 stages cannot run on 2 ranks: that variant fails in its first repetition; the
  // bench goes on with single, writes its figures, names the failure with its error and exits 1.
  // Before, the first failure discarded the whole bench.
  const auto dir = fresh_dir("weft_bench", "failing");
  const std::string out = dir + "/bench";
  const auto result = run_tiny_bench(
      dir, "--plugin single --plugin 'gpipe --set plugin.stages=3' --nproc 1 --nproc 2 --repetitions 2");
  EXPECT_EQ(result.exit_code, 1) << result.output;
  const auto json = nlohmann::json::parse(read_text(out + "/bench.json"));
  ASSERT_EQ(json["variants"].size(), 1u) << json.dump(2);
  EXPECT_EQ(json["variants"][0]["name"], "single x1");
  EXPECT_EQ(json["variants"][0]["runs"].size(), 2u);
  ASSERT_EQ(json["failed"].size(), 1u) << json.dump(2);
  EXPECT_EQ(json["failed"][0]["name"], "gpipe stages=3 x2");
  EXPECT_EQ(json["failed"][0]["repetition"], 1);
  const std::string error = json["failed"][0]["error"];
  EXPECT_NE(error.find("stages"), std::string::npos) << error;
  EXPECT_NE(error.find(out + "/runs/gpipe_stages_3_x2/rep1/output.log"), std::string::npos) << error;
  EXPECT_FALSE(std::filesystem::exists(out + "/runs/gpipe_stages_3_x2/rep2"));  // not run again
  const std::string table = read_text(out + "/bench.md");
  EXPECT_NE(table.find("| single x1 |"), std::string::npos) << table;
  EXPECT_NE(table.find("**gpipe stages=3 x2 failed** in repetition 1"), std::string::npos) << table;
}

// The PyTorch DDP baseline (python/pytorch_baseline.py, Debian's python3-torch) trains the job
// trainer bench exported: the same model (its parameter count equals weft's for the exported
// config.json), the same global batch, on 2 processes, in the same alternation.
TEST(BenchCommand, ThePytorchBaselineTrainsTheSameModelInTheAlternation) {
  const auto dir = fresh_dir("weft_bench", "pytorch");
  const std::string out = dir + "/bench";
  const auto result = run_tiny_bench(dir, "--plugin ddp --nproc 2 --baseline pytorch --repetitions 1");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto json = nlohmann::json::parse(read_text(out + "/bench.json"));
  ASSERT_EQ(json["variants"].size(), 2u);
  EXPECT_EQ(json["variants"][1]["name"], "pytorch-ddp x2");
  EXPECT_EQ(json["variants"][1]["kind"], "pytorch");
  EXPECT_EQ(json["variants"][1]["peak_rss_mib_per_rank"].size(), 2u);
  EXPECT_EQ(json["ratios"][0]["b"], "pytorch-ddp x2");
  nlohmann::json summary;
  std::ifstream metrics(out + "/runs/pytorch-ddp_x2/rep1/metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "step") ++steps;
    if (j["type"] == "summary") summary = j;
  }
  EXPECT_EQ(steps, 3);  // warm-up + measured
  const auto model = weft::load_hf_config(out + "/job/config.json");
  EXPECT_EQ(summary["parameters"].get<int64_t>(), model.parameter_count());
  EXPECT_EQ(summary["world_size"], 2);
}

// PyTorch's DTensor tensor parallelism (--parallel tp) trains the same job as its DDP baseline:
// the same losses and gradient norms step by step, with the forward and backward times apart.
TEST(BenchCommand, ThePytorchTensorParallelBaselineTrainsWhatItsDdpBaselineTrains) {
  const auto dir = fresh_dir("weft_bench", "pytorch_tp");
  const std::string out = dir + "/bench";
  const auto result = run_tiny_bench(dir, "--plugin tensor_parallel --nproc 2 --baseline pytorch --repetitions 1");
  const auto json = nlohmann::json::parse(read_text(out + "/bench.json"));
  const auto records = [&](const std::string& variant) {
    std::vector<nlohmann::json> steps;
    nlohmann::json summary;
    std::ifstream metrics(out + "/runs/" + variant + "/rep1/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      (j["type"] == "step" ? steps.emplace_back(j) : summary) = j;
    }
    return std::pair{steps, summary};
  };
  const auto [ddp_steps, ddp_summary] = records("pytorch-ddp_x2");
  ASSERT_EQ(ddp_steps.size(), 3u) << result.output;
  // weft's side: rank 0's time in the host's forward and backward, per step, on the CPU
  ASSERT_EQ(json["variants"][0]["name"], "tensor_parallel x2");
  EXPECT_GT(json["variants"][0]["forward_s"].get<double>(), 0.0);
  EXPECT_GT(json["variants"][0]["backward_s"].get<double>(), 0.0);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  ASSERT_EQ(json["variants"].size(), 3u) << json.dump(2);
  EXPECT_EQ(json["variants"][2]["name"], "pytorch-tp x2");
  const auto [tp_steps, tp_summary] = records("pytorch-tp_x2");
  EXPECT_EQ(tp_summary["parallel"], "tp");
  EXPECT_EQ(tp_summary["parameters"], ddp_summary["parameters"]);
  ASSERT_EQ(tp_steps.size(), ddp_steps.size());
  for (size_t i = 0; i < tp_steps.size(); ++i) {
    EXPECT_NEAR(tp_steps[i]["loss"].get<double>(), ddp_steps[i]["loss"].get<double>(), 1e-5) << "step " << i + 1;
    EXPECT_NEAR(tp_steps[i]["grad_norm"].get<double>(), ddp_steps[i]["grad_norm"].get<double>(), 1e-4) << "step " << i + 1;
    EXPECT_GT(tp_steps[i]["forward_s"].get<double>(), 0.0);
    EXPECT_GT(tp_steps[i]["backward_s"].get<double>(), 0.0);
    EXPECT_LE(tp_steps[i]["forward_s"].get<double>() + tp_steps[i]["backward_s"].get<double>(),
              tp_steps[i]["step_time_s"].get<double>());
  }
}

// PyTorch's pipeline schedules (torch.distributed.pipelining: ScheduleGPipe, Schedule1F1B,
// ScheduleInterleaved1F1B) train what its DDP baseline trains on a 4-layer model: the same losses
// and gradient norms at every step. On a 2-layer model the interleaved schedule (4 stages over 2
// processes) cannot run: the baseline refuses it in one line before any process starts (the same
// command on the bench's job with 2 layers; a failing variant in a bench: AFailingVariantIsNamed...).
// ~26 s (ctest -j2, 2-core Xeon): a bench of 5 variants, 4 of them PyTorch's (2 processes each).
TEST(BenchCommand, ThePytorchPipelineBaselinesTrainWhatItsDdpBaselineTrains) {
  const auto dir = fresh_dir("weft_bench", "pytorch_pp");
  const std::string out = dir + "/bench";
  const std::string model = " --set model.config=" + std::string(WEFT_SOURCE_DIR) + "/configs/models/austen-mini/config.json";
  const auto result = run_tiny_bench(dir, "--plugin gpipe --nproc 2 --baseline pytorch --repetitions 1" + model);
  const auto losses = [&](const std::string& variant) {
    std::vector<std::pair<double, double>> steps;
    std::string version;
    std::ifstream metrics(out + "/runs/" + variant + "/rep1/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step") steps.emplace_back(j["loss"].get<double>(), j["grad_norm"].get<double>());
      if (j["type"] == "summary") version = j["torch_version"];
    }
    return std::pair{steps, version};
  };
  const auto [ddp, version] = losses("pytorch-ddp_x2");
  ASSERT_EQ(ddp.size(), 3u) << result.output;
  ASSERT_EQ(result.exit_code, 0) << result.output;
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved1f1b"}) {
    const auto [steps, unused] = losses("pytorch-" + schedule + "_x2");
    ASSERT_EQ(steps.size(), ddp.size()) << schedule;
    for (size_t i = 0; i < steps.size(); ++i) {
      EXPECT_NEAR(steps[i].first, ddp[i].first, 1e-5) << schedule << " step " << i + 1;
      EXPECT_NEAR(steps[i].second, ddp[i].second, 1e-4) << schedule << " step " << i + 1;
    }
  }
  // The interleaved variant's own command on a copy of the job whose model has 2 layers.
  std::filesystem::copy(out + "/job", dir + "/job2", std::filesystem::copy_options::recursive);
  auto config = nlohmann::json::parse(read_text(dir + "/job2/config.json"));
  config["num_hidden_layers"] = 2;
  std::ofstream(dir + "/job2/config.json") << config.dump(2);
  std::string command = read_text(out + "/runs/pytorch-interleaved1f1b_x2/rep1/command.txt");
  command = command.substr(0, command.find_last_not_of('\n') + 1);
  const auto at = command.find(out + "/job");
  ASSERT_NE(at, std::string::npos) << command;
  command.replace(at, (out + "/job").size(), dir + "/job2");
  const auto refused = weft::testing::run_command(command);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_NE(refused.output.find("pytorch_baseline: error: --parallel pp: 2 layers cannot fill 4 stages (2 processes x 2)"),
            std::string::npos)
      << refused.output;
}

// Beside a job that fine-tunes a checkpoint, --baseline pytorch runs transformers' LlamaForCausalLM
// with PEFT's LoRA on that checkpoint (the bundled SmolLM2 GGUF, which transformers dequantizes
// itself): the same model (its parameter and trained-parameter counts are weft's), the same first
// batch (LoRA's B starts at zero, so the first step's loss is the checkpoint's own on that batch:
// equal to weft's to fp32 rounding), the same number of steps; with train.mode = "full" its name
// says transformers alone. ~40 s (2-core Xeon, contended; 55 s there before python/gguf_memo.py):
// transformers loads the GGUF file (~12 s).
TEST(BenchCommand, TransformersAndPeftTrainTheSameCheckpointBesideWeft) {
  const std::string source = WEFT_SOURCE_DIR;
  const std::string model = source + "/data/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  ASSERT_TRUE(std::filesystem::exists(model)) << model << ": tools/setup.sh links the bundled model there";
  const auto dir = fresh_dir("weft_bench", "transformers");
  const std::string out = dir + "/bench";
  const auto result = run_trainer(
      "bench --config " + source + "/configs/quickstart.toml --set model.weights=" + model + " --set data.tokenizer=" +
      model + " --set data.path=" + source + "/data/austen/austen.jsonl --set data.cache_dir= --set data.seq_len=32 --set train.batch_size=2 --set "
      "data.max_documents=2 --set lora.r=4 --plugin single --nproc 1 --baseline pytorch --warmup 0 --steps 2 "
      "--repetitions 1 --out " + out);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto json = nlohmann::json::parse(read_text(out + "/bench.json"));
  ASSERT_EQ(json["variants"].size(), 3u) << json.dump(2);
  EXPECT_EQ(json["variants"][1]["name"], "pytorch-ddp x1");
  EXPECT_EQ(json["variants"][2]["name"], "transformers-peft x1");
  EXPECT_EQ(json["variants"][2]["kind"], "pytorch");
  // MFU: transformers + PEFT trains the job's adapters (weft's FLOPs per token); PyTorch's own
  // model trains every weight of a LoRA job (other FLOPs): none for it.
  EXPECT_GT(json["variants"][0]["mfu"].get<double>(), 0.0);
  EXPECT_NEAR(json["variants"][2]["mfu"].get<double>() / json["variants"][0]["mfu"].get<double>(),
              json["variants"][2]["tokens_per_s"]["median"].get<double>() /
                  json["variants"][0]["tokens_per_s"]["median"].get<double>(),
              1e-9);
  EXPECT_TRUE(json["variants"][1]["mfu"].is_null());
  const auto records = [&](const std::string& variant) {
    std::vector<double> losses;
    nlohmann::json summary;
    std::ifstream metrics(out + "/runs/" + variant + "/rep1/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j["type"] == "step") losses.push_back(j["loss"].get<double>());
      if (j["type"] == "summary") summary = j;
    }
    return std::pair{losses, summary};
  };
  const auto [weft_losses, weft_summary] = records("single_x1");
  const auto [peft_losses, peft_summary] = records("transformers-peft_x1");
  ASSERT_EQ(weft_losses.size(), 2u) << result.output;
  ASSERT_EQ(peft_losses.size(), 2u) << result.output;
  EXPECT_NEAR(peft_losses[0], weft_losses[0], 1e-4 * weft_losses[0]);
  EXPECT_GT(weft_losses[0], 1.0);  // a real loss, not a degenerate one
  EXPECT_EQ(peft_summary["mode"], "lora");
  EXPECT_EQ(peft_summary["model"], "transformers");
  EXPECT_EQ(peft_summary["parameters"], weft_summary["model"]["parameters"].get<int64_t>() +
                                            weft_summary["model"]["trainable_parameters"].get<int64_t>());
  EXPECT_EQ(peft_summary["trained_parameters"], weft_summary["model"]["trainable_parameters"]);

  // Full fine-tuning: transformers alone (no PEFT), every parameter trained.
  weft::BenchOptions full;
  full.config = source + "/configs/quickstart.toml";
  full.overrides = {"train.mode=full", "model.weights=" + model, "data.tokenizer=" + model};
  full.plugins = {"single"};
  full.nproc = {"1,2"};
  full.pytorch_baseline = true;
  const auto variants = weft::plan_bench(full);
  EXPECT_EQ(names(variants), (std::vector<std::string>{"single x1", "single x2", "pytorch-ddp x1", "pytorch-ddp x2",
                                                        "transformers x1", "transformers x2"}));
  EXPECT_EQ(variants[5].transformers, "full");
  // Without a checkpoint there is nothing of transformers' to load for full fine-tuning (PyTorch's
  // own model trains the same shape from weft's weights): no such variant.
  full.overrides.push_back("model.weights=");
  full.overrides.push_back("model.preset=tiny");
  EXPECT_EQ(names(weft::plan_bench(full)).size(), 4u);
  // A LoRA job on a preset's shape: transformers + PEFT on transformers' initialisation of it.
  full.overrides.push_back("train.mode=lora");
  EXPECT_EQ(names(weft::plan_bench(full)), (std::vector<std::string>{"single x1", "single x2", "pytorch-ddp x1",
                                                                     "pytorch-ddp x2", "transformers-peft x1",
                                                                     "transformers-peft x2"}));
}

}  // namespace
