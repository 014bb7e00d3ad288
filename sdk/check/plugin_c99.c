/* Compiles weft/plugin.h as strict C99 (-pedantic -Werror): plugins may be written in C. */
#include <weft/plugin.h>

/* A C plugin's entry point has this shape. */
const weft_plugin* weft_sdk_c99_check_entry(uint16_t host_abi_major, uint16_t host_abi_minor);
const weft_plugin* weft_sdk_c99_check_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? (const weft_plugin*)0 : (const weft_plugin*)0;
}
