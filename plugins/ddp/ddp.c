/* ddp.so: data parallelism as a layout alone (weft/plugin.h). It owns the
 * data-parallel dimension, splits each batch's rows over it and leaves every parameter, gradient
 * and optimizer state REPLICATE (the host's default, so it has no weft_place): the host derives the
 * rest, broadcasting the parameters from rank 0 at setup and averaging the replicated gradients with
 * bucketed all-reduces that start during the last micro-batch's backward (the REDUCE action it
 * lowers into the step). */
#include <stddef.h>
#include <string.h>

#include <weft/plugin.h>

#include <stdio.h>
#include <stdlib.h>

typedef struct ddp {
  double bucket_mb; /* plugin.bucket_mb: the host's gradient buckets (default 25, as PyTorch DDP's) */
} ddp;

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  weft_config_float_fn config_float = (weft_config_float_fn)host->get_proc_address("weft_config_float");
  weft_status_create_fn status_create = (weft_status_create_fn)host->get_proc_address("weft_status_create");
  double bucket_mb = 25.0;
  weft_status* status;
  ddp* self;
  if (config_float == NULL || status_create == NULL) return NULL; /* cannot happen on a 2.0 host */
  status = config_float(host->context, "bucket_mb", 25.0, &bucket_mb);
  if (status != NULL) return status;
  if (!(bucket_mb > 0.0)) {
    char message[96];
    snprintf(message, sizeof message, "plugin.bucket_mb must be > 0, got %g", bucket_mb);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  self = (ddp*)malloc(sizeof(ddp));
  if (self == NULL) return status_create(WEFT_STATUS_INTERNAL, "ddp: out of memory");
  self->bucket_mb = bucket_mb;
  *out = (weft_plugin_instance*)self;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) { free(instance); }

static weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const ddp* self = (const ddp*)instance;
  out->batch_split = WEFT_SPLIT_ROWS;
  out->reduce_bucket_bytes = (int64_t)(self->bucket_mb * 1024.0 * 1024.0);
  if (out->reduce_bucket_bytes < 1) out->reduce_bucket_bytes = 1;
  return NULL;
}

static weft_proc get_proc_address(const char* name) {
  if (name != NULL && strcmp(name, "weft_layout") == 0) return (weft_proc)layout;
  return NULL;
}

WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  static const weft_plugin table = {
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "ddp", "2.0.0",
      "data parallelism: a layout (rows split, everything replicated); the host reduces",
      1u << WEFT_MESH_DP, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
