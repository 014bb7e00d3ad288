#!/usr/bin/env bash
# LoRA over a quantized base (model.quantize), measured against the unquantized base:
#   shape    the Llama 3.2 1B shape (random weights, LoRA r 16 on all seven projections, seq 512,
#            batch 1, activation checkpointing): the base's bytes, peak RSS and seconds per step
#            (median over the steps after the first) for each format
#   quality  the small preset trained on the bundled corpus (BASE_STEPS full-training steps), then
#            LoRA on top of it for LORA_STEPS steps with each format: held-out loss (the same 50
#            held-out batches), and its difference from the unquantized base's
# Formats (env FORMATS, default "none int8 int8-dequantize nf4"): model.quantize's values, and
# int8-dequantize = int8 with model.int8_gemm = false (each layer dequantized for a float GEMM
# instead of the CPU's int8 GEMM).
# FROZEN (default fp32) is model.frozen_dtype for every run: bf16 stores the frozen base's other
# matrices (embedding, head, and "none"'s block weights) in bf16, the baseline the quantized
# formats are meant to beat.
# Usage: tools/measure_quantized.sh shape|quality|all   (env: PRECISION, THREADS, STEPS,
# BASE_STEPS, LORA_STEPS, FORMATS, FROZEN, OUT). Run it on an otherwise idle machine; it prints one table
# per part.
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
precision=${PRECISION:-fp32}
threads=${THREADS:-2}
out=${OUT:-$(mktemp -d)}
trainer=build/trainer
frozen=${FROZEN:-fp32}
common=(--set train.precision="$precision" --set train.threads="$threads" --set log.progress=off
        --set checkpoint.keep_best=false --set train.overwrite=true)
targets='["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]'
formats=${FORMATS:-none int8 int8-dequantize nf4}
format_settings() {  # the --set options of a format name
  case $1 in
    int8-dequantize) echo "--set model.quantize=int8 --set model.int8_gemm=false" ;;
    *) echo "--set model.quantize=$1" ;;
  esac
}

summary() {  # a field of the run's summary (the last record of metrics.jsonl)
  python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if "\"summary\"" in l][-1][sys.argv[2]])' \
    "$1/metrics.jsonl" "$2"
}

if [[ $part == shape || $part == all ]]; then
  steps=${STEPS:-3}
  printf "%-15s %14s %14s %12s   (llama-3.2-1b shape, %s, %s thread(s), %s steps)\n" \
    format "base MiB" "peak RSS MiB" "s/step" "$precision, frozen $frozen" "$threads" "$steps"
  for q in $formats; do
    run="$out/shape-$q"
    OMP_NUM_THREADS=$threads $trainer --config configs/base.toml "${common[@]}" --set model.frozen_dtype="$frozen" --set model.preset=llama-3.2-1b \
      --set model.activation_checkpointing=true $(format_settings "$q") --set data.seq_len=512 \
      --set train.batch_size=1 --set train.mode=lora --set lora.r=16 --set lora.alpha=32 \
      --set "lora.target_modules=$targets" --set train.max_steps="$steps" --set eval.max_batches=1 \
      --set checkpoint.save_final=false --set train.out_dir="$run" \
      --log-level info > "$run.log" 2>&1 || { tail -5 "$run.log"; exit 1; }
    base=$(python3 - "$run.log" "$frozen" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"held as \w+ in ([0-9.]+) MiB", text)
if m:
    print(m.group(1))
else:  # unquantized: the blocks' linear weights (16 x 2048 x (2048+512+512+2048+3*8192)), 4 or 2 B each
    print(f"{16 * 2048 * (2048 + 512 + 512 + 2048 + 3 * 8192) * (2 if sys.argv[2] == 'bf16' else 4) / 2**20:.1f}")
PY
)
    printf "%-15s %14s %14.0f %12.2f\n" "$q" "$base" "$(summary "$run" peak_rss_mib)" "$(summary "$run" step_time_median_s)"
  done
fi

if [[ $part == quality || $part == all ]]; then
  base_steps=${BASE_STEPS:-300}
  lora_steps=${LORA_STEPS:-100}
  small=(--set model.preset=small --set data.seq_len=256 --set train.batch_size=8 --set eval.max_batches=50)
  base="$out/quality-base"
  if [[ ! -d $base/final ]]; then
    OMP_NUM_THREADS=$threads $trainer --config configs/base.toml "${common[@]}" "${small[@]}" --set train.lr=2e-3 \
      --set train.max_steps="$base_steps" --set eval.every_steps=0 --set checkpoint.save_final=true \
      --set train.out_dir="$base" --log-level warn > "$base.log" 2>&1 || { tail -5 "$base.log"; exit 1; }
  fi
  printf "%-15s %14s %12s %10s   (small preset: %s full steps, then %s LoRA steps, %s, frozen %s)\n" format \
    "held-out loss" "vs first" "s/step" "$base_steps" "$lora_steps" "$precision" "$frozen"
  reference=""
  for q in $formats; do
    run="$out/quality-$q"
    OMP_NUM_THREADS=$threads $trainer --config configs/base.toml "${common[@]}" "${small[@]}" --set model.frozen_dtype="$frozen" --set model.weights="$base/final" \
      $(format_settings "$q") --set train.mode=lora --set lora.r=16 --set lora.alpha=32 --set "lora.target_modules=$targets" \
      --set train.lr=1e-3 --set train.max_steps="$lora_steps" --set eval.every_steps=0 --set checkpoint.save_final=false \
      --set train.out_dir="$run" --log-level warn > "$run.log" 2>&1 || { tail -5 "$run.log"; exit 1; }
    loss=$(summary "$run" eval_loss)
    reference=${reference:-$loss}
    printf "%-15s %14.4f %11.2f%% %10.3f\n" "$q" "$loss" "$(python3 -c "print(100 * ($loss - $reference) / $reference)")" \
      "$(summary "$run" step_time_median_s)"
  done
fi
echo "runs in $out"
