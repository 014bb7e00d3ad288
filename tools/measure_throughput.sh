#!/usr/bin/env bash
# Measures training throughput of a config in one process for each precision and intra-op
# thread count, from the per-step metrics (median over the steps after the first 3 warm-up
# steps). Usage: tools/measure_throughput.sh [CONFIG] [STEPS]
# Until `trainer bench` exists (issue 6) this is the throughput measurement behind README figures.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/small-bench.toml}
steps=${2:-20}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
printf "%-6s %-8s %12s %12s\n" precision threads "tokens/s" "step_s"
for precision in fp32 bf16; do
  for threads in 1 2; do
    run="$out/$precision-$threads"
    OMP_NUM_THREADS=$threads build/trainer --config "$config" --set train.precision=$precision \
      --set train.threads=$threads --set train.max_steps="$steps" --set train.out_dir="$run" \
      --set log.progress=off --set eval.max_batches=1 --set checkpoint.save_final=false \
      --set checkpoint.keep_best=false --log-level warn
    python3 - "$run/metrics.jsonl" "$precision" "$threads" <<'PY'
import json, statistics, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if '"type":"step"' in l]
steps = steps[3:] if len(steps) > 6 else steps
tps = statistics.median(s["tokens_per_s"] for s in steps)
st = statistics.median(s["step_time_s"] for s in steps)
print(f"{sys.argv[2]:<6} {sys.argv[3]:<8} {tps:12.0f} {st:12.3f}")
PY
  done
done
