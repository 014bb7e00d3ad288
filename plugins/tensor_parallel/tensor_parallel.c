/* tensor_parallel.so: Megatron-LM tensor parallelism (Shoeybi et al. 2019) as a layout and hooks
 * (weft/plugin.h), in C. It owns the tensor-parallel dimension (every
 * rank takes the same rows) and places each weight as a slice: q/k/v and gate/up column-sliced
 * (dimension 0), o and down row-sliced (dimension 1), the embedding and the LM head sliced over the
 * vocabulary (dimension 0), norms whole. Attention heads split over the ranks; kv heads too when
 * the ranks divide them, else (the kv heads divide the ranks) N / kv consecutive ranks share one
 * kv head (slice_parts = kv), and its gradient, from each rank's own query heads, is PARTIAL. LoRA
 * and AdaLoRA factors follow their base layer: the sliced factor is a SLICE, the whole one holds
 * this rank's part of its gradient (PARTIAL). The host builds only the slices, sums the PARTIAL
 * gradients and saves whole tensors.
 *
 * Its hooks at the model's points are Megatron's f and g and the vocabulary-parallel loss: sum the
 * gradient entering a region (f, backward), sum a region's partial outputs (g, forward), and combine
 * each token's max and sums over the vocabulary slices, never gathering the logits. With
 * plugin.sequence_parallel (Korthikanti et al. 2022) the residual stream between the regions holds
 * 1/N of each sequence's tokens: the region points all-gather tokens in and reduce-scatter them out,
 * and the norms' gradients (from this rank's tokens) are PARTIAL. It composes with a data-parallel
 * plugin on a mesh tp x dp (its dimension then the rank's tp slice).
 *
 * Settings ([plugin]): sequence_parallel (bool, default false); bucket_mb (float > 0, default 25:
 * the host's buckets for the PARTIAL gradients' sums). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/plugin.h>

typedef struct tensor_parallel {
  weft_host_context* host;
  weft_status_create_fn status_create;
  weft_all_reduce_fn all_reduce;
  weft_all_gather_fn all_gather;
  weft_reduce_scatter_fn reduce_scatter;
  weft_model_config_int_fn model_int;
  int32_t rank, size;
  int32_t sequence_parallel;
  double bucket_mb;
  int64_t kv_parts; /* how many kv slices: the ranks, or the kv heads when fewer (0: not yet asked) */
} tensor_parallel;

static int ends_with(const char* s, const char* suffix) {
  const size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  weft_config_bool_fn config_bool = (weft_config_bool_fn)host->get_proc_address("weft_config_bool");
  weft_config_float_fn config_float = (weft_config_float_fn)host->get_proc_address("weft_config_float");
  weft_world_fn world = (weft_world_fn)host->get_proc_address("weft_world");
  weft_status_create_fn status_create = (weft_status_create_fn)host->get_proc_address("weft_status_create");
  tensor_parallel* self;
  int32_t sequence_parallel = 0;
  double bucket_mb = 25.0;
  char message[96];
  weft_status* status;
  if (status_create == NULL) return NULL; /* no way to say why: the host refuses a NULL instance */
  if (config_bool == NULL || config_float == NULL || world == NULL || host->get_proc_address("weft_all_gather") == NULL ||
      host->get_proc_address("weft_model_config_int") == NULL) {
    return status_create(WEFT_STATUS_UNSUPPORTED, "tensor_parallel needs a host of ABI 2.3 or later");
  }
  if ((status = config_bool(host->context, "sequence_parallel", 0, &sequence_parallel)) != NULL) return status;
  if ((status = config_float(host->context, "bucket_mb", 25.0, &bucket_mb)) != NULL) return status;
  if (!(bucket_mb > 0.0)) {
    snprintf(message, sizeof message, "plugin.bucket_mb must be > 0, got %g", bucket_mb);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  self = (tensor_parallel*)calloc(1, sizeof(tensor_parallel));
  if (self == NULL) return status_create(WEFT_STATUS_INTERNAL, "tensor_parallel: out of memory");
  self->host = host->context;
  self->status_create = status_create;
  self->all_reduce = (weft_all_reduce_fn)host->get_proc_address("weft_all_reduce");
  self->all_gather = (weft_all_gather_fn)host->get_proc_address("weft_all_gather");
  self->reduce_scatter = (weft_reduce_scatter_fn)host->get_proc_address("weft_reduce_scatter");
  self->model_int = (weft_model_config_int_fn)host->get_proc_address("weft_model_config_int");
  world(host->context, &self->rank, &self->size);
  self->sequence_parallel = sequence_parallel != 0 && self->size > 1;
  self->bucket_mb = bucket_mb;
  *out = (weft_plugin_instance*)self;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) { free(instance); }

static weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const tensor_parallel* self = (const tensor_parallel*)instance;
  out->batch_split = WEFT_SPLIT_NONE; /* every rank takes the same rows */
  out->reduce_bucket_bytes = (int64_t)(self->bucket_mb * 1024.0 * 1024.0);
  if (out->reduce_bucket_bytes < 1) out->reduce_bucket_bytes = 1;
  if (out->struct_size >= offsetof(weft_layout, sequence_parallel) + sizeof out->sequence_parallel) {
    out->sequence_parallel = self->sequence_parallel;
  }
  return NULL;
}

/* The model's sizes must split over the ranks: heads, MLP width, vocabulary; the kv heads divide
 * the ranks or are divided by them. */
static weft_status* check_model(tensor_parallel* self) {
  static const char* const keys[] = {"num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"};
  static const char* const what[] = {"attention heads", "kv heads", "intermediate size", "vocabulary"};
  int64_t value[4];
  char message[160];
  int k;
  weft_status* status;
  if (self->kv_parts > 0) return NULL;
  for (k = 0; k < 4; ++k) {
    if ((status = self->model_int(self->host, keys[k], &value[k])) != NULL) return status;
    if (k == 1 && (value[1] % self->size == 0 || self->size % value[1] == 0)) continue;
    if (value[k] % self->size != 0) {
      snprintf(message, sizeof message, "the model's %s (%lld) cannot be split over %d tensor-parallel ranks%s", what[k],
               (long long)value[k], (int)self->size, k == 1 ? " (neither divides the other)" : "");
      return self->status_create(WEFT_STATUS_BAD_CONFIG, message);
    }
  }
  self->kv_parts = value[1] % self->size == 0 ? self->size : value[1];
  return NULL;
}

static void slice(weft_placement* p, int32_t dim) {
  p->kind = WEFT_PLACE_SLICE;
  p->dim = dim;
}

/* Which layer a weight or a factor belongs to: 'c' column-sliced, 'k' kv (column, maybe shared),
 * 'r' row-sliced, 'v' vocabulary-sliced, 0 whole. */
static char layer_kind(const char* name) {
  if (strstr(name, "self_attn.q_proj.") || strstr(name, "mlp.gate_proj.") || strstr(name, "mlp.up_proj.")) return 'c';
  if (strstr(name, "self_attn.k_proj.") || strstr(name, "self_attn.v_proj.")) return 'k';
  if (strstr(name, "self_attn.o_proj.") || strstr(name, "mlp.down_proj.")) return 'r';
  if (strcmp(name, "model.embed_tokens.weight") == 0 || strcmp(name, "lm_head.weight") == 0) return 'v';
  return 0;
}

static weft_status* place(weft_plugin_instance* instance, const weft_parameter_desc* parameter,
                          weft_parameter_layout* out) {
  tensor_parallel* self = (tensor_parallel*)instance;
  const char* name = parameter->name;
  const char kind = layer_kind(name);
  /* LoRA's factors (".lora_A.weight", ".lora_B.weight") and AdaLoRA's (".lora_A" P, ".lora_E"
   * Lambda, ".lora_B" Q); anything else of a layer is its weight. */
  const int a = strstr(name, ".lora_A") != NULL, b = strstr(name, ".lora_B") != NULL, e = strstr(name, ".lora_E") != NULL;
  const int factor = a || b || e;
  int sliced_dim = -1; /* the dimension this tensor is sliced along, or -1: whole */
  int shared = 0;      /* a kv slice held by several ranks */
  weft_status* status = check_model(self);
  if (status != NULL) return status;
  if (self->size == 1) return NULL; /* everything whole */
  switch (kind) {
    case 'c': sliced_dim = !factor ? 0 : b ? 0 : -1; break;
    case 'k': sliced_dim = !factor ? 0 : b ? 0 : -1; shared = sliced_dim == 0 && self->kv_parts < self->size; break;
    case 'r': sliced_dim = !factor ? 1 : a ? 1 : -1; break;
    case 'v': sliced_dim = factor ? -1 : 0; break;
    default: break;
  }
  if (sliced_dim >= 0) {
    slice(&out->parameter, sliced_dim);
    slice(&out->gradient, sliced_dim);
    slice(&out->optimizer_state, sliced_dim);
    if (kind == 'k') out->slice_parts = (int32_t)self->kv_parts;
    if (shared) out->gradient.kind = WEFT_PLACE_PARTIAL; /* each rank's part, from its own query heads */
    return NULL;
  }
  /* Whole: a factor beside a sliced layer holds this rank's part of its gradient, and so does a norm
   * under sequence parallelism (this rank's tokens); a norm's or a classifier's otherwise is complete. */
  if ((factor && kind != 0) || (self->sequence_parallel && strstr(name, "norm.weight") != NULL)) {
    out->gradient.kind = WEFT_PLACE_PARTIAL;
  }
  return NULL;
}

/* Megatron's f (sum the gradient entering a region), g (sum a region's partial outputs) and the
 * vocabulary-parallel loss's per-token max and sums; under sequence parallelism the regions' ends
 * move tokens: the shapes say which way. */
static weft_status* combine(weft_plugin_instance* instance, const weft_hook_event* event) {
  const tensor_parallel* self = (const tensor_parallel*)instance;
  const char* point = event->point;
  if (event->struct_size < offsetof(weft_hook_event, source) + sizeof event->source || event->tensor == NULL) return NULL;
  if (event->source != NULL) {
    return event->tensor->ndim == event->source->ndim + 1 ? self->all_gather(self->host, event->tensor, event->source)
                                                          : self->reduce_scatter(self->host, event->tensor, event->source);
  }
  if (strcmp(point, "loss.max") == 0 || strcmp(point, "linear.row_absmax") == 0) {
    return event->backward ? NULL : self->all_reduce(self->host, event->tensor, WEFT_REDUCE_MAX);
  }
  if (ends_with(point, ".input")) { /* f: identity forward, sum backward */
    return event->backward ? self->all_reduce(self->host, event->tensor, WEFT_REDUCE_SUM) : NULL;
  }
  /* g: block.*.output, embedding.output, loss.sum, adalora.slice_sums: sum forward */
  return event->backward ? NULL : self->all_reduce(self->host, event->tensor, WEFT_REDUCE_SUM);
}

static const weft_hook* hooks(weft_plugin_instance* instance, int32_t* count) {
  static const weft_hook all[] = {
      {"block.attention.input", combine}, {"block.attention.output", combine}, {"block.mlp.input", combine},
      {"block.mlp.output", combine},      {"embedding.output", combine},       {"head.input", combine},
      {"loss.max", combine},              {"loss.sum", combine},               {"linear.row_absmax", combine},
      {"adalora.slice_sums", combine}};
  const tensor_parallel* self = (const tensor_parallel*)instance;
  *count = self->size > 1 ? (int32_t)(sizeof all / sizeof all[0]) : 0;
  return all;
}

static weft_proc get_proc_address(const char* name) {
  if (name == NULL) return NULL;
  if (strcmp(name, "weft_layout") == 0) return (weft_proc)layout;
  if (strcmp(name, "weft_place") == 0) return (weft_proc)place;
  if (strcmp(name, "weft_hooks") == 0) return (weft_proc)hooks;
  return NULL;
}

WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  static const weft_plugin table = {
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "tensor_parallel", "2.3.0",
      "Megatron tensor parallelism: weights placed as slices, f/g and the vocabulary-parallel loss as hooks",
      1u << WEFT_MESH_TP, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
