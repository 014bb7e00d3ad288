/* zero.so: ZeRO's three stages (Rajbhandari et al. 2020) as a layout alone (weft/plugin.h). It
 * owns the data-parallel dimension, splits each batch's rows over it and places every trainable
 * parameter's optimizer state FLAT_SHARD (each rank's optimizer keeps and updates 1/N of it). Stage
 * 1 leaves the gradient REPLICATE (the host all-reduces it, as for ddp, and gathers each
 * updated parameter whole after the optimizer step); stage 2 places it FLAT_SHARD too (the host
 * reduce-scatters it, so a rank keeps only its range of each gradient between steps); stage 3
 * places every parameter FLAT_SHARD as well (the host gathers each model stage's parameters around
 * its forward and backward and frees them after: FSDP), in the run's compute dtype by default
 * (plugin.param_dtype = "compute": under bf16 the whole matrices and their whole gradients are bf16,
 * as FSDP's MixedPrecisionPolicy(param_dtype=bf16); "fp32" gathers fp32), released after each
 * stage's forward unless plugin.reshard_after_forward = false.
 *
 * Settings ([plugin]): stage (1, 2 or 3; default 3); bucket_mb (float > 0, default 64: the host's
 * reduction and gather buckets); param_dtype ("compute" or "fp32"); reshard_after_forward (bool,
 * default true). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/plugin.h>

typedef struct zero {
  int64_t stage;    /* plugin.stage: 1, 2 or 3 (default) */
  double bucket_mb; /* plugin.bucket_mb: the host's gradient buckets and gather groups (default 64, as zero.so's) */
  int32_t compute_dtype; /* plugin.param_dtype: "compute" (default, 1) or "fp32" (0); stage 3 */
  int32_t reshard;       /* plugin.reshard_after_forward (default true); stage 3 */
} zero;

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  weft_config_int_fn config_int = (weft_config_int_fn)host->get_proc_address("weft_config_int");
  weft_config_float_fn config_float = (weft_config_float_fn)host->get_proc_address("weft_config_float");
  weft_config_bool_fn config_bool = (weft_config_bool_fn)host->get_proc_address("weft_config_bool");
  weft_config_string_fn config_string = (weft_config_string_fn)host->get_proc_address("weft_config_string");
  weft_status_create_fn status_create = (weft_status_create_fn)host->get_proc_address("weft_status_create");
  int64_t stage = 3;
  double bucket_mb = 64.0;
  int32_t reshard = 1;
  const char* param_dtype = "compute";
  char message[128];
  weft_status* status;
  zero* self;
  if (config_int == NULL || config_float == NULL || config_bool == NULL || config_string == NULL || status_create == NULL) {
    return NULL; /* not on a 2.0 host */
  }
  if (host->abi_minor < 5) {
    return status_create(WEFT_STATUS_UNSUPPORTED, "zero needs a host of ABI 2.5 or later (weft_layout's shard options)");
  }
  if ((status = config_int(host->context, "stage", 3, &stage)) != NULL) return status;
  if ((status = config_float(host->context, "bucket_mb", 64.0, &bucket_mb)) != NULL) return status;
  if ((status = config_bool(host->context, "reshard_after_forward", 1, &reshard)) != NULL) return status;
  if ((status = config_string(host->context, "param_dtype", "compute", &param_dtype)) != NULL) return status;
  if (strcmp(param_dtype, "compute") != 0 && strcmp(param_dtype, "fp32") != 0) {
    snprintf(message, sizeof message, "plugin.param_dtype must be \"compute\" or \"fp32\", got \"%.40s\"", param_dtype);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  if (stage < 1 || stage > 3) {
    snprintf(message, sizeof message, "plugin.stage must be 1, 2 or 3 (ZeRO's stages), got %lld", (long long)stage);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  if (!(bucket_mb > 0.0)) {
    snprintf(message, sizeof message, "plugin.bucket_mb must be > 0, got %g", bucket_mb);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  self = (zero*)malloc(sizeof(zero));
  if (self == NULL) return status_create(WEFT_STATUS_INTERNAL, "zero: out of memory");
  self->stage = stage;
  self->bucket_mb = bucket_mb;
  self->compute_dtype = strcmp(param_dtype, "compute") == 0;
  self->reshard = reshard != 0;
  *out = (weft_plugin_instance*)self;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) { free(instance); }

static weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const zero* self = (const zero*)instance;
  out->batch_split = WEFT_SPLIT_ROWS;
  out->reduce_bucket_bytes = (int64_t)(self->bucket_mb * 1024.0 * 1024.0);
  if (out->reduce_bucket_bytes < 1) out->reduce_bucket_bytes = 1;
  out->shard_compute_dtype = self->stage >= 3 && self->compute_dtype;
  out->shard_keep_after_forward = self->stage >= 3 && !self->reshard;
  return NULL;
}

static weft_status* place(weft_plugin_instance* instance, const weft_parameter_desc* parameter,
                          weft_parameter_layout* out) {
  const zero* self = (const zero*)instance;
  if (self->stage >= 3) out->parameter.kind = WEFT_PLACE_FLAT_SHARD; /* every parameter, frozen ones too */
  if (!parameter->trainable) return NULL;                            /* no optimizer state, no gradient */
  out->optimizer_state.kind = WEFT_PLACE_FLAT_SHARD;
  if (self->stage >= 2) out->gradient.kind = WEFT_PLACE_FLAT_SHARD;
  return NULL;
}

static weft_proc get_proc_address(const char* name) {
  if (name == NULL) return NULL;
  if (strcmp(name, "weft_layout") == 0) return (weft_proc)layout;
  if (strcmp(name, "weft_place") == 0) return (weft_proc)place;
  return NULL;
}

WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  static const weft_plugin table = {
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "zero", "2.5.0",
      "ZeRO stages 1-3: a layout (optimizer state, gradients, parameters flat-sharded); the host does the rest",
      1u << WEFT_MESH_DP, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
