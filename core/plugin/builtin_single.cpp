// single.so's strategy (plugins/single/single.c, ABI 2) compiled into the host: a run without a
// plugin (train.plugin = "") goes through the same step as every plugin, with no library to find.
// The entry point is renamed, so that the host exports no weft_plugin_entry of its own;
// PluginLibrary::load("single") returns this table (library.h).
#define weft_plugin_entry weft_builtin_single_entry
extern "C" {
#include "plugins/single/single.c"
}
#undef weft_plugin_entry
