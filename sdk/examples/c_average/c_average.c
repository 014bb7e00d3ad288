/* c_average: a strategy plugin in plain C99 against weft/strategy.h alone.
 *
 * train_step: the one-process reference step (for each micro-batch: batch -> forward(all
 * stages) -> loss(scale 1/M) -> backward), then naive data-parallel gradient averaging: for
 * each trainable parameter, all_reduce(SUM) its gradient over the world, wait, and divide by
 * the world size in place through the gradient's DLTensor view (fp32 CPU gradients only).
 * The step's loss is averaged over the world the same way, so every rank returns the same value.
 * eval_step: forward only (no autograd history) over this rank's held-out rows, then the sum of
 * token losses and the token count are summed over the world, so every rank returns the totals.
 * Alone, every rank must hold the whole model (no plan/shard_parameter: the host's defaults).
 *
 * Composition (ABI 1.12): the table offers the data-parallel mesh dimension, so a run can name it
 * with shipped plugins, e.g. train.plugin = "tensor_parallel,/path/c_average.so" with [mesh] tp = 2,
 * dp = 2. There the host hands it the data-parallel slice as its world (group_world) and another
 * plugin drives the step; finish_step then averages the gradients and the loss over that world,
 * finish_eval sums the held-out loss and tokens, and gradient_copies says every rank of the world
 * holds the same averaged gradient. The same code serves both: it only ever talks to its world. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include <weft/strategy.h>

/* The plugin's instance (opaque to the host). */
struct weft_strategy {
  const weft_host_api* api;
  weft_host* host;
};

/* A host status with a printf-formatted message. */
static weft_status* status_printf(const weft_host_api* api, weft_status_code code,
                                  const char* format, ...) {
  char message[512];
  va_list args;
  va_start(args, format);
  vsnprintf(message, sizeof message, format, args);
  va_end(args);
  return api->status_create(code, message);
}

static weft_status* create(const weft_host_api* api, weft_host* host, weft_strategy** out) {
  weft_strategy* strategy = (weft_strategy*)malloc(sizeof *strategy);
  if (strategy == NULL) return api->status_create(WEFT_STATUS_INTERNAL, "c_average: out of memory");
  strategy->api = api;
  strategy->host = host;
  *out = strategy;
  return NULL;
}

static void destroy(weft_strategy* strategy) { free(strategy); }

/* One micro-batch: batch -> forward -> loss(scale) -> backward; adds the unscaled loss. */
static weft_status* micro_batch_step(weft_strategy* s, int32_t micro_batch, double scale,
                                     double* loss_sum) {
  const weft_host_api* api = s->api;
  weft_activation* inputs = NULL;
  weft_activation* targets = NULL;
  weft_activation* logits = NULL;
  weft_activation* loss = NULL;
  double value = 0.0;
  int64_t tokens = 0;
  weft_status* status = api->batch(s->host, micro_batch, 0, 1, &inputs, &targets);
  if (status == NULL) {
    status = api->forward(s->host, 0, api->model_num_stages(s->host), inputs, 0, &logits);
  }
  if (status == NULL) status = api->loss(s->host, logits, targets, scale, &loss, &value, &tokens);
  if (status == NULL) status = api->backward(s->host, loss, NULL);
  if (status == NULL) *loss_sum += value;
  /* Whoever creates releases: every activation we received, on success or failure. */
  api->activation_release(s->host, loss);
  api->activation_release(s->host, logits);
  api->activation_release(s->host, targets);
  api->activation_release(s->host, inputs);
  return status;
}

static int64_t element_count(const DLTensor* tensor) {
  int64_t count = 1;
  int32_t d;
  for (d = 0; d < tensor->ndim; ++d) count *= tensor->shape[d];
  return count;
}

/* Row-major without gaps (NULL strides mean exactly that). */
static int is_contiguous(const DLTensor* tensor) {
  int64_t expected = 1;
  int32_t d;
  if (tensor->strides == NULL) return 1;
  for (d = tensor->ndim - 1; d >= 0; --d) {
    if (tensor->shape[d] != 1 && tensor->strides[d] != expected) return 0;
    expected *= tensor->shape[d];
  }
  return 1;
}

/* Sums `tensor` over the world in place and waits for it. */
static weft_status* all_reduce_sum(weft_strategy* s, weft_group* world, DLTensor* tensor) {
  weft_work* work = NULL;
  weft_status* status = s->api->all_reduce(s->host, world, tensor, WEFT_REDUCE_SUM, &work);
  if (status != NULL) return status;
  status = s->api->work_wait(s->host, work);
  s->api->work_release(s->host, work);
  return status;
}

/* Every trainable gradient becomes the mean over the world's ranks. */
static weft_status* average_gradients(weft_strategy* s, weft_group* world, int32_t world_size) {
  const weft_host_api* api = s->api;
  const int64_t count = api->parameter_count(s->host);
  int64_t index;
  for (index = 0; index < count; ++index) {
    weft_parameter_info info;
    DLTensor grad;
    float* data;
    int64_t n, i;
    weft_status* status = api->parameter_info(s->host, index, &info);
    if (status != NULL) return status;
    if (!info.trainable) continue;
    status = api->parameter_grad(s->host, index, &grad);
    if (status != NULL) return status;
    if (grad.device.device_type != kDLCPU || grad.dtype.code != kDLFloat ||
        grad.dtype.bits != 32 || grad.dtype.lanes != 1 || !is_contiguous(&grad)) {
      return status_printf(api, WEFT_STATUS_UNSUPPORTED,
                           "c_average: the gradient of %s is not a contiguous fp32 CPU tensor",
                           info.name);
    }
    status = all_reduce_sum(s, world, &grad);
    if (status != NULL) return status;
    data = (float*)((char*)grad.data + grad.byte_offset);
    n = element_count(&grad);
    for (i = 0; i < n; ++i) data[i] /= (float)world_size;
  }
  return NULL;
}

/* A contiguous 1-D fp64 CPU view of values[0..*count) (so that doubles can be all-reduced in
 * place); `count` and `unit_stride` (= 1) must outlive the view. */
static DLTensor double_view(double* values, int64_t* count, int64_t* unit_stride) {
  DLTensor view;
  view.data = values;
  view.device.device_type = kDLCPU;
  view.device.device_id = 0;
  view.ndim = 1;
  view.dtype.code = kDLFloat;
  view.dtype.bits = 64;
  view.dtype.lanes = 1;
  view.shape = count;
  view.strides = unit_stride;
  view.byte_offset = 0;
  return view;
}

/* The gradients and `*loss` (this rank's value) averaged over the world. */
static weft_status* average_over_world(weft_strategy* s, double* loss) {
  weft_group* world = s->api->group_world(s->host);
  const int32_t world_size = s->api->group_size(world);
  int64_t one = 1;
  DLTensor loss_view;
  weft_status* status = average_gradients(s, world, world_size);
  if (status != NULL) return status;
  /* The loss too, so that every rank reports the global mean. */
  loss_view = double_view(loss, &one, &one);
  status = all_reduce_sum(s, world, &loss_view);
  if (status != NULL) return status;
  *loss /= world_size;
  return NULL;
}

static weft_status* train_step(weft_strategy* s, const weft_step_info* step, double* loss_out) {
  double loss_sum = 0.0;
  int32_t m;
  weft_status* status;
  if (step->micro_batches < 1) {
    return status_printf(s->api, WEFT_STATUS_INVALID_ARGUMENT,
                         "c_average: %d micro-batches", (int)step->micro_batches);
  }
  for (m = 0; m < step->micro_batches; ++m) {
    status = micro_batch_step(s, m, 1.0 / step->micro_batches, &loss_sum);
    if (status != NULL) return status;
  }
  status = average_over_world(s, &loss_sum);
  if (status == NULL) *loss_out = loss_sum / step->micro_batches;
  return status;
}

/* Composed (1.12): after the driver's step, the same averaging over this plugin's world (the
 * data-parallel slice of the mesh). */
static weft_status* finish_step(weft_strategy* s, const weft_step_info* step, double* loss_inout) {
  (void)step;
  return average_over_world(s, loss_inout);
}

/* One held-out micro-batch, forward only: adds its token-loss sum and token count. A rank may
 * get no rows of the last, partial batch. */
static weft_status* eval_micro_batch(weft_strategy* s, int32_t micro_batch, double* sums) {
  const weft_host_api* api = s->api;
  weft_activation* inputs = NULL;
  weft_activation* targets = NULL;
  weft_activation* logits = NULL;
  weft_activation* loss = NULL;
  DLTensor view;
  double value = 0.0;
  int64_t tokens = 0;
  weft_status* status = api->batch(s->host, micro_batch, 0, 1, &inputs, &targets);
  if (status == NULL) status = api->activation_view(s->host, inputs, &view);
  if (status == NULL && !(view.ndim > 0 && view.shape[0] == 0)) {
    status = api->forward(s->host, 0, api->model_num_stages(s->host), inputs,
                          WEFT_FORWARD_NO_GRAD, &logits);
    if (status == NULL) status = api->loss(s->host, logits, targets, 1.0, &loss, &value, &tokens);
    if (status == NULL) {
      sums[0] += value * (double)tokens;
      sums[1] += (double)tokens;
    }
  }
  api->activation_release(s->host, loss);
  api->activation_release(s->host, logits);
  api->activation_release(s->host, targets);
  api->activation_release(s->host, inputs);
  return status;
}

static weft_status* eval_step(weft_strategy* s, const weft_step_info* step, double* loss_sum_out,
                              int64_t* tokens_out) {
  weft_group* world = s->api->group_world(s->host);
  double sums[2] = {0.0, 0.0}; /* token-loss sum, tokens (exact in a double below 2^53) */
  int64_t two = 2;
  int64_t one = 1;
  DLTensor view;
  const int32_t micro_batches = step->micro_batches > 0 ? step->micro_batches : 1;
  int32_t m;
  weft_status* status;
  for (m = 0; m < micro_batches; ++m) {
    status = eval_micro_batch(s, m, sums);
    if (status != NULL) return status;
  }
  view = double_view(sums, &two, &one);
  status = all_reduce_sum(s, world, &view);
  if (status != NULL) return status;
  *loss_sum_out = sums[0];
  *tokens_out = (int64_t)(sums[1] + 0.5);
  return NULL;
}

/* Composed (1.12): the held-out sums over this plugin's world (its ranks saw different rows). */
static weft_status* finish_eval(weft_strategy* s, const weft_step_info* step, double* loss_sum_inout,
                                int64_t* tokens_inout) {
  double sums[2];
  int64_t two = 2;
  int64_t one = 1;
  DLTensor view;
  weft_status* status;
  (void)step;
  sums[0] = *loss_sum_inout;
  sums[1] = (double)*tokens_inout;
  view = double_view(sums, &two, &one);
  status = all_reduce_sum(s, s->api->group_world(s->host), &view);
  if (status != NULL) return status;
  *loss_sum_inout = sums[0];
  *tokens_inout = (int64_t)(sums[1] + 0.5);
  return NULL;
}

/* Composed (1.12): every rank of the world holds the same averaged gradient. */
static weft_status* gradient_copies(weft_strategy* s, int64_t parameter_index, int32_t* copies_out) {
  (void)parameter_index;
  *copies_out = s->api->group_size(s->api->group_world(s->host));
  return NULL;
}

static const weft_strategy_api table = {
    {(uint32_t)sizeof(weft_strategy_api), WEFT_ABI_VERSION_MAJOR, WEFT_ABI_VERSION_MINOR},
    0, /* min_host_minor */
    0, /* reserved */
    "c_average",
    "1.0.0",
    "one step per rank plus naive gradient averaging over the world, in plain C",
    create,
    destroy,
    NULL, /* plan: the host's default (every rank holds every stage) */
    NULL, /* shard_parameter: whole tensors */
    NULL, /* setup */
    train_step,
    eval_step,
    NULL, /* global_grad_norm_sq: gradients are replicated, the local norm is global */
    NULL, /* comm_point */
    NULL, /* flat_shard (1.3): the training state is not sharded */
    NULL, /* after_optimizer_step (1.3) */
    NULL, /* materialize_parameters (1.3) */
    NULL, /* memory_plan (1.3): the host's one-process plan holds */
    NULL, /* sequence_exchange (1.4): whole sequences */
    NULL, /* sequence_attention (1.5) */
    NULL, /* sequence_region (1.9): whole sequences between tensor-parallel regions */
    1u << WEFT_MESH_DP, /* mesh_dimensions (1.12): the data-parallel dimension of a composed run */
    0,                  /* reserved_1_12 */
    finish_step,        /* (1.12) */
    finish_eval,        /* (1.12) */
    gradient_copies     /* (1.12) */
};

WEFT_EXPORT const weft_strategy_api* weft_strategy_entry(uint16_t host_abi_major,
                                                         uint16_t host_abi_minor);
WEFT_EXPORT const weft_strategy_api* weft_strategy_entry(uint16_t host_abi_major,
                                                         uint16_t host_abi_minor) {
  (void)host_abi_minor;
  return host_abi_major == WEFT_ABI_VERSION_MAJOR ? &table : NULL;
}
