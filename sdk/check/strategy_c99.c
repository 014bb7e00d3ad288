/* Compiles weft/strategy.h and weft/plugin.h as strict C99 (-pedantic -Werror): both ABIs must stay
 * usable from C. */
#include <weft/plugin.h>
#include <weft/strategy.h>

/* A C plugin's entry point has this shape. */
const weft_strategy_api* weft_sdk_c99_check_entry(uint16_t host_abi_major, uint16_t host_abi_minor);
const weft_strategy_api* weft_sdk_c99_check_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == WEFT_ABI_VERSION_MAJOR ? (const weft_strategy_api*)0 : (const weft_strategy_api*)0;
}
