/* An ABI 2 plugin linked against LibTorch that does not say which build (no weft_torch_build). */
#define ABI2_NAME "abi2_torch_undeclared"
#define ABI2_DIMENSIONS (1u << WEFT_MESH_DP)
#include "../fixtures/abi2.h"
