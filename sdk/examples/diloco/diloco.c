/* diloco.so: DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
 * Models", arXiv 2311.08105), written out of tree against ABI 2 (weft/plugin.h) alone, in C99.
 *
 * Each rank (a worker) trains on its own rows of every batch with the host's optimizer (AdamW, the
 * inner optimizer) and no gradient reduction: its parameters, gradients and optimizer state are
 * placed LOCAL. Every H = plugin.inner_steps steps, the workers average their parameter deltas
 * since the last outer step (the outer gradient, anchor - parameters) with one all-reduce, and the
 * outer optimizer (SGD with Nesterov momentum, as the paper's: plugin.outer_lr 0.7,
 * plugin.outer_momentum 0.9) moves the anchor; every worker continues from it. So a rank sends the
 * trainable parameters' bytes once per H steps, where ddp sends the gradients' every step.
 *
 * Two hooks do it: "train.begin" keeps the anchor (the parameters as training starts), "step.end"
 * takes the outer step. With plugin.check_replicas = true the plugin measures, after every step,
 * how far the workers' parameters are apart (two more all-reduces: metrics.jsonl
 * plugin.replica_spread, the largest max - min of one element over the ranks): 0 after each outer
 * step. One worker with outer_lr 1 and outer_momentum 0 trains as single does.
 *
 * The anchor and the outer momentum are state the host keeps for it ("weft_state_tensor"):
 * checkpoints carry them, and a resume continues the outer optimizer where it was. Its maths runs on
 * the parameters in CPU memory (fp32), so it refuses a run on a GPU. What a checkpoint does not keep:
 * the workers' own parameters and inner optimizer state between outer steps (a resume starts every
 * worker from rank 0's), so a resume of several workers is exact only in the outer state. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/plugin.h>

#if WEFT_PLUGIN_ABI_MAJOR != 2 || WEFT_PLUGIN_ABI_MINOR < 1
#error "diloco needs weft/plugin.h of ABI 2.1 or later (hooks)"
#endif

typedef struct diloco {
  weft_host_context* host;
  weft_status_create_fn status_create;
  weft_log_fn log;
  weft_parameter_count_fn parameter_count;
  weft_parameter_fn parameter;
  weft_all_reduce_fn all_reduce;
  weft_report_metric_fn report_metric;
  weft_state_tensor_fn state_tensor;
  int64_t inner_steps;   /* H */
  double outer_lr;       /* the outer SGD's learning rate */
  double outer_momentum; /* its Nesterov momentum; 0: plain SGD */
  int32_t check_replicas;
  int32_t rank, world;
  /* The trainable parameters, flattened one after another: */
  int64_t count;      /* how many */
  float** data;       /* each one's elements (the host's tensor, written in place) */
  int64_t* sizes;     /* each one's element count */
  int64_t elements;   /* their sum */
  float* anchor;      /* the parameters as of the last outer step (state the host keeps) */
  float* momentum;    /* the outer optimizer's (state the host keeps) */
  float* scratch;     /* the outer gradient; the replica check's buffers */
  int64_t outer_steps;
} diloco;

static weft_status* fail(const diloco* self, weft_status_code code, const char* message) {
  return self->status_create(code, message);
}

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  weft_status_create_fn status_create = (weft_status_create_fn)host->get_proc_address("weft_status_create");
  weft_config_int_fn config_int = (weft_config_int_fn)host->get_proc_address("weft_config_int");
  weft_config_float_fn config_float = (weft_config_float_fn)host->get_proc_address("weft_config_float");
  weft_config_bool_fn config_bool = (weft_config_bool_fn)host->get_proc_address("weft_config_bool");
  weft_world_fn world = (weft_world_fn)host->get_proc_address("weft_world");
  diloco* self;
  weft_status* status;
  char message[160];
  if (status_create == NULL) return NULL; /* cannot happen on a 2.x host */
  self = (diloco*)calloc(1, sizeof(diloco));
  if (self == NULL) return status_create(WEFT_STATUS_INTERNAL, "diloco: out of memory");
  self->host = host->context;
  self->status_create = status_create;
  self->log = (weft_log_fn)host->get_proc_address("weft_log");
  self->parameter_count = (weft_parameter_count_fn)host->get_proc_address("weft_parameter_count");
  self->parameter = (weft_parameter_fn)host->get_proc_address("weft_parameter");
  self->all_reduce = (weft_all_reduce_fn)host->get_proc_address("weft_all_reduce");
  self->report_metric = (weft_report_metric_fn)host->get_proc_address("weft_report_metric");
  self->state_tensor = (weft_state_tensor_fn)host->get_proc_address("weft_state_tensor");
  if (self->parameter_count == NULL || self->parameter == NULL || self->all_reduce == NULL ||
      self->report_metric == NULL || self->state_tensor == NULL || config_int == NULL || config_float == NULL || config_bool == NULL ||
      world == NULL) {
    snprintf(message, sizeof message,
             "diloco needs a host of ABI 2.1 or later (hooks, parameters and collectives); this one is %u.%u",
             (unsigned)host->abi_major, (unsigned)host->abi_minor);
    free(self);
    return status_create(WEFT_STATUS_UNSUPPORTED, message);
  }
  if ((status = config_int(host->context, "inner_steps", 50, &self->inner_steps)) != NULL ||
      (status = config_float(host->context, "outer_lr", 0.7, &self->outer_lr)) != NULL ||
      (status = config_float(host->context, "outer_momentum", 0.9, &self->outer_momentum)) != NULL ||
      (status = config_bool(host->context, "check_replicas", 0, &self->check_replicas)) != NULL) {
    free(self);
    return status;
  }
  if (self->inner_steps < 1) {
    snprintf(message, sizeof message, "plugin.inner_steps must be >= 1, got %lld", (long long)self->inner_steps);
  } else if (!(self->outer_lr > 0.0) || !isfinite(self->outer_lr)) {
    snprintf(message, sizeof message, "plugin.outer_lr must be > 0, got %g", self->outer_lr);
  } else if (!(self->outer_momentum >= 0.0 && self->outer_momentum < 1.0)) {
    snprintf(message, sizeof message, "plugin.outer_momentum must be in [0, 1), got %g", self->outer_momentum);
  } else {
    message[0] = '\0';
  }
  if (message[0] != '\0') {
    free(self);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  world(host->context, &self->rank, &self->world);
  *out = (weft_plugin_instance*)self;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) {
  diloco* self = (diloco*)instance;
  free(self->data);
  free(self->sizes);
  free(self->scratch);
  free(self);
}

/* Each worker takes its own rows of every batch. */
static weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  (void)instance;
  out->batch_split = WEFT_SPLIT_ROWS;
  return NULL;
}

/* A trainable parameter, its gradient and its optimizer state are each worker's own; frozen ones
 * stay replicated. */
static weft_status* place(weft_plugin_instance* instance, const weft_parameter_desc* parameter,
                          weft_parameter_layout* out) {
  (void)instance;
  if (parameter->trainable) {
    out->parameter.kind = WEFT_PLACE_LOCAL;
    out->gradient.kind = WEFT_PLACE_LOCAL;
    out->optimizer_state.kind = WEFT_PLACE_LOCAL;
  }
  return NULL;
}

static int64_t element_count(const DLTensor* t) {
  int64_t n = 1;
  int32_t d;
  for (d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

static int is_contiguous(const DLTensor* t) {
  int64_t expected = 1;
  int32_t d;
  if (t->strides == NULL) return 1;
  for (d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] != 1 && t->strides[d] != expected) return 0;
    expected *= t->shape[d];
  }
  return 1;
}

/* One fp32 vector of the plugin's state, kept by the host (checkpoints carry it). */
static weft_status* state_vector(diloco* self, const char* name, float** out, int32_t* restored) {
  int64_t shape[1];
  DLDataType fp32;
  DLTensor view;
  weft_status* status;
  shape[0] = self->elements;
  fp32.code = kDLFloat;
  fp32.bits = 32;
  fp32.lanes = 1;
  if ((status = self->state_tensor(self->host, name, fp32, 1, shape, &view, restored)) != NULL) return status;
  if (view.device.device_type != kDLCPU) return fail(self, WEFT_STATUS_UNSUPPORTED, "diloco: its state is not in CPU memory");
  *out = (float*)((char*)view.data + view.byte_offset);
  return NULL;
}

/* "train.begin": the trainable parameters, and the anchor and the momentum: a checkpoint's, or the
 * parameters and zeros. */
static weft_status* train_begin(weft_plugin_instance* instance, const weft_hook_event* event) {
  diloco* self = (diloco*)instance;
  const int64_t total = self->parameter_count(self->host);
  int64_t i, k = 0, offset = 0;
  int32_t anchor_restored = 0, momentum_restored = 0;
  weft_status* status;
  char message[320];
  self->data = (float**)calloc((size_t)(total > 0 ? total : 1), sizeof(float*));
  self->sizes = (int64_t*)calloc((size_t)(total > 0 ? total : 1), sizeof(int64_t));
  if (self->data == NULL || self->sizes == NULL) return fail(self, WEFT_STATUS_INTERNAL, "diloco: out of memory");
  for (i = 0; i < total; ++i) {
    weft_parameter_desc desc;
    DLTensor data;
    weft_status* status;
    memset(&desc, 0, sizeof desc);
    desc.struct_size = sizeof desc;
    if ((status = self->parameter(self->host, i, &desc, &data)) != NULL) return status;
    if (!desc.trainable) continue;
    if (data.device.device_type != kDLCPU || data.dtype.code != kDLFloat || data.dtype.bits != 32 ||
        data.dtype.lanes != 1 || !is_contiguous(&data)) {
      snprintf(message, sizeof message,
               "diloco computes its outer step on fp32 parameters in CPU memory; %s is not (run it on the CPU)",
               desc.name);
      return fail(self, WEFT_STATUS_UNSUPPORTED, message);
    }
    self->data[k] = (float*)((char*)data.data + data.byte_offset);
    self->sizes[k] = element_count(&data);
    self->elements += self->sizes[k];
    ++k;
  }
  self->count = k;
  if (self->elements == 0) return fail(self, WEFT_STATUS_BAD_CONFIG, "diloco: the model has no trainable parameter");
  if ((status = state_vector(self, "anchor", &self->anchor, &anchor_restored)) != NULL ||
      (status = state_vector(self, "momentum", &self->momentum, &momentum_restored)) != NULL) {
    return status;
  }
  self->scratch = (float*)malloc((size_t)self->elements * 2 * sizeof(float));
  if (self->scratch == NULL) return fail(self, WEFT_STATUS_INTERNAL, "diloco: out of memory for its buffers");
  if (!anchor_restored) {
    for (k = 0; k < self->count; ++k) {
      memcpy(self->anchor + offset, self->data[k], (size_t)self->sizes[k] * sizeof(float));
      offset += self->sizes[k];
    }
  }
  if (self->log != NULL) {
    snprintf(message, sizeof message,
             "diloco: %d workers, an outer step every %lld steps over %lld trainable elements (outer lr %g, "
             "Nesterov momentum %g); from step %lld with %s",
             (int)self->world, (long long)self->inner_steps, (long long)self->elements, self->outer_lr,
             self->outer_momentum, (long long)event->step,
             anchor_restored && momentum_restored ? "the checkpoint's anchor and momentum" : "a new anchor and momentum");
    self->log(self->host, WEFT_LOG_INFO, message);
  }
  return NULL;
}

static DLTensor flat_view(float* data, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

/* The outer step: g = mean over workers of (anchor - parameters); m = mu m + g; the anchor moves by
 * -lr (g + mu m) (Nesterov, as torch.optim.SGD(nesterov=True)); every worker continues from it. */
static weft_status* outer_step(diloco* self) {
  const float lr = (float)self->outer_lr, mu = (float)self->outer_momentum, inverse = 1.0f / (float)self->world;
  float* g = self->scratch;
  int64_t shape[1], j, k, offset = 0;
  DLTensor view;
  weft_status* status;
  double norm_sq = 0.0;
  for (k = 0; k < self->count; ++k) {
    const float* p = self->data[k];
    for (j = 0; j < self->sizes[k]; ++j) g[offset + j] = self->anchor[offset + j] - p[j];
    offset += self->sizes[k];
  }
  shape[0] = self->elements;
  view = flat_view(g, shape);
  if ((status = self->all_reduce(self->host, &view, WEFT_REDUCE_SUM)) != NULL) return status;
  for (j = 0; j < self->elements; ++j) {
    float update = g[j] * inverse;
    norm_sq += (double)update * update;
    if (mu > 0.0f) {
      self->momentum[j] = mu * self->momentum[j] + update;
      update += mu * self->momentum[j];
    }
    self->anchor[j] -= lr * update;
  }
  offset = 0;
  for (k = 0; k < self->count; ++k) {
    memcpy(self->data[k], self->anchor + offset, (size_t)self->sizes[k] * sizeof(float));
    offset += self->sizes[k];
  }
  ++self->outer_steps;
  self->report_metric(self->host, "outer_gradient_norm", sqrt(norm_sq));
  return NULL;
}

/* The largest spread of one element over the workers: max and -min by two all-reduces of MAX. */
static weft_status* replica_spread(diloco* self, double* spread) {
  float* high = self->scratch;
  float* low = self->scratch + self->elements;
  int64_t shape[1], j, k, offset = 0;
  DLTensor view;
  weft_status* status;
  for (k = 0; k < self->count; ++k) {
    for (j = 0; j < self->sizes[k]; ++j) {
      high[offset + j] = self->data[k][j];
      low[offset + j] = -self->data[k][j];
    }
    offset += self->sizes[k];
  }
  shape[0] = 2 * self->elements;
  view = flat_view(self->scratch, shape);
  if ((status = self->all_reduce(self->host, &view, WEFT_REDUCE_MAX)) != NULL) return status;
  *spread = 0.0;
  for (j = 0; j < self->elements; ++j) {
    const double d = (double)high[j] + (double)low[j];
    if (d > *spread) *spread = d;
  }
  return NULL;
}

/* "step.end": the outer step every H steps. */
static weft_status* step_end(weft_plugin_instance* instance, const weft_hook_event* event) {
  diloco* self = (diloco*)instance;
  const int outer = event->step % self->inner_steps == 0;
  weft_status* status;
  if (self->anchor == NULL) return fail(self, WEFT_STATUS_INTERNAL, "diloco: step.end before train.begin");
  if (outer && (status = outer_step(self)) != NULL) return status;
  self->report_metric(self->host, "outer_step", outer ? 1.0 : 0.0);
  if (self->check_replicas) {
    double spread = 0.0;
    if ((status = replica_spread(self, &spread)) != NULL) return status;
    self->report_metric(self->host, "replica_spread", spread);
  }
  return NULL;
}

static const weft_hook* hooks(weft_plugin_instance* instance, int32_t* count) {
  static const weft_hook list[] = {{"train.begin", train_begin}, {"step.end", step_end}};
  (void)instance;
  *count = 2;
  return list;
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
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "diloco", "0.1.0",
      "DiLoCo: local AdamW steps per worker, an outer Nesterov step on the averaged delta every H steps",
      1u << WEFT_MESH_DP, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
