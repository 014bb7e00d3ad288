#include "core/job/options.h"

#include <filesystem>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>

#include "core/util/fs.h"

namespace weft {
namespace {

// One configuration key: its schema entry (name, type, default, doc, constraints) and how it sets
// its TrainOptions member.
struct Row {
  SchemaEntry entry;
  std::function<void(TrainOptions&, const ConfigValue&)> set;
};

using Bound = std::optional<double>;
constexpr std::nullopt_t none = std::nullopt;

// The member a key sets, as an accessor: WEFT_MEMBER(optim.lr).
#define WEFT_MEMBER(member) [](TrainOptions& o) -> auto& { return o.member; }

template <typename Access>
Row int_key(std::string key, Access member, int64_t def, std::string doc, Bound min = none, Bound max = none) {
  return {{std::move(key), ValueType::Int, def, std::move(doc), {}, min, max},
          [member](TrainOptions& o, const ConfigValue& v) {
            auto& field = member(o);
            field = static_cast<std::remove_reference_t<decltype(field)>>(std::get<int64_t>(v));
          }};
}
template <typename Access>
Row float_key(std::string key, Access member, double def, std::string doc, Bound min = none, Bound max = none) {
  return {{std::move(key), ValueType::Float, def, std::move(doc), {}, min, max},
          [member](TrainOptions& o, const ConfigValue& v) { member(o) = std::get<double>(v); }};
}
template <typename Access>
Row bool_key(std::string key, Access member, bool def, std::string doc) {
  return {{std::move(key), ValueType::Bool, def, std::move(doc), {}, none, none},
          [member](TrainOptions& o, const ConfigValue& v) { member(o) = std::get<bool>(v); }};
}
template <typename Access>
Row string_key(std::string key, Access member, std::string def, std::string doc, std::vector<std::string> choices = {}) {
  return {{std::move(key), ValueType::String, std::move(def), std::move(doc), std::move(choices), none, none},
          [member](TrainOptions& o, const ConfigValue& v) { member(o) = std::get<std::string>(v); }};
}
template <typename Access>
Row list_key(std::string key, Access member, std::vector<std::string> def, std::string doc) {
  return {{std::move(key), ValueType::StringList, std::move(def), std::move(doc), {}, none, none},
          [member](TrainOptions& o, const ConfigValue& v) { member(o) = std::get<std::vector<std::string>>(v); }};
}
// A key whose default the run decides (`text` says what it is): its member is a std::optional,
// left empty unless a file or an override sets the key.
Row decided_by_run(Row row, std::string text) {
  row.entry.default_text = std::move(text);
  return row;
}
// A bound that the value may not equal: exclusive(float_key(...), /*min=*/true, /*max=*/false).
Row exclusive(Row row, bool min, bool max) {
  row.entry.min_exclusive = min;
  row.entry.max_exclusive = max;
  return row;
}

const std::vector<SchemaSection>& sections() {
  static const std::vector<SchemaSection> sections = {
      {"model", "Model architecture and initial weights.", false},
      {"data", "Training data, tokenizer and held-out split.", false},
      {"train", "Optimisation: mode, batch, learning-rate schedule, AdamW, precision.", false},
      {"lora", "LoRA adapters (used when train.mode = \"lora\", and for \"adalora\" their alpha, dropout and targets).", false},
      {"adalora", "AdaLoRA's rank budget (used when train.mode = \"adalora\"; PEFT's AdaLoraConfig).", false},
      {"prompt_tuning", "Virtual tokens (used when train.mode = \"prompt_tuning\"; PEFT's PromptTuningConfig).", false},
      {"eval", "Held-out evaluation and early stopping.", false},
      {"checkpoint", "Checkpoint saving and resuming.", false},
      {"backup", "Checkpoints backed up to S3-compatible storage (AWS S3, MinIO, Ceph RGW) while training; "
                 "credentials only from the AWS environment variables or ~/.aws/credentials.", false},
      {"generate", "Text generation (trainer generate --prompt ...).", false},
      {"log", "Console logging and the metrics file.", false},
      {"mesh", "The device mesh of a run that composes several plugins (train.plugin = \"tensor_parallel,gpipe\"): "
               "ranks along each dimension, world rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i.", false},
      {"plugin", "Free-form settings for a strategy plugin (any keys, not validated here). A sub-table named after a "
       "plugin overrides them for that plugin alone, e.g. in a composed run `[plugin.context_parallel] mode = "
       "\"ring\"` beside pipedream's `mode` (`--set plugin.context_parallel.mode=\"ring\"`).", true},
  };
  return sections;
}

// Every key, once: grouped by section, in the order of sections().
const std::vector<Row>& rows() {
  static const std::vector<Row> rows = {
      // [model]
      string_key("model.preset", WEFT_MEMBER(model.preset), "tiny",
                 "Named model shape (\"\" = none, model.config required); ignored when model.config "
                 "is set.",
                 {"tiny", "small", "llama-3.2-1b", "llama-3.2-3b", ""}),
      string_key("model.config", WEFT_MEMBER(model.config_path), "", "Path to an HF config.json describing the model shape."),
      string_key("model.weights", WEFT_MEMBER(model.weights), "",
                 "Weights to load: a safetensors file, an HF model folder or index, or a GGUF file of the llama "
                 "architecture (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, dequantized to fp32; the "
                 "model's shape from its metadata); empty = seeded random init."),
      string_key("model.adapter", WEFT_MEMBER(model.adapter), "",
                 "A LoRA adapter directory (PEFT: adapter_config.json, adapter_model.safetensors) applied on top "
                 "of model.weights; train it further with train.mode = \"lora\". Empty = none."),
      float_key("model.init_std", WEFT_MEMBER(model.init_std), 0.02, "Standard deviation of the random weight init.", 0),
      int_key("model.vocab_size", WEFT_MEMBER(model.vocab_size), 0,
              "Vocabulary size override; 0 = the preset's or config's value (must cover the tokenizer).",
              0),
      bool_key("model.activation_checkpointing", WEFT_MEMBER(model.activation_checkpointing), false,
               "Recompute each decoder block in backward instead of storing its activations."),
      bool_key("model.chunked_loss", WEFT_MEMBER(model.chunked_loss), true,
               "Compute the LM head with its cross-entropy in chunks of rows (Liger's fused linear + cross-entropy: "
               "the gradients in the same pass), never holding the whole logits: a causal LM whose whole "
               "vocabulary and tokens are on the last stage's rank, a head without an adapter. false: the "
               "logits [rows, seq, vocab], then the loss."),
      string_key("model.quantize", WEFT_MEMBER(model.quantize), "none",
                 "Store the decoder blocks' frozen linear weights quantized (adapter training only): int8 = "
                 "LLM.int8's per-row absmax, nf4 = QLoRA's 4-bit NormalFloat (blocks of 64, double-quantized "
                 "scales); quantized at load, one tensor at a time.",
                 {"none", "int8", "nf4"}),
      float_key("model.int8_threshold", WEFT_MEMBER(model.int8_threshold), 6.0,
                "int8 on the CPU's int8 GEMM (model.int8_gemm): input elements of magnitude >= this are "
                "LLM.int8's outliers, multiplied in fp32; the rest are quantized per token to 7 bits. 0 = no "
                "outliers.",
                0),
      bool_key("model.int8_gemm", WEFT_MEMBER(model.int8_gemm), true,
               "int8 on the CPU: multiply in LibTorch's int8 GEMM (quantized::linear_dynamic, onednn/x86/fbgemm), "
               "LLM.int8's scheme; false = dequantize each layer for a float GEMM (the int8 weights' exact "
               "function). CUDA, and a LibTorch without an exact CPU int8 GEMM, always dequantize."),
      string_key("model.frozen_dtype", WEFT_MEMBER(model.frozen_dtype), "fp32",
                 "Adapter training (lora, adalora): how the frozen base's matrices that are not quantized "
                 "(embedding, LM head, unquantized block weights) are stored; bf16 halves them, as a PEFT user "
                 "loads the base in bf16. Each product casts its layer to the compute dtype; norms, adapters and "
                 "a classifier's head stay fp32.",
                 {"fp32", "bf16"}),
      bool_key("model.cache_frozen_casts", WEFT_MEMBER(model.cache_frozen_casts), true,
               "Adapter training with a compute dtype narrower than the frozen base's storage (fp32 weights, "
               "train.precision = \"bf16\"): keep each frozen matrix's compute-dtype copy (a fused group's "
               "stacked) between steps instead of casting it in every forward, made again when the weights "
               "change. Costs that copy (bf16: half the fp32 base), which a forward without checkpointing holds "
               "for backward anyway; off under a plugin that releases parameters between uses (ZeRO-3)."),
      // [data]
      list_key("data.path", WEFT_MEMBER(data.paths), {"data/austen/austen.jsonl"},
               "Training files or directories: text .txt, JSONL .jsonl, or tokens .u16/.u32/.bin."),
      string_key("data.format", WEFT_MEMBER(data.format), "auto",
                 "Input format; auto = by file extension; glue = a GLUE task's directory of TSV files as "
                 "distributed (train.task = \"classification\", with data.glue_task); chat = instruction JSONL "
                 "as TRL's SFTTrainer reads it ({\"messages\": [...]}, or \"prompt\" and \"completion\"), "
                 "rendered with the tokenizer's chat template, one example per sequence.",
                 {"auto", "text", "jsonl", "tokens-u16", "tokens-u32", "glue", "chat"}),
      string_key("data.loss_on", WEFT_MEMBER(chat.loss_on), "assistant",
                 "data.format = \"chat\": the tokens the loss counts; assistant = the assistant messages' "
                 "(or the completion's) tokens, as TRL's assistant_only_loss / completion_only_loss; all = every "
                 "token.",
                 {"assistant", "all"}),
      bool_key("data.packing", WEFT_MEMBER(chat.packing), false,
               "data.format = \"chat\": several examples per sequence, as TRL's packing = True (best fit "
               "decreasing into sequences of seq_len + 1 tokens, in runs of 1000 examples); each example keeps "
               "its own positions and attends to itself only. Not with prompt tuning or a plugin's own attention "
               "core (ring attention)."),
      string_key("data.text_field", WEFT_MEMBER(data.text_field), "text", "Field of each JSONL record that holds the text."),
      string_key("data.glue_task", WEFT_MEMBER(classification.glue_task), "",
                 "data.format = \"glue\": the task whose files data.path holds (train.tsv, dev.tsv; MNLI also "
                 "dev_matched.tsv and dev_mismatched.tsv).",
                 {"", "cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}),
      string_key("data.pair_field", WEFT_MEMBER(classification.pair_field), "text_pair",
                 "Classification from JSONL: the field holding an optional second text (a sentence pair)."),
      string_key("data.label_field", WEFT_MEMBER(classification.label_field), "label",
                 "Classification from JSONL: the field holding the label (a class name, an integer id, or a score "
                 "with data.regression)."),
      list_key("data.labels", WEFT_MEMBER(classification.labels), {},
               "Classification from JSONL: the class names in id order; empty = 0..max for integer labels, else "
               "the distinct labels sorted."),
      bool_key("data.regression", WEFT_MEMBER(classification.regression), false,
               "Classification from JSONL: the labels are scores (one output, mean squared error, Pearson and "
               "Spearman), as GLUE's STS-B."),
      string_key("data.text_document", WEFT_MEMBER(data.text_document), "paragraph", "How plain text is cut into documents.",
                 {"file", "paragraph", "line"}),
      string_key("data.tokenizer", WEFT_MEMBER(tokenizer), "byte",
                 "\"byte\" for the built-in byte tokenizer, a tokenizer.json (or its directory), or a GGUF file (the "
                 "tokenizer in its metadata)."),
      int_key("data.seq_len", WEFT_MEMBER(data.seq_len), 256, "Tokens per training sequence.", 2),
      float_key("data.heldout_fraction", WEFT_MEMBER(data.heldout_fraction), 0.1, "Fraction of documents held out for evaluation.", 0,
                0.9),
      int_key("data.split_seed", WEFT_MEMBER(data.split_seed), 1234, "Seed of the train/held-out document split."),
      int_key("data.max_documents", WEFT_MEMBER(data.max_documents), 0, "Use at most this many documents (classification: examples, drawn by data.split_seed); 0 = all.", 0),
      string_key("data.cache_dir", WEFT_MEMBER(data.cache_dir), ".cache/weft", "Directory for cached tokenized data."),
      decided_by_run(bool_key("data.add_bos", WEFT_MEMBER(data.add_bos), true,
                              "Prepend the BOS token to each document (and to a generation prompt)."),
                     "the tokenizer's"),
      decided_by_run(bool_key("data.add_eos", WEFT_MEMBER(data.add_eos), true, "Append the EOS token to each document."),
                     "the tokenizer's"),
      // [train]
      string_key("train.mode", WEFT_MEMBER(mode), "full",
                 "Train all weights (full), LoRA adapters only (lora), AdaLoRA's adapters with their rank budget "
                 "(adalora), or virtual-token embeddings before every sequence (prompt_tuning, PEFT's prompt tuning).",
                 {"full", "lora", "adalora", "prompt_tuning"}),
      string_key("train.task", WEFT_MEMBER(task), "causal_lm",
                 "causal_lm = next-token prediction on text; classification = LlamaForSequenceClassification's head "
                 "on labeled examples (data.format = \"glue\", or JSONL with data.label_field), with the task's "
                 "metrics at each evaluation.",
                 {"causal_lm", "classification"}),
      int_key("train.seed", WEFT_MEMBER(seed), 1234, "Seed for initialisation, shuffling and dropout."),
      int_key("train.epochs", WEFT_MEMBER(epochs), 1, "Passes over the training set.", 1),
      int_key("train.max_steps", WEFT_MEMBER(max_steps), 0, "Stop after this many optimizer steps; 0 = no limit.", 0),
      int_key("train.batch_size", WEFT_MEMBER(batch_size), 8,
              "Global micro-batch: sequences per forward/backward, summed over data-parallel ranks.",
              1),
      int_key("train.grad_accum_steps", WEFT_MEMBER(grad_accum_steps), 1, "Micro-batches accumulated per optimizer step.", 1),
      float_key("train.lr", WEFT_MEMBER(optim.lr), 3e-4, "Peak learning rate.", 0),
      float_key("train.min_lr_ratio", WEFT_MEMBER(optim.min_lr_ratio), 0.1, "Final learning rate as a fraction of train.lr.", 0, 1),
      int_key("train.warmup_steps", WEFT_MEMBER(optim.warmup_steps), 100, "Linear warm-up steps from 0 to train.lr.", 0),
      string_key("train.schedule", WEFT_MEMBER(optim.schedule), "cosine", "Learning-rate decay after warm-up.",
                 {"cosine", "linear", "constant"}),
      float_key("train.weight_decay", WEFT_MEMBER(optim.weight_decay), 0.1, "AdamW decoupled weight decay.", 0),
      exclusive(float_key("train.beta1", WEFT_MEMBER(optim.beta1), 0.9, "AdamW first-moment decay.", 0, 1), false, true),
      exclusive(float_key("train.beta2", WEFT_MEMBER(optim.beta2), 0.95, "AdamW second-moment decay.", 0, 1), false, true),
      exclusive(float_key("train.eps", WEFT_MEMBER(optim.eps), 1e-8, "AdamW denominator epsilon.", 0), true, false),
      float_key("train.grad_clip", WEFT_MEMBER(optim.grad_clip), 1.0, "Clip the global gradient norm to this; 0 = off.", 0),
      string_key("train.precision", WEFT_MEMBER(precision), "fp32",
                 "Compute precision over fp32 master weights: fp32, bf16, or fp16 with dynamic loss scaling.",
                 {"fp32", "bf16", "fp16"}),
      exclusive(float_key("train.loss_scale", WEFT_MEMBER(loss_scale), 65536.0,
                          "fp16: the initial dynamic loss scale (halved after a step with non-finite gradients, which "
                          "is skipped; doubled after 2000 finite steps).",
                          0),
                true, false),
      string_key("train.device", WEFT_MEMBER(device), "auto",
                 "Where each rank computes: cuda (cuda:LOCAL_RANK), cpu, or auto (cuda when this build has CUDA and a "
                 "GPU is visible).",
                 {"auto", "cpu", "cuda"}),
      float_key("train.peak_tflops", WEFT_MEMBER(peak_tflops), 0.0,
                "The device's peak TFLOP/s at train.precision for model FLOP utilisation; 0 = from weft's table of "
                "known GPUs (none for CPUs).",
                0),
      int_key("train.threads", WEFT_MEMBER(threads), 1, "Intra-op threads per process.", 1),
      string_key("train.fp32_cpu_gemm", WEFT_MEMBER(fp32_cpu_gemm), "auto",
                 "The library that multiplies fp32 matrices on the CPU: aten = ATen's (its BLAS: MKL in PyTorch's "
                 "x86 builds), onednn = oneDNN's matmul in the same LibTorch, auto = onednn where ATen's BLAS is MKL on "
                 "an AMD CPU of family 0x1A or later (Zen 5, whose full-width AVX-512 MKL leaves to its AVX2 kernels) "
                 "and oneDNN takes fp32, aten elsewhere. The summary's fp32_cpu_gemm says which ran. Results differ "
                 "by rounding only.",
                 {"auto", "aten", "onednn"}),
      string_key("train.out_dir", WEFT_MEMBER(out_dir), "runs/default",
                 "Run directory for checkpoints, metrics and the effective config."),
      // A string or a list of strings: the list's names joined with commas (TrainOptions::plugin).
      Row{{"train.plugin", ValueType::StringList, std::vector<std::string>{},
           "Strategy plugin: a path or a name found in the build's plugins/ or WEFT_PLUGIN_PATH (e.g. \"ddp\"); empty = "
           "single, built into the host (one process, the reference step). Several, as a list ([\"tensor_parallel\", "
           "\"gpipe\"]) or comma-separated (\"tensor_parallel,gpipe\", as --plugin takes them), compose over the "
           "device mesh ([mesh]), one per dimension.",
           {}, none, none},
          [](TrainOptions& o, const ConfigValue& v) {
            o.plugin.clear();
            for (const auto& name : std::get<std::vector<std::string>>(v)) o.plugin += (o.plugin.empty() ? "" : ",") + name;
          }},
      float_key("train.collective_timeout_s", WEFT_MEMBER(collective_timeout_s), 300.0,
                "Seconds a collective or the start-up rendezvous may take before the run stops with an error naming it.",
                1.0),
      bool_key("train.shared_memory_collectives", WEFT_MEMBER(shared_memory_collectives), true,
               "Ranks on one machine all-reduce and reduce-scatter CPU fp32 and bf16 sums (data parallelism's "
               "gradient buckets, sharded gradients) and all-gather CPU tensors through a shared memory segment (1 MiB "
               "per rank in /dev/shm) instead of Gloo's loopback connections; ranks on other machines, and every "
               "other operation, stay on Gloo (or NCCL)."),
      float_key("train.memory_limit_gib", WEFT_MEMBER(memory_limit_gib), 0.0,
                "GiB the memory plan may use before compute: on the CPU, all ranks of a machine together; on CUDA, "
                "each rank's device. 0 = the machine's memory (MemTotal) or the device's. A run whose plan exceeds it "
                "is refused before the model is built (trainer plan prints the plan).",
                0),
      bool_key("train.overwrite", WEFT_MEMBER(overwrite), false,
               "Start fresh even if out_dir already holds checkpoints or saved models (they are replaced)."),
      // [lora]
      int_key("lora.r", WEFT_MEMBER(lora.spec.r), 8, "Rank of the LoRA update matrices.", 1),
      exclusive(float_key("lora.alpha", WEFT_MEMBER(lora.spec.alpha), 16, "LoRA scaling numerator (the update is scaled by alpha / r).", 0),
                true, false),
      exclusive(float_key("lora.dropout", WEFT_MEMBER(lora.spec.dropout), 0.05, "Dropout on the LoRA input.", 0, 1), false, true),
      list_key("lora.target_modules", WEFT_MEMBER(lora.target_modules), {"q_proj", "k_proj", "v_proj", "o_proj"},
               "Linear layers that get LoRA adapters (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head)."),
      bool_key("lora.save_merged", WEFT_MEMBER(save_merged), false,
               "At the end, also save the base model with the adapters merged in (<out_dir>/final-merged)."),
      // [prompt_tuning]
      int_key("prompt_tuning.num_virtual_tokens", WEFT_MEMBER(prompt_tuning.num_virtual_tokens), 32,
              "Trainable embeddings put before every sequence (each sequence grows by this many positions).", 1),
      string_key("prompt_tuning.init", WEFT_MEMBER(prompt_tuning.init), "random",
                 "How they start: random = N(0, 1) as PEFT's RANDOM; text = the embeddings of "
                 "prompt_tuning.init_text's tokens, repeated or cut to num_virtual_tokens (PEFT's TEXT).",
                 {"random", "text"}),
      string_key("prompt_tuning.init_text", WEFT_MEMBER(prompt_tuning.init_text), "",
                 "prompt_tuning.init = \"text\": the text (tokenized with the checkpoint's framing, as PEFT does)."),
      // [adalora]
      int_key("adalora.init_r", WEFT_MEMBER(adalora.spec.r), 12, "Rank every adapted layer starts at.", 1),
      int_key("adalora.target_r", WEFT_MEMBER(adalora.target_r), 8,
              "Average rank per layer the budget falls to (the budget is target_r x layers, shared unevenly).", 0),
      int_key("adalora.tinit", WEFT_MEMBER(adalora.tinit), 0, "Steps at the initial budget before pruning starts.", 0),
      int_key("adalora.tfinal", WEFT_MEMBER(adalora.tfinal), 0,
              "Steps at the end with the final budget and its pattern fixed.", 0),
      int_key("adalora.deltaT", WEFT_MEMBER(adalora.delta_t), 1, "Steps between two budget reallocations.", 1),
      exclusive(float_key("adalora.beta1", WEFT_MEMBER(adalora.beta1), 0.85, "EMA factor of the sensitivity.", 0, 1),
                true, true),
      exclusive(float_key("adalora.beta2", WEFT_MEMBER(adalora.beta2), 0.85, "EMA factor of its uncertainty.", 0, 1),
                true, true),
      float_key("adalora.orth_reg_weight", WEFT_MEMBER(adalora.orth_reg_weight), 0.5,
                "Weight of the orthogonal regularisation of P and Q in the loss.", 0),
      int_key("adalora.total_step", WEFT_MEMBER(adalora.total_step), 0,
              "Length of the budget schedule in optimizer steps; 0 = the run's total steps.", 0),
      // [eval]
      int_key("eval.every_steps", WEFT_MEMBER(eval_every), 0, "Evaluate every N optimizer steps (and at each epoch end; one due within N/2 steps after an epoch end is skipped); 0 = only at each epoch end.",
              0),
      int_key("eval.max_batches", WEFT_MEMBER(eval_max_batches), 0, "Batches per evaluation; 0 = the whole held-out set.", 0),
      int_key("eval.batch_size", WEFT_MEMBER(eval_batch_size), 0, "Sequences per evaluation batch; 0 = train.batch_size.", 0),
      int_key("eval.patience", WEFT_MEMBER(patience), 0,
              "Evaluations without improvement before early stopping; 0 = off.", 0),
      bool_key("eval.on_start", WEFT_MEMBER(eval_on_start), false,
               "Also evaluate the starting model before the first step (step 0 in metrics.jsonl: a pretrained "
               "model's held-out loss to compare the run with); a resumed run does not evaluate again."),
      // [checkpoint]
      int_key("checkpoint.every_steps", WEFT_MEMBER(checkpoint_every), 0, "Save a checkpoint every N optimizer steps; 0 = off.", 0),
      int_key("checkpoint.keep_last", WEFT_MEMBER(keep_last), 2, "Periodic checkpoints to keep (older ones are deleted).",
              1),
      string_key("checkpoint.resume", WEFT_MEMBER(resume), "",
                 "\"\" = start fresh, \"auto\" = latest in train.out_dir if any, or a checkpoint "
                 "directory."),
      bool_key("checkpoint.save_final", WEFT_MEMBER(save_final), true,
               "Save the final model when training ends (train.out_dir/final/, an HF model folder, or the adapters "
               "under LoRA): a model to evaluate or start from (model.weights), not a checkpoint to resume "
               "(checkpoint.every_steps writes those)."),
      bool_key("checkpoint.keep_best", WEFT_MEMBER(keep_best), true,
               "Keep the checkpoint with the best held-out loss as well."),
      // [backup]
      string_key("backup.url", WEFT_MEMBER(backup.url), "",
                 "\"s3://bucket/prefix\": upload every checkpoint there in the background; \"\" = no backup."),
      string_key("backup.endpoint", WEFT_MEMBER(backup.endpoint), "",
                 "S3 endpoint URL (MinIO, Ceph RGW: \"http(s)://host:port\", path-style); \"\" = AWS."),
      string_key("backup.region", WEFT_MEMBER(backup.region), "",
                 "Region that signs the requests; \"\" = AWS_REGION, AWS_DEFAULT_REGION, else us-east-1."),
      int_key("backup.keep_last", WEFT_MEMBER(backup.keep_last), 0,
              "Complete checkpoints to keep in the bucket (older ones are deleted); 0 = checkpoint.keep_last.", 0),
      int_key("backup.part_size_mb", WEFT_MEMBER(backup.part_size_mb), 64,
              "Files larger than this go as multipart uploads of parts this size (MiB; S3's minimum is 5).", 5, 5120),
      float_key("backup.max_mb_per_s", WEFT_MEMBER(backup.max_mb_per_second), 0.0,
                "Upload rate cap in MB/s, so the backup leaves the network to training; 0 = unlimited.", 0.0),
      int_key("backup.retries", WEFT_MEMBER(backup.retries), 5,
              "Retries of each failed request (exponential backoff from 0.5 s, at most 30 s) before the "
              "checkpoint's backup is given up with a warning.", 0, 20),
      // [generate]
      int_key("generate.max_new_tokens", WEFT_MEMBER(max_new_tokens), 64, "Tokens to generate after the prompt (trainer generate).", 1),
      float_key("generate.temperature", WEFT_MEMBER(temperature), 0.0, "Sampling temperature; 0 = greedy (the most likely token).", 0.0),
      exclusive(float_key("generate.top_p", WEFT_MEMBER(top_p), 1.0, "Nucleus sampling: sample among the most likely tokens whose "
                          "probabilities sum to top_p (with temperature > 0).", 0.0, 1.0),
                true, false),
      int_key("generate.seed", WEFT_MEMBER(generate_seed), 0, "Seed of the sampler (every rank draws the same tokens).", 0),
      string_key("generate.system", WEFT_MEMBER(chat_system), "",
                 "trainer generate --chat: a system message before the user's; empty = none (the template's "
                 "default, if it has one)."),
      // [log]
      string_key("log.level", WEFT_MEMBER(log_level), "info", "Console log level.",
                 {"trace", "debug", "info", "warn", "error"}),
      string_key("log.progress", WEFT_MEMBER(progress), "auto",
                 "Progress display; auto = a bar on a terminal, lines otherwise.",
                 {"auto", "bar", "lines", "off"}),
      int_key("log.every_steps", WEFT_MEMBER(log_every), 10, "Log training metrics every N optimizer steps.", 1),
      string_key("log.metrics_file", WEFT_MEMBER(metrics_file), "", "JSONL metrics file; empty = <out_dir>/metrics.jsonl."),
      string_key("log.trace", WEFT_MEMBER(trace_file), "",
                 "Chrome/Perfetto trace file (open in ui.perfetto.dev or chrome://tracing); ranks of "
                 "a multi-process run write FILE.rank<r>.json; empty = off. Also --trace FILE."),
      string_key("log.torch_profile", WEFT_MEMBER(torch_profile), "",
                 "PyTorch's profiler (Kineto) over a few training steps: every operator, and every CUDA "
                 "kernel on a GPU, as a Chrome trace (ranks of a multi-process run write "
                 "FILE.rank<r>.json; tools/gpu/profile_summary.py sums it by kernel); empty = off."),
      int_key("log.torch_profile_from", WEFT_MEMBER(torch_profile_from), 5,
              "log.torch_profile: the optimizer steps done before recording starts (warm-up).", 0),
      int_key("log.torch_profile_steps", WEFT_MEMBER(torch_profile_steps), 3,
              "log.torch_profile: how many optimizer steps are recorded.", 1),
      // [mesh]
      int_key("mesh.pp", WEFT_MEMBER(mesh_pp), 0,
              "Pipeline stages (the plugin owning pp: gpipe, pipedream); 0 = what is left when it is the one size "
              "not given.", 0),
      int_key("mesh.dp", WEFT_MEMBER(mesh_dp), 0, "Data-parallel replicas (ddp); 0 = what the other sizes leave.", 0),
      int_key("mesh.cp", WEFT_MEMBER(mesh_cp), 0, "Context-parallel ranks (context_parallel); 0 = as mesh.pp.", 0),
      int_key("mesh.tp", WEFT_MEMBER(mesh_tp), 0, "Tensor-parallel ranks (tensor_parallel); 0 = as mesh.pp.", 0),
  };
  return rows;
}

}  // namespace

const Schema& run_schema() {
  static const Schema schema = [] {
    Schema s;
    s.sections = sections();
    for (const Row& row : rows()) s.entries.push_back(row.entry);
    return s;
  }();
  return schema;
}

TrainOptions::TrainOptions() {
  for (const Row& row : rows()) {
    if (row.entry.default_text.empty()) row.set(*this, row.entry.default_value);
  }
}

Config load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_config(run_schema(), path, overrides);
}

TrainOptions train_options_from_config(const Config& config) {
  TrainOptions o;
  for (const Row& row : rows()) {
    if (row.entry.default_text.empty() || config.is_set(row.entry.key)) row.set(o, config.value(row.entry.key));
  }
  o.plugin_config = config.section_table("plugin");
  if (o.metrics_file.empty()) o.metrics_file = o.out_dir + "/metrics.jsonl";
  return o;
}

void write_run_config(const std::string& out_dir, const Config& config) {
  std::filesystem::create_directories(out_dir);
  write_file_atomically(out_dir + "/config.toml", config.to_toml());
}

}  // namespace weft
