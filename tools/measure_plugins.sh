#!/usr/bin/env bash
# A/B throughput of strategy plugins on one config: runs each variant in alternation
# (A B C A B C ...), R repetitions, and reports per variant the median over repetitions of each
# run's median tokens/s and step time (steps after the first 3), and the share of step time
# rank 0 spent blocked on communication with the payload bytes per step (host-measured,
# metrics.jsonl comm_wait_s / comm_bytes), the projected time per epoch (median step time x
# steps per epoch), pipelines' measured bubble next to (S-1)/(M+S-1), and each rank's peak
# activation memory.
#   usage: tools/measure_plugins.sh [CONFIG] [STEPS] [REPETITIONS] -- VARIANT...
#   VARIANT: "NAME:PLUGIN[@TRAINER]:NPROC[:--set k=v ...]", e.g. "ddp-b4:ddp:2:--set plugin.bucket_mb=4";
#   @TRAINER runs that variant with another build's trainer (default build/trainer), e.g.
#   "ddp-2.12:ddp@build-2.12/trainer:2" against "ddp-2.11:ddp:2" to A/B two LibTorch builds.
# `trainer bench` is the user-facing A/B tool (one trainer); this script also alternates builds.
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
    trainer=build/trainer
    if [[ "$plugin" == *@* ]]; then trainer=${plugin#*@}; plugin=${plugin%%@*}; fi
    run="$out/$name/$rep"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=1 "$trainer" --config "$config" --plugin "$plugin" --nproc "$nproc" \
      --set train.threads=1 --set train.max_steps="$steps" --set train.out_dir="$run" \
      --set log.progress=off --set eval.max_batches=1 --set checkpoint.save_final=false \
      --set checkpoint.keep_best=false --log-level warn $extra
  done
done
python3 - "$out" "${variants[@]}" <<'PY'
import json, os, statistics, sys
root, variants = sys.argv[1], sys.argv[2:]
print(f"{'variant':<16} {'tokens/s':>9} {'step_s':>7} {'epoch':>8} {'comm_wait':>9} {'MB/step':>8} "
      f"{'bubble':>7} {'formula':>7} {'act MiB/rank':>14}  runs (tokens/s)")
for v in variants:
    name = v.split(":")[0]
    runs = []
    for rep in sorted(os.listdir(os.path.join(root, name))):
        lines = [json.loads(l) for l in open(os.path.join(root, name, rep, "metrics.jsonl"))]
        steps = [l for l in lines if l["type"] == "step"][3:]
        summary = next(l for l in lines if l["type"] == "summary")
        step_s = statistics.median(s["step_time_s"] for s in steps)
        runs.append({
            "tps": statistics.median(s["tokens_per_s"] for s in steps), "step": step_s,
            "epoch": step_s * summary["steps_per_epoch"],
            "wait": sum(s.get("comm_wait_s", 0) for s in steps) / sum(s["step_time_s"] for s in steps),
            "mb": statistics.median(s.get("comm_bytes", 0) for s in steps) / 1e6,
            "bubble": statistics.median(s.get("plugin.bubble", float("nan")) for s in steps),
            "formula": steps[-1].get("plugin.bubble_formula", float("nan")),
            "act": summary.get("activation_peak_mib_per_rank", [summary.get("activation_peak_mib", 0)])})
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    epoch = med("epoch")
    act = "/".join(f"{a:.0f}" for a in runs[-1]["act"])
    print(f"{name:<16} {med('tps'):9.0f} {med('step'):7.3f} {int(epoch // 3600)}:{int(epoch % 3600 // 60):02d}:{int(epoch % 60):02d}"
          f" {100 * med('wait'):8.1f}% {med('mb'):8.2f} {med('bubble'):7.3f} {med('formula'):7.3f} {act:>14}  "
          + " ".join(f"{r['tps']:.0f}" for r in runs))
PY
