/*
 * weft/common.h - the basics of the plugin ABI (C99): statuses, log levels, the mesh's dimensions,
 * reduction operations and the export attribute. Included by weft/plugin.h (and by the host's
 * internal step interface).
 */
#ifndef WEFT_COMMON_H
#define WEFT_COMMON_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define WEFT_EXPORT __attribute__((visibility("default")))
#else
#define WEFT_EXPORT
#endif

/* An error: code + message; host-owned memory (created by the host, including the ones a plugin
 * returns, and released by whoever receives it). NULL means success. */
typedef struct weft_status weft_status;

typedef enum weft_status_code {
  WEFT_STATUS_OK = 0,
  WEFT_STATUS_INVALID_ARGUMENT = 1, /* a bad value from the caller */
  WEFT_STATUS_UNSUPPORTED = 2,      /* a valid request this implementation cannot serve */
  WEFT_STATUS_BAD_CONFIG = 3,       /* the plugin's configuration or the world size is unusable */
  WEFT_STATUS_COMMUNICATION = 4,    /* a collective or transfer failed */
  WEFT_STATUS_TIMEOUT = 5,          /* a collective or transfer timed out */
  WEFT_STATUS_INTERNAL = 6          /* anything else (e.g. an exception caught at the boundary) */
} weft_status_code;

typedef enum weft_log_level {
  WEFT_LOG_TRACE = 0,
  WEFT_LOG_DEBUG = 1,
  WEFT_LOG_INFO = 2,
  WEFT_LOG_WARN = 3,
  WEFT_LOG_ERROR = 4
} weft_log_level;

/* The dimensions of the device mesh a run lays its ranks on ([mesh] pp, dp, cp, tp). World rank =
 * ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i: tensor parallelism varies fastest (neighbouring
 * ranks, e.g. one machine's GPUs), pipeline stages slowest, as torchtitan's and Megatron's meshes. */
typedef enum weft_mesh_dim {
  WEFT_MESH_PP = 0, /* pipeline stages */
  WEFT_MESH_DP = 1, /* data-parallel replicas: different rows of every global batch */
  WEFT_MESH_CP = 2, /* context parallelism: different tokens of every sequence */
  WEFT_MESH_TP = 3  /* tensor parallelism: slices of the weights, the same rows and tokens */
} weft_mesh_dim;
#define WEFT_MESH_DIMS 4

/* How a collective combines the ranks' values. */
typedef enum weft_reduce_op {
  WEFT_REDUCE_SUM = 0,
  WEFT_REDUCE_PRODUCT = 1,
  WEFT_REDUCE_MIN = 2,
  WEFT_REDUCE_MAX = 3
} weft_reduce_op;

#ifdef __cplusplus
}
#endif

#endif /* WEFT_COMMON_H */
