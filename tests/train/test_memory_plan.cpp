// The memory plan (ABI 1.3 memory_plan / stage_memory, core/job): made on every rank before the
// model is built, printed by `trainer plan`, enforced against train.memory_limit_gib, and close to
// what the ranks' tensors then peak at. Also what zero.so's stages keep between steps, against the
// ZeRO paper's per-rank formulas (fp32: 4 bytes per parameter each for weights and gradients, 8
// for AdamW's moments). Real processes, as users run them.
#include <cmath>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/process.h"

namespace {

using weft::testing::fresh_dir;
using weft::testing::read_text;
using weft::testing::run_trainer;

const std::string kCorpus = std::string(WEFT_SOURCE_DIR) + "/data/austen/austen.jsonl";

std::string small_run(const std::string& dir, const std::string& plugin, int nproc, const std::string& extra = "") {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/small-bench.toml --plugin " + plugin + " --nproc " +
         std::to_string(nproc) + " --set data.path=" + kCorpus + " --set data.cache_dir= --set train.out_dir=" + dir +
         " --set train.overwrite=true --set log.progress=off --set train.max_steps=2 " + extra;
}

nlohmann::json summary_of(const std::string& dir) {
  nlohmann::json summary;
  std::istringstream lines(read_text(dir + "/metrics.jsonl"));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    auto record = nlohmann::json::parse(line);
    if (record.contains("memory_plan_mib_per_rank")) summary = record;
  }
  return summary;
}

TEST(MemoryPlan, ARunOverTheLimitIsRefusedBeforeTheModelIsBuiltWithThePlanInTheMessage) {
  const std::string dir = fresh_dir("memory_plan", "refused");
  const auto outcome = run_trainer(small_run(dir, "ddp", 2, "--set train.memory_limit_gib=0.1"));
  EXPECT_NE(outcome.exit_code, 0) << outcome.output;
  for (const char* part : {"the memory plan needs", "for the 2 rank(s) on this machine", "rank 0: parameters",
                           "rank 1: parameters", "optimizer", "train.memory_limit_gib allows 0.10 GiB",
                           "the processes alone need 0.80 GiB"}) {
    EXPECT_NE(outcome.output.find(part), std::string::npos) << part << "\n" << outcome.output;
  }
  // Refused before the model: no model line in the log, no step recorded.
  EXPECT_EQ(outcome.output.find("] info model:"), std::string::npos) << outcome.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/metrics.jsonl"));
}

// The table's row for `rank`, as numbers (MiB): parameters, gradients, optimizer, activations,
// buffers, runtime, total.
std::vector<double> plan_row(const std::string& output, int rank) {
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    int r = -1, machine = -1;
    if (!(fields >> r >> machine) || r != rank) continue;
    std::vector<double> row;
    for (double v; fields >> v;) row.push_back(v);
    if (row.size() == 7) return row;
  }
  return {};
}

TEST(MemoryPlan, TrainerPlanPrintsEveryRanksPlanWithoutBuildingAnything) {
  const std::string dir = fresh_dir("memory_plan", "table");
  const std::string config = std::string(WEFT_SOURCE_DIR) + "/configs/small-bench.toml";
  const auto ddp = run_trainer("plan --config " + config + " --plugin ddp --nproc 2");
  ASSERT_EQ(ddp.exit_code, 0) << ddp.output;
  EXPECT_NE(ddp.output.find("memory plan: plugin ddp, 2 rank(s)"), std::string::npos) << ddp.output;
  EXPECT_NE(ddp.output.find("fits"), std::string::npos) << ddp.output;
  EXPECT_EQ(ddp.output.find("] info model:"), std::string::npos) << ddp.output;  // no model was built
  const auto zero3 = run_trainer("plan --config " + config + " --plugin zero --nproc 2 --set plugin.stage=3");
  ASSERT_EQ(zero3.exit_code, 0) << zero3.output;
  const auto d = plan_row(ddp.output, 1), z = plan_row(zero3.output, 1);
  ASSERT_EQ(d.size(), 7u) << ddp.output;
  ASSERT_EQ(z.size(), 7u) << zero3.output;
  EXPECT_NEAR(d[2], 2 * d[0], 0.2);          // ddp: AdamW's two moments per parameter
  EXPECT_NEAR(d[4], 0.0, 0.05);             // ddp: its gradients are its all-reduce buckets' memory, no copy
  EXPECT_NEAR(z[2], d[2] / 2, 0.2);          // zero: half the optimizer state per rank at 2 ranks
  EXPECT_LT(z[0], d[0]);                     // stage 3: parameters sharded, a few stages whole at once
  EXPECT_NEAR(d[6], d[0] + d[1] + d[2] + d[3] + d[4] + d[5], 0.5);
  // A plan over the limit: exit status 1 and the verdict on stdout.
  const auto tight = run_trainer("plan --config " + config + " --plugin ddp --nproc 2 --set train.memory_limit_gib=0.1");
  EXPECT_EQ(tight.exit_code, 1) << tight.output;
  EXPECT_NE(tight.output.find("does NOT fit"), std::string::npos) << tight.output;
}

// trainer plan works from the shapes: a tokenizer and weights that do not exist here are named in a
// note, not refused (before, the missing tokenizer stopped the plan and the weights went unmentioned).
TEST(MemoryPlan, APlanNeedsOnlyTheShapesAndNamesTheMissingInputs) {
  const std::string dir = fresh_dir("memory_plan", "shapes_only");
  const auto r = run_trainer("plan --config " + std::string(WEFT_SOURCE_DIR) + "/configs/llama-3.2-1b-lora.toml" +
                             " --set data.tokenizer=" + dir + "/Llama-3.2-1B --set model.weights=" + dir +
                             "/Llama-3.2-1B --set data.path=" + dir + "/text.jsonl --set train.memory_limit_gib=1000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("memory plan: plugin single, 1 rank(s), precision bf16"), std::string::npos) << r.output;
  const auto row = plan_row(r.output, 0);
  ASSERT_EQ(row.size(), 7u) << r.output;
  EXPECT_GT(row[0], 2000.0) << r.output;  // the 1B preset's parameters (bf16 frozen base or fp32: > 2 GB)
  for (const std::string& missing : std::vector<std::string>{"data.tokenizer = '" + dir + "/Llama-3.2-1B'", "model.weights = '" + dir + "/Llama-3.2-1B'",
                                     "data.path = '" + dir + "/text.jsonl'", "model.preset = 'llama-3.2-1b'"}) {
    EXPECT_NE(r.output.find(missing), std::string::npos) << missing << "\n" << r.output;
  }
  // A run of the same config is still refused for the missing tokenizer, before anything is built.
  const auto run = run_trainer("--config " + std::string(WEFT_SOURCE_DIR) + "/configs/llama-3.2-1b-lora.toml" +
                               " --set data.tokenizer=" + dir + "/Llama-3.2-1B --set train.out_dir=" + dir + "/out");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_NE(run.output.find("data.tokenizer = '" + dir + "/Llama-3.2-1B' does not exist"), std::string::npos) << run.output;
}

// A plan over the limit advises what follows from it: the host's settings that fit (each tried in
// the plan, with the GiB it needs), then what the shares say a plugin could do; under zero stage 1
// that is a higher stage, not "a plugin that shards the state (zero)"; and the launcher adds no
// line blaming a rank for the answer "does not fit".
TEST(MemoryPlan, APlanThatDoesNotFitAdvisesWhatWouldFromThePlan) {
  const std::string config = std::string(WEFT_SOURCE_DIR) + "/configs/small-bench.toml";
  const std::regex fits_line(R"(--set model\.activation_checkpointing=true fits \(([0-9.]+) GiB\))");
  const auto ddp = run_trainer("plan --config " + config + " --plugin ddp --nproc 2 --set train.memory_limit_gib=1.2");
  EXPECT_EQ(ddp.exit_code, 1) << ddp.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(ddp.output, m, fits_line)) << ddp.output;
  EXPECT_LE(std::stod(m[1].str()), 1.2) << ddp.output;
  // What it advises fits when applied: the plan with activation checkpointing passes.
  const auto applied = run_trainer("plan --config " + config +
                                   " --plugin ddp --nproc 2 --set train.memory_limit_gib=1.2 --set model.activation_checkpointing=true");
  EXPECT_EQ(applied.exit_code, 0) << applied.output;
  EXPECT_NE(ddp.output.find("--set train.batch_size=4 --set train.grad_accum_steps=2 fits ("), std::string::npos)
      << ddp.output;
  // zero stage 1 with little activation memory: its gradients and parameters are whole on each rank.
  const auto zero1 = run_trainer("plan --config " + config + " --plugin zero --nproc 2 --set plugin.stage=1 " +
                                 "--set data.seq_len=16 --set train.batch_size=2 --set train.memory_limit_gib=0.93");
  EXPECT_EQ(zero1.exit_code, 1) << zero1.output;
  EXPECT_NE(zero1.output.find("are whole on every rank: a plugin setting that shards them too (zero's plugin.stage = 2 "
                              "or 3) would need about"),
            std::string::npos)
      << zero1.output;
  EXPECT_EQ(zero1.output.find("a plugin that shards"), std::string::npos) << zero1.output;
  for (const auto* out : {&ddp.output, &zero1.output}) {
    EXPECT_EQ(out->find("failed"), std::string::npos) << *out;
  }
}

// ZeRO stage 3 in bf16 (zero.so's weft_layout.shard_compute_dtype):
// gathered matrices and their whole gradients in the compute dtype, so the plan's parameters and
// gradients per rank fall against plugin.param_dtype = "fp32" by the gathered stages' half, and its
// activations lose the weight copies (none are made).
TEST(MemoryPlan, ZeroStage3PlansItsGatheredParametersInTheComputeDtype) {
  const std::string config = std::string(WEFT_SOURCE_DIR) + "/configs/small-bench.toml";
  for (const std::string plugin : {"zero --set plugin.stage=3"}) {
    const std::string base = "plan --config " + config + " --plugin " + plugin + " --nproc 2 --set train.precision=bf16";
    const auto compute = run_trainer(base);
    const auto fp32 = run_trainer(base + " --set plugin.param_dtype=\"fp32\"");
    ASSERT_EQ(compute.exit_code, 0) << compute.output;
    ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
    const auto c = plan_row(compute.output, 0), f = plan_row(fp32.output, 0);
    ASSERT_EQ(c.size(), 7u) << compute.output;
    ASSERT_EQ(f.size(), 7u) << fp32.output;
    EXPECT_LT(c[0], f[0]) << plugin;  // parameters: fp32 shards + bf16 whole stages
    EXPECT_LT(c[1], f[1]) << plugin;  // gradients: fp32 shards + bf16 whole gradients
    EXPECT_GT(c[0], 0.5 * f[0]) << plugin;  // the shards stay fp32
    EXPECT_NEAR(c[2], f[2], 0.01) << plugin;  // optimizer state: the same fp32 moments
    EXPECT_LE(c[3], f[3]) << plugin;  // activations: no weight copies
    const auto bad = run_trainer(base + " --set plugin.param_dtype=\"fp8\"");
    EXPECT_NE(bad.exit_code, 0);
    EXPECT_NE(bad.output.find("plugin.param_dtype must be \"compute\" or \"fp32\""), std::string::npos) << bad.output;
    // Kept from the forward to the backward, every stage is whole at the peak.
    const auto keep = run_trainer(base + " --set plugin.reshard_after_forward=false");
    ASSERT_EQ(keep.exit_code, 0) << keep.output;
    const auto k = plan_row(keep.output, 0);
    ASSERT_EQ(k.size(), 7u) << keep.output;
    EXPECT_GT(k[0], c[0]) << plugin;
  }
}

// The plan (made before the model existed) against the run's measured peak of tensor memory per
// rank. The margin: 25% either way, measured at <= 19% (gpipe's first stage, whose receive and
// gradient temporaries the plan underestimates) for these runs.
// ~45 s (ctest -j2, 2-core Xeon): 10 plugins and settings, each a 2-rank run of the small preset at
// its real sequence length, where activations weigh as they do in real runs.
TEST(MemoryPlan, TheEstimateIsWithinItsMarginOfTheMeasuredPeakForEveryKindOfPlugin) {
  std::map<std::string, double> plans;  // rank 0's plan, MiB
  for (const std::string plugin : {"ddp",
                                   // slices placed by weft_place before the model is built
                                   "tensor_parallel", "tensor_parallel --set plugin.sequence_parallel=true",
                                   "gpipe",
                                   // placements asked before the model is built: ZeRO's stages 1 and 3
                                   "zero --set plugin.stage=1", "zero --set plugin.stage=3",
                                   "zero --set plugin.stage=3 --set train.precision=bf16",
                                   "context_parallel",
                                   // the ring's buffers are the plugin's to say (weft_memory)
                                   "context_parallel --set plugin.mode=\"ring\"",
                                   // ZB-V (a schedule as data): two chunks per rank, W passes waiting
                                   WEFT_PLUGIN_FIXTURE_DIR "/zbv.so"}) {
    const std::string dir = fresh_dir("memory_plan", "peak");
    const auto outcome = run_trainer(small_run(dir, plugin, 2));
    ASSERT_EQ(outcome.exit_code, 0) << plugin << "\n" << outcome.output;
    const auto summary = summary_of(dir);
    ASSERT_TRUE(summary.contains("tensor_peak_mib_per_rank")) << plugin;
    plans[plugin] = summary["memory_plan_mib_per_rank"][0];
    for (int r = 0; r < 2; ++r) {
      const double plan = summary["memory_plan_mib_per_rank"][r], peak = summary["tensor_peak_mib_per_rank"][r];
      EXPECT_GT(plan, 0.0);
      EXPECT_LE(std::abs(plan - peak) / peak, 0.25) << plugin << " rank " << r << ": plan " << plan << " MiB, peak "
                                                    << peak << " MiB";
    }
  }
  // Sequence parallelism's residual stream holds half the tokens between the regions: planned less.
  EXPECT_LT(plans.at("tensor_parallel --set plugin.sequence_parallel=true"), plans.at("tensor_parallel"));
  // ZeRO's stage 1 keeps half the optimizer state (and a range of the gradients beside them).
  EXPECT_LT(plans.at("zero --set plugin.stage=1"), plans.at("ddp"));
}

// What each ZeRO stage keeps between steps at 2 and 4 ranks, measured from the stored tensors,
// against ddp's (every rank: 4 psi parameters, 4 psi gradients, 8 psi optimizer state):
// stage 1 divides the optimizer state by N (its whole gradients stay, plus their shard), stage 2
// the gradients too, stage 3 the parameters too. The training state does not depend on the batch:
// short sequences and 4 rows keep the 7 runs cheap (a 4-rank run 2.8 s instead of 4.3).
TEST(MemoryPlan, ZeroStagesKeepTheZeroPapersShareOfTheTrainingState) {
  const auto state = [](const std::string& plugin, int nproc) {
    const std::string dir = fresh_dir("memory_plan", "state");
    const auto outcome = run_trainer(small_run(dir, plugin, nproc, "--set data.seq_len=64 --set train.batch_size=4"));
    EXPECT_EQ(outcome.exit_code, 0) << plugin << "\n" << outcome.output;
    const auto summary = summary_of(dir);
    std::map<std::string, double> mib;
    for (const char* kind : {"parameters", "gradients", "optimizer"}) mib[kind] = summary["state_mib_per_rank"][kind][0];
    return mib;
  };
  const auto ddp = state("ddp", 2);
  const double psi4 = ddp.at("parameters");  // 4 bytes per parameter
  ASSERT_GT(psi4, 1.0);
  EXPECT_NEAR(ddp.at("gradients"), psi4, 0.01);
  EXPECT_NEAR(ddp.at("optimizer"), 2 * psi4, 0.01);
  for (int n : {2, 4}) {
    const auto s1 = state("zero --set plugin.stage=1", n), s2 = state("zero --set plugin.stage=2", n),
               s3 = state("zero --set plugin.stage=3", n);
    const double tolerance = 0.02 * psi4;  // padding of uneven shards
    EXPECT_NEAR(s1.at("optimizer"), 2 * psi4 / n, tolerance) << n;
    EXPECT_NEAR(s1.at("parameters"), psi4, tolerance) << n;
    EXPECT_NEAR(s1.at("gradients"), psi4 + psi4 / n, tolerance) << n;
    EXPECT_NEAR(s2.at("gradients"), psi4 / n, tolerance) << n;
    EXPECT_NEAR(s2.at("optimizer"), 2 * psi4 / n, tolerance) << n;
    EXPECT_NEAR(s2.at("parameters"), psi4, tolerance) << n;
    EXPECT_NEAR(s3.at("parameters"), psi4 / n, tolerance) << n;
    EXPECT_NEAR(s3.at("gradients"), psi4 / n, tolerance) << n;
    EXPECT_NEAR(s3.at("optimizer"), 2 * psi4 / n, tolerance) << n;
  }
}

}  // namespace
