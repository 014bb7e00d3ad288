// ABI 2 plugins (sdk/include/weft/plugin.h) in the host: their core table, validated at load, and
// the host's step that runs them (HostStep in abi2.cpp, PipelineStep in abi2_pipeline.cpp), which
// creates the plugin, asks it for its layout and executes the step program lowered from it. The
// strategy session holds that step and calls its methods.
#pragma once

#include <memory>
#include <string>

#include <weft/plugin.h>
#include "core/plugin/step/step.hpp"

namespace weft {

struct Abi2Plugin {
  std::string path;
  weft_plugin table{};  // the plugin's table, copied (its strings and functions stay in the library)
};

// Validates a 2.x core table from `path` against this host (2.WEFT_PLUGIN_ABI_MINOR): the major,
// struct_size, create / destroy / get_proc_address, a name and a version. Throws weft::Error, one
// line naming the file and the problem.
Abi2Plugin validate_abi2_table(const weft_plugin& table, const std::string& path);

// The host's step for `plugin` over the session's host services (the plugin's own create runs
// inside): what the strategy session calls. Throws sdk::Error: the plugin's refusal, with its
// message, or a layout this host cannot execute.
std::unique_ptr<sdk::Strategy> create_abi2_step(const Abi2Plugin& plugin, sdk::Host host);

}  // namespace weft
