// Loading strategy plugins (shared libraries implementing sdk/include/weft/plugin.h, ABI 2) and
// validating their tables.
//
// A plugin is named either by a path (anything containing '/', used as is) or by a bare name
// ("ddp" or "ddp.so") looked up in the plugin search directories (plugin_search_dirs). Loaded
// libraries are never unloaded: the process keeps every library it opened, including ones it
// then refused, for its whole life (code from a library must not vanish while anything it made
// is alive).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/plugin/abi2.h"

namespace weft {

struct PluginVersion {
  uint16_t major = 0;
  uint16_t minor = 0;
};

// The strategy built into the host (plugins/single, compiled in): what "" and "single" name.
inline constexpr const char* kBuiltinStrategy = "single";
// PluginLibrary::path() of the built-in strategy.
inline constexpr const char* kBuiltinPath = "(built in)";

// A loaded, validated strategy plugin. Obtain one with load(); it lives as long as the process.
class PluginLibrary {
 public:
  // kBuiltinStrategy ("single") is the strategy compiled into the host (its table validated like a
  // library's); a path to single.so loads the library. Anything else:
  // resolves `path_or_name` (resolve_plugin_path), loads it with RTLD_NOW | RTLD_LOCAL, calls its
  // weft_plugin_entry with this host's ABI version and validates the table (validate_abi2_table).
  // Loading the same file again (by any path or name that resolves to it) returns the same
  // object. Throws weft::Error, one line naming the file and the problem: not found (listing
  // the places searched), not a shared library, dlopen's error (e.g. an undefined symbol), no
  // entry symbol (or ABI 1's weft_strategy_entry), entry returned NULL, or any refusal of
  // validate_abi2_table.
  static std::shared_ptr<PluginLibrary> load(const std::string& path_or_name);

  const std::string& path() const { return path_; }  // canonical absolute path of the library
  const std::string& name() const { return name_; }  // the table's name, e.g. "ddp"
  const std::string& version() const { return version_; }
  const std::string& description() const { return description_; }  // "" when the plugin has none

  PluginVersion plugin_abi() const { return plugin_abi_; }  // the table's ABI version
  // The ABI the plugin runs at here: "2.<min(the plugin's minor, this host's)>".
  std::string abi() const;
  // The plugin's validated core table.
  const Abi2Plugin& plugin() const { return plugin_; }
  // A validated plugin (validate_abi2_table). Public for make_shared; plugins are obtained with
  // load().
  PluginLibrary(std::string path, const Abi2Plugin& plugin);

 private:
  std::string path_, name_, version_, description_;
  PluginVersion plugin_abi_;
  Abi2Plugin plugin_;
};

// Where bare plugin names are looked up, in order: <directory of the running executable>/plugins,
// then each non-empty entry of the colon-separated environment variable WEFT_PLUGIN_PATH.
// Directories that do not exist are included (they are still "places searched").
std::vector<std::string> plugin_search_dirs();

// A name containing '/' is returned unchanged if it names an existing file. Otherwise ".so" is
// appended when the name lacks it and the first search directory holding that file wins.
// Throws weft::Error if there is no such file; for a bare name the message lists every
// place searched.
std::string resolve_plugin_path(const std::string& path_or_name);
// A comma-separated list of plugins (train.plugin of a run composed over a device mesh, ABI
// 1.12): each resolved as above, in order. resolve_plugin_path itself refuses a list.
std::vector<std::string> resolve_plugin_paths(const std::string& list);

// One library found by list_plugins.
struct PluginListing {
  std::string path, name, version, description;
  PluginVersion abi;    // the table's header version
  std::string problem;  // non-empty if the library failed to load (the load error's message)
};

// The built-in strategy, then every *.so in the search directories (each directory sorted by
// file name; a file reached through two directories is listed once), each loaded and described.
// A library that is the built-in strategy (single.so: same name and version) adds its path to the
// built-in's row instead of a row of its own. Load failures are reported in `problem`, never thrown.
std::vector<PluginListing> list_plugins();

// A human-readable table of listings (NAME VERSION ABI PATH DESCRIPTION), failures marked with
// their problem; or a line saying no plugins were found and where it looked.
std::string format_plugin_table(const std::vector<PluginListing>& listings);

}  // namespace weft
