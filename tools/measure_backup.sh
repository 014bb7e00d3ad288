#!/usr/bin/env bash
# Does checkpoint backup slow training? The small preset with full fine-tuning (2048 tokens a step,
# a 73.5 MB checkpoint every 5 steps, 40 steps), without and with [backup] to moto's S3 server on
# this machine, alternated twice: median and mean step time, throughput, and the uploads' time.
# Needs tools/requirements.txt (moto, boto3) in WEFT_VENV. Figures: issue 21's note, docs/training.md.
#   tools/measure_backup.sh [build/trainer]
set -euo pipefail
cd "$(dirname "$0")/.."
trainer=$(realpath "${1:-build/trainer}")
python=${WEFT_VENV:-$HOME/.cache/weft/venv}/bin/python
work=$(mktemp -d)
trap 'kill $moto 2>/dev/null; rm -rf "$work"' EXIT
port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$python" -m moto.server -H 127.0.0.1 -p "$port" > "$work/moto.log" 2>&1 &
moto=$!
sleep 3
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing OMP_NUM_THREADS=1
"$python" -c "import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:$port', region_name='us-east-1').create_bucket(Bucket='bench')"
for round in 1 2; do
  for mode in none backup; do
    extra=()
    [[ $mode == backup ]] && extra=(--set "backup.url=s3://bench/r$round" --set "backup.endpoint=http://127.0.0.1:$port")
    "$trainer" --config configs/tiny.toml --set model.preset=small --set data.path=data/austen/austen.jsonl \
      --set data.max_documents=0 --set data.seq_len=256 --set train.batch_size=8 --set train.max_steps=40 \
      --set checkpoint.every_steps=5 --set eval.every_steps=0 --set eval.max_batches=1 \
      --set train.out_dir="$work/$mode-$round" --set log.progress=off "${extra[@]}" > "$work/$mode-$round.log" 2>&1
    python3 - "$work/$mode-$round/metrics.jsonl" "$mode" "$round" <<'PY'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
steps = [r["step_time_s"] for r in records if r.get("type") == "step" and "step_time_s" in r]
summary = [r for r in records if r.get("type") == "summary"][-1]
print(f"{sys.argv[2]:6} round {sys.argv[3]}: median step {statistics.median(steps):.3f} s, mean {statistics.mean(steps):.3f} s, "
      f"{summary.get('tokens_per_s', 0):.0f} tokens/s")
PY
    grep -ho "backup: [0-9]* checkpoint(s) uploaded.*" "$work/$mode-$round.log" || true
  done
done
