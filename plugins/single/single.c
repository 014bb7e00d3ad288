/* single.so: the one-process reference (weft/plugin.h). It owns no mesh
 * dimension and gives no layout: the host's step (forward and backward of each micro-batch, then the
 * optimizer) is the whole strategy. The host compiles this file in as its built-in strategy
 * (core/plugin/builtin_single.cpp: a run without a plugin, and the reference of every conformance
 * check); single.so is the same built as a plugin. */
#include <stddef.h>

#include <weft/plugin.h>

#ifndef WEFT_SINGLE_NAME
#define WEFT_SINGLE_NAME "single"
#endif

static int the_instance;

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  (void)host;
  *out = (weft_plugin_instance*)&the_instance;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) { (void)instance; }

static weft_proc get_proc_address(const char* name) {
  (void)name;
  return NULL;
}

WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  static const weft_plugin table = {
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, WEFT_SINGLE_NAME, "2.0.0",
      "one process: the host's step alone", 0u, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
