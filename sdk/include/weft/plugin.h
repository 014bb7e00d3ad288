/*
 * weft/plugin.h - the strategy plugin ABI, version 2 (C99).
 *
 * STATUS: 2.5 (design: sdk/DESIGN.md; history: sdk/CHANGELOG.md). The host loads 2.x plugins only
 * (a library exporting ABI 1's weft_strategy_entry is refused in one line); single.so, ddp.so,
 * zero.so, gpipe.so, pipedream.so, tensor_parallel.so, context_parallel.so and the out-of-tree
 * examples sdk/examples/diloco, sdk/examples/hsdp and sdk/examples/zbv are written against it. A plugin owns one mesh dimension (or none, alone on one
 * process):
 * - Data parallelism: it places every parameter, gradient and optimizer state REPLICATE or LOCAL
 *   (all three LOCAL together), or the optimizer state FLAT_SHARD (ZeRO's stage 1), its gradient
 *   with it (stage 2) and the parameter too (stage 3); it may register hooks at "train.begin" and
 *   "step.end", where it reads and writes the parameters, runs collectives and keeps state that
 *   checkpoints carry, through the host's services.
 * - The pipeline: it gives the placement of virtual stages on ranks and each rank's schedule as
 *   data (weft_layout's pipeline fields, "weft_schedule"); the host partitions the model, adds the
 *   transfers, verifies and runs the schedule, sums a tied embedding's two copies' gradients and
 *   evaluates with a forward-only schedule; or (2.4) it asks for the host's asynchronous 1F1B
 *   (weft_layout.pipeline_asynchronous), whose schedule spans steps.
 * - Tensor parallelism (2.3): it places weights as SLICEs (the host builds only them and saves
 *   whole tensors), gradients PARTIAL where each rank holds a part of the sum (the host sums them),
 *   may ask for Megatron's sequence parallelism, and hooks the model's points (Megatron's f and g,
 *   the vocabulary-parallel loss), where it runs collectives over its dimension.
 * - Context parallelism (2.4): its layout splits every sequence's tokens over the ranks (contiguous
 *   or balanced chunks; every rank takes the same rows), and it hooks the attention: Ulysses moves
 *   q, k, v and the output with all-to-alls ("attention.exchange"), ring attention computes the
 *   attention core itself ("attention.core", with LibTorch and point-to-point transfers). Its
 *   REPLICATE gradients are averaged over the dimension, as data parallelism's.
 * Plugins of different dimensions compose on a device mesh pp x dp x cp x tp (train.plugin =
 * "ddp,gpipe,tensor_parallel", [mesh] pp, dp, cp, tp; rank = ((pp coordinate x dp + dp
 * coordinate) x cp + cp coordinate) x tp + tp coordinate), each plugin's "weft_world" its own mesh
 * slice: the pipeline plugin's schedule runs over pp (without one, the host's one step); the
 * data-parallel plugin's layout over dp (a reduction per chunk after its last backward; for FLAT_SHARD
 * parameters a gather before its first compute and a release after the reduction), its hooks refused
 * there; the tensor-parallel plugin's slices and hooks inside each stage (2.3; a slice FLAT_SHARD over
 * dp is FSDP x TP); the context-parallel plugin's sequence split and attention hook inside each stage
 * (2.4), where the data-parallel plugin's dimension and placements span dp x cp (the ranks that split
 * the same rows' sequences hold replicas of the parameters). Any two or more of them compose. A plugin may compute with LibTorch if it says which it was built against
 * ("weft_torch_build"). Other placements, points and compositions are the next landings; this host
 * refuses a plugin that asks for them, in one line, at load, at create or (a placement, a point)
 * before the first step.
 *
 * The host owns the step. Per rank, one training step is a list of actions the host executes
 * (weft_action_kind): the forward and backward of each micro-batch, the reduction of gradients,
 * the optimizer step. A plugin does not write that loop: it gives a layout (how a batch splits over
 * the mesh dimension it owns, where each parameter, its gradient and its optimizer state live on
 * it), and the host derives the actions from it. Data parallelism is the layout "rows split,
 * every parameter replicated": the host averages the replicated gradients with bucketed
 * all-reduces that start during the last micro-batch's backward, as parameters' gradients become
 * final, and waits for them before the optimizer step.
 *
 * A plugin is a shared library exporting one C function, weft_plugin_entry
 * (WEFT_PLUGIN_ENTRY_SYMBOL), which returns its core table (static storage). Everything else is
 * found by name, as ggml-backend finds a backend's optional functions: the plugin's functions
 * through its table's get_proc_address, the host's services through weft_host_services'. A name
 * a side does not know gives NULL; a new function is a new name, not a new version.
 *
 * Conventions: errors are weft_status* (weft/common.h; NULL is success), created by
 * the host's "weft_status_create" and owned by the receiver; no C++ exception, longjmp or signal
 * crosses the boundary; strings passed in are borrowed for the call; structs that start with
 * struct_size are written by the side that owns them, and a reader uses only the fields within
 * struct_size (fields are only ever appended). The host calls an instance from one thread at a
 * time. Libraries are never unloaded while the process runs.
 */
#ifndef WEFT_PLUGIN_H
#define WEFT_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#include <weft/common.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Major: incompatible changes; must match. Minor: appended names and fields. */
#define WEFT_PLUGIN_ABI_MAJOR 2
#define WEFT_PLUGIN_ABI_MINOR 5
#define WEFT_PLUGIN_ENTRY_SYMBOL "weft_plugin_entry"

typedef struct weft_plugin_instance weft_plugin_instance; /* the plugin's; opaque to the host */
typedef struct weft_host_context weft_host_context;       /* the host's side of one instance */

/* What get_proc_address returns: cast it to the function's own type (below, per name). */
typedef void (*weft_proc)(void);

/* ------------------------------------------------------------------------------------------
 * The host: handed to create, valid for the instance's life.
 * ---------------------------------------------------------------------------------------- */
typedef struct weft_host_services {
  uint32_t struct_size;
  uint16_t abi_major, abi_minor; /* the host's (2, its minor) */
  weft_host_context* context;    /* the first argument of the services that take one */
  weft_proc (*get_proc_address)(const char* name);
} weft_host_services;

/* The host's services, by name (since 2.0 unless marked):
 *   "weft_status_create"  weft_status* (*)(weft_status_code code, const char* message)
 *   "weft_log"            void (*)(weft_host_context*, weft_log_level level, const char* message)
 *   "weft_world"          void (*)(weft_host_context*, int32_t* rank, int32_t* size)
 *       this rank's place along the plugin's dimension: the world alone, its mesh slice composed
 *   "weft_config_int"     weft_status* (*)(weft_host_context*, const char* key, int64_t fallback, int64_t* out)
 *   "weft_config_float"   weft_status* (*)(weft_host_context*, const char* key, double fallback, double* out)
 *   "weft_config_bool"    weft_status* (*)(weft_host_context*, const char* key, int32_t fallback, int32_t* out)
 *   "weft_config_string"  weft_status* (*)(weft_host_context*, const char* key, const char* fallback, const char** out)
 *   "weft_config_int_list" weft_status* (*)(weft_host_context*, const char* key, int64_t* out, int32_t capacity,
 *                                           int32_t* count)   (since 2.2)
 *       an array of integers: `*count` of them (0 for a missing key), the first `capacity` written to `out`
 * The config services read the run's [plugin] table (a key missing: the fallback; a key of another
 * type: an error naming it); a key no plugin reads is refused before the run starts. A string
 * stays valid for the instance's life.
 *
 * Since 2.1, for hooks (valid once the model is built: from "weft_place" on):
 *   "weft_parameter_count"  int64_t (*)(weft_host_context*)
 *   "weft_parameter"        weft_status* (*)(weft_host_context*, int64_t index, weft_parameter_desc* desc, DLTensor* data)
 *       parameter `index` (0-based, the model's order: embedding first, head last): its description
 *       (the caller sets desc->struct_size; the host writes the fields it covers) and a view of this
 *       rank's tensor (contiguous, on the rank's device; read and written in place; valid for the
 *       instance's life; shape and strides point into host memory).
 *   "weft_all_reduce"       weft_status* (*)(weft_host_context*, DLTensor* tensor, weft_reduce_op op)
 *       combines `tensor` in place over the ranks of the plugin's dimension and returns when done;
 *       every rank calls it alike. fp32 or fp64 (since 2.3 also bf16 and fp16), contiguous, on the
 *       rank's device. Its bytes count in the step's communication (metrics.jsonl comm_bytes).
 *   "weft_report_metric"    void (*)(weft_host_context*, const char* name, double value)
 *       a value of the current step: metrics.jsonl's "plugin.<name>" (rank 0's).
 *   "weft_state_tensor"     weft_status* (*)(weft_host_context*, const char* name, DLDataType dtype, int32_t ndim,
 *                                            const int64_t* shape, DLTensor* out, int32_t* restored)
 *       a tensor of the plugin's training state that the host keeps for it (contiguous, on the
 *       rank's device; fp32, fp64, int32 or int64; one per name; valid for the instance's life):
 *       checkpoints carry it (rank 0's: it must be the same on every rank) and a resume gives it
 *       back. Made from "train.begin" on; `*restored` is 1 when it holds a checkpoint's values, 0
 *       when it is new (zeros: a fresh run, or a checkpoint another plugin wrote)
 *
 * Since 2.3, for a plugin that owns the tensor-parallel dimension (its hooks at the model's points):
 *   "weft_all_gather"       weft_status* (*)(weft_host_context*, DLTensor* output, const DLTensor* input)
 *       output [size, ...input's shape]: slice r from rank r of the plugin's dimension
 *   "weft_reduce_scatter"   weft_status* (*)(weft_host_context*, DLTensor* output, const DLTensor* input)
 *       input [size, ...output's shape]: output = the sum over the ranks of their slice `rank`
 *       Both return when done; contiguous tensors of one dtype (fp32, fp64, bf16, fp16), on the
 *       rank's device; every rank calls them alike; their bytes count in comm_bytes.
 *   "weft_model_config_int" weft_status* (*)(weft_host_context*, const char* key, int64_t* out)
 *       the model's configuration by its config.json name: "hidden_size", "num_attention_heads",
 *       "num_key_value_heads", "intermediate_size", "vocab_size", "num_hidden_layers",
 *       "tie_word_embeddings" (0 or 1); another key is an error naming it. From "weft_place" on.
 *
 * Since 2.4, collectives and transfers over the plugin's dimension (context parallelism's):
 *   "weft_all_to_all"       weft_status* (*)(weft_host_context*, DLTensor* output, const DLTensor* input)
 *       input and output [size, ...] of one shape and dtype: chunk j of input goes to rank j, chunk
 *       i of output comes from rank i. Returns when done; counts in comm_bytes.
 *   "weft_send"             weft_status* (*)(weft_host_context*, const DLTensor* tensor, int32_t peer,
 *                                            int32_t tag, weft_transfer** out)
 *   "weft_recv"             weft_status* (*)(weft_host_context*, DLTensor* tensor, int32_t peer,
 *                                            int32_t tag, weft_transfer** out)
 *       start a transfer to or from rank `peer` of the dimension and return at once; `*out` is the
 *       transfer in flight, which the plugin passes to "weft_transfer_wait" exactly once, and the
 *       tensor stays untouched until then. NCCL pairs two ranks' transfers in the order they were
 *       started (Gloo by tag as well), so start them in the same order at both ends, and between two
 *       ranks that send to each other, not both with the send. Contiguous, on the rank's device.
 *   "weft_transfer_wait"    weft_status* (*)(weft_host_context*, weft_transfer* transfer)
 *       waits for it to complete and frees it (NULL: nothing to wait for). */
typedef weft_status* (*weft_status_create_fn)(weft_status_code code, const char* message);
typedef void (*weft_log_fn)(weft_host_context* host, weft_log_level level, const char* message);
typedef void (*weft_world_fn)(weft_host_context* host, int32_t* rank, int32_t* size);
typedef weft_status* (*weft_config_int_fn)(weft_host_context* host, const char* key, int64_t fallback, int64_t* out);
typedef weft_status* (*weft_config_float_fn)(weft_host_context* host, const char* key, double fallback, double* out);
typedef weft_status* (*weft_config_bool_fn)(weft_host_context* host, const char* key, int32_t fallback, int32_t* out);
typedef weft_status* (*weft_config_string_fn)(weft_host_context* host, const char* key, const char* fallback,
                                              const char** out);
typedef weft_status* (*weft_config_int_list_fn)(weft_host_context* host, const char* key, int64_t* out, int32_t capacity,
                                                int32_t* count);
typedef struct weft_parameter_desc weft_parameter_desc;
typedef int64_t (*weft_parameter_count_fn)(weft_host_context* host);
typedef weft_status* (*weft_parameter_fn)(weft_host_context* host, int64_t index, weft_parameter_desc* desc,
                                          DLTensor* data);
typedef weft_status* (*weft_all_reduce_fn)(weft_host_context* host, DLTensor* tensor, weft_reduce_op op);
typedef void (*weft_report_metric_fn)(weft_host_context* host, const char* name, double value);
typedef weft_status* (*weft_state_tensor_fn)(weft_host_context* host, const char* name, DLDataType dtype, int32_t ndim,
                                             const int64_t* shape, DLTensor* out, int32_t* restored);
typedef weft_status* (*weft_all_gather_fn)(weft_host_context* host, DLTensor* output, const DLTensor* input);
typedef weft_status* (*weft_reduce_scatter_fn)(weft_host_context* host, DLTensor* output, const DLTensor* input);
typedef weft_status* (*weft_model_config_int_fn)(weft_host_context* host, const char* key, int64_t* out);
typedef struct weft_transfer weft_transfer; /* a point-to-point transfer in flight (the host's) */
typedef weft_status* (*weft_all_to_all_fn)(weft_host_context* host, DLTensor* output, const DLTensor* input);
typedef weft_status* (*weft_send_fn)(weft_host_context* host, const DLTensor* tensor, int32_t peer, int32_t tag,
                                     weft_transfer** out);
typedef weft_status* (*weft_recv_fn)(weft_host_context* host, DLTensor* tensor, int32_t peer, int32_t tag,
                                     weft_transfer** out);
typedef weft_status* (*weft_transfer_wait_fn)(weft_host_context* host, weft_transfer* transfer);

/* ------------------------------------------------------------------------------------------
 * The plugin: its core table, returned by weft_plugin_entry.
 * ---------------------------------------------------------------------------------------- */
typedef struct weft_plugin {
  uint32_t struct_size;          /* sizeof(weft_plugin) as the plugin compiled it */
  uint16_t abi_major, abi_minor; /* WEFT_PLUGIN_ABI_MAJOR, WEFT_PLUGIN_ABI_MINOR */
  const char* name;              /* "ddp": non-empty */
  const char* version;           /* the plugin's own, "2.0.0": non-empty */
  const char* description;       /* one line, or NULL */
  uint32_t mesh_dimensions;      /* the weft_mesh_dim it can own, as bits (1u << WEFT_MESH_DP); 0: none */
  /* Validates the [plugin] settings and the world; creates the instance. Required. */
  weft_status* (*create)(const weft_host_services* host, weft_plugin_instance** out);
  void (*destroy)(weft_plugin_instance* instance); /* required */
  /* The plugin's other functions by name (below); NULL for a name it does not provide. Required. */
  weft_proc (*get_proc_address)(const char* name);
} weft_plugin;

/* The exported entry: the table for a host of this major, or NULL to refuse it. */
typedef const weft_plugin* (*weft_plugin_entry_fn)(uint16_t host_abi_major, uint16_t host_abi_minor);

/* ------------------------------------------------------------------------------------------
 * The layout (plugin functions "weft_layout" and "weft_place"; both optional)
 * ---------------------------------------------------------------------------------------- */

/* How a batch splits over the dimension the plugin owns. */
typedef enum weft_batch_split {
  WEFT_SPLIT_NONE = 0, /* every rank of the dimension takes the whole batch */
  WEFT_SPLIT_ROWS = 1, /* each takes a contiguous share of the rows (data parallelism) */
  /* Since 2.4, for a plugin that owns the context-parallel dimension (WEFT_MESH_CP): every rank
   * takes the same rows and a share of each sequence's tokens, at their global positions (RoPE,
   * the causal mask): */
  WEFT_SPLIT_SEQUENCE = 2,         /* rank r of N: tokens [r L / N, (r + 1) L / N) */
  WEFT_SPLIT_SEQUENCE_BALANCED = 3 /* 2N equal chunks, rank r: chunk r, then chunk 2N - 1 - r (every
                                      rank as much causal attention work; needs "attention.core") */
} weft_batch_split;

typedef struct weft_layout {
  uint32_t struct_size; /* set by the host to sizeof its struct */
  int32_t dimension;    /* the weft_mesh_dim the plugin owns in this run, or -1 for none (host-set) */
  int32_t batch_split;  /* weft_batch_split; the host's default: WEFT_SPLIT_NONE */
  int64_t reduce_bucket_bytes; /* the most bytes one gradient all-reduce carries; the host's
                                  default: 25 MiB (PyTorch DDP's bucket_cap_mb) */
  /* Since 2.1: FLAT_SHARD placements shard over groups of this many consecutive ranks of the
   * dimension and are replicated across the groups (HSDP: FSDP inside each group, data parallel
   * between them); it must divide the dimension's size. The host's default: 0, the whole
   * dimension. */
  int32_t shard_group_size;
  /* Since 2.2, for a plugin that owns the pipeline dimension (WEFT_MESH_PP): the model is cut into
   * stages x pipeline_chunks virtual stages (contiguous runs of the model's stages, balanced by
   * parameter count over the ranks that hold them); each rank of the dimension holds
   * pipeline_chunks of them. chunk_stages says
   * which: chunk c of rank p is virtual stage chunk_stages[p * pipeline_chunks + c] (a permutation
   * of [0, stages x pipeline_chunks); storage the plugin keeps for the instance's life), or with
   * NULL, c x stages + p (Megatron's interleaving). Each host micro-batch splits into
   * pipeline_micro_batches micro-batches of equal rows. The host's defaults: 1, NULL, 1. */
  int32_t pipeline_chunks;
  const int32_t* chunk_stages;
  int32_t pipeline_micro_batches;
  /* Since 2.2 too: the decoder layers of each virtual stage, in virtual-stage order
   * (pipeline_balance_count = stages x pipeline_chunks entries, each >= 1, summing to the model's
   * layers; the embedding joins the first, the head the last), in place of the host's balance;
   * NULL, 0: the host's. Plugin storage, for the instance's life. */
  const int64_t* pipeline_balance;
  int32_t pipeline_balance_count;
  /* Since 2.2 too: the ranks of one pipeline; it must divide the dimension's size, and the
   * pipeline is replicated over the rest (rank = replica x pipeline_stages + stage; each replica
   * takes its share of every batch's rows, and the host averages the replicas' gradients). The
   * host's default: 0, every rank of the dimension in one pipeline. */
  int32_t pipeline_stages;
  /* Since 2.3, for a plugin that owns the tensor-parallel dimension (WEFT_MESH_TP): 1 for Megatron's
   * sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel regions (the
   * embedding's output, the residual stream, the norms) rank r of N holds tokens [r L / N,
   * (r + 1) L / N) of every sequence, and the region points ("block.attention.input", ...) move
   * tokens instead of combining sums: an all-gather in, a reduce-scatter out (weft_hook_event's
   * `source`). The host's default: 0. */
  int32_t sequence_parallel;
  /* Since 2.3, for a plugin that owns the pipeline dimension: how the host balances the virtual
   * stages where pipeline_balance is NULL (weft_partition). The host's default: by parameters. */
  int32_t pipeline_partition;
  /* Since 2.4, for a plugin that owns the pipeline dimension: 1 for PipeDream's asynchronous 1F1B
   * (Narayanan et al. 2019), whose schedule spans steps and so is the host's: no flush, every step one
   * minibatch (train.grad_accum_steps = 1; pipeline_micro_batches then only splits an evaluation's
   * forward), stage p forwarding minibatch t and back-propagating minibatch t - (S - 1 - p) in step t,
   * each with the weights its forward used (weight stashing: the host keeps an in-flight minibatch's
   * weights and input and recomputes the stage's forward for its backward); one chunk per rank,
   * replicated placements only, no tensor- or context-parallel plugin beside it. Not equal to the
   * one-process run by design (the gradients are of stale weights). The host's default: 0. */
  int32_t pipeline_asynchronous;
  /* Since 2.5, for a plugin that places parameters FLAT_SHARD (FSDP2's fully_shard options), both
   * 0 or 1. shard_compute_dtype = 1: the host gathers each matrix (two or more dimensions) whole in
   * the run's compute dtype (bf16 / fp16 under train.precision) and its whole gradient comes in it,
   * as FSDP's MixedPrecisionPolicy(param_dtype=bf16); the ranges, the gradient ranges and the
   * optimizer's state stay fp32, and the collectives move fp32. The host's default 0: whole
   * parameters in fp32, as the ranges. shard_keep_after_forward = 1: in the host's one-chunk step a
   * model stage's parameters stay whole from its forward to its backward (reshard_after_forward =
   * False: one gather per micro-batch instead of two, every stage whole at the peak); the host's
   * default 0 releases them after the forward and gathers them again for the backward. In a
   * pipeline a chunk's parameters stay whole from its first compute to its reduction either way. */
  int32_t shard_compute_dtype;
  int32_t shard_keep_after_forward;
} weft_layout;

/* weft_layout.pipeline_partition */
typedef enum weft_partition {
  WEFT_PARTITION_PARAMETERS = 0, /* each virtual stage about the same parameter count */
  WEFT_PARTITION_TIME = 1        /* about the same forward + backward time: the host times each model
                                    stage on every rank before the model is built and averages */
} weft_partition;

/* Where a tensor lives on the plugin's dimension. */
typedef enum weft_placement_kind {
  WEFT_PLACE_REPLICATE = 0, /* whole and equal on every rank of the dimension; a gradient placed
                               so is averaged over them where the batch splits over the dimension
                               (where every rank takes the whole batch, it is equal already) */
  WEFT_PLACE_LOCAL = 1,     /* whole and each rank's own: a gradient left as the rank computed it
                               (no reduction), a parameter and an optimizer state that may differ
                               between ranks (DiLoCo's inner steps). Since 2.1, for a parameter, its
                               gradient and its optimizer state together; the replicas start equal
                               (rank 0's values), and making them equal again is the plugin's (a hook).
                               Checkpoints keep every rank's own values and optimizer state of it, and
                               a resume on as many ranks gives each rank its own (else rank 0's) */
  WEFT_PLACE_SLICE = 2,     /* since 2.3, on the tensor-parallel dimension: a slice along the tensor's
                               `dim` (Megatron's column and row splits): rank r of N holds rows (or
                               columns) [i n / P, (i + 1) n / P) of the full tensor, i = r P / N, P =
                               weft_parameter_layout.slice_parts (0: N; P divides N, and N / P
                               consecutive ranks hold the same slice). The host builds only that
                               slice; a checkpoint holds the whole tensor. The gradient and the
                               optimizer state of a SLICE parameter are this slice's (placed SLICE, or
                               the gradient PARTIAL) */
  WEFT_PLACE_FLAT_SHARD = 3, /* a flat range (ZeRO / FSDP): rank r of N holds elements [r*c, (r+1)*c) of
                               the flattened tensor, c = ceil(n / N) (the last range shorter or
                               empty). For the optimizer state: the host's optimizer updates this
                               rank's range from the averaged gradient, then gathers the parameter
                               whole. For the gradient too (with the optimizer state): it is
                               reduce-scattered, a rank keeps only its range between steps. For the
                               parameter too (a trainable one with both): the range is the master
                               copy; the host runs the model stage by stage, all-gathering each
                               stage's parameters (fp32, or since 2.5 in the compute dtype:
                               weft_layout.shard_compute_dtype) for its forward and its backward and
                               freeing them after (a tied embedding stays whole through a step) */
  WEFT_PLACE_PARTIAL = 4    /* since 2.3, a gradient on the tensor-parallel dimension: each rank holds a
                               part of the sum (a whole LoRA factor beside a sliced layer, a norm under
                               sequence parallelism, a kv slice shared by several ranks' query heads):
                               the host sums it over the ranks that hold the same parameter (all of the
                               dimension for a REPLICATE one, the N / P sharing a SLICE) */
} weft_placement_kind;

typedef struct weft_placement {
  int32_t kind; /* weft_placement_kind */
  int32_t dim;  /* WEFT_PLACE_SLICE's dimension */
} weft_placement;

typedef struct weft_parameter_layout {
  /* between uses, after the gradient reduction, and of the optimizer's state */
  weft_placement parameter, gradient, optimizer_state;
  /* Since 2.3: a SLICE parameter's number of distinct slices over the dimension (see
   * WEFT_PLACE_SLICE); the host's default 0: one per rank. Written by plugins that place SLICE,
   * which a host of 2.3 or later asks alone (the struct has no size of its own). */
  int32_t slice_parts;
} weft_parameter_layout;

struct weft_parameter_desc {
  uint32_t struct_size; /* the size of the struct its writer fills (see "weft_parameter") */
  const char* name;     /* "model.layers.0.self_attn.q_proj.weight", "...lora_A.weight" */
  int32_t ndim;
  const int64_t* shape; /* ndim sizes: the full tensor's (a SLICE placement's rank holds less) */
  int32_t trainable;    /* 0 for a frozen parameter (LoRA's base) */
};

/* "weft_layout": the batch split (`out` comes filled with the host's defaults). */
typedef weft_status* (*weft_layout_fn)(weft_plugin_instance* instance, weft_layout* out);
/* "weft_place": called once per parameter after the model is built (`out` comes REPLICATE,
 * REPLICATE, REPLICATE). Without the function every parameter keeps that. The host may also ask it
 * before the model is built, for the memory plan, with each parameter's full shape (LoRA adapters
 * aside) and trainable = 1: the answer must follow from the description alone. */
typedef weft_status* (*weft_place_fn)(weft_plugin_instance* instance, const weft_parameter_desc* parameter,
                                      weft_parameter_layout* out);

/* ------------------------------------------------------------------------------------------
 * The step the host executes
 * ---------------------------------------------------------------------------------------- */

/* One action of a rank's step. Without a pipeline the host builds every list itself: one chunk
 * (the whole model), FORWARD and BACKWARD per micro-batch, then REDUCE (where a gradient placement
 * asks for one) and OPTIMIZER_STEP. A plugin that owns the pipeline dimension gives each rank's
 * list ("weft_schedule", since 2.2). The host verifies the lists before the first step. */
typedef enum weft_action_kind {
  WEFT_ACTION_FORWARD = 0,        /* forward (and, on the last chunk, the loss) of a micro-batch */
  WEFT_ACTION_BACKWARD = 1,       /* its backward */
  WEFT_ACTION_REDUCE = 2,         /* the chunk's gradients over the dimension whose placement asks:
                                     started during its last backward, complete before the optimizer step */
  WEFT_ACTION_OPTIMIZER_STEP = 3, /* the host's optimizer: the step's last action */
  /* Since 2.2: a backward split in two halves (zero-bubble schedules), for every backward of a
   * schedule or none: the input gradients (what the previous virtual stage waits for), then,
   * later, the weights' gradients of the same micro-batch and chunk. */
  WEFT_ACTION_BACKWARD_INPUT = 4,
  WEFT_ACTION_BACKWARD_WEIGHT = 5
} weft_action_kind;

typedef struct weft_action {
  int32_t kind;        /* weft_action_kind */
  int32_t chunk;       /* the rank's stage chunk (0 without a pipeline) */
  int32_t micro_batch; /* FORWARD and the BACKWARDs; -1 otherwise */
} weft_action;

/* ------------------------------------------------------------------------------------------
 * Pipeline schedules as data (plugin function "weft_schedule"; since 2.2)
 * ---------------------------------------------------------------------------------------- */

/* What the host asks: one rank's list for a step of `micro_batches` micro-batches. */
typedef struct weft_schedule_request {
  uint32_t struct_size;  /* host-set */
  int32_t rank;          /* the stage whose list is asked, 0 <= rank < stages (every replica runs the same) */
  int32_t stages;        /* the ranks of one pipeline (weft_layout.pipeline_stages, or the dimension's size) */
  int32_t chunks;        /* weft_layout.pipeline_chunks */
  int32_t micro_batches; /* in this step: host micro-batches x weft_layout.pipeline_micro_batches */
} weft_schedule_request;

/* "weft_schedule": the compute actions of one rank's step, in order: FORWARD and BACKWARD (or
 * BACKWARD_INPUT and BACKWARD_WEIGHT) of every (chunk, micro-batch) once, OPTIMIZER_STEP last.
 * `*actions` is the plugin's storage, valid until its next call. The host asks every rank's list
 * (on every rank) once per micro-batch count, adds the transfers the placement implies (a receive
 * posted one compute action before the compute that needs it, a send right after the compute that
 * made its data; between two chunks of one rank, a copy) and verifies the whole schedule before
 * the first step: every action once and in dependency order on its rank, transfers matched in
 * order between each pair of ranks, and a dataflow simulation in which no rank waits forever. A
 * list it refuses stops the run there, in one line naming the rank and the action. */
typedef weft_status* (*weft_schedule_fn)(weft_plugin_instance* instance, const weft_schedule_request* request,
                                         const weft_action** actions, int64_t* count);

/* ------------------------------------------------------------------------------------------
 * Hooks at named points (plugin function "weft_hooks"; optional; since 2.1)
 * ---------------------------------------------------------------------------------------- */

/* Points are names the host publishes, not an enum of this header: a new point is a new name. A
 * 2.1 host publishes:
 *   "train.begin"  before the first training step of this process (after a resume restored the
 *                  model): event.step = the optimizer steps already taken (0 for a fresh run)
 *   "step.end"     after each optimizer step, and after what the placements ask after it (the
 *                  gathers of a FLAT_SHARD optimizer state): event.step = the steps taken, this one
 *                  included (1 after the first)
 * Since 2.3, where a plugin owns the tensor-parallel dimension, the model's points too, each called
 * in the forward pass (event.backward = 0) and the backward (1) with the activation or its gradient
 * in event.tensor (the hook combines it in place over its dimension, or leaves it):
 *   "embedding.output"        after a vocabulary-sliced embedding's lookup (Megatron: sum forward)
 *   "block.attention.input"   before q/k/v (Megatron's f: sum the gradient, backward)
 *   "block.attention.output"  after o_proj (Megatron's g: sum the partial outputs, forward)
 *   "block.mlp.input"         before gate/up (f)
 *   "block.mlp.output"        after down_proj (g)
 *   "head.input"              before a vocabulary-sliced LM head (f)
 *   "loss.max"                each token's max over this rank's logits (MAX, forward)
 *   "loss.sum"                each token's sums over this rank's logits (SUM, forward)
 *   "linear.row_absmax"       each token's absmax over an int8 row-sliced layer's input columns
 *                             (MAX, forward)
 *   "adalora.slice_sums"      AdaLoRA's sums over its factors' slices (SUM, forward)
 * Since 2.4, where a plugin owns the context-parallel dimension (its layout splits sequences), the
 * attention's points, of which it hooks one (and registers its hooks from weft_layout on: the host
 * asks "weft_hooks" before the model is built):
 *   "attention.exchange"  Ulysses (the contiguous split only): before the attention core, each of
 *                         q, k and v of this rank's tokens and every head goes to the ranks by heads,
 *                         and after it the output back by tokens, as all-to-alls: event.source [N, ...]
 *                         to send (chunk j to rank j), event.tensor [N, ...] to fill (chunk i from
 *                         rank i); in the backward, the gradients the other way. The host then runs
 *                         the core over the whole sequence for 1/N of the heads (N must divide them).
 *   "attention.core"      the plugin computes the attention core of this rank's queries against every
 *                         rank's keys and values (ring attention): event.attention holds the tensors
 *                         (weft_attention_core); the host does not run the core itself.
 * Under sequence parallelism (weft_layout.sequence_parallel) the regions' points embedding.output,
 * block.attention.input/output, block.mlp.input/output and head.input move tokens instead: event.source
 * is set and the shapes say which collective (weft_hook_event); gradients go the other way in the
 * backward, and a region's saved input may be gathered again before its backward.
 * A plugin registering a name the host does not publish is refused, in one line naming it and the
 * points the host has, before the first step. A hook may use the host's services (parameters,
 * collectives over its dimension, metrics); an error it returns stops the run, naming the plugin
 * and the point. */
/* The attention core of one decoder block for the tensors of this rank's tokens, at "attention.core"
 * (since 2.4): causal softmax(q k^T scale) v with each token at its global position (the layout's
 * chunks) and query head h using key/value head h / (H / Hkv). All contiguous, on the rank's device. */
typedef struct weft_attention_core {
  uint32_t struct_size; /* host-set */
  double scale;         /* the softmax scale, 1 / sqrt(D) */
  const DLTensor *q, *k, *v; /* q [B, H, s, D]; k, v [B, Hkv, s, D]: RoPE applied, the compute dtype */
  /* Forward: write out (fp32 [B, H, s, D]) and lse (fp32 [B, H, s]: each query's log-sum-exp of its
   * scaled scores). Backward: they hold what the forward wrote (read them), grad_out [B, H, s, D]
   * (the compute dtype) the output's gradient, and the plugin adds the gradients into grad_q, grad_k,
   * grad_v (fp32, like q, k, v, zeroed by the host). */
  DLTensor *out, *lse;
  const DLTensor* grad_out;
  DLTensor *grad_q, *grad_k, *grad_v;
} weft_attention_core;

typedef struct weft_hook_event {
  uint32_t struct_size; /* host-set */
  const char* point;    /* the point's name */
  int64_t step;         /* see the points */
  /* Since 2.3, at the model's points (NULL tensor at the step's): */
  int32_t backward; /* 1 in the backward pass (`tensor` is a gradient), 0 in the forward */
  int64_t layer;    /* the decoder block (0-based), -1 outside the blocks */
  DLTensor* tensor; /* the activation or its gradient, combined in place by the hook (contiguous,
                       the compute dtype or fp32, on the rank's device) */
  const DLTensor* source; /* where the point moves tokens (sequence parallelism's regions): the
                             input, and `tensor` the output to fill: [N, ...source] for an
                             all-gather, or source [N, ...tensor] for a reduce-scatter; else NULL */
  /* Since 2.4, at "attention.core" (else NULL; `tensor` is NULL there): */
  weft_attention_core* attention;
} weft_hook_event;

typedef weft_status* (*weft_hook_fn)(weft_plugin_instance* instance, const weft_hook_event* event);

typedef struct weft_hook {
  const char* point; /* "step.end" */
  weft_hook_fn fn;
} weft_hook;

/* "weft_hooks": the plugin's hooks (`*count` of them; storage the plugin keeps for the instance's
 * life), asked once after "weft_place". Several hooks at one point run in the order given. */
typedef const weft_hook* (*weft_hooks_fn)(weft_plugin_instance* instance, int32_t* count);

/* ------------------------------------------------------------------------------------------
 * The plugin's own memory (plugin function "weft_memory"; optional; since 2.4)
 * ---------------------------------------------------------------------------------------- */

/* What the host tells "weft_memory" for its memory plan (trainer plan, train.memory_limit_gib),
 * before the model is built. */
typedef struct weft_memory_request {
  uint32_t struct_size;         /* host-set */
  int64_t rows_per_micro_batch; /* this rank's sequences per micro-batch */
  int64_t tokens;               /* this rank's tokens of each sequence (its share where sequences split) */
  int32_t compute_bytes;        /* bytes of one element of the compute dtype (2 for bf16) */
} weft_memory_request;

/* "weft_memory": the bytes the plugin holds itself at the step's peak (what it allocates, e.g. with
 * LibTorch: ring attention's key/value blocks), which the host adds to its plan. `*bytes` comes 0; the
 * model's sizes come from "weft_model_config_int". */
typedef weft_status* (*weft_memory_fn)(weft_plugin_instance* instance, const weft_memory_request* request,
                                       int64_t* bytes);

/* ------------------------------------------------------------------------------------------
 * Plugins that link LibTorch (plugin function "weft_torch_build"; since 2.2)
 * ---------------------------------------------------------------------------------------- */

/* A plugin may do its own maths with LibTorch (weft/plugin_torch.hpp: views between DLTensor and
 * at::Tensor). It then shares the host's process, so it must be built against the host's LibTorch:
 * the same version and the same C++ standard-library ABI. It says which through
 * "weft_torch_build" (weft/plugin_torch.hpp defines the function: WEFT_PLUGIN_TORCH_BUILD). At
 * load, the host refuses in one line a plugin whose build differs from its own, and a plugin that
 * links a LibTorch library (libtorch*.so, libc10*.so) without the function. A plugin that only
 * moves data (layouts, schedules, collectives in hooks) needs neither. */
typedef struct weft_torch_build {
  uint32_t struct_size;
  int32_t major, minor, patch; /* TORCH_VERSION_MAJOR, _MINOR, _PATCH */
  int32_t cxx11_abi;           /* _GLIBCXX_USE_CXX11_ABI */
} weft_torch_build;

/* "weft_torch_build": the LibTorch the plugin was compiled against (static storage). */
typedef const weft_torch_build* (*weft_torch_build_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* WEFT_PLUGIN_H */
