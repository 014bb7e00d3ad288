#!/usr/bin/env bash
# The bundled classification tasks, measured as docs/performance.md reports them: pretrain the
# 0.8M-parameter model on the Austen corpus (configs/austen-mini.toml, in fp32 here: bf16 is emulated on
# CPUs without AVX-512), then LoRA with a new classification head on 2 ddp ranks for
# configs/austen-novel.toml and configs/fortunes-topic.toml, and `trainer eval` of each adapter on
# its held-out examples next to the majority-class baseline.
#
#   tools/measure_classification.sh [BUILD_DIR] [RUNS_DIR]     (defaults: build, runs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
runs=${2:-runs}
export OMP_NUM_THREADS=1
trainer="$build/trainer"

if [[ ! -f "$runs/austen-mini/final/model.safetensors" ]]; then
  "$trainer" --config configs/austen-mini.toml --set train.precision=fp32 --set train.out_dir="$runs/austen-mini" \
    --set train.overwrite=true --set log.progress=off
fi
for task in austen-novel fortunes-topic; do
  start=$(date +%s)
  "$trainer" --config "configs/$task.toml" --plugin ddp --nproc 2 --set model.weights="$runs/austen-mini/final" \
    --set train.out_dir="$runs/$task" --set train.overwrite=true --set log.progress=off 2>&1 | grep -E "run summary|held-out|time per epoch"
  echo "$task: trained in $(( $(date +%s) - start )) s"
  "$trainer" eval --config "configs/$task.toml" --plugin ddp --nproc 2 --set model.weights="$runs/austen-mini/final" \
    --set model.adapter="$runs/$task/final" --set train.out_dir="$runs/$task-eval" 2>/dev/null
done
