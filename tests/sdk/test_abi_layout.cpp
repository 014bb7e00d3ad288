// The ABI's frozen parts: the version header that starts both tables must never change, and
// table slots are only ever appended (ABI 1.0 layout pinned here on LP64).
#include <cstddef>

#include <gtest/gtest.h>

#include <weft/strategy.h>

namespace {

static_assert(sizeof(weft_abi_header) == 8, "weft_abi_header is frozen");
static_assert(offsetof(weft_abi_header, struct_size) == 0, "weft_abi_header is frozen");
static_assert(offsetof(weft_abi_header, abi_major) == 4, "weft_abi_header is frozen");
static_assert(offsetof(weft_abi_header, abi_minor) == 6, "weft_abi_header is frozen");
static_assert(offsetof(weft_host_api, header) == 0, "tables start with the header");
static_assert(offsetof(weft_strategy_api, header) == 0, "tables start with the header");
static_assert(offsetof(weft_strategy_api, min_host_minor) == 8, "1.0 layout");
static_assert(offsetof(weft_strategy_api, name) == 16, "1.0 layout");

TEST(AbiLayout, TablesAreAppendOnlyFromVersionOne) {
  // ABI 1.0: 8-byte header + 38 host service slots; header, 2 x uint16, 3 strings + 9 slots.
  // ABI 1.1 appended 6 host slots (model_info, trace_begin, trace_end, report_metric,
  // config_int_list, profile_stages); ABI 1.2 appended 6 more (buffer_create, buffer_release,
  // tensor_copy, tensor_scale, tensor_add, tensor_squared_norm); ABI 1.3 appended 5 (parameter_shard,
  // parameter_grad_shard, parameter_grad_release, parameter_release, parameter_materialize,
  // stage_memory) and 4 plugin slots (flat_shard, after_optimizer_step, materialize_parameters,
  // memory_plan). ABI 1.5 appended attention_block; ABI 1.11 backward_input, backward_weight and
  // weight_pass_release.
  EXPECT_EQ(sizeof(weft_host_api), 8 + 63 * sizeof(void*));  // + 1.12's mesh_info, group_mesh, 1.14's parameter_grad_step
  EXPECT_EQ(offsetof(weft_host_api, attention_block), 8 + 56 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, backward_input), 8 + 57 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, weight_pass_release), 8 + 59 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, status_create), 8u);
  EXPECT_EQ(offsetof(weft_host_api, activation_release), 8 + 37 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, model_info), 8 + 38 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, report_metric), 8 + 41 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, config_int_list), 8 + 42 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, profile_stages), 8 + 43 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, buffer_create), 8 + 44 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, tensor_squared_norm), 8 + 49 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, parameter_shard), 8 + 50 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, parameter_materialize), 8 + 54 * sizeof(void*));
  // weft_flat_shard (1.3).
  EXPECT_EQ(sizeof(weft_flat_shard), 24u);
  EXPECT_EQ(offsetof(weft_flat_shard, flags), 16u);
  EXPECT_EQ(offsetof(weft_host_api, stage_memory), 8 + 55 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_stage_memory, output_bytes_per_row), 40u);
  // ABI 1.6 appended compute_parameter_bytes and compute_trainable_bytes (a 1.3 caller's
  // struct_size of 48 still reads the old fields only).
  EXPECT_EQ(offsetof(weft_stage_memory, compute_parameter_bytes), 48u);
  EXPECT_EQ(sizeof(weft_stage_memory), 64u);
  EXPECT_EQ(WEFT_FLAT_SHARD_COMPUTE_DTYPE, 2u);
  EXPECT_EQ(offsetof(weft_memory_plan, buffer_bytes), 56u);
  // weft_model_info (1.1): fields are only ever appended.
  EXPECT_EQ(offsetof(weft_model_info, num_layers), 4u);
  EXPECT_EQ(offsetof(weft_model_info, hidden_size), 8u);
  EXPECT_EQ(offsetof(weft_model_info, compute_dtype), 52u);
  EXPECT_EQ(sizeof(weft_model_info), 56u);
  // ABI 1.4 appended the plugin's sequence_exchange and weft_model_plan's sequence fields.
  EXPECT_EQ(offsetof(weft_strategy_api, sequence_exchange), 16 + 3 * sizeof(void*) + 13 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_model_plan, data_parallel_rank), 28u);
  EXPECT_EQ(offsetof(weft_model_plan, sequence_parallel_size), 32u);
  EXPECT_EQ(offsetof(weft_strategy_api, comm_point), 16 + 3 * sizeof(void*) + 8 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_strategy_api, flat_shard), 16 + 3 * sizeof(void*) + 9 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_strategy_api, memory_plan), 16 + 3 * sizeof(void*) + 12 * sizeof(void*));
  // ABI 1.5 appended the plugin's sequence_attention, the host's attention_block, weft_model_plan's
  // layout and attention fields, and the structs of the attention calls.
  EXPECT_EQ(offsetof(weft_strategy_api, sequence_attention), 16 + 3 * sizeof(void*) + 14 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, attention_block), 8 + 56 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_model_plan, sequence_parallel_layout), 40u);
  EXPECT_EQ(offsetof(weft_model_plan, sequence_parallel_attention), 44u);
  EXPECT_EQ(offsetof(weft_attention_call, layer), 8u);
  EXPECT_EQ(offsetof(weft_attention_call, q), 24u);
  EXPECT_EQ(sizeof(weft_attention_call), 24 + 9 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_attention_block, q_position), 8u);
  EXPECT_EQ(offsetof(weft_attention_block, q), 40u);
  EXPECT_EQ(sizeof(weft_attention_block), 40 + 9 * sizeof(void*));
  // ABI 1.7 and 1.8 appended comm points; the earlier ones keep their values.
  EXPECT_EQ(WEFT_COMM_HEAD_INPUT, 7);
  EXPECT_EQ(WEFT_COMM_ROW_ABSMAX, 8);
  EXPECT_EQ(WEFT_COMM_ADAPTER_SUM, 9);  // 1.8
  // ABI 1.9 appended the plugin's sequence_region and weft_model_plan's tensor_sequence fields
  // (the 1.5 fields keep their offsets: a 1.5 host's struct_size of 48 covers them only).
  EXPECT_EQ(offsetof(weft_strategy_api, sequence_attention), 16 + 3 * sizeof(void*) + 14 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_strategy_api, sequence_region), 16 + 3 * sizeof(void*) + 15 * sizeof(void*));
  // ABI 1.12 appended mesh_dimensions (data: 2 x uint32) and finish_step, finish_eval,
  // gradient_copies.
  EXPECT_EQ(offsetof(weft_strategy_api, mesh_dimensions), 16 + 3 * sizeof(void*) + 16 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_strategy_api, finish_step), 16 + 3 * sizeof(void*) + 16 * sizeof(void*) + 8);
  EXPECT_EQ(sizeof(weft_strategy_api), 16 + 3 * sizeof(void*) + 19 * sizeof(void*) + 8);
  EXPECT_EQ(offsetof(weft_model_plan, tensor_sequence_size), 48u);
  EXPECT_EQ(offsetof(weft_model_plan, tensor_sequence_rank), 52u);
  // ABI 1.10 appended virtual pipeline stages: stage_chunks and the chunks' ranges.
  EXPECT_EQ(offsetof(weft_model_plan, stage_chunks), 56u);
  EXPECT_EQ(offsetof(weft_model_plan, chunk_stages), 64u);
  EXPECT_EQ(WEFT_MAX_STAGE_CHUNKS, 16);
  // ABI 1.11 appended split_backward (zero-bubble schedules).
  EXPECT_EQ(offsetof(weft_model_plan, split_backward), 64u + 2 * 16 * 8);
  // ABI 1.14 appended drives_stages (a 1.13 host's struct_size of 328 stops before it).
  EXPECT_EQ(offsetof(weft_model_plan, drives_stages), 64u + 2 * 16 * 8 + 8);
  EXPECT_EQ(sizeof(weft_model_plan), 64u + 2 * 16 * 8 + 16);
  EXPECT_EQ(WEFT_ABI_VERSION_MAJOR, 1);
  // ABI 1.12: the host's mesh_info and group_mesh, weft_mesh_info, weft_mesh_dim.
  EXPECT_EQ(offsetof(weft_host_api, mesh_info), 8 + 60 * sizeof(void*));
  EXPECT_EQ(offsetof(weft_host_api, group_mesh), 8 + 61 * sizeof(void*));
  EXPECT_EQ(sizeof(weft_mesh_info), 48u);
  EXPECT_EQ(WEFT_MESH_PP, 0);
  EXPECT_EQ(WEFT_MESH_TP, 3);
  // ABI 1.13 appended stage_tokens to weft_step_info and weft_memory_plan (a 1.12 host's struct_size
  // of 48 / 64 stops before it: the SDK then reads seq_len).
  EXPECT_EQ(offsetof(weft_step_info, seq_len), 40u);
  EXPECT_EQ(offsetof(weft_step_info, stage_tokens), 48u);
  EXPECT_EQ(sizeof(weft_step_info), 56u);
  EXPECT_EQ(offsetof(weft_memory_plan, stage_tokens), 64u);
  EXPECT_EQ(sizeof(weft_memory_plan), 72u);
  // ABI 1.14 appended the host's parameter_grad_step.
  EXPECT_EQ(offsetof(weft_host_api, parameter_grad_step), 8 + 62 * sizeof(void*));
  EXPECT_EQ(WEFT_ABI_VERSION_MINOR, 14);
}

}  // namespace
