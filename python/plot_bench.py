#!/usr/bin/env python3
"""Plots the JSON that `trainer bench` writes: per variant tokens/s and projected time per
epoch (median bars, min-max whiskers over repetitions; the PyTorch baseline in grey), and per
plugin tokens/s and time per epoch against world size.

  python/plot_bench.py BENCH_JSON [-o OUT_DIR]

Writes OUT_DIR/tokens_per_s.png, epoch_time.png, scaling.png and scaling_epoch.png, and where
pipeline variants measured their bubble ("gpipe microbatches=8 x2"), bubble.png: the measured
bubble against micro-batches per step, one line per schedule and world size, each world size's
formula dashed, and where variants evaluated (--eval-every), held_out_loss.png: held-out loss
against training time, one line per variant (OUT_DIR defaults to the JSON's folder). Prints each path written. Plots with
matplotlib (python/charts.py).
"""
import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from charts import BASELINE, PALETTE, bar_chart, finite, line_chart, time_unit  # noqa: E402

WORLD_SUFFIX = re.compile(r"\s*[x\u00d7]\s*\d+\s*$")
MICROBATCHES = re.compile(r"\s*\bmicrobatches=(\d+)")


def fail(message):
    sys.exit(f"plot_bench: {message}")


def load(path):
    try:
        with open(path) as f:
            bench = json.load(f)
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(f"{path} is not valid JSON: {e}")
    if not isinstance(bench, dict) or not isinstance(bench.get("variants"), list) or not bench["variants"]:
        fail(f"{path} holds no 'variants' list")
    return bench


def stat(variant, key):
    """(median, min, max) of a {"median", "min", "max"} field, None where absent."""
    s = variant.get(key)
    if isinstance(s, dict):
        return finite(s.get("median")), finite(s.get("min")), finite(s.get("max"))
    return finite(s), None, None


def is_pytorch(variant):
    return variant.get("kind") == "pytorch"


def plugin_name(variant):
    plugin = variant.get("plugin") or ""
    base = os.path.basename(str(plugin))
    for suffix in (".so", ".dylib", ".dll"):
        if base.endswith(suffix):
            base = base[:-len(suffix)]
    if base.startswith("lib") and plugin != base:
        base = base[3:]
    return base


def series_key(variant):
    """The line a variant belongs to in the scaling charts: its name without the trailing world
    size ("gpipe microbatches=8 x2" -> "gpipe microbatches=8"); else pytorch/plugin name."""
    name = str(variant.get("name", ""))
    if WORLD_SUFFIX.search(name):
        return WORLD_SUFFIX.sub("", name)
    plugin = plugin_name(variant) or name
    return ("pytorch " + plugin) if is_pytorch(variant) and "pytorch" not in plugin else plugin


def colors_for(variants):
    """A colour per variant: the PyTorch baseline grey, weft variants one colour per series."""
    keys = []
    for v in variants:
        if not is_pytorch(v) and series_key(v) not in keys:
            keys.append(series_key(v))
    return [BASELINE if is_pytorch(v) else PALETTE[keys.index(series_key(v)) % len(PALETTE)] for v in variants]


def subtitle(bench, whiskers=True):
    parts = []
    if bench.get("config"):
        parts.append(str(bench["config"]))
    reps, steps, warm = bench.get("repetitions"), bench.get("steps"), bench.get("warmup_steps")
    if steps:
        parts.append(f"{steps} steps" + (f" after {warm} warm-up" if warm else ""))
    if reps:
        parts.append(f"median of {reps} repetition{'s' * (reps != 1)}" + (", whiskers min-max" if whiskers else ""))
    if bench.get("tokens_per_step"):
        parts.append(f"{bench['tokens_per_step']} tokens/step")
    return ", ".join(parts)


def scaling(path, title, variants, key, divisor, y_label, sub):
    groups = {}
    for v in variants:
        median = stat(v, key)[0]
        if median is None:
            continue
        nproc = v.get("nproc") or 1
        groups.setdefault(series_key(v), []).append((nproc, median / divisor, is_pytorch(v)))
    color_of = {series_key(v): c for v, c in zip(variants, colors_for(variants))}  # as in the bar charts
    series = []
    for name, points in groups.items():
        points.sort()
        series.append((name, [(n, y) for n, y, _ in points], {"color": color_of[name]}))
    worlds = sorted({int(v.get("nproc") or 1) for v in variants})
    return line_chart(path, title, series, "world size (processes)", y_label, x_ticks=worlds, subtitle=sub,
                      y_from_zero=True, dodge=5)


def bubble(path, variants, sub):
    """The pipeline variants' measured bubble (median over steps) against their micro-batches per
    step, one line per schedule and world size, and the formula each reported, dashed, one line per
    world size (and one more each for interleaved schedules, whose formula divides M's share by
    the chunks, and for ZB-H1); None when no variant names its micro-batches and measured a bubble."""
    measured, formula = {}, {}
    for v in variants:
        value = finite(v.get("bubble"))
        found = MICROBATCHES.search(str(v.get("name", "")))
        if value is None or not found:
            continue
        micro, nproc = int(found.group(1)), int(v.get("nproc") or 1)
        schedule = MICROBATCHES.sub("", series_key(v)).strip()
        measured.setdefault(f"{schedule} x{nproc}", []).append((micro, value))
        if finite(v.get("bubble_formula")) is not None:  # interleaved schedules have their own
            name = str(v.get("name", ""))
            kind = "interleaved" if "interleaved" in name else "zbh1" if "zbh1" in name else "plain"
            formula.setdefault((nproc, kind), {})[micro] = finite(v.get("bubble_formula"))
    if not measured:
        return None
    series = []
    for k, (name, points) in enumerate(sorted(measured.items())):
        series.append((name, sorted(points), {"color": PALETTE[k % len(PALETTE)]}))
    greys = [BASELINE, (70, 70, 70), (190, 190, 190)]  # one shade per world size and kind
    for k, ((nproc, kind), points) in enumerate(sorted(formula.items())):
        label = {"interleaved": f"formula (S - 1) / (vM + S - 1), interleaved x{nproc}",
                 "zbh1": f"formula (S - 1) / (3M + S - 1), ZB-H1 x{nproc}"}.get(
                     kind, f"formula (S - 1) / (M + S - 1), x{nproc}")
        series.append((label, sorted(points.items()), {"color": greys[k % len(greys)], "dashed": True, "width": 1}))
    ticks = sorted({m for _, points, _ in series for m, _ in points})
    return line_chart(path, "Pipeline bubble against micro-batches", series, "micro-batches per step (M)",
                      "bubble (idle share of the step)", x_ticks=ticks, subtitle=sub, y_from_zero=True)


def held_out(path, variants, colors, sub):
    """Held-out loss against training time (the step times up to each evaluation), one line per
    variant that evaluated (trainer bench --eval-every); None when none did."""
    series = []
    for v, color in zip(variants, colors):
        points = [(finite(e.get("train_seconds")), finite(e.get("loss"))) for e in v.get("held_out") or []
                  if isinstance(e, dict)]
        if points:
            series.append((str(v.get("name", "")), points, {"color": color}))
    if not series:
        return None
    return line_chart(path, "Held-out loss against training time", series, "training time (s)", "held-out loss",
                      subtitle=sub)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json")
    parser.add_argument("-o", "--out-dir", default=None, help="default: the JSON's folder")
    args = parser.parse_args()

    bench = load(args.bench_json)
    out = args.out_dir or os.path.dirname(os.path.abspath(args.bench_json))
    os.makedirs(out, exist_ok=True)
    variants = [v for v in bench["variants"] if isinstance(v, dict)]
    names = [str(v.get("name", f"variant {i + 1}")) for i, v in enumerate(variants)]
    colors = colors_for(variants)
    sub = subtitle(bench)
    written = []

    tps = [stat(v, "tokens_per_s") for v in variants]
    written.append(bar_chart(os.path.join(out, "tokens_per_s.png"), "Throughput (tokens/s)", names,
                             [t[0] for t in tps], [t[1] for t in tps], [t[2] for t in tps],
                             unit="tokens/s", colors=colors, subtitle=sub))

    epoch = [stat(v, "epoch_s") for v in variants]
    known = [x for t in epoch for x in t if x is not None]
    epoch_title = "Projected time per epoch"
    if bench.get("steps_per_epoch"):
        epoch_title += f" ({bench['steps_per_epoch']} steps)"
    if known:
        div, unit = time_unit(max(known))
        scaled = [[None if x is None else x / div for x in t] for t in epoch]
        written.append(bar_chart(os.path.join(out, "epoch_time.png"), epoch_title, names,
                                 [t[0] for t in scaled], [t[1] for t in scaled], [t[2] for t in scaled],
                                 unit=unit, colors=colors, subtitle=sub))
    else:
        print("plot_bench: no epoch_s in any variant; skipping epoch_time.png and scaling_epoch.png", file=sys.stderr)

    written.append(scaling(os.path.join(out, "scaling.png"), "Throughput against world size", variants,
                           "tokens_per_s", 1.0, "tokens/s", subtitle(bench, False)))
    if known:
        div, unit = time_unit(max(known))
        written.append(scaling(os.path.join(out, "scaling_epoch.png"), "Time per epoch against world size",
                               variants, "epoch_s", div, unit, subtitle(bench, False)))
    held_out_png = held_out(os.path.join(out, "held_out_loss.png"), variants, colors, subtitle(bench, False))
    if held_out_png:
        written.append(held_out_png)
    bubble_png = bubble(os.path.join(out, "bubble.png"), variants, subtitle(bench, False))
    if bubble_png:
        written.append(bubble_png)
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
