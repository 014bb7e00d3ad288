#include "core/plugin/library.h"

#include <dlfcn.h>
#include <elf.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <type_traits>

#ifndef BOOST_DLL_USE_STD_FS  // normally defined for the whole build (core/CMakeLists.txt)
#define BOOST_DLL_USE_STD_FS
#endif
#include <boost/dll/shared_library.hpp>
#include <fmt/format.h>

#include "core/util/error.h"
#include "core/util/libtorch.h"
#include "core/util/suggest.h"

// The strategy compiled into the host (builtin_single.cpp).
extern "C" const weft_plugin* weft_builtin_single_entry(uint16_t host_abi_major, uint16_t host_abi_minor);

namespace weft {
namespace fs = std::filesystem;

namespace {

// Every library this process opened (refused ones included) and every plugin it accepted, by
// canonical path. Never emptied: libraries are never unloaded.
struct Registry {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<boost::dll::shared_library>> libraries;
  std::map<std::string, std::shared_ptr<PluginLibrary>> plugins;
};

Registry& registry() {
  static Registry* instance = new Registry;  // leaked on purpose: outlives static destructors
  return *instance;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_file(const fs::path& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

bool has_elf_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "\x7f" "ELF", 4) == 0;
}

std::string version_string(PluginVersion v) { return fmt::format("{}.{}", v.major, v.minor); }

// dlopen()s `path` (canonical) once per process and keeps it open for good.
std::shared_ptr<boost::dll::shared_library> open_library(const std::string& path) {
  auto& libraries = registry().libraries;
  if (auto it = libraries.find(path); it != libraries.end()) return it->second;
  WEFT_CHECK(has_elf_magic(path), "plugin {}: not a shared library (no ELF header)", path);
  auto library = std::make_shared<boost::dll::shared_library>();
  boost::dll::fs::error_code ec;
  library->load(path, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local, ec);
  if (ec) {
    const char* reason = dlerror();  // Boost.DLL leaves dlopen's message in place on failure
    fail("plugin {}: cannot be loaded: {}", path, reason ? reason : ec.message());
  }
  libraries.emplace(path, library);
  return library;
}


// The DT_NEEDED entries of a 64-bit ELF shared library (empty when the file is not one or is
// malformed: dlopen has accepted it already, this only reads what it links).
std::vector<std::string> needed_libraries(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> needed;
  const auto fits = [&](uint64_t offset, uint64_t size) { return offset <= bytes.size() && size <= bytes.size() - offset; };
  if (!fits(0, sizeof(Elf64_Ehdr))) return needed;
  Elf64_Ehdr header;
  std::memcpy(&header, bytes.data(), sizeof header);
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0 || header.e_ident[EI_CLASS] != ELFCLASS64 ||
      header.e_shentsize != sizeof(Elf64_Shdr) || !fits(header.e_shoff, uint64_t{header.e_shnum} * sizeof(Elf64_Shdr))) {
    return needed;
  }
  const auto section = [&](size_t i) {
    Elf64_Shdr s;
    std::memcpy(&s, bytes.data() + header.e_shoff + i * sizeof(Elf64_Shdr), sizeof s);
    return s;
  };
  for (size_t i = 0; i < header.e_shnum; ++i) {
    const Elf64_Shdr dynamic = section(i);
    if (dynamic.sh_type != SHT_DYNAMIC || dynamic.sh_link >= header.e_shnum || !fits(dynamic.sh_offset, dynamic.sh_size)) continue;
    const Elf64_Shdr strings = section(dynamic.sh_link);
    if (!fits(strings.sh_offset, strings.sh_size)) continue;
    for (uint64_t at = 0; at + sizeof(Elf64_Dyn) <= dynamic.sh_size; at += sizeof(Elf64_Dyn)) {
      Elf64_Dyn entry;
      std::memcpy(&entry, bytes.data() + dynamic.sh_offset + at, sizeof entry);
      if (entry.d_tag == DT_NULL) break;
      if (entry.d_tag != DT_NEEDED || entry.d_un.d_val >= strings.sh_size) continue;
      const char* name = bytes.data() + strings.sh_offset + entry.d_un.d_val;
      needed.emplace_back(name, strnlen(name, strings.sh_size - entry.d_un.d_val));
    }
  }
  return needed;
}

// A plugin that links LibTorch shares the host's: it must say which it was built against
// ("weft_torch_build", weft/plugin.h), and that must be the host's (version and C++ ABI).
void check_torch_build(const Abi2Plugin& plugin, const std::string& path) {
  const auto fn = reinterpret_cast<weft_torch_build_fn>(plugin.table.get_proc_address("weft_torch_build"));
  const std::string host = fmt::format("{} (C++11 ABI {})", libtorch_version(), _GLIBCXX_USE_CXX11_ABI);
  if (fn == nullptr) {
    for (const std::string& library : needed_libraries(path)) {
      const bool torch = library.rfind("libtorch", 0) == 0 || library.rfind("libc10", 0) == 0;
      WEFT_CHECK(!torch,
                 "plugin {} links LibTorch ({}) but does not say which build (weft_torch_build; weft/plugin_torch.hpp "
                 "defines it): this host runs LibTorch {}",
                 path, library, host);
    }
    return;
  }
  const weft_torch_build* build = fn();
  WEFT_CHECK(build != nullptr && build->struct_size >= sizeof(weft_torch_build),
             "plugin {}: weft_torch_build gave no build (NULL or smaller than ABI 2.2's)", path);
  const std::string built = fmt::format("{}.{}.{} (C++11 ABI {})", build->major, build->minor, build->patch, build->cxx11_abi);
  WEFT_CHECK(built == host,
             "plugin {} was built against LibTorch {}, this host runs {}: rebuild it against the host's LibTorch "
             "(both load into one process)",
             path, built, host);
}

}  // namespace

PluginLibrary::PluginLibrary(std::string path, const Abi2Plugin& plugin)
    : path_(std::move(path)),
      name_(plugin.table.name),
      version_(plugin.table.version),
      description_(plugin.table.description != nullptr ? plugin.table.description : ""),
      plugin_abi_{plugin.table.abi_major, plugin.table.abi_minor},
      plugin_(plugin) {}

std::string PluginLibrary::abi() const {
  return version_string({WEFT_PLUGIN_ABI_MAJOR, std::min<uint16_t>(plugin_abi_.minor, WEFT_PLUGIN_ABI_MINOR)});
}

std::shared_ptr<PluginLibrary> PluginLibrary::load(const std::string& path_or_name) {
  if (path_or_name == kBuiltinStrategy) {
    static const std::shared_ptr<PluginLibrary> builtin = [] {
      const weft_plugin* table = weft_builtin_single_entry(WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR);
      WEFT_CHECK(table != nullptr, "the built-in strategy refuses this host's ABI");
      return std::make_shared<PluginLibrary>(kBuiltinPath, validate_abi2_table(*table, kBuiltinPath));
    }();
    return builtin;
  }
  const std::string path = fs::canonical(resolve_plugin_path(path_or_name)).string();
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (auto it = r.plugins.find(path); it != r.plugins.end()) return it->second;
  const auto library = open_library(path);
  if (library->has(WEFT_PLUGIN_ENTRY_SYMBOL)) {  // ABI 2
    auto& entry = library->get<std::remove_pointer_t<weft_plugin_entry_fn>>(WEFT_PLUGIN_ENTRY_SYMBOL);
    const weft_plugin* table = entry(WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR);
    WEFT_CHECK(table, "plugin {}: {} returned NULL (the plugin refuses this host's ABI {}.{})", path,
               WEFT_PLUGIN_ENTRY_SYMBOL, WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR);
    Abi2Plugin validated = validate_abi2_table(*table, path);
    check_torch_build(validated, path);
    auto plugin = std::make_shared<PluginLibrary>(path, validated);
    r.plugins.emplace(path, plugin);
    return plugin;
  }
  // ABI 1 (weft_strategy_entry, its table of 63 host callbacks) is gone: one line says so.
  WEFT_CHECK(!library->has("weft_strategy_entry"),
             "plugin {}: an ABI 1 strategy plugin (it exports weft_strategy_entry); this host loads ABI {} plugins "
             "only (weft_plugin_entry, sdk/include/weft/plugin.h; sdk/CHANGELOG.md says what changed)",
             path, WEFT_PLUGIN_ABI_MAJOR);
  fail("plugin {}: exports no {}: not a weft strategy plugin", path, WEFT_PLUGIN_ENTRY_SYMBOL);
}

std::vector<std::string> plugin_search_dirs() {
  std::vector<std::string> dirs;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back((exe.parent_path() / "plugins").string());
  if (const char* env = std::getenv("WEFT_PLUGIN_PATH")) {
    std::stringstream entries(env);
    for (std::string dir; std::getline(entries, dir, ':');) {
      if (!dir.empty()) dirs.push_back(dir);
    }
  }
  return dirs;
}

std::vector<std::string> resolve_plugin_paths(const std::string& list) {
  std::vector<std::string> paths;
  std::stringstream names(list);
  for (std::string name; std::getline(names, name, ',');) {
    const auto first = name.find_first_not_of(" \t"), last = name.find_last_not_of(" \t");
    WEFT_CHECK(first != std::string::npos, "--plugin {}: an empty plugin name in the list", list);
    paths.push_back(resolve_plugin_path(name.substr(first, last - first + 1)));
  }
  return paths;
}

std::string resolve_plugin_path(const std::string& path_or_name) {
  WEFT_CHECK(!path_or_name.empty(), "plugin: empty plugin name");
  WEFT_CHECK(path_or_name.find(',') == std::string::npos || path_or_name.find('/') != std::string::npos,
             "--plugin {} names several plugins (a run composed over a device mesh): each is loaded on its own "
             "(resolve_plugin_paths)",
             path_or_name);
  if (path_or_name.find('/') != std::string::npos) {
    WEFT_CHECK(is_file(path_or_name), "plugin {}: file not found", path_or_name);
    return path_or_name;
  }
  const std::string file = ends_with(path_or_name, ".so") ? path_or_name : path_or_name + ".so";
  std::vector<std::string> searched;
  for (const std::string& dir : plugin_search_dirs()) {
    const std::string candidate = (fs::path(dir) / file).string();
    if (is_file(candidate)) return candidate;
    searched.push_back(candidate);
  }
  // The plugins that are there, and the one the name probably meant ("dpp", "zer0").
  std::vector<std::string> names{kBuiltinStrategy};
  for (const std::string& dir : plugin_search_dirs()) {
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      if (it->path().extension() == ".so" && is_file(it->path())) names.push_back(it->path().stem().string());
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  const auto meant = closest(fs::path(file).stem().string(), names);
  fail("plugin '{}' not found{} (plugins here: {}; searched: {}; set WEFT_PLUGIN_PATH or pass a path)", path_or_name,
       meant ? fmt::format(": did you mean '{}'?", *meant) : "", fmt::join(names, ", "),
       searched.empty() ? "nothing" : fmt::format("{}", fmt::join(searched, ", ")));
}

namespace {

std::vector<fs::path> shared_libraries_in(const std::string& dir) {
  std::vector<fs::path> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".so" && is_file(it->path())) found.push_back(it->path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

PluginListing describe(const fs::path& file) {
  PluginListing listing;
  listing.path = file.string();
  try {
    const auto plugin = PluginLibrary::load(listing.path);
    listing.path = plugin->path();
    listing.name = plugin->name();
    listing.version = plugin->version();
    listing.description = plugin->description();
    listing.abi = plugin->plugin_abi();
  } catch (const std::exception& e) {
    listing.problem = e.what();
  }
  return listing;
}

}  // namespace

std::vector<PluginListing> list_plugins() {
  std::vector<PluginListing> listings{describe(kBuiltinStrategy)};
  std::set<fs::path> seen;
  for (const std::string& dir : plugin_search_dirs()) {
    for (const fs::path& file : shared_libraries_in(dir)) {
      std::error_code ec;
      const fs::path canonical = fs::canonical(file, ec);
      if (!seen.insert(ec ? file : canonical).second) continue;
      PluginListing listing = describe(ec ? file : canonical);
      // single.so (the built-in strategy as a plugin, which tests compare with it): one row, not two.
      if (listing.problem.empty() && listing.name == listings.front().name && listing.version == listings.front().version) {
        listings.front().path += ", " + listing.path;
        continue;
      }
      listings.push_back(std::move(listing));
    }
  }
  return listings;
}

std::string format_plugin_table(const std::vector<PluginListing>& listings) {
  if (listings.empty()) {
    const auto dirs = plugin_search_dirs();
    return fmt::format("no plugins found (searched: {})\n", fmt::join(dirs, ", "));
  }
  std::vector<std::array<std::string, 5>> rows{{"NAME", "VERSION", "ABI", "PATH", "DESCRIPTION"}};
  for (const PluginListing& p : listings) {
    if (p.problem.empty()) {
      rows.push_back({p.name, p.version, version_string(p.abi), p.path, p.description});
    } else {
      rows.push_back({fs::path(p.path).stem().string(), "-", "-", p.path, "PROBLEM: " + p.problem});
    }
  }
  std::array<size_t, 4> width{};  // the last column is not padded
  for (const auto& row : rows) {
    for (size_t c = 0; c < width.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    for (size_t c = 0; c < width.size(); ++c) out += fmt::format("{:<{}}  ", row[c], width[c]);
    out += row[4] + "\n";
  }
  return out;
}

}  // namespace weft
