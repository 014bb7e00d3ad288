// ABI 2 plugins (sdk/include/weft/plugin.h) in the host: their core table, validated at load, and
// the host's step that runs them. For now (the first landing of issue 44) an ABI 2 plugin reaches
// the rest of the host through the same strategy session as ABI 1 plugins: the session holds, as
// its instance, the host's own step (HostStep in abi2.cpp), which creates the plugin, asks it for
// its layout and executes the step program lowered from it. Nothing of ABI 1 reaches the plugin.
#pragma once

#include <string>

#include <weft/plugin.h>
#include <weft/strategy.h>

namespace weft {

struct Abi2Plugin {
  std::string path;
  weft_plugin table{};  // the plugin's table, copied (its strings and functions stay in the library)
};

// Validates a 2.x core table from `path` against this host (2.WEFT_PLUGIN_ABI_MINOR): the major,
// struct_size, create / destroy / get_proc_address, a name and a version. Throws weft::Error, one
// line naming the file and the problem.
Abi2Plugin validate_abi2_table(const weft_plugin& table, const std::string& path);

// The ABI 1 table the strategy session calls for an ABI 2 plugin: the host's step, with the
// plugin's name, version, description and mesh dimensions. Its create slot refuses; the session
// creates the instance with create_abi2_step.
weft_strategy_api abi2_session_table(const Abi2Plugin& plugin);

// Creates the host's step for `plugin` over the session's host services (the plugin's own create
// runs inside). A status on failure (the plugin's refusal, with its message), NULL on success.
weft_status* create_abi2_step(const Abi2Plugin& plugin, const weft_host_api* api, weft_host* host,
                              weft_strategy** out);

}  // namespace weft
