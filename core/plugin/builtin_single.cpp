// single.so's strategy (plugins/single/single.cpp) compiled into the host: a run without a plugin
// (train.plugin = "") goes through the same strategy session as every plugin, with no library
// to find. The entry point is renamed, so that the host exports no weft_strategy_entry of its own;
// PluginLibrary::load("single") returns this table (library.h).
#define weft_strategy_entry weft_builtin_single_entry
#include "plugins/single/single.cpp"
#undef weft_strategy_entry
