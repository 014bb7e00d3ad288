// Loading strategy plugins: their tables and every refusal, against the purpose-built C plugins
// of tests/plugin/fixtures (built into WEFT_PLUGIN_FIXTURE_DIR).
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <sys/wait.h>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "core/plugin/library.h"
#include "core/plugin/status.h"
#include "core/util/error.h"
#include "core/util/libtorch.h"
#include "test_paths.h"

namespace weft {
namespace {
namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kFixtureDir = WEFT_PLUGIN_FIXTURE_DIR;
const std::string kHostAbi = fmt::format("{}.{}", WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR);

std::string fixture(const std::string& name) { return kFixtureDir + "/" + name + ".so"; }

// Sets an environment variable for the scope, restoring the previous value afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

std::string load_error(const std::string& path_or_name) {
  try {
    PluginLibrary::load(path_or_name);
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded)";
}

TEST(PluginLoader, GoodPluginDescribesItself) {
  const auto plugin = PluginLibrary::load(fixture("good"));
  EXPECT_EQ(plugin->path(), fs::canonical(fixture("good")).string());
  EXPECT_EQ(plugin->name(), "good");
  EXPECT_EQ(plugin->version(), "1.2.3");
  EXPECT_EQ(plugin->description(), "test fixture good");
  EXPECT_EQ(plugin->plugin_abi().major, WEFT_PLUGIN_ABI_MAJOR);
  EXPECT_EQ(plugin->plugin_abi().minor, WEFT_PLUGIN_ABI_MINOR);
  EXPECT_EQ(plugin->abi(), kHostAbi);
  EXPECT_EQ(plugin->plugin().table.mesh_dimensions, 1u << WEFT_MESH_DP);
}

TEST(PluginLoader, NewerMinorPluginRunsAtThisHostsMinor) {
  const auto plugin = PluginLibrary::load(fixture("newer_minor"));
  EXPECT_EQ(plugin->plugin_abi().minor, WEFT_PLUGIN_ABI_MINOR + 1);
  EXPECT_EQ(plugin->abi(), kHostAbi);
}

// A plugin's create may refuse the run (its settings, the world size, the host's minor): its status
// reaches the user as one line naming the plugin, before the model is built.
TEST(PluginLoader, ErrorFromCreateReachesTheHost) {
  FILE* pipe = popen((std::string(WEFT_TRAINER_PATH) + " check --plugin " + fixture("error_create") +
                      " --nproc 1 --steps 1 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) output.append(buffer, n);
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << output;
  EXPECT_THAT(output, HasSubstr("error_create"));
  EXPECT_THAT(output, HasSubstr("world size 3 is not divisible by tensor_parallel 2"));
  EXPECT_THAT(output, Not(HasSubstr("step 1")));
}

struct Refusal {
  const char* fixture;
  std::string expected;
};

TEST(PluginLoader, BrokenPluginsAreRefusedWithOneLineNamingTheProblem) {
  const std::vector<Refusal> refusals{
      {"abi1", "an ABI 1 strategy plugin (it exports weft_strategy_entry); this host loads ABI 2 plugins only"},
      {"wrong_major", "is built for weft ABI 3.x, this host speaks " + kHostAbi},
      {"entry_null", "weft_plugin_entry returned NULL (the plugin refuses this host's ABI " + kHostAbi + ")"},
      {"no_entry", "exports no weft_plugin_entry: not a weft strategy plugin"},
      {"too_small", fmt::format("its table's struct_size {} is smaller than ABI 2.0's ({})", offsetof(weft_plugin, create),
                                sizeof(weft_plugin))},
      {"missing_create", "required function(s) are NULL: create"},
      {"missing_name", "its table has no name"},
      {"not_a_library", "not a shared library"},
      {"undefined_symbol", "cannot be loaded: "},
      // ABI 2 (weft/plugin.h): a plugin owns one dimension: data-parallel, pipeline, tensor- or context-parallel.
      {"abi2_tensor_parallel", "offers mesh dimensions 0xa; an ABI 2 plugin on this host (ABI 2.5) owns one of the "
                               "data-parallel dimension (0x2), the pipeline dimension (0x1), the tensor-parallel "
                               "dimension (0x8) and the context-parallel dimension (0x4)"},
      {"abi2_no_proc_address", "required function(s) are NULL: get_proc_address"},
      // A plugin that links LibTorch must be built against the host's and say so (weft_torch_build).
      {"abi2_torch_mismatch", "was built against LibTorch 2.4.1 (C++11 ABI 1), this host runs " + weft::libtorch_version()},
      {"abi2_torch_undeclared", "links LibTorch (libtorch.so) but does not say which build (weft_torch_build"},
  };
  for (const Refusal& r : refusals) {
    const std::string message = load_error(fixture(r.fixture));
    EXPECT_THAT(message, HasSubstr(r.expected)) << r.fixture;
    EXPECT_THAT(message, HasSubstr(fs::canonical(fixture(r.fixture)).string())) << r.fixture;
    EXPECT_EQ(message.find('\n'), std::string::npos) << r.fixture;
    EXPECT_EQ(load_error(fixture(r.fixture)), message) << "refused again, the same way: " << r.fixture;
  }
  // RTLD_NOW: the unresolved import fails the load, with dlopen's own explanation.
  EXPECT_THAT(load_error(fixture("undefined_symbol")), HasSubstr("weft_fixture_function_nobody_defines"));
}

TEST(PluginLoader, TheSameFileLoadsOnceWhateverItIsCalled) {
  ScopedEnv env("WEFT_PLUGIN_PATH", kFixtureDir);
  const auto by_path = PluginLibrary::load(fixture("good"));
  EXPECT_EQ(PluginLibrary::load(fixture("good")), by_path);
  EXPECT_EQ(PluginLibrary::load("good"), by_path);
  EXPECT_EQ(PluginLibrary::load("good.so"), by_path);
  EXPECT_EQ(PluginLibrary::load(kFixtureDir + "/../plugin_fixtures/good.so"), by_path);
  EXPECT_NE(PluginLibrary::load("newer_minor"), by_path);
}

TEST(PluginLoader, BareNamesAreSearchedInOrder) {
  const fs::path shadow = fs::temp_directory_path() / fmt::format("weft_plugin_shadow_{}", getpid());
  fs::create_directories(shadow);
  std::ofstream(shadow / "good.so") << "not really";
  {
    ScopedEnv env("WEFT_PLUGIN_PATH", "/nonexistent-weft-dir::" + kFixtureDir);
    EXPECT_EQ(resolve_plugin_path("good"), kFixtureDir + "/good.so");
    EXPECT_EQ(resolve_plugin_path("good.so"), kFixtureDir + "/good.so");
    EXPECT_EQ(resolve_plugin_path("wrong_major"), kFixtureDir + "/wrong_major.so");
  }
  {
    ScopedEnv env("WEFT_PLUGIN_PATH", shadow.string() + ":" + kFixtureDir);
    EXPECT_EQ(resolve_plugin_path("good"), (shadow / "good.so").string());
  }
  fs::remove_all(shadow);
}

TEST(PluginLoader, NotFoundListsEveryPlaceSearched) {
  ScopedEnv env("WEFT_PLUGIN_PATH", "/nonexistent-weft-dir:" + kFixtureDir);
  try {
    resolve_plugin_path("no_such_plugin");
    FAIL() << "no exception";
  } catch (const Error& e) {
    // The plugins there (the fixtures' and the built-in single), then every place searched.
    EXPECT_THAT(e.what(), HasSubstr("plugin 'no_such_plugin' not found (plugins here: abi1, abi2_bad_context, abi2_bad_slice, "));
    EXPECT_THAT(e.what(), HasSubstr(", abi2_unknown_point, diloco, "));
    EXPECT_THAT(e.what(), HasSubstr(", good, "));
    EXPECT_THAT(e.what(), HasSubstr(", single, "));
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("; searched: {0}/tests/plugins/no_such_plugin.so, "
                                                "/nonexistent-weft-dir/no_such_plugin.so, {1}/no_such_plugin.so; "
                                                "set WEFT_PLUGIN_PATH or pass a path)",
                                                fs::canonical(WEFT_BINARY_DIR).string(), kFixtureDir)));
    EXPECT_THAT(load_error("goood"), HasSubstr("plugin 'goood' not found: did you mean 'good'?"));
  }
  EXPECT_THAT(load_error("no_such_plugin"), HasSubstr("/nonexistent-weft-dir/no_such_plugin.so"));
}

// Several strategies in one --plugin (a run composed over a device mesh) are each
// resolved on their own, never searched for as a file called "zero,tensor_parallel.so".
TEST(PluginLoader, AListOfPluginsResolvesEachAndASinglePathRefusesIt) {
  ScopedEnv env("WEFT_PLUGIN_PATH", kFixtureDir);
  EXPECT_EQ(resolve_plugin_paths("good, newer_minor"),
            (std::vector<std::string>{fixture("good"), fixture("newer_minor")}));
  EXPECT_THAT(load_error("good,"), HasSubstr("names several plugins"));
  try {
    resolve_plugin_paths("good,,newer_minor");
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("an empty plugin name in the list"));
  }
}

TEST(PluginLoader, PathsAreUsedAsGiven) {
  ScopedEnv env("WEFT_PLUGIN_PATH", kFixtureDir);
  EXPECT_EQ(resolve_plugin_path(fixture("good")), fixture("good"));
  EXPECT_THAT(load_error("./good.so"), HasSubstr("plugin ./good.so: file not found"));
  EXPECT_THAT(load_error(kFixtureDir + "/good"), HasSubstr("file not found"));  // no ".so" appended
}

TEST(PluginLoader, ListsEveryLibraryInTheSearchPathWithItsProblem) {
  ScopedEnv env("WEFT_PLUGIN_PATH", kFixtureDir + ":" + kFixtureDir);  // listed once nevertheless
  const std::vector<PluginListing> listings = list_plugins();
  std::vector<std::string> files;
  for (const auto& l : listings) files.push_back(fs::path(l.path).filename().string());
  // The strategy built into the host first, then the libraries.
  ASSERT_FALSE(listings.empty());
  EXPECT_EQ(listings[0].path, "(built in)");
  EXPECT_EQ(listings[0].name, "single");
  EXPECT_EQ(listings[0].problem, "");
  EXPECT_EQ(files, (std::vector<std::string>{"(built in)", "abi1.so", "abi2_bad_context.so", "abi2_bad_slice.so",
                                             "abi2_local_gradient.so", "abi2_no_proc_address.so",
                                             "abi2_pipeline_bad_layout.so", "abi2_pipeline_deadlock.so", "abi2_schedule.so",
                                             "abi2_slice.so", "abi2_tensor_parallel.so",
                                             "abi2_torch.so", "abi2_torch_mismatch.so", "abi2_torch_undeclared.so",
                                             "abi2_unknown_point.so", "diloco.so", "entry_null.so",
                                             "error_create.so", "good.so", "hsdp.so", "missing_create.so",
                                             "missing_name.so", "newer_minor.so",
                                             "no_entry.so", "not_a_library.so", "too_small.so",
                                             "undefined_symbol.so", "wrong_major.so", "zbv.so"}));
  const auto find = [&](const std::string& file) {
    for (const auto& l : listings) {
      if (fs::path(l.path).filename() == file) return l;
    }
    return PluginListing{};
  };
  const PluginListing good = find("good.so");
  EXPECT_EQ(good.problem, "");
  EXPECT_EQ(good.name, "good");
  EXPECT_EQ(good.version, "1.2.3");
  EXPECT_EQ(good.abi.major, WEFT_PLUGIN_ABI_MAJOR);
  EXPECT_EQ(find("newer_minor.so").abi.minor, WEFT_PLUGIN_ABI_MINOR + 1);
  EXPECT_EQ(find("error_create.so").problem, "");  // it loads; only its create fails
  EXPECT_THAT(find("wrong_major.so").problem, HasSubstr("is built for weft ABI 3.x"));
  EXPECT_THAT(find("abi1.so").problem, HasSubstr("an ABI 1 strategy plugin"));
  EXPECT_THAT(find("not_a_library.so").problem, HasSubstr("not a shared library"));
  EXPECT_EQ(find("abi2_slice.so").problem, "");
  EXPECT_THAT(find("abi2_tensor_parallel.so").problem, HasSubstr("owns one of the data-parallel dimension"));
  EXPECT_EQ(find("not_a_library.so").name, "");
}

// single.so is the built-in strategy built as a plugin (the tests compare the two): trainer plugins
// lists it in the built-in's row, not as a second "single".
TEST(PluginLoader, TheBuiltInStrategyAsALibraryIsListedInTheBuiltInsRow) {
  const std::string plugins = std::string(WEFT_BINARY_DIR) + "/plugins";
  ASSERT_TRUE(fs::exists(plugins + "/single.so"));
  ScopedEnv env("WEFT_PLUGIN_PATH", plugins);
  const std::vector<PluginListing> listings = list_plugins();
  int singles = 0;
  for (const auto& l : listings) singles += l.name == "single" ? 1 : 0;
  EXPECT_EQ(singles, 1);
  ASSERT_FALSE(listings.empty());
  EXPECT_EQ(listings[0].path, "(built in), " + fs::canonical(plugins + "/single.so").string());
  EXPECT_GT(listings.size(), 2u);  // the other plugins keep their rows
}

TEST(PluginLoader, FormatsListingsAsATable) {
  PluginListing ddp{"/p/ddp.so", "ddp", "1.0.0", "data parallel", {2, 1}, ""};
  PluginListing bad{"/p/broken.so", "", "", "", {}, "plugin /p/broken.so: not a shared library (no ELF header)"};
  EXPECT_EQ(format_plugin_table({ddp, bad}),
            "NAME    VERSION  ABI  PATH          DESCRIPTION\n"
            "ddp     1.0.0    2.1  /p/ddp.so     data parallel\n"
            "broken  -        -    /p/broken.so  PROBLEM: plugin /p/broken.so: not a shared library (no ELF header)\n");
  ScopedEnv env("WEFT_PLUGIN_PATH", "/nowhere");
  EXPECT_THAT(format_plugin_table({}), HasSubstr("no plugins found (searched: "));
  EXPECT_THAT(format_plugin_table({}), HasSubstr(", /nowhere)"));
}

TEST(PluginLoader, TrainerPluginsCommandPrintsTheTable) {
  ScopedEnv env("WEFT_PLUGIN_PATH", kFixtureDir);
  FILE* pipe = popen(WEFT_TRAINER_PATH " plugins 2>&1", "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[4096];
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) output.append(buffer, n);
  const int status = pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  EXPECT_THAT(output, HasSubstr("NAME"));
  // The host's LibTorch first: plugins that link LibTorch must be built against the same one.
  EXPECT_THAT(output, HasSubstr("host: LibTorch " + libtorch_version() + ", NCCL "));
  EXPECT_THAT(output, HasSubstr("test fixture good"));
  EXPECT_THAT(output, HasSubstr(fs::canonical(fixture("good")).string()));
  EXPECT_THAT(output, HasSubstr("PROBLEM: plugin " + fs::canonical(fixture("wrong_major")).string()));
}

}  // namespace
}  // namespace weft
