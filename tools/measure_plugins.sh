#!/usr/bin/env bash
# A/B throughput of strategy plugins on one config: runs each variant in alternation
# (A B C A B C ...), R repetitions, and reports per variant the median over repetitions of each
# run's median tokens/s and step time (steps after the first 3), and the share of step time
# rank 0 spent blocked on communication with the payload bytes per step (host-measured,
# metrics.jsonl comm_wait_s / comm_bytes).
#   usage: tools/measure_plugins.sh [CONFIG] [STEPS] [REPETITIONS] -- VARIANT...
#   VARIANT: "NAME:PLUGIN:NPROC[:--set k=v ...]", e.g. "ddp-b4:ddp:2:--set plugin.bucket_mb=4"
# Until `trainer bench` exists (issue 6) this is the measurement behind the plugin figures.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/small-bench.toml}
steps=${2:-16}
reps=${3:-3}
shift 3 || true
[[ "${1:-}" == "--" ]] && shift
variants=("$@")
[[ ${#variants[@]} -gt 0 ]] || variants=("single:single:1" "ddp:ddp:2")
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for rep in $(seq "$reps"); do
  for variant in "${variants[@]}"; do
    IFS=: read -r name plugin nproc extra <<<"$variant"
    run="$out/$name/$rep"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 build/trainer --config "$config" --plugin "$plugin" --nproc "$nproc" \
      --set train.threads=1 --set train.max_steps="$steps" --set train.out_dir="$run" \
      --set log.progress=off --set eval.max_batches=1 --set checkpoint.save_final=false \
      --set checkpoint.keep_best=false --log-level warn $extra
  done
done
python3 - "$out" "${variants[@]}" <<'PY'
import json, os, statistics, sys
root, variants = sys.argv[1], sys.argv[2:]
print(f"{'variant':<14} {'tokens/s':>9} {'step_s':>7} {'comm_wait':>9} {'MB/step':>8}  runs (tokens/s)")
for v in variants:
    name = v.split(":")[0]
    runs = []
    for rep in sorted(os.listdir(os.path.join(root, name))):
        steps = [json.loads(l) for l in open(os.path.join(root, name, rep, "metrics.jsonl"))
                 if '"type":"step"' in l][3:]
        runs.append((statistics.median(s["tokens_per_s"] for s in steps),
                     statistics.median(s["step_time_s"] for s in steps),
                     sum(s.get("comm_wait_s", 0) for s in steps) / sum(s["step_time_s"] for s in steps),
                     statistics.median(s.get("comm_bytes", 0) for s in steps) / 1e6))
    med = [statistics.median(r[i] for r in runs) for i in range(4)]
    print(f"{name:<14} {med[0]:9.0f} {med[1]:7.3f} {100*med[2]:8.1f}% {med[3]:8.2f}  "
          + " ".join(f"{r[0]:.0f}" for r in runs))
PY
