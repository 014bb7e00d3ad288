/* An ABI 2 plugin linked against LibTorch that says it was built against LibTorch 2.4.1. */
#define ABI2_NAME "abi2_torch_mismatch"
#define ABI2_DIMENSIONS (1u << WEFT_MESH_DP)
#define ABI2_TORCH_BUILD 2, 4, 1, 1
#include "../fixtures/abi2.h"
