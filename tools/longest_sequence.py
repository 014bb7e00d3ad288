#!/usr/bin/python3
"""The longest sequence each strategy trains within a per-rank activation budget.

For every variant (a plugin, its ranks and settings) this searches the longest data.seq_len whose
training step keeps at most --budget-mib of activations on every rank, measured by the host's own
accounting (the summary's activation_peak_mib_per_rank: peak tensor bytes above the step's start,
per rank). Each probe is a real run of --steps optimizer steps of one sequence per rank group
(train.batch_size = --batch) on the bundled corpus. The search doubles the length until a probe
exceeds the budget, then narrows the bracket by interpolation to --granularity tokens.

Writes DIR/longest.json (every probe: length, per-rank peaks, step seconds, loss) and
DIR/longest.md (the table), and, with matplotlib, DIR/activation_vs_seq_len.png: peak activation
memory per rank against seq_len for every variant.

  usage: tools/longest_sequence.py [--shape small|medium] [--budget-mib 2048] [--out DIR]
                                   [--variant NAME:PLUGIN:NPROC[:--set k=v ...]] ...
Default variants: single; ulysses and ring (context_parallel) at 2 and 4 ranks.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

# HF config.json shapes with positions to spare (RoPE at any position; random weights).
SHAPES = {
    # the small preset (6.1M parameters), its positions raised from 1024
    "small": dict(hidden_size=288, intermediate_size=768, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=6, vocab_size=512, tie_word_embeddings=True),
    # a larger one with grouped-query attention (8 query heads over 2 kv heads)
    "medium": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}

DEFAULT_VARIANTS = [
    "single:single:1",
    "ulysses-2:context_parallel:2",
    "ring-2:context_parallel:2:--set plugin.mode=\"ring\"",
    "ulysses-4:context_parallel:4",
    "ring-4:context_parallel:4:--set plugin.mode=\"ring\"",
]


def write_config(shape, path):
    config = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  max_position_embeddings=1 << 18, rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float32")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def probe(args, config_json, variant, length, work):
    """One run at `length`: (max peak MiB over ranks, per-rank peaks, median step s, losses) or None."""
    name, plugin, nproc, extra = variant
    out = os.path.join(work, f"{name}-{length}")
    cmd = [args.trainer, "--config", args.config, "--plugin", plugin, "--nproc", str(nproc),
           "--set", f"model.config={config_json}", "--set", f"data.seq_len={length}",
           "--set", f"train.batch_size={args.batch}", "--set", f"train.max_steps={args.steps}",
           "--set", "train.warmup_steps=1", "--set", f"train.out_dir={out}", "--set", "train.threads=1",
           "--set", "log.progress=off", "--set", "log.every_steps=1", "--set", "eval.max_batches=1",
           "--set", "checkpoint.save_final=false", "--set", "checkpoint.keep_best=false",
           "--set", f"model.attention={json.dumps(args.attention)}", "--log-level", "warn"] + shlex.split(extra)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if r.returncode != 0:
        errors = [line for line in (r.stdout + r.stderr).splitlines() if " error " in line]
        reason = errors[0].split(" error ", 1)[1] if errors else "exit status %d" % r.returncode
        print(f"  {name} L={length}: run failed ({wall:.0f} s): {reason}", flush=True)
        return dict(seq_len=length, failed=reason)
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    summary = [x for x in records if x.get("type") == "summary"][-1]
    steps = [x for x in records if x.get("type") == "step"]
    peaks = summary["activation_peak_mib_per_rank"]
    times = sorted(x["step_time_s"] for x in steps[1:] or steps)  # the first step warms the allocator
    losses = [x["loss"] for x in steps]
    result = dict(seq_len=length, peak_mib=max(peaks), peak_mib_per_rank=peaks,
                  step_s=times[len(times) // 2] if times else None, losses=losses, wall_s=wall)
    print(f"  {name} L={length}: peak {max(peaks):.0f} MiB per rank (ranks {', '.join(f'{p:.0f}' for p in peaks)}), "
          f"{wall:.0f} s", flush=True)
    return result


def search(args, config_json, variant, work):
    g = args.granularity * variant[2] * 2  # ring's balanced layout cuts 2N chunks
    probes = []

    failures = []

    def run(length):
        result = probe(args, config_json, variant, length, work)
        if result is not None and "failed" in result:
            failures.append(result)
            return None
        if result is not None:
            probes.append(result)
        return result

    lo, lo_peak, hi, hi_peak = 0, 0.0, None, None
    length = g
    while length <= args.max_len:  # double until over budget
        result = run(length)
        if result is None or result["peak_mib"] > args.budget_mib:
            hi, hi_peak = length, result["peak_mib"] if result else None
            break
        lo, lo_peak = length, result["peak_mib"]
        length *= 2
    while hi is not None and hi - lo > g:  # narrow: interpolate the budget's crossing, on the grid
        if hi_peak is not None and hi_peak > lo_peak:
            guess = lo + (args.budget_mib - lo_peak) * (hi - lo) / (hi_peak - lo_peak)
        else:
            guess = (lo + hi) / 2
        length = int(round(guess / g)) * g
        length = min(max(length, lo + g), hi - g)
        result = run(length)
        if result is not None and result["peak_mib"] <= args.budget_mib:
            lo, lo_peak = length, result["peak_mib"]
        else:
            hi, hi_peak = length, result["peak_mib"] if result else None
    return dict(name=variant[0], plugin=variant[1], nproc=variant[2], settings=variant[3], longest=lo,
                capped=hi is None, probes=sorted(probes, key=lambda p: p["seq_len"]), failures=failures)


def plot(results, args, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if not r["probes"]:
            continue
        xs = [p["seq_len"] for p in r["probes"]]
        ys = [p["peak_mib"] for p in r["probes"]]
        ax.plot(xs, ys, marker="o", label=f"{r['name']} (longest {r['longest']})")
    ax.axhline(args.budget_mib, color="grey", linestyle="--", label=f"budget {args.budget_mib} MiB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("seq_len (tokens)")
    ax.set_ylabel("peak activation memory per rank (MiB)")
    ax.set_title(f"{args.shape} shape, {args.attention} attention, batch {args.batch}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--budget-mib", type=float, default=2048)
    p.add_argument("--batch", type=int, default=1, help="train.batch_size (sequences per step)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--granularity", type=int, default=64, help="lengths are multiples of this x 2 x ranks")
    p.add_argument("--max-len", type=int, default=1 << 17)
    p.add_argument("--attention", default="auto", help="model.attention: auto, weft (math) or sdpa")
    p.add_argument("--config", default="configs/small-bench.toml")
    p.add_argument("--trainer", default="build/trainer")
    p.add_argument("--variant", action="append", help="NAME:PLUGIN:NPROC[:--set k=v ...]")
    p.add_argument("--out", default="runs/longest-sequence")
    args = p.parse_args()
    variants = []
    for v in args.variant or DEFAULT_VARIANTS:
        name, plugin, nproc, *rest = v.split(":", 3)
        variants.append((name, plugin, int(nproc), rest[0] if rest else ""))
    os.makedirs(args.out, exist_ok=True)
    config_json = os.path.abspath(os.path.join(args.out, f"{args.shape}-config.json"))
    write_config(args.shape, config_json)
    results = []
    with tempfile.TemporaryDirectory() as work:
        for variant in variants:
            print(f"{variant[0]}: searching ({args.shape}, budget {args.budget_mib:.0f} MiB per rank)", flush=True)
            results.append(search(args, config_json, variant, work))
    report = dict(shape=args.shape, budget_mib=args.budget_mib, batch=args.batch, attention=args.attention,
                  config=SHAPES[args.shape], variants=results)
    with open(os.path.join(args.out, "longest.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"Longest seq_len within {args.budget_mib:.0f} MiB of activations per rank ({args.shape} shape, "
             f"batch {args.batch}, attention {args.attention}):", "",
             "| variant | ranks | longest seq_len | peak MiB per rank there | step s there |", "|---|---|---|---|---|"]
    for r in results:
        at = [p for p in r["probes"] if p["seq_len"] == r["longest"]]
        peak = ", ".join(f"{x:.0f}" for x in at[0]["peak_mib_per_rank"]) if at else "-"
        step = f"{at[0]['step_s']:.2f}" if at and at[0]["step_s"] else "-"
        longest = f">= {r['longest']} (cap)" if r["capped"] else str(r["longest"])
        if not r["probes"] and r["failures"]:
            longest = "refused: " + r["failures"][0]["failed"]
        lines.append(f"| {r['name']} | {r['nproc']} | {longest} | {peak} | {step} |")
    with open(os.path.join(args.out, "longest.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, args, os.path.join(args.out, "activation_vs_seq_len.png"))


if __name__ == "__main__":
    main()
