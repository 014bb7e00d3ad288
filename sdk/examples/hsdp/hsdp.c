/* hsdp.so: hybrid sharded data parallelism (PyTorch FSDP2's HSDP, DeepSpeed's hpZ), written out of
 * tree against ABI 2 (weft/plugin.h) alone, in C99, as a layout and nothing else.
 *
 * The ranks form groups of plugin.shard_group consecutive ranks (a machine's GPUs, typically).
 * Inside a group every parameter, gradient and optimizer state is sharded as ZeRO-3 / FSDP shards
 * them (placed FLAT_SHARD: the host gathers a model stage's parameters around its uses and
 * reduce-scatters the gradients); across the groups they are replicated (the host sums the reduced
 * shards over the ranks holding the same range in the other groups). Every rank takes its own rows
 * of each batch. So the parameters' all-gathers stay inside a group, and only the gradient shards
 * cross between groups: on N ranks in groups of k, a rank holds 1/k of the model's state, against
 * 1/N for ZeRO-3 over all of them and the whole for ddp.
 *
 * plugin.shard_group must divide the number of ranks; 1 is ddp's layout with sharded bookkeeping,
 * the number of ranks is ZeRO-3's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/plugin.h>

#if WEFT_PLUGIN_ABI_MAJOR != 2 || WEFT_PLUGIN_ABI_MINOR < 1
#error "hsdp needs weft/plugin.h of ABI 2.1 or later (weft_layout.shard_group_size)"
#endif

typedef struct hsdp {
  int64_t shard_group; /* plugin.shard_group: ranks per sharding group */
  double bucket_mb;    /* plugin.bucket_mb: the host's collectives (default 25) */
} hsdp;

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  weft_status_create_fn status_create = (weft_status_create_fn)host->get_proc_address("weft_status_create");
  weft_config_int_fn config_int = (weft_config_int_fn)host->get_proc_address("weft_config_int");
  weft_config_float_fn config_float = (weft_config_float_fn)host->get_proc_address("weft_config_float");
  weft_world_fn world = (weft_world_fn)host->get_proc_address("weft_world");
  int64_t shard_group = 2;
  double bucket_mb = 25.0;
  int32_t rank = 0, size = 1;
  char message[200];
  weft_status* status;
  hsdp* self;
  if (status_create == NULL) return NULL; /* cannot happen on a 2.x host */
  if (host->abi_minor < 1 || config_int == NULL || config_float == NULL || world == NULL) {
    snprintf(message, sizeof message, "hsdp needs a host of ABI 2.1 or later (sharding groups); this one is %u.%u",
             (unsigned)host->abi_major, (unsigned)host->abi_minor);
    return status_create(WEFT_STATUS_UNSUPPORTED, message);
  }
  if ((status = config_int(host->context, "shard_group", 2, &shard_group)) != NULL) return status;
  if ((status = config_float(host->context, "bucket_mb", 25.0, &bucket_mb)) != NULL) return status;
  world(host->context, &rank, &size);
  if (shard_group < 1 || size % shard_group != 0) {
    snprintf(message, sizeof message,
             "plugin.shard_group must be >= 1 and divide the %d ranks (groups of equal size), got %lld", (int)size,
             (long long)shard_group);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  if (!(bucket_mb > 0.0)) {
    snprintf(message, sizeof message, "plugin.bucket_mb must be > 0, got %g", bucket_mb);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  self = (hsdp*)malloc(sizeof(hsdp));
  if (self == NULL) return status_create(WEFT_STATUS_INTERNAL, "hsdp: out of memory");
  self->shard_group = shard_group;
  self->bucket_mb = bucket_mb;
  *out = (weft_plugin_instance*)self;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) { free(instance); }

static weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const hsdp* self = (const hsdp*)instance;
  out->batch_split = WEFT_SPLIT_ROWS;
  out->reduce_bucket_bytes = (int64_t)(self->bucket_mb * 1024.0 * 1024.0);
  if (out->reduce_bucket_bytes < 1) out->reduce_bucket_bytes = 1;
  out->shard_group_size = (int32_t)self->shard_group;
  return NULL;
}

/* Everything sharded inside a group: the parameter (frozen ones too), its gradient, its state. */
static weft_status* place(weft_plugin_instance* instance, const weft_parameter_desc* parameter,
                          weft_parameter_layout* out) {
  (void)instance;
  out->parameter.kind = WEFT_PLACE_FLAT_SHARD;
  if (parameter->trainable) {
    out->gradient.kind = WEFT_PLACE_FLAT_SHARD;
    out->optimizer_state.kind = WEFT_PLACE_FLAT_SHARD;
  }
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
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "hsdp", "0.1.0",
      "HSDP: ZeRO-3 sharding inside groups of plugin.shard_group ranks, replicated across the groups",
      1u << WEFT_MESH_DP, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
