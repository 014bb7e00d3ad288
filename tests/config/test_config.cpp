#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <unistd.h>

#include "core/config/config.h"
#include "core/job/options.h"
#include "core/config/schema.h"
#include "core/util/error.h"

namespace fs = std::filesystem;
using weft::Config;
using weft::load_run_config;
using weft::run_schema;
using weft::load_config_text;

namespace {

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("weft_config_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes `text` to dir_/relative and returns the full path.
  std::string write(const std::string& relative, const std::string& text) {
    const fs::path path = dir_ / relative;
    fs::create_directories(path.parent_path());
    std::ofstream(path) << text;
    return path.string();
  }

  fs::path dir_;
};

// The weft::Error message thrown by `action`, or "" (a test failure) when none is thrown.
std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const weft::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected weft::Error";
  return "";
}

using Strings = std::vector<std::string>;

TEST_F(ConfigTest, DefaultsComeFromTheSchema) {
  const Config config = load_run_config("");
  EXPECT_EQ(config.get_string("model.preset"), "tiny");
  EXPECT_DOUBLE_EQ(config.get_float("train.lr"), 3e-4);
  EXPECT_EQ(config.get_int("data.seq_len"), 256);
  EXPECT_TRUE(config.get_bool("data.add_bos"));
  EXPECT_EQ(config.get_string_list("lora.target_modules"),
            (Strings{"q_proj", "k_proj", "v_proj", "o_proj"}));
  EXPECT_EQ(config.get_string_list("data.path"), Strings{"data/austen/austen.jsonl"});
  EXPECT_FALSE(config.is_set("train.lr"));
  EXPECT_EQ(config.origin("train.lr"), "default");
  EXPECT_EQ(config.to_toml(), Config(run_schema()).to_toml());
}

TEST_F(ConfigTest, ValuesFromAFile) {
  const std::string path = write("run.toml",
                                 "[train]\n"
                                 "lr = 1e-3\n"
                                 "precision = \"bf16\"\n"
                                 "[data]\n"
                                 "path = \"corpus.txt\"\n");
  const Config config = load_run_config(path);
  EXPECT_DOUBLE_EQ(config.get_float("train.lr"), 1e-3);
  EXPECT_EQ(config.get_string("train.precision"), "bf16");
  EXPECT_EQ(config.get_string_list("data.path"), Strings{"corpus.txt"});  // single string -> list
  EXPECT_TRUE(config.is_set("train.lr"));
  EXPECT_FALSE(config.is_set("train.epochs"));
  EXPECT_EQ(config.origin("train.lr"), path + ":2");
  EXPECT_EQ(config.files(), Strings{path});
}

TEST_F(ConfigTest, ChildOverridesBaseAndKeepsBaseKeys) {
  const std::string base = write("base.toml",
                                 "[train]\n"
                                 "lr = 1e-3\n"
                                 "epochs = 3\n"
                                 "[lora]\n"
                                 "target_modules = [\"a\", \"b\"]\n"
                                 "[plugin.opt]\n"
                                 "a = 1\n"
                                 "b = 2\n");
  const std::string child = write("child.toml",
                                  "extends = \"base.toml\"\n"
                                  "[train]\n"
                                  "lr = 5e-4\n"
                                  "[lora]\n"
                                  "target_modules = [\"c\"]\n"
                                  "[plugin.opt]\n"
                                  "b = 3\n"
                                  "c = 4\n");
  const Config config = load_run_config(child);
  EXPECT_DOUBLE_EQ(config.get_float("train.lr"), 5e-4);
  EXPECT_EQ(config.get_int("train.epochs"), 3);
  EXPECT_EQ(config.get_string_list("lora.target_modules"), Strings{"c"});  // lists replace
  const toml::table plugin = config.section_table("plugin");
  EXPECT_EQ(plugin.at_path("opt.a").value<int64_t>(), 1);  // nested tables merge
  EXPECT_EQ(plugin.at_path("opt.b").value<int64_t>(), 3);
  EXPECT_EQ(plugin.at_path("opt.c").value<int64_t>(), 4);
  EXPECT_EQ(config.origin("train.lr"), child + ":3");
  EXPECT_EQ(config.origin("train.epochs"), base + ":3");
  EXPECT_EQ(config.files(), (Strings{base, child}));
}

TEST_F(ConfigTest, ThreeLevelChainWithPathsRelativeToEachFile) {
  write("configs/base.toml", "[train]\nlr = 1.0\nepochs = 2\nseed = 7\n");
  write("configs/mid/mid.toml", "extends = \"../base.toml\"\n[train]\nlr = 2.0\nepochs = 4\n");
  const std::string leaf =
      write("configs/mid/leaf/leaf.toml", "extends = \"../mid.toml\"\n[train]\nlr = 3.0\n");
  const Config config = load_run_config(leaf);
  EXPECT_DOUBLE_EQ(config.get_float("train.lr"), 3.0);
  EXPECT_EQ(config.get_int("train.epochs"), 4);
  EXPECT_EQ(config.get_int("train.seed"), 7);
  ASSERT_EQ(config.files().size(), 3u);
  EXPECT_EQ(config.files()[0], (dir_ / "configs/base.toml").string());
  EXPECT_EQ(config.files()[1], (dir_ / "configs/mid/mid.toml").string());
  EXPECT_EQ(config.origin("train.epochs"), (dir_ / "configs/mid/mid.toml").string() + ":4");
}

TEST_F(ConfigTest, ExtendsCycleIsAnError) {
  write("a.toml", "extends = \"b.toml\"\n");
  write("b.toml", "extends = \"c.toml\"\n");
  write("c.toml", "extends = \"a.toml\"\n");
  const std::string message = error_of([&] { load_run_config((dir_ / "a.toml").string()); });
  EXPECT_NE(message.find("cycle"), std::string::npos) << message;
  const std::string a = (dir_ / "a.toml").string(), b = (dir_ / "b.toml").string(),
                    c = (dir_ / "c.toml").string();
  EXPECT_NE(message.find(a + " -> " + b + " -> " + c + " -> " + a), std::string::npos) << message;

  const std::string self = write("self.toml", "extends = \"self.toml\"\n");
  EXPECT_NE(error_of([&] { load_run_config(self); }).find("cycle"), std::string::npos);
}

TEST_F(ConfigTest, MissingBaseOrFileIsAnError) {
  const std::string child = write("child.toml", "\n[train]\nlr = 1.0\nextends = 3\n");
  const std::string child2 = write("child2.toml", "extends = \"nope.toml\"\n");
  EXPECT_EQ(error_of([&] { load_run_config(child2); }),
            "config file '" + (dir_ / "nope.toml").string() + "' not found (extended by " +
                child2 + ":1)");
  EXPECT_EQ(error_of([&] { load_run_config((dir_ / "absent.toml").string()); }),
            "config file '" + (dir_ / "absent.toml").string() + "' not found");
  // `extends` is only meaningful at the top level; inside [train] it is an unknown key.
  EXPECT_NE(error_of([&] { load_run_config(child); }).find("unknown config key 'train.extends'"),
            std::string::npos);
  const std::string bad = write("bad.toml", "extends = 3\n");
  EXPECT_EQ(error_of([&] { load_run_config(bad); }),
            "config key 'extends' must be a string path (" + bad + ":1)");
}

TEST_F(ConfigTest, OverridesAreParsedAsTomlValues) {
  const std::string path = write("run.toml", "[train]\nlr = 1e-3\nepochs = 2\n");
  const Config config = load_run_config(path, {"train.lr=3e-4",
                                           "train.epochs = 5",
                                           "train.precision=bf16",
                                           "data.add_bos=false",
                                           "lora.target_modules=[\"q_proj\",\"v_proj\"]",
                                           "data.path=[a.txt, b.txt]",
                                           "train.out_dir=2024",
                                           "model.preset=\"\"",
                                           "log.metrics_file=m=1.jsonl"});
  EXPECT_DOUBLE_EQ(config.get_float("train.lr"), 3e-4);
  EXPECT_EQ(config.get_int("train.epochs"), 5);
  EXPECT_EQ(config.get_string("train.precision"), "bf16");
  EXPECT_FALSE(config.get_bool("data.add_bos"));
  EXPECT_EQ(config.get_string_list("lora.target_modules"), (Strings{"q_proj", "v_proj"}));
  EXPECT_EQ(config.get_string_list("data.path"), (Strings{"a.txt", "b.txt"}));
  EXPECT_EQ(config.get_string("train.out_dir"), "2024");
  EXPECT_EQ(config.get_string("model.preset"), "");
  EXPECT_EQ(config.get_string("log.metrics_file"), "m=1.jsonl");
  EXPECT_EQ(config.origin("train.lr"), "--set");
  EXPECT_EQ(config.origin("train.precision"), "--set");
}

TEST_F(ConfigTest, MalformedOverridesAreErrors) {
  EXPECT_EQ(error_of([] { load_run_config("", {"train.lr"}); }),
            "malformed override 'train.lr': expected section.key=value");
  EXPECT_EQ(error_of([] { load_run_config("", {"=3"}); }),
            "malformed override '=3': expected section.key=value");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.=3"}); }),
            "malformed override 'train.=3': expected section.key=value");
  EXPECT_EQ(error_of([] { load_run_config("", {"lr=3"}); }),
            "malformed override 'lr=3': expected section.key=value");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.lrr=1"}); }),
            "unknown config key 'train.lrr' (--set); did you mean 'train.lr'?");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.epochs=abc"}); }),
            "config key 'train.epochs' must be an integer, got string \"abc\" (--set)");
}

TEST_F(ConfigTest, UnknownKeyNamesFileLineAndSuggestion) {
  const std::string path = write("x.toml",
                                 "# a comment\n"
                                 "[train]\n"
                                 "lr = 1e-3\n"
                                 "lrr = 2e-3\n");
  EXPECT_EQ(error_of([&] { load_run_config(path); }),
            "unknown config key 'train.lrr' (" + path + ":4); did you mean 'train.lr'?");

  const std::string far = write("far.toml", "[train]\nzzzzzzzz = 1\n");
  EXPECT_EQ(error_of([&] { load_run_config(far); }),
            "unknown config key 'train.zzzzzzzz' (" + far + ":2)");

  const std::string moved = write("moved.toml", "[train]\nseq_len = 64\n");
  EXPECT_EQ(error_of([&] { load_run_config(moved); }),
            "unknown config key 'train.seq_len' (" + moved + ":2); did you mean 'data.seq_len'?");

  const std::string top = write("top.toml", "lr = 0.1\n");
  EXPECT_EQ(error_of([&] { load_run_config(top); }),
            "unknown config key 'lr' (" + top + ":1); did you mean 'train.lr'?");

  const std::string nested = write("nested.toml", "[train.sub]\nx = 1\n");
  EXPECT_NE(error_of([&] { load_run_config(nested); }).find("unknown config key 'train.sub'"),
            std::string::npos);
}

TEST_F(ConfigTest, UnknownSectionIsAnError) {
  const std::string path = write("x.toml", "[data]\nseq_len = 8\n\n[trian]\nlr = 1.0\n");
  EXPECT_EQ(error_of([&] { load_run_config(path); }),
            "unknown config section 'trian' (" + path + ":4); did you mean 'train'?");
  const std::string other = write("other.toml", "[wandb]\nproject = \"x\"\n");
  EXPECT_EQ(error_of([&] { load_run_config(other); }),
            "unknown config section 'wandb' (" + other + ":1)");
}

TEST_F(ConfigTest, WrongTypeNamesExpectedAndActual) {
  const std::string path = write("x.toml", "[train]\nlr = \"abc\"\n");
  EXPECT_EQ(error_of([&] { load_run_config(path); }),
            "config key 'train.lr' must be a float, got string \"abc\" (" + path + ":2)");
  EXPECT_EQ(error_of([] { load_config_text(run_schema(), "[train]\nepochs = 2.5\n", "t.toml"); }),
            "config key 'train.epochs' must be an integer, got float 2.5 (t.toml:2)");
  EXPECT_EQ(error_of([] { load_config_text(run_schema(), "[data]\nadd_bos = 1\n", "t.toml"); }),
            "config key 'data.add_bos' must be a boolean, got integer 1 (t.toml:2)");
  const std::string list_error =
      error_of([] { load_config_text(run_schema(), "[lora]\ntarget_modules = [\"a\", 1]\n", "t.toml"); });
  EXPECT_EQ(list_error.rfind("config key 'lora.target_modules' must be a list of strings, got array", 0),
            0u)
      << list_error;
  EXPECT_EQ(error_of([] { load_config_text(run_schema(), "train = 3\n", "t.toml"); }),
            "config key 'train' must be a section (table), got integer 3 (t.toml:1)");
}

TEST_F(ConfigTest, IntegerIsAcceptedForFloat) {
  const Config config = load_config_text(run_schema(), "[train]\nlr = 1\ngrad_clip = 0\n", "t.toml");
  EXPECT_DOUBLE_EQ(config.get_float("train.lr"), 1.0);
  EXPECT_DOUBLE_EQ(config.get_float("train.grad_clip"), 0.0);
  EXPECT_NE(config.to_toml().find("lr = 1.0\n"), std::string::npos);  // written back as a float
}

TEST_F(ConfigTest, ChoicesAreEnforced) {
  EXPECT_EQ(error_of([] { load_config_text(run_schema(), "[train]\nprecision = \"fp8\"\n", "t.toml"); }),
            "config key 'train.precision' must be one of \"fp32\", \"bf16\", \"fp16\"; got \"fp8\" "
            "(t.toml:2)");
  EXPECT_EQ(load_run_config("", {"model.preset=llama-3.2-1b"}).get_string("model.preset"),
            "llama-3.2-1b");
  EXPECT_EQ(load_config_text(run_schema(), "[model]\npreset = \"\"\n", "t.toml").get_string("model.preset"), "");
}

TEST_F(ConfigTest, MinAndMaxAreInclusiveBounds) {
  EXPECT_EQ(error_of([] { load_run_config("", {"data.heldout_fraction=0.95"}); }),
            "config key 'data.heldout_fraction' must be between 0 and 0.9, got 0.95 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.epochs=0"}); }),
            "config key 'train.epochs' must be >= 1, got 0 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.lr=-1e-3"}); }),
            "config key 'train.lr' must be >= 0, got -0.001 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.lr=nan"}); }),
            "config key 'train.lr' must be a finite number, got float nan (--set)");
  const Config edges =
      load_run_config("", {"data.heldout_fraction=0.9", "train.epochs=1", "lora.dropout=0"});
  EXPECT_DOUBLE_EQ(edges.get_float("data.heldout_fraction"), 0.9);
  EXPECT_EQ(edges.get_int("train.epochs"), 1);
}

TEST_F(ConfigTest, ExclusiveBoundsRefuseTheirEdge) {
  // top_p = 0 keeps no token at all (sampling divided by zero before this check existed), and a
  // probability mass above 1 means nothing.
  EXPECT_EQ(error_of([] { load_run_config("", {"generate.top_p=0"}); }),
            "config key 'generate.top_p' must be > 0 and <= 1, got 0.0 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"generate.top_p=1.5"}); }),
            "config key 'generate.top_p' must be > 0 and <= 1, got 1.5 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"generate.temperature=-1"}); }),
            "config key 'generate.temperature' must be >= 0, got -1.0 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"train.beta2=1"}); }),
            "config key 'train.beta2' must be >= 0 and < 1, got 1.0 (--set)");
  EXPECT_EQ(error_of([] { load_run_config("", {"lora.dropout=1"}); }),
            "config key 'lora.dropout' must be >= 0 and < 1, got 1.0 (--set)");
  const Config edges = load_run_config("", {"generate.top_p=1", "generate.top_p=0.01", "train.beta2=0"});
  EXPECT_DOUBLE_EQ(edges.get_float("generate.top_p"), 0.01);
}

TEST_F(ConfigTest, TomlSyntaxErrorHasLineAndColumn) {
  const std::string path = write("broken.toml", "[train]\nlr = 1e-3\nepochs = = 3\n");
  const std::string message = error_of([&] { load_run_config(path); });
  EXPECT_EQ(message.rfind(path + ":3:10: TOML syntax error: ", 0), 0u) << message;
  EXPECT_GT(message.size(), (path + ":3:10: TOML syntax error: ").size());

  const std::string base = write("base.toml", "[train\n");
  const std::string child = write("child.toml", "extends = \"base.toml\"\n");
  EXPECT_EQ(error_of([&] { load_run_config(child); }).rfind(base + ":1:", 0), 0u);
}

TEST_F(ConfigTest, ToTomlRoundTripsValuesAndHash) {
  const std::string path = write("run.toml",
                                 "[train]\n"
                                 "lr = 0.1\n"
                                 "eps = 1e-10\n"
                                 "out_dir = \"runs/a \\\"quoted\\\" \\\\ dir\\t\u00e9\"\n"
                                 "[plugin]\n"
                                 "name = \"ema\"\n"
                                 "decay = 0.999\n"
                                 "layers = [1, 2, 3]\n"
                                 "[plugin.inner]\n"
                                 "flag = true\n");
  const Config config = load_run_config(path, {"lora.target_modules=[\"q_proj\"]", "train.seed=-5"});
  const std::string text = config.to_toml();
  const Config again = load_run_config(write("again.toml", text));

  EXPECT_EQ(again.to_toml(), text);
  EXPECT_EQ(again.hash(), config.hash());
  EXPECT_EQ(again.get_float("train.lr"), 0.1);  // exact, not approximately
  EXPECT_EQ(again.get_float("train.eps"), 1e-10);
  EXPECT_EQ(again.get_string("train.out_dir"), "runs/a \"quoted\" \\ dir\t\u00e9");
  EXPECT_EQ(again.get_int("train.seed"), -5);
  EXPECT_EQ(again.get_string_list("lora.target_modules"), Strings{"q_proj"});
  EXPECT_EQ(again.get_float("train.beta2"), 0.95);  // defaults are written out too
  EXPECT_TRUE(again.is_set("train.beta2"));
  const toml::table plugin = again.section_table("plugin");
  EXPECT_EQ(plugin["decay"].value<double>(), 0.999);
  EXPECT_EQ(plugin["inner"]["flag"].value<bool>(), true);
  EXPECT_EQ(plugin["layers"].as_array()->size(), 3u);
  EXPECT_EQ(plugin, config.section_table("plugin"));

  // Every schema key appears in the output; one whose default the run decides (data.add_bos: the
  // tokenizer's), unset, as a comment, so that it stays unset when the text is read back.
  for (const auto& entry : weft::run_schema().entries) {
    if (entry.default_text.empty() || config.is_set(entry.key)) {
      EXPECT_NE(text.find("\n" + entry.name() + " = "), std::string::npos) << entry.key;
    } else {
      EXPECT_NE(text.find("\n# " + entry.name() + ": " + entry.default_text), std::string::npos) << entry.key;
      EXPECT_FALSE(again.is_set(entry.key)) << entry.key;
    }
  }
  EXPECT_FALSE(again.is_set("data.add_bos"));
}

TEST_F(ConfigTest, HashIsStableAndSensitive) {
  const std::string hash = Config(run_schema()).hash();
  EXPECT_EQ(hash.size(), 16u);
  EXPECT_EQ(hash.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(load_run_config("").hash(), hash);
  // Setting a key to its default value does not change the effective configuration.
  EXPECT_EQ(load_run_config("", {"train.lr=0.0003"}).hash(), hash);
  EXPECT_NE(load_run_config("", {"train.lr=0.0004"}).hash(), hash);
  EXPECT_NE(load_run_config("", {"plugin.x=1"}).hash(), hash);
}

TEST_F(ConfigTest, OpenSectionAcceptsAnyKeys) {
  const Config config = load_config_text(run_schema(), 
      "[plugin]\nstrategy = \"ema\"\nweights = [0.5, 0.25]\n[plugin.nested]\nk = 1\n", "p.toml",
      {"plugin.nested.k=2", "plugin.extra=yes"});
  const toml::table plugin = config.section_table("plugin");
  EXPECT_EQ(plugin["strategy"].value<std::string>(), "ema");
  EXPECT_EQ(plugin["weights"][1].value<double>(), 0.25);
  EXPECT_EQ(plugin["nested"]["k"].value<int64_t>(), 2);
  EXPECT_EQ(plugin["extra"].value<std::string>(), "yes");
  EXPECT_TRUE(config.is_set("plugin.strategy"));
  EXPECT_FALSE(config.is_set("plugin.missing"));
  EXPECT_EQ(config.origin("plugin.strategy"), "p.toml:2");
  EXPECT_EQ(config.origin("plugin.nested.k"), "--set");
  EXPECT_TRUE(Config(run_schema()).section_table("plugin").empty());
}

TEST_F(ConfigTest, MisuseOfTheApiIsALogicError) {
  const Config config(run_schema());
  EXPECT_THROW(config.get_float("train.lrr"), std::logic_error);
  EXPECT_THROW(config.get_int("train.lr"), std::logic_error);  // a float key
  EXPECT_THROW(config.get_string("data.path"), std::logic_error);  // a list key
  EXPECT_THROW(config.is_set("nope.key"), std::logic_error);
  EXPECT_THROW(config.section_table("train"), std::logic_error);
  EXPECT_THROW(config.section_table("nope"), std::logic_error);
}

TEST(ConfigSchema, EntriesAreWellFormed) {
  for (const auto& entry : weft::run_schema().entries) {
    SCOPED_TRACE(entry.key);
    ASSERT_NE(weft::run_schema().find_section(entry.section()), nullptr);
    EXPECT_FALSE(weft::run_schema().find_section(entry.section())->open);
    EXPECT_FALSE(entry.doc.empty());
    EXPECT_EQ(static_cast<int>(entry.default_value.index()), static_cast<int>(entry.type));
    EXPECT_EQ(weft::run_schema().find_key(entry.key), &entry);
  }
  // Every default passes validation: a config that sets every key to its default loads.
  const Config all_defaults = load_config_text(run_schema(), Config(run_schema()).to_toml(), "defaults.toml");
  EXPECT_EQ(all_defaults.hash(), Config(run_schema()).hash());
}

TEST(ConfigSchema, HelpAndReferenceListEveryKey) {
  const std::string help = weft::render_help(weft::run_schema());
  const std::string markdown = weft::render_markdown_reference(weft::run_schema());
  for (const auto& section : weft::run_schema().sections) {
    EXPECT_NE(help.find("[" + section.name + "]"), std::string::npos) << section.name;
    EXPECT_NE(markdown.find("### `[" + section.name + "]`"), std::string::npos) << section.name;
  }
  for (const auto& entry : weft::run_schema().entries) {
    const std::string shown = entry.default_text.empty() ? weft::value_to_toml(entry.default_value) : entry.default_text;
    EXPECT_NE(help.find("  " + entry.key + " (" + weft::type_name(entry.type) + ", default " + shown), std::string::npos)
        << entry.key;
    EXPECT_NE(help.find(entry.doc), std::string::npos) << entry.key;
    EXPECT_NE(markdown.find("| `" + entry.name() + "` | " + weft::type_name(entry.type) + " |"),
              std::string::npos)
        << entry.key;
  }
  EXPECT_NE(help.find("train.precision (string, default \"fp32\"; one of \"fp32\", \"bf16\", \"fp16\")"),
            std::string::npos);
  EXPECT_NE(help.find("data.heldout_fraction (float, default 0.1; min 0; max 0.9)"),
            std::string::npos);
  // Markdown: angle brackets escaped so that "<out_dir>" is not read as an HTML tag.
  EXPECT_NE(markdown.find("empty = &lt;out_dir&gt;/metrics.jsonl"), std::string::npos);
  EXPECT_NE(markdown.find("| `lr` | float | `0.0003` | Peak learning rate. (min 0) |"),
            std::string::npos);
}

}  // namespace

namespace {

// Found by fuzz_config: an `extends` name the file system refuses (longer than NAME_MAX) escaped
// as std::filesystem_error instead of the one clear error.
TEST(ConfigFuzzFindings, AnExtendsNameTooLongForTheFileSystemIsOneError) {
  const std::string text = "extends = \"" + std::string(300, 'w') + ".toml\"\n";
  const std::string message = error_of([&] { load_config_text(run_schema(), text, "/tmp/main.toml"); });
  EXPECT_NE(message.find("config key 'extends' names '/tmp/" + std::string(300, 'w') + ".toml': File name too long"),
            std::string::npos) << message;
}

}  // namespace
