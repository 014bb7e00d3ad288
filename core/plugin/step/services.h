/*
 * core/plugin/step/services.h - INTERNAL to the host: the services its own step for ABI 2 plugins
 * (core/plugin/abi2.cpp, abi2_pipeline.cpp) and the pipeline runtime (core/pipeline) call, as a
 * table of C functions (weft_host_api) that PluginHost serves, with the structs they exchange. No
 * plugin sees it: plugins use weft/plugin.h, and the host refuses a library exporting ABI 1's
 * weft_strategy_entry. It began as ABI 1's host table (history: sdk/CHANGELOG.md). "The
 * plugin" below is the step (sdk::Strategy, step.hpp) that calls these services, and
 * "slot" one of that step's methods.
 *
 * Division of labour. The host keeps the model (as stages: embedding, decoder blocks,
 * norm + head), autograd, the data loader and the optimizer. The plugin decides what runs
 * where and when (which stages a rank holds, the micro-batch schedule, which slice of each
 * weight a rank holds) and what is communicated (collectives and point-to-point transfers
 * through host process groups).
 *
 * Conventions that hold for every function below unless its comment says otherwise:
 *  - Errors: functions return weft_status*; NULL means success. A non-NULL status is owned by
 *    the receiver, who releases it with status_release (every status is created
 *    by the host, including the ones a plugin returns: plugins create them with status_create).
 *    Out-parameters are left untouched when a function fails.
 *  - No C++ exception, longjmp or signal may cross this boundary in either direction.
 *  - Strings passed in are borrowed for the duration of the call. Strings returned by the
 *    host stay valid for the life of the plugin instance unless stated otherwise.
 *  - Tensors: DLTensor* arguments are borrowed views (DLPack 0.6, always with strides), valid
 *    only during the call unless stated otherwise. Autograd history never crosses the boundary:
 *    tensors that need it stay in the host behind weft_activation handles. DLPack 0.6 has no
 *    bool type: booleans cross as {kDLUInt, 8, 1}. Tensors live on the rank's device
 *    (train.device: the CPU, or cuda:LOCAL_RANK); collectives route by the tensor's device: Gloo
 *    for CPU tensors, NCCL for CUDA tensors where the host's LibTorch has it (else Gloo through a
 *    host copy). On CUDA, what has been verified on a GPU is listed in docs/gpu.md.
 *  - Structs passed by pointer that start with `struct_size` (weft_model_plan,
 *    weft_step_info) are written by the host with its own size; a reader uses only the fields
 *    that lie within struct_size (fields are only ever appended).
 *  - Threads: the host calls a plugin instance from one thread at a time; callbacks the
 *    plugin registers may run on the host's autograd thread, which is then the calling thread.
 *    Host services may be called from any thread that the host is currently calling into
 *    (including from a callback).
 */
#ifndef WEFT_CORE_PLUGIN_STEP_SERVICES_H
#define WEFT_CORE_PLUGIN_STEP_SERVICES_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#include <weft/common.h> /* weft_status, weft_status_code, weft_log_level, weft_mesh_dim, weft_reduce_op, WEFT_EXPORT */

#ifdef __cplusplus
extern "C" {
#endif


/* ------------------------------------------------------------------------------------------
 * Opaque handles
 * ---------------------------------------------------------------------------------------- */

typedef struct weft_host weft_host;             /* the host side of one plugin instance */
typedef struct weft_group weft_group;           /* a process group; lives until the run ends */
typedef struct weft_work weft_work;             /* an asynchronous communication in flight */
typedef struct weft_activation weft_activation; /* a host tensor, possibly with autograd history */
typedef struct weft_buffer weft_buffer;         /* memory on the rank's device owned by a plugin */
typedef struct weft_weight_pass weft_weight_pass; /* weight gradients deferred by backward_input */

/* ------------------------------------------------------------------------------------------
 * Plain data exchanged between the host and its step
 * ---------------------------------------------------------------------------------------- */

/* One parameter of the full model, as the host describes it.
 * LoRA (train.mode = lora): the base weights are frozen (trainable 0) and each adapted layer
 * "<base>" adds "<base>.lora_A.weight" [r, in] and "<base>.lora_B.weight" [out, r] (PEFT's
 * names). shard_parameter is asked about base weights only; adapters follow their base's
 * split: a base split along dim 0 splits lora_B the same way and keeps lora_A whole, a base
 * split along dim 1 splits lora_A along dim 1 and keeps lora_B whole. The whole factor's
 * gradient after backward is then only this rank's share; the plugin sums it over the ranks
 * that hold the base's other slices (tensor_parallel.so: its tp group). */
typedef struct weft_parameter_info {
  const char* name;      /* HF name, e.g. "model.layers.3.self_attn.q_proj.weight" */
  int64_t stage;         /* the model stage that owns it: 0 embedding, 1..L blocks, L+1 head */
  int32_t trainable;     /* 1 if the optimizer updates it (0 for frozen base weights under LoRA) */
  int32_t ndim;
  const int64_t* shape;  /* full (unsharded) shape, ndim entries; valid for the run */
  DLDataType dtype;      /* of the master copy (fp32) */
} weft_parameter_info;

/* How one rank holds a parameter: the slice [index * size / parts, (index + 1) * size / parts)
 * along `dim`, or the whole tensor when parts == 1. */
typedef struct weft_shard {
  int32_t dim;
  int32_t parts;
  int32_t index;
} weft_shard;

/* Which elements of a parameter's training state this rank keeps under sharded data parallelism
 * (ZeRO, FSDP): elements [begin, begin + count) of the parameter's flattened local tensor (its
 * tensor-parallel slice, if any, in row-major order). Returned by the plugin's flat_shard slot.
 * For a trainable parameter with count < its element count, the host keeps AdamW's state for
 * those elements only and updates only them, from the gradient shard the plugin writes
 * (parameter_grad_shard). flags: WEFT_FLAT_SHARD_*. */
typedef struct weft_flat_shard {
  int64_t begin;
  int64_t count;
  uint32_t flags;
  uint32_t reserved; /* 0 */
} weft_flat_shard;

/* The plugin will release the whole parameter between uses (parameter_release, ZeRO-3): the host
 * keeps the shard's elements in storage of their own (the persistent master copy, read and
 * written through parameter_shard) instead of as a view of the whole parameter. Allowed for
 * frozen parameters too (their shard is kept, no optimizer state). */
#define WEFT_FLAT_SHARD_RELEASABLE 1u
/* With RELEASABLE: parameter_materialize gives the whole parameter in the run's compute dtype
 * (weft_model_info.compute_dtype: bf16 / fp16) when it is a matrix (two or more dimensions: the
 * linear weights, the embedding, LoRA factors), and in its master dtype (fp32) otherwise or when
 * the compute dtype is fp32. The model casts its matrices to the compute dtype before every
 * product anyway, so a forward sees the same values and no separate weight copy is made; whole
 * gradients (parameter_grad) then come in that dtype too, and are accumulated in it over the
 * micro-batches of a step. Masters, shards and gradient shards stay fp32. While the host asks
 * the plugin to materialise every parameter (materialize_parameters(1), to save, export or
 * generate), parameter_materialize gives fp32 whatever the flag. Halves what a rank holds of
 * gathered parameters and their gradients, as FSDP's MixedPrecisionPolicy(param_dtype=bf16).
 * The grad-ready callback (set_grad_ready_callback) does not follow a parameter whose dtype
 * changed (autograd gives it a new accumulator): use the flag where the plugin drives the
 * backward itself and reads gradients after it. */
#define WEFT_FLAT_SHARD_COMPUTE_DTYPE 2u

/* What one model stage costs in memory as this rank would hold it, estimated by the host before
 * the model is built (stage_memory). Bytes. */
typedef struct weft_stage_memory {
  uint32_t struct_size;            /* set by the CALLER to sizeof its struct (as model_info) */
  uint32_t reserved;
  int64_t parameter_bytes;         /* the stage's parameters as this rank holds them (its slices
                                      after shard_parameter; LoRA adapters included), fp32 masters */
  int64_t trainable_bytes;         /* the part the optimizer updates (LoRA: the adapters only) */
  int64_t activation_bytes_per_row;/* what a forward of one sequence of the run's seq_len keeps for
                                      backward in this stage (the host's model of its own kernels:
                                      compute dtype, attention kernel, activation checkpointing) */
  int64_t weight_copy_bytes;       /* compute-dtype copies of the stage's weights a forward keeps for
                                      backward (bf16 / fp16 compute over fp32 masters; 0 in fp32) */
  int64_t output_bytes_per_row;    /* the stage's output for one sequence: fp32 hidden states, or
                                      the logits for the last stage */
  /* */
  int64_t compute_parameter_bytes; /* parameter_bytes with the matrices in the compute dtype: the
                                      stage whole as WEFT_FLAT_SHARD_COMPUTE_DTYPE materialises it */
  int64_t compute_trainable_bytes; /* trainable_bytes likewise: its whole gradients under that flag */
} weft_stage_memory;

/* What one rank will hold at its peak, in bytes, by kind: the memory plan the host checks against
 * train.memory_limit_gib before the model is built, and `trainer plan` prints. The host fills it
 * with the one-process layout of this rank's stages and slices (parameters and gradients of what
 * it holds, AdamW's two fp32 moments per trainable element, one micro-batch's activations through
 * its stages plus the weight copies, no buffers) and the step's geometry, then hands it to the
 * plugin's memory_plan slot to adjust for what the plugin does differently (shards, micro-batches
 * in flight, its own buffers). */
typedef struct weft_memory_plan {
  uint32_t struct_size;            /* set by the host */
  int32_t micro_batches;           /* in: gradient-accumulation micro-batches per step */
  int64_t rows_per_micro_batch;    /* in: this rank's sequences per micro-batch */
  int64_t seq_len;                 /* in */
  int64_t parameter_bytes;         /* in/out: master parameters resident at the peak */
  int64_t gradient_bytes;          /* in/out: gradients at the peak */
  int64_t optimizer_bytes;         /* in/out: optimizer state */
  int64_t activation_bytes;        /* in/out: activations (and weight copies) kept for backward */
  int64_t buffer_bytes;            /* in/out: the plugin's own memory at the peak (gradient buckets,
                                      receive buffers, gathered parameters) */
  int64_t stage_tokens;            /* in: tokens per
                                      row of the hidden states between stages, as weft_step_info's */
} weft_memory_plan;

/* What this rank materialises; filled by the plugin in `plan` before the model is built.
 * The host pre-fills it with the one-process layout (all stages, no sharding). */
typedef struct weft_model_plan {
  uint32_t struct_size;    /* set by the host */
  int64_t first_stage;     /* stages [first_stage, last_stage) are built on this rank */
  int64_t last_stage;
  int32_t data_parallel_size;  /* ranks that see different data for the same stages/shards */
  int32_t data_parallel_rank;  /* selects this rank's share of each global batch */
  /* Context parallelism. context_parallel_size ranks (>= 1; 1 = whole
   * sequences, the pre-filled value) split every sequence of their rows between them, and this
   * rank is number context_parallel_rank among them: batch() then returns tokens
   * [r * L / size, (r + 1) * L / size) of every row (L = seq_len, which size must divide), the
   * host runs RoPE at those global positions and, in every decoder block, calls
   * context_exchange around the attention core, which runs over the whole sequence for
   * num_attention_heads / size heads (size must divide the heads; kv heads that it does not
   * divide are repeated to one per query head). The loss of batch() is the mean over this
   * rank's tokens: with every rank holding as many target tokens, the mean of the ranks' losses
   * and gradients is the whole sequence's. Everything else (embeddings, norms, MLP, head) runs
   * on this rank's tokens. Each rank of a split sequence passes its tokens to the same rank of
   * the next stage (weft_step_info.stage_tokens). */
  int32_t context_parallel_size;
  int32_t context_parallel_rank;
  /* Pre-filled 0, 0. Which tokens
   * of each sequence this rank holds (weft_sequence_layout) and who runs the attention core over
   * the split sequence (weft_sequence_attention). The layout applies to batch(), RoPE and the
   * loss as above; BALANCED needs seq_len divisible by 2 x size and the PLUGIN attention. */
  int32_t context_parallel_layout;
  int32_t context_parallel_attention;
  /* Pre-filled 1, 0: Megatron
   * sequence parallelism (Korthikanti et al. 2022) inside a tensor-parallel group of
   * sequence_parallel_size ranks, this rank number sequence_parallel_rank in it. Between the
   * tensor-parallel regions (the embedding's output, the residual stream, the RMSNorms and the
   * final norm) each rank holds tokens [r L / size, (r + 1) L / size) of every sequence; inside
   * them (attention with RoPE at global positions, the MLP, the LM head and the loss) every
   * token. The host calls the plugin's sequence_region where the whole-model comm points
   * ATTENTION_INPUT, MLP_INPUT, HEAD_INPUT (all-gather forward) and ATTENTION_OUTPUT, MLP_OUTPUT,
   * EMBEDDING_OUTPUT (reduce-scatter forward) would be, instead of comm_point; LOSS_*, ROW_ABSMAX
   * and ADAPTER_SUM stay comm points, and cached decoding (generation) keeps whole sequences and
   * the whole-model comm points. batch() still returns whole sequences (the group's ranks see the same
   * rows). The RMSNorm weights' gradients then hold this rank's tokens' share: the plugin sums
   * them over the group. Needs: a vocabulary-parallel
   * embedding (its all-reduce becomes the reduce-scatter), seq_len divisible by size, whole
   * sequences otherwise, or a context-parallel split (the regions then gather this rank's
   * seq_len / context_parallel_size tokens, which size must divide). With a split of the stages,
   * the stages pass this rank's tokens (weft_step_info.stage_tokens). The host refuses the plan
   * before the model is built otherwise. */
  int32_t sequence_parallel_size;
  int32_t sequence_parallel_rank;
  /* Pre-filled 1, 0 and zeros:
   * virtual pipeline stages (Megatron's interleaved schedule). stage_chunks > 1 says this rank
   * holds stage_chunks disjoint ranges of model stages: chunk i is stages
   * [chunk_stages[2 i], chunk_stages[2 i + 1]), ascending, non-empty and not adjacent
   * (first_stage and last_stage must then be the first chunk's first and the last chunk's last
   * stage: the hull). The host builds only those stages; forward() runs any range within one
   * chunk; parameters, shards, the memory plan and checkpoints cover the chunks' stages. At most
   * WEFT_MAX_STAGE_CHUNKS chunks. 1 (the pre-filled value): [first_stage, last_stage) alone;
   * chunk_stages is then ignored. The sequence splits above combine with chunks as with any
   * split of the stages. */
  int32_t stage_chunks;
  int32_t reserved_1_10;  /* 0; alignment */
  int64_t chunk_stages[2 * 16];
  /* Pre-filled 0: 1 = this plugin
   * splits backward passes (zero-bubble schedules, Qi et al. 2023) with backward_input and
   * backward_weight; the host then builds its linear layers so that their trainable weights'
   * gradients can be computed apart. 0: backward_input is refused. */
  int32_t split_backward;
  int32_t reserved_1_11;  /* 0; alignment */
} weft_model_plan;

/* The most chunks weft_model_plan.stage_chunks may name (the length of chunk_stages / 2). */
#define WEFT_MAX_STAGE_CHUNKS 16

/* Which tokens of every sequence sequence-parallel rank r of N holds. */
typedef enum weft_sequence_layout {
  /* Tokens [r L / N, (r + 1) L / N). Under a causal mask the last rank's
   * queries see N times the keys of the first rank's. */
  WEFT_CONTEXT_CONTIGUOUS = 0,
  /* The sequence cut into 2N equal chunks; rank r holds chunk r then chunk 2N - 1 - r (local
   * tokens [0, L / 2N) are chunk r, the rest chunk 2N - 1 - r): every rank's queries see as many
   * keys, so ring attention's ranks do equal work (Megatron / torchtitan's load balancing). */
  WEFT_CONTEXT_BALANCED = 1
} weft_sequence_layout;

/* Who runs the attention core when sequences are split. */
typedef enum weft_sequence_attention {
  /* Ulysses: the host runs the core over the whole sequence for 1/N of the heads, between
   * the plugin's context_exchange all-to-alls. */
  WEFT_CONTEXT_ATTENTION_EXCHANGE = 0,
  /* The plugin's context_attention slot computes the core's output for this rank's queries
   * (e.g. ring attention: key/value blocks travel between the ranks). */
  WEFT_CONTEXT_ATTENTION_PLUGIN = 1
} weft_sequence_attention;

/* One call of the plugin's context_attention slot: the attention core of decoder block `layer`
 * over this rank's queries, in the forward or the backward direction. All tensors are host-owned,
 * contiguous, on the rank's device and valid during the call; B rows, H query heads, Hkv key/value
 * heads (H a multiple of Hkv: query head h uses kv head h / (H / Hkv)), s local tokens in the
 * plan's layout, D head dim. The core is causal softmax(scale q k^T) v over the whole sequence's
 * keys, each token at its global position. */
typedef struct weft_attention_call {
  uint32_t struct_size;       /* set by the host */
  int32_t direction;          /* weft_direction */
  int64_t layer;              /* the decoder block */
  double scale;               /* the softmax scale, 1 / sqrt(D) */
  const DLTensor* q;          /* [B, H, s, D], compute dtype, RoPE applied */
  const DLTensor* k;          /* [B, Hkv, s, D], compute dtype, RoPE applied */
  const DLTensor* v;          /* [B, Hkv, s, D], compute dtype */
  DLTensor* out;              /* fp32 [B, H, s, D]: forward: the plugin writes the output;
                                 backward: the forward's output (read only) */
  DLTensor* lse;              /* fp32 [B, H, s]: forward: the plugin writes each query's
                                 log-sum-exp of its scaled scores; backward: read only */
  const DLTensor* grad_out;   /* backward: the output's gradient [B, H, s, D], compute dtype;
                                 NULL in the forward */
  DLTensor* grad_q;           /* backward: fp32, zero on entry; the plugin leaves in each the */
  DLTensor* grad_k;           /* gradient of this rank's q, k, v (k and v: summed over every */
  DLTensor* grad_v;           /* rank's queries); NULL in the forward */
} weft_attention_call;


/* The step the host asks the plugin to run. */
typedef struct weft_step_info {
  uint32_t struct_size;
  int64_t step;              /* 0-based optimizer step */
  int64_t epoch;             /* 0-based */
  int32_t micro_batches;     /* gradient-accumulation micro-batches of this step (>= 1) */
  int32_t reserved;          /* 0 */
  int64_t rows_per_micro_batch;     /* this rank's sequences per micro-batch */
  int64_t seq_len;                  /* tokens per sequence (batch() returns fewer under a
                                       context_parallel_size > 1 plan: see weft_model_plan) */
  /* Tokens per row of the hidden states this rank's forward() takes and returns between model
   * stages, and of their gradients - seq_len divided by the plan's context_parallel_size and
   * sequence_parallel_size (each rank of a split sequence passes its own tokens to the same rank
   * of the next stage). */
  int64_t stage_tokens;
} weft_step_info;

/* Places inside the model where the host calls the plugin (Megatron's f and g, vocabulary-
 * parallel reductions). The plugin communicates in place; it may do nothing. */
typedef enum weft_comm_point {
  WEFT_COMM_ATTENTION_INPUT = 0, /* before q/k/v (column-parallel input) */
  WEFT_COMM_ATTENTION_OUTPUT = 1,/* after o_proj (row-parallel output) */
  WEFT_COMM_MLP_INPUT = 2,       /* before gate/up */
  WEFT_COMM_MLP_OUTPUT = 3,      /* after down_proj */
  WEFT_COMM_EMBEDDING_OUTPUT = 4,/* after a vocabulary-sharded embedding lookup */
  WEFT_COMM_LOSS_MAX = 5,        /* per-token max of sharded logits (vocab-parallel loss) */
  WEFT_COMM_LOSS_SUM = 6,        /* per-token sums of sharded logits (vocab-parallel loss) */
  WEFT_COMM_HEAD_INPUT = 7,      /* before a vocabulary-parallel LM head */
  WEFT_COMM_ROW_ABSMAX = 8,      /* per-token absmax of a row-parallel int8 layer's input */
  WEFT_COMM_ADAPTER_SUM = 9      /* sums over the slices of split AdaLoRA adapters */
} weft_comm_point;

typedef enum weft_direction {
  WEFT_FORWARD = 0,
  WEFT_BACKWARD = 1
} weft_direction;

/* The device mesh's dimensions (weft_mesh_dim, WEFT_MESH_DIMS) are in weft/common.h. */


/* The model's shape, known from `plan` on (before the model is built), e.g. to size
 * receive buffers or check that heads divide by a tensor-parallel degree. Hidden states
 * between stages are always fp32 [rows, stage_tokens, hidden_size] (weft_step_info; the residual
 * stream stays fp32 in every precision), as are their gradients. Filled by model_info. */
typedef struct weft_model_info {
  uint32_t struct_size;        /* set by the CALLER to sizeof its struct; see model_info */
  int32_t num_layers;          /* decoder blocks (the model has num_layers + 2 stages) */
  int64_t hidden_size;
  int64_t intermediate_size;
  int32_t num_attention_heads;
  int32_t num_key_value_heads;
  int64_t head_dim;
  int64_t vocab_size;
  int32_t tie_word_embeddings; /* 1: the LM head is the embedding (a rank holding the last
                                  stage but not stage 0 holds its own copy, named
                                  "model.embed_tokens.weight", whose gradient the plugin must
                                  combine with stage 0's); 0 for a sequence classifier,
                                  whose head is its own "score.weight" */
  DLDataType compute_dtype;    /* of matrix multiplications: fp32 or bf16 */
} weft_model_info;

/* Flags for forward. */
#define WEFT_FORWARD_NO_GRAD 1u /* evaluation: record no autograd history */
/* Keep only each decoder block's input and recompute the block's activations during backward
 * (GPipe's re-materialisation; less memory, about one more forward of compute). */
#define WEFT_FORWARD_RECOMPUTE 2u

/* Called by the host during backward once a parameter's gradient for this backward pass is
 * complete (accumulated into its .grad). `parameter_index` indexes parameter_*.
 * Runs on the autograd thread; must not call forward/backward. It cannot fail: a plugin keeps
 * any error it meets (e.g. a collective that could not start) and returns it from train_step.
 * */
typedef void (*weft_grad_ready_fn)(void* user_data, int64_t parameter_index);


#ifdef __cplusplus
} /* extern "C" */
#endif

/* ------------------------------------------------------------------------------------------
 * The host's services, which PluginHost serves (core/plugin/host_*.cpp). Each takes the
 * weft_host of the step that calls it.
 * ---------------------------------------------------------------------------------------- */
#ifdef __cplusplus
namespace weft {
// Statuses (core/plugin/status.h): every status is the host's; the receiver releases it.
weft_status* status_create(weft_status_code code, const char* message) noexcept;
weft_status_code status_code(const weft_status* status) noexcept;
const char* status_message(const weft_status* status) noexcept;
void status_release(weft_status* status) noexcept;

namespace host {

/* --- logging --- */
/* Logs one line through the host's logger (prefixed with the rank and plugin name). */
void log_line(weft_host* host, weft_log_level level, const char* message);

/* --- configuration: the plugin's own section ([plugin] in the TOML config) --- */
/* Each reads `key` from the plugin's section; when absent, *out = fallback. A value of the
 * wrong type is WEFT_STATUS_BAD_CONFIG naming the key. Strings stay valid for the run. */
weft_status* config_int(weft_host* host, const char* key, int64_t fallback, int64_t* out);
weft_status* config_float(weft_host* host, const char* key, double fallback, double* out);
weft_status* config_bool(weft_host* host, const char* key, int32_t fallback, int32_t* out);
weft_status* config_string(weft_host* host, const char* key, const char* fallback,
                              const char** out);

/* --- process groups --- */
/* All ranks of the job. */
weft_group* group_world(weft_host* host);
int32_t group_rank(const weft_group* group); /* this process's rank in the group, or -1 */
int32_t group_size(const weft_group* group);
/* Creates a sub-group of the world from `count` world ranks. Collective: every rank of the
 * world must call it with the same list in the same order (as c10d's new_group), including
 * ranks not in the list (they get a group whose group_rank is -1). Host-owned. */
weft_status* group_create(weft_host* host, const int32_t* world_ranks, int32_t count,
                             weft_group** out);

/* --- collectives: asynchronous; every one returns a work handle to wait on ---
 * The tensors' memory must stay alive and unmodified (inputs) / unread (outputs) until
 * work_wait returns. All tensors are contiguous, on one device, of one dtype, any dtype. A
 * collective goes over NCCL when its tensors are CUDA tensors and the run has NCCL groups
 * (train.device = cuda with a LibTorch that has NCCL), else over Gloo (a CUDA tensor is then
 * copied to host memory and back). Where the backend cannot reduce the dtype (Gloo: fp16,
 * bf16) the host reduces an fp32 copy and writes the result back; where it cannot move it, the
 * host moves its bytes. */
weft_status* all_reduce(weft_host* host, weft_group* group, DLTensor* tensor,
                           weft_reduce_op op, weft_work** work);
/* output = this rank's part (dim 0, equal parts) of the reduction of `input` over the group. */
weft_status* reduce_scatter(weft_host* host, weft_group* group, DLTensor* output,
                               const DLTensor* input, weft_reduce_op op, weft_work** work);
/* output = the inputs of all ranks concatenated along dim 0, in rank order. */
weft_status* all_gather(weft_host* host, weft_group* group, DLTensor* output,
                           const DLTensor* input, weft_work** work);
weft_status* broadcast(weft_host* host, weft_group* group, DLTensor* tensor,
                          int32_t root_group_rank, weft_work** work);
/* input split into group_size equal parts along dim 0; part i goes to rank i; output holds
 * the parts received, in rank order. */
weft_status* all_to_all(weft_host* host, weft_group* group, DLTensor* output,
                           const DLTensor* input, weft_work** work);
/* Point-to-point. `tag` tells a pair's transfers apart over Gloo; NCCL ignores it and pairs the
 * sends and receives between two ranks in the order they were posted, so post them in the same
 * order at both ends (and, between two ranks that send to each other, not both send first). */
weft_status* send(weft_host* host, weft_group* group, const DLTensor* tensor,
                     int32_t peer_group_rank, int32_t tag, weft_work** work);
weft_status* recv(weft_host* host, weft_group* group, DLTensor* tensor,
                     int32_t peer_group_rank, int32_t tag, weft_work** work);
/* Blocks until the work completes (or the configured collective timeout passes:
 * WEFT_STATUS_TIMEOUT naming the operation and, for a collective, the ranks that never joined
 * it). The handle stays valid until released. */
weft_status* work_wait(weft_host* host, weft_work* work);
/* Releases a work handle; releasing one that has not been waited for waits first. */
void work_release(weft_host* host, weft_work* work);

/* --- model --- */
int64_t model_num_stages(weft_host* host); /* num_hidden_layers + 2 */
/* The parameters this rank holds (after plan and shard_parameter), in the model's order:
 * the same list on every rank that holds the same stages. */
int64_t parameter_count(weft_host* host);
weft_status* parameter_info(weft_host* host, int64_t index, weft_parameter_info* out);
/* A view of this rank's master copy (writable; e.g. to broadcast initial values into it).
 * Valid for the run (the optimizer updates it in place). */
weft_status* parameter_data(weft_host* host, int64_t index, DLTensor* out);
/* A view of the parameter's gradient (writable: e.g. to average it in place). Valid from the
 * first backward of a step until the optimizer step; WEFT_STATUS_INVALID_ARGUMENT before. */
weft_status* parameter_grad(weft_host* host, int64_t index, DLTensor* out);
/* Registers the callback for gradient readiness (one per instance; NULL unregisters). */
weft_status* set_grad_ready_callback(weft_host* host, weft_grad_ready_fn callback,
                                        void* user_data);

/* --- the step: data, forward and backward over stage ranges --- */
/* This rank's rows of micro-batch `micro_batch` of the current step, split further into
 * `splits` equal pipeline micro-batches of which `split` is returned (splits = 1 for the
 * whole micro-batch). inputs: int64 token ids [rows, seq_len]; targets likewise. A plugin
 * hands targets to loss unchanged and never reads them: in a sequence-classification run
 * (the host's train.task = "classification", any 1.x host) every target is -100 but the one at
 * each row's last token, which holds the row's class (or a regression score's bits), the rows
 * are padded after that token, and loss's tokens_out counts those labeled positions (one per
 * row). Such a run does not start under a plan with context_parallel_size > 1. */
weft_status* batch(weft_host* host, int32_t micro_batch, int32_t split, int32_t splits,
                      weft_activation** inputs, weft_activation** targets);
/* Runs stages [first_stage, last_stage) on `input` (token ids when first_stage == 0, hidden
 * states otherwise) and returns the output with its autograd history (unless
 * WEFT_FORWARD_NO_GRAD). The input is borrowed. */
weft_status* forward(weft_host* host, int64_t first_stage, int64_t last_stage,
                        weft_activation* input, uint32_t flags, weft_activation** output);
/* Mean cross-entropy of `logits` against `targets`, multiplied by `scale` (e.g. 1 /
 * micro-batches) and, in a training step under train.precision = fp16, by the host's dynamic
 * loss scale (so gradients, also those a pipeline passes between stages, hold that factor; the
 * host removes it before the optimizer and skips a step whose gradients are not finite).
 * value_out: the unscaled mean (double); tokens_out: target tokens. */
weft_status* loss(weft_host* host, weft_activation* logits, weft_activation* targets,
                     double scale, weft_activation** loss_out, double* value_out,
                     int64_t* tokens_out);
/* Back-propagates from `output`: a scalar loss (grad_output NULL) or a stage output with the
 * gradient received for it. Parameter gradients accumulate; inputs created with
 * activation_from_tensor(requires_grad = 1) receive a gradient (activation_grad). A stage
 * output that depends on nothing trainable (a frozen embedding alone, under LoRA) takes its
 * gradient and does nothing (host behaviour since 2026-11-27; before, an error). */
weft_status* backward(weft_host* host, weft_activation* output,
                         weft_activation* grad_output);
/* A read-only view of the activation's data (e.g. to send it). Valid until it is released. */
weft_status* activation_view(weft_host* host, weft_activation* activation, DLTensor* out);
/* The gradient accumulated into an input activation by backward, as a new activation. */
weft_status* activation_grad(weft_host* host, weft_activation* input,
                                weft_activation** out);
/* A new leaf activation holding a copy of `data` (from any device the host's LibTorch knows,
 * copied to the model's device), optionally requiring grad (a stage input received from the
 * previous stage). */
weft_status* activation_from_tensor(weft_host* host, const DLTensor* data,
                                       int32_t requires_grad, weft_activation** out);
/* Packed rows (several examples per row): batch() gives its inputs each token's position within
 * its example, and forward() follows them and passes them on to its output. This gives them to
 * `to`, a stage input made with activation_from_tensor (received from another stage or chunk),
 * from `from` (the same micro-batch's inputs from batch()); nothing when `from` has none. */
weft_status* activation_share_layout(weft_host* host, weft_activation* to, const weft_activation* from);
/* Releases an activation and, with it, the autograd graph only it kept alive. NULL allowed. */
void activation_release(weft_host* host, weft_activation* activation);

/* The model's shape. The caller sets out->struct_size to sizeof(weft_model_info) as it was
 * compiled; the host fills the fields that both versions know and sets out->struct_size to
 * the size it wrote. Callable from plan on (the shape is resolved after create).
 * */
weft_status* model_info(weft_host* host, weft_model_info* out);
/* Tracing. When the user asked for a trace (trainer --trace FILE), the host records spans in
 * a Chrome/Perfetto trace per rank; otherwise these return at once. trace_begin opens a span
 * on the calling thread (name and category are copied; categories the host's tools know:
 * "forward", "backward", "send", "recv", "optimizer", "comm"); trace_end closes the calling
 * thread's innermost open span. Spans nest; the host itself adds spans for each step and for
 * time blocked in work_wait (category "wait"). */
void trace_begin(weft_host* host, const char* category, const char* name);
void trace_end(weft_host* host);
/* Adds a named value to this rank's record of the current training step (metrics.jsonl on
 * rank 0, as "plugin.<name>"); the run summary reports each name's mean over the steps.
 * Reporting a name twice in one step keeps the last value. `name` is copied; it must be
 * [a-z0-9_]+. */
weft_status* report_metric(weft_host* host, const char* name, double value);
/* An array of integers from the plugin's configuration section (e.g. balance = [3, 3]).
 * Writes up to `capacity` values to `out` and the array's length to `count_out`; a missing
 * key gives count 0 (and `out` untouched); a value that is not an array of integers is
 * WEFT_STATUS_BAD_CONFIG naming the key. Call with capacity 0 to learn the length.
 * */
weft_status* config_int_list(weft_host* host, const char* key, int64_t* out,
                                int32_t capacity, int32_t* count_out);
/* Measures what each model stage costs: the median seconds of a forward and a backward on
 * `rows` sequences of the run's length (0: the run's train.batch_size), over `repeats` runs
 * after one warm-up; stage 0 includes the embedding, the last stage the head and the loss.
 * The host builds temporary copies of the embedding, one decoder block (all blocks have the
 * same shape and cost) and the head, never the whole model, on random data in the run's
 * precision. Writes `count` (= the number of model stages) values to seconds_out. Callable
 * in plan (before the model is built). Local: ranks measure separately (average them, e.g.
 * with an all_reduce, so that every rank picks the same plan). */
weft_status* profile_stages(weft_host* host, int64_t rows, int32_t repeats,
                               double* seconds_out, int64_t count);

/* Memory where the model is. A plugin that keeps its own buffers (gradient buckets, receive
 * buffers, stashed weights) asks the host for them, so that they live on the rank's device
 * (train.device: the CPU, or cuda:LOCAL_RANK), and works on views it cannot touch itself
 * (plain loads, stores and memcpy work only on kDLCPU memory) through the operations below.
 * They run in order with the host's other work on that device: a collective, a forward or a
 * copy issued after one sees its result. */
/* A new zero-filled contiguous buffer of `shape` and `dtype` on the rank's device, owned by
 * the caller (buffer_release). *view_out receives its view (shape and strides owned by the
 * host), valid until the buffer is released; byte_offset and narrower shapes make views of
 * parts of it. */
weft_status* buffer_create(weft_host* host, int32_t ndim, const int64_t* shape,
                              DLDataType dtype, weft_buffer** out, DLTensor* view_out);
/* Releases a buffer (NULL allowed); its views die with it. */
void buffer_release(weft_host* host, weft_buffer* buffer);
/* dst[i] = src[i] over the elements of two views of the same element count and dtype (their
 * shapes may differ; each may be strided), on any devices the host knows, between host and
 * device memory too. The two floating-point dtypes may differ (fp32, bf16, fp16): values are converted as ATen's copy_ does (rounded to nearest even). */
weft_status* tensor_copy(weft_host* host, DLTensor* dst, const DLTensor* src);
/* tensor *= factor, in place, for a floating-point view; factor 0 writes zeros (NaN and inf
 * included) in a view of any dtype. */
weft_status* tensor_scale(weft_host* host, DLTensor* tensor, double factor);
/* dst += alpha * src, element by element, for floating-point views of the same element count
 * and dtype (on any devices). */
weft_status* tensor_add(weft_host* host, DLTensor* dst, const DLTensor* src, double alpha);
/* The sum of the squares of a floating-point view's elements, accumulated in fp64 (it waits
 * for the device). */
weft_status* tensor_squared_norm(weft_host* host, const DLTensor* tensor, double* out);

/* Sharded training state (ZeRO / FSDP). The host asks the plugin's flat_shard slot, once per
 * parameter after setup, which elements of each parameter this rank keeps; these services
 * then give the plugin the pieces it moves. Indices are parameter_* indices. A
 * parameter whose shard is whole (the default) has none of this: parameter_shard and
 * parameter_grad_shard are WEFT_STATUS_INVALID_ARGUMENT for it. */
/* A writable view of this rank's master copy of the shard's elements: 1-D, `count` elements,
 * the parameter's dtype, on the rank's device. A view into the whole parameter, or, for a
 * RELEASABLE shard, storage of its own that outlives parameter_release (the plugin gathers
 * whole parameters from the ranks' shards). The optimizer updates it in place. Valid for the
 * run. */
weft_status* parameter_shard(weft_host* host, int64_t index, DLTensor* out);
/* A writable view of the gradient of a trainable parameter's shard: 1-D, `count` fp32 elements,
 * on the rank's device, zero at the start of every step (the host zeroes it after the
 * optimizer step). The plugin leaves it holding the shard's gradient averaged over the data-
 * parallel ranks (summed over micro-batches with the loss scaled by 1 / micro_batches, as
 * train_step says for whole gradients); the optimizer, gradient clipping and the fp16 loss
 * scaler then read it instead of the whole gradient. Valid for the run. */
weft_status* parameter_grad_shard(weft_host* host, int64_t index, DLTensor* out);
/* Frees the parameter's whole gradient (e.g. once its shard has been reduce-scattered into
 * parameter_grad_shard): parameter_grad fails until the next backward accumulates a new one.
 * Views of the old gradient die. */
weft_status* parameter_grad_release(weft_host* host, int64_t index);
/* Host-internal (not a service of the ABI's table): the parameter's whole gradient becomes elements
 * [offset, offset + n) of `buffer` (n: the gradient's element count), its values copied there
 * first; the gradient then shares the buffer's storage (it keeps it alive) and the backward adds
 * into it in place, as PyTorch DDP's gradient_as_bucket_view. Nothing happens where the parameter
 * has no gradient, or one of another dtype or device than the buffer's. */
weft_status* parameter_grad_into_buffer(weft_host* host, int64_t index, weft_buffer* buffer, int64_t offset);
/* Frees the whole parameter's storage (its shard must be RELEASABLE): views from
 * parameter_data die, and the parameter must be materialised again before a forward or
 * backward that uses it. The shard (parameter_shard) is kept. Releasing a released parameter
 * does nothing. */
weft_status* parameter_release(weft_host* host, int64_t index);
/* Gives a released parameter whole storage again and returns its writable view (the local
 * shape, contiguous, on the rank's device) with UNDEFINED contents: the plugin fills it (e.g.
 * all-gathers the ranks' shards into it) before the model uses it. A parameter that is
 * whole already keeps its storage and values; the view is of it. Autograd sees the new
 * storage: a backward after a release and a materialisation uses the values written here.
 * Valid until the next parameter_release of it. A shard flagged
 * WEFT_FLAT_SHARD_COMPUTE_DTYPE materialises a matrix in the compute dtype (see the flag); a
 * whole parameter in the other dtype is converted, keeping its values. */
weft_status* parameter_materialize(weft_host* host, int64_t index, DLTensor* out);
/* The host's memory estimate for model stage `stage` as this rank would hold it
 * (weft_stage_memory; the caller sets out->struct_size, the host sets it to the size it wrote).
 * Callable from the plugin's memory_plan on (after plan and shard_parameter, before the model is
 * built): stages this rank does not hold are estimated whole. */
weft_status* stage_memory(weft_host* host, int64_t stage, weft_stage_memory* out);

/* The input-gradient half of a split backward (ZB-H1's B pass; needs plan.split_backward = 1):
 * back-propagates like backward, giving every input and parameter its gradient except the
 * trainable weights of the model's linear layers (attention and MLP projections, an untied
 * LM head), whose inputs and output gradients are kept in *pass_out instead. Frozen weights
 * (LoRA's base, quantized layers) defer nothing; adapters, norms and the embedding get their
 * gradients here. The plugin owns *pass_out and hands it to backward_weight (or
 * weight_pass_release) exactly once, before the optimizer step. */
weft_status* backward_input(weft_host* host, weft_activation* output, weft_activation* grad_output,
                               weft_weight_pass** pass_out);
/* The weight-gradient half (ZB-H1's W pass): computes dW = dY^T x for every weight `pass`
 * deferred and accumulates it into the parameter's gradient, then (as backward would have)
 * calls the grad-ready callback for it. Consumes `pass`, also when it fails. */
weft_status* backward_weight(weft_host* host, weft_weight_pass* pass);
/* Frees `pass` without computing its gradients (an abandoned step). */
void weight_pass_release(weft_host* host, weft_weight_pass* pass);

}  // namespace host
}  // namespace weft
#endif

#endif /* WEFT_CORE_PLUGIN_STEP_SERVICES_H */
