#!/usr/bin/env python3
"""Draws one training step of a pipeline run as the GPipe paper does: ranks on rows, time on
the x-axis, each forward (F) and backward (B) of a micro-batch as a labelled box; white is idle
(the bubble). Reads the per-rank Chrome traces that `trainer --trace FILE` writes.

  python/plot_pipeline.py runs/x/trace.rank*.json -o timeline.png [--step N] [--formula S M]

Prints the step's measured bubble: 1 - (time in forward/backward) / (ranks x step time).
Drawn with matplotlib (python/charts.py's colours).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from charts import plt, rgb  # noqa: E402  (matplotlib with the Agg backend)

FORWARD, BACKWARD = (66, 133, 244), (52, 168, 83)
WAIT, INK = (200, 200, 200), (20, 20, 20)


def load(paths):
    ranks = {}
    for path in paths:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        if events:
            ranks[events[0]["pid"]] = events
    if not ranks:
        sys.exit("plot_pipeline: no trace events in " + ", ".join(paths))
    return dict(sorted(ranks.items()))


def step_window(ranks, step):
    """[start, end) in µs of training step `step` (1-based; None = the last) over all ranks."""
    starts, ends = [], []
    for events in ranks.values():
        steps = [e for e in events if e.get("cat") == "step"]
        if not steps:
            continue
        chosen = steps[-1] if step is None else next((e for e in steps if e["name"] == f"step {step}"), None)
        if chosen is None:
            sys.exit(f"plot_pipeline: no 'step {step}' span in the trace")
        starts.append(chosen["ts"])
        ends.append(chosen["ts"] + chosen["dur"])
    return min(starts), max(ends), (steps[-1]["name"] if step is None else f"step {step}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--formula", nargs=2, type=int, metavar=("STAGES", "MICROBATCHES"),
                        help="print GPipe's (S-1)/(M+S-1) next to the measured bubble")
    args = parser.parse_args()

    ranks = load(args.traces)
    t0, t1, label = step_window(ranks, args.step)
    span = max(t1 - t0, 1.0)
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(ranks) + 1.4), dpi=100)
    busy = 0.0
    for row, (rank, events) in enumerate(ranks.items()):
        y = len(ranks) - 1 - row  # rank 0 on top
        for e in events:
            a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            if b <= a:
                continue
            cat = e.get("cat")
            x, w = (a - t0) / 1000, (b - a) / 1000  # ms
            if cat in ("forward", "backward"):
                busy += b - a
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=rgb(FORWARD if cat == "forward" else BACKWARD),
                               edgecolors="white", linewidth=0.5)
                if w > span / 1000 * 0.025:  # label boxes wide enough to hold it
                    ax.text(x + w / 2, y, e["name"], ha="center", va="center", color="white", fontsize=8)
            elif cat in ("wait", "recv"):
                ax.broken_barh([(x, w)], (y - 0.45, 0.1), facecolors=rgb(WAIT))
    bubble = 1.0 - busy / (len(ranks) * span)
    title = f"{label}: {span / 1000:.1f} ms, bubble {100 * bubble:.1f}%"
    if args.formula:
        s, m = args.formula
        title += f" (gpipe formula {100 * (s - 1) / (m + s - 1):.1f}%)"
    ax.set_title(title, loc="left", fontsize=12, color=rgb(INK))
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(list(ranks))])
    ax.set_xlim(0, span / 1000)
    ax.set_xlabel("ms")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(args.output)
    plt.close(fig)
    formula = ""
    if args.formula:
        s, m = args.formula
        formula = f", formula {(s - 1) / (m + s - 1):.3f}"
    print(f"{args.output}: {label}, {len(ranks)} ranks, {span / 1000:.1f} ms, measured bubble {bubble:.3f}{formula}")


if __name__ == "__main__":
    main()
