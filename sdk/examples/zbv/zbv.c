/* zbv.so: a zero-bubble pipeline with the V-shaped placement of ZB-V (Qi et al. 2024, "Pipeline
 * Parallelism with Controllable Memory"), written out of tree against ABI 2 (weft/plugin.h) alone,
 * in C99, as data: where the virtual stages live and each rank's list of compute actions. The host
 * partitions the model, adds the transfers, verifies the schedule and runs it.
 *
 * Placement: the model is cut into 2 S virtual stages for S ranks; rank p holds virtual stages p
 * (chunk 0) and 2 S - 1 - p (chunk 1), so a micro-batch goes down the ranks and back up, and rank 0
 * holds both the embedding and the head (the V). Each backward is split into B (input gradients, on
 * the critical path) and W (weight gradients, deferred into the bubbles).
 *
 * Order: a list schedule in unit time (F = B = W = one chunk's work, free transfers) that each rank
 * fills greedily, as ZB-H1's: a ready B first (the oldest micro-batch; the deeper chunk on a tie),
 * else a ready F while fewer than 2 S chunk activations are in flight on the rank and fewer than
 * 2 S W passes wait (1F1B's peak activation memory: 2 S chunks of half a stage each), the deeper
 * chunk first, else the oldest waiting W. The host's verifier checks the result and reports the
 * simulated bubble (metrics.jsonl plugin.bubble_formula).
 *
 * [plugin] settings:
 *   microbatches  int >= 1, default 4: pipeline micro-batches per host micro-batch (the rows of
 *                 each must divide by it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <weft/plugin.h>

#if WEFT_PLUGIN_ABI_MAJOR != 2 || WEFT_PLUGIN_ABI_MINOR < 2
#error "zbv needs weft/plugin.h of ABI 2.2 or later (pipeline schedules as data)"
#endif

typedef struct zbv {
  weft_status_create_fn status_create;
  int32_t stages;
  int64_t micro_batches;
  int32_t* chunk_stages;  /* [p * 2 + c]: the V */
  int32_t built_for;      /* the micro-batch count `lists` were built for (0: none) */
  weft_action* lists;     /* [stages][3 * 2 * M + 1] */
  int64_t* counts;        /* [stages] */
} zbv;

static weft_status* create(const weft_host_services* host, weft_plugin_instance** out) {
  weft_status_create_fn status_create = (weft_status_create_fn)host->get_proc_address("weft_status_create");
  weft_config_int_fn config_int = (weft_config_int_fn)host->get_proc_address("weft_config_int");
  weft_world_fn world = (weft_world_fn)host->get_proc_address("weft_world");
  int64_t micro_batches = 4;
  int32_t rank = 0, size = 1, p;
  char message[200];
  weft_status* status;
  zbv* self;
  if (status_create == NULL) return NULL; /* cannot happen on a 2.x host */
  if (host->abi_minor < 2 || config_int == NULL || world == NULL) {
    snprintf(message, sizeof message, "zbv needs a host of ABI 2.2 or later (pipeline schedules); this one is %u.%u",
             (unsigned)host->abi_major, (unsigned)host->abi_minor);
    return status_create(WEFT_STATUS_UNSUPPORTED, message);
  }
  if ((status = config_int(host->context, "microbatches", 4, &micro_batches)) != NULL) return status;
  if (micro_batches < 1 || micro_batches > 4096) {
    snprintf(message, sizeof message, "plugin.microbatches must be in [1, 4096], got %lld", (long long)micro_batches);
    return status_create(WEFT_STATUS_BAD_CONFIG, message);
  }
  world(host->context, &rank, &size);
  self = (zbv*)calloc(1, sizeof(zbv));
  if (self == NULL) return status_create(WEFT_STATUS_INTERNAL, "zbv: out of memory");
  self->status_create = status_create;
  self->stages = size;
  self->micro_batches = micro_batches;
  self->chunk_stages = (int32_t*)malloc(sizeof(int32_t) * 2 * (size_t)size);
  if (self->chunk_stages == NULL) {
    free(self);
    return status_create(WEFT_STATUS_INTERNAL, "zbv: out of memory");
  }
  for (p = 0; p < size; ++p) {
    self->chunk_stages[2 * p] = p;
    self->chunk_stages[2 * p + 1] = 2 * size - 1 - p;
  }
  *out = (weft_plugin_instance*)self;
  return NULL;
}

static void destroy(weft_plugin_instance* instance) {
  zbv* self = (zbv*)instance;
  free(self->lists);
  free(self->counts);
  free(self->chunk_stages);
  free(self);
}

static weft_status* layout(weft_plugin_instance* instance, weft_layout* out) {
  const zbv* self = (const zbv*)instance;
  out->pipeline_chunks = 2;
  out->chunk_stages = self->chunk_stages;
  out->pipeline_micro_batches = (int32_t)self->micro_batches;
  return NULL;
}

/* The list schedule of every rank for M micro-batches into self->lists; NULL or an error. */
static weft_status* build(zbv* self, int32_t M) {
  const int32_t S = self->stages, V = 2 * S, limit = 2 * S;
  const size_t per_rank = (size_t)(3 * 2 * M + 1);
  /* Per virtual stage u and micro-batch m: when its F and its B finished (0: not yet). */
  int64_t* f_done = (int64_t*)calloc((size_t)V * (size_t)M, sizeof(int64_t));
  int64_t* b_done = (int64_t*)calloc((size_t)V * (size_t)M, sizeof(int64_t));
  int32_t* next_f = (int32_t*)calloc((size_t)V, sizeof(int32_t));
  int32_t* next_b = (int32_t*)calloc((size_t)V, sizeof(int32_t));
  int32_t* in_flight = (int32_t*)calloc((size_t)S, sizeof(int32_t));
  /* Per rank, the B passes waiting for their W (oldest first), as u * M + m. */
  int32_t* waiting = (int32_t*)calloc((size_t)S * 2 * (size_t)M, sizeof(int32_t));
  int32_t* waiting_count = (int32_t*)calloc((size_t)S, sizeof(int32_t));
  weft_action* lists = (weft_action*)calloc((size_t)S * per_rank, sizeof(weft_action));
  int64_t* counts = (int64_t*)calloc((size_t)S, sizeof(int64_t));
  int64_t remaining = 3LL * V * M, t;
  const int64_t give_up = 4 * (3LL * V * M + V);
  weft_status* status = NULL;
  int32_t p, i;
  if (!f_done || !b_done || !next_f || !next_b || !in_flight || !waiting || !waiting_count || !lists || !counts) {
    status = self->status_create(WEFT_STATUS_INTERNAL, "zbv: out of memory");
    goto done;
  }
#define DONE_BY(array, u, m) ((array)[(size_t)(u) * (size_t)M + (size_t)(m)] != 0 && (array)[(size_t)(u) * (size_t)M + (size_t)(m)] <= t + 1)
  for (t = 0; remaining > 0; ++t) {
    if (t > give_up) {
      status = self->status_create(WEFT_STATUS_INTERNAL, "zbv: the list scheduler made no progress");
      goto done;
    }
    for (p = 0; p < S; ++p) {
      const int32_t chunk_u[2] = {p, V - 1 - p};
      weft_action* list = lists + (size_t)p * per_rank;
      int32_t pick = -1, pick_m = M, c;
      /* 1. A ready B: the oldest micro-batch, the deeper chunk (1) on a tie. */
      for (c = 1; c >= 0; --c) {
        const int32_t u = chunk_u[c], m = next_b[u];
        if (m < M && DONE_BY(f_done, u, m) && (u == V - 1 || DONE_BY(b_done, u + 1, m)) && m < pick_m) {
          pick = c;
          pick_m = m;
        }
      }
      if (pick >= 0) {
        const int32_t u = chunk_u[pick];
        list[counts[p]++] = (weft_action){WEFT_ACTION_BACKWARD_INPUT, pick, pick_m};
        b_done[(size_t)u * (size_t)M + (size_t)pick_m] = t + 2; /* usable from step t + 1 on */
        ++next_b[u];
        --in_flight[p];
        waiting[(size_t)p * 2 * (size_t)M + (size_t)waiting_count[p]++] = u * M + pick_m;
        --remaining;
        continue;
      }
      /* 2. A ready F within the memory bounds: the deeper chunk first. */
      if (in_flight[p] < limit && waiting_count[p] < limit) {
        for (c = 1; c >= 0 && pick < 0; --c) {
          const int32_t u = chunk_u[c], m = next_f[u];
          if (m < M && (u == 0 || DONE_BY(f_done, u - 1, m))) pick = c;
        }
      }
      if (pick >= 0) {
        const int32_t u = chunk_u[pick], m = next_f[u];
        list[counts[p]++] = (weft_action){WEFT_ACTION_FORWARD, pick, m};
        f_done[(size_t)u * (size_t)M + (size_t)m] = t + 2;
        ++next_f[u];
        ++in_flight[p];
        --remaining;
        continue;
      }
      /* 3. The oldest waiting W. */
      if (waiting_count[p] > 0) {
        int32_t* queue = waiting + (size_t)p * 2 * (size_t)M;
        const int32_t u = queue[0] / M, m = queue[0] % M;
        list[counts[p]++] = (weft_action){WEFT_ACTION_BACKWARD_WEIGHT, u == chunk_u[0] ? 0 : 1, m};
        for (i = 1; i < waiting_count[p]; ++i) queue[i - 1] = queue[i];
        --waiting_count[p];
        --remaining;
      }
    }
  }
#undef DONE_BY
  for (p = 0; p < S; ++p) lists[(size_t)p * per_rank + (size_t)counts[p]++] = (weft_action){WEFT_ACTION_OPTIMIZER_STEP, 0, -1};
  free(self->lists);
  free(self->counts);
  self->lists = lists;
  self->counts = counts;
  self->built_for = M;
  lists = NULL;
  counts = NULL;
done:
  free(f_done);
  free(b_done);
  free(next_f);
  free(next_b);
  free(in_flight);
  free(waiting);
  free(waiting_count);
  free(lists);
  free(counts);
  return status;
}

static weft_status* schedule(weft_plugin_instance* instance, const weft_schedule_request* request,
                             const weft_action** actions, int64_t* count) {
  zbv* self = (zbv*)instance;
  weft_status* status;
  char message[200];
  if (request->stages != self->stages || request->chunks != 2 || request->rank < 0 || request->rank >= request->stages ||
      request->micro_batches < 1) {
    snprintf(message, sizeof message, "zbv: asked for rank %d of %d stages x %d chunks, %d micro-batches",
             (int)request->rank, (int)request->stages, (int)request->chunks, (int)request->micro_batches);
    return self->status_create(WEFT_STATUS_INVALID_ARGUMENT, message);
  }
  if (self->built_for != request->micro_batches && (status = build(self, request->micro_batches)) != NULL) return status;
  *actions = self->lists + (size_t)request->rank * (size_t)(3 * 2 * self->built_for + 1);
  *count = self->counts[request->rank];
  return NULL;
}

static weft_proc get_proc_address(const char* name) {
  if (name == NULL) return NULL;
  if (strcmp(name, "weft_layout") == 0) return (weft_proc)layout;
  if (strcmp(name, "weft_schedule") == 0) return (weft_proc)schedule;
  return NULL;
}

WEFT_EXPORT const weft_plugin* weft_plugin_entry(uint16_t host_abi_major, uint16_t host_abi_minor) {
  static const weft_plugin table = {
      sizeof(weft_plugin), WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR, "zbv", "0.1.0",
      "ZB-V: a zero-bubble pipeline schedule on the V-shaped placement of two chunks per rank, as data",
      1u << WEFT_MESH_PP, create, destroy, get_proc_address};
  (void)host_abi_minor;
  return host_abi_major == WEFT_PLUGIN_ABI_MAJOR ? &table : NULL;
}
