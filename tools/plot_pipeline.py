#!/usr/bin/env python3
"""Draws one training step of a pipeline run as the GPipe paper does: ranks on rows, time on
the x-axis, each forward (F) and backward (B) of a micro-batch as a labelled box; white is idle
(the bubble). Reads the per-rank Chrome traces that `trainer --trace FILE` writes.

  tools/plot_pipeline.py runs/x/trace.rank*.json -o timeline.png [--step N] [--formula S M]

Prints the step's measured bubble: 1 - (time in forward/backward) / (ranks x step time).
Standard library only (tools/pngcanvas.py).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pngcanvas import Canvas  # noqa: E402

FORWARD, BACKWARD = (66, 133, 244), (52, 168, 83)
WAIT, GRID, INK = (225, 225, 225), (200, 200, 200), (20, 20, 20)


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
    left, right, top, row_h, gap = 96, 20, 40, 34, 8
    width = 1400
    plot_w = width - left - right
    height = top + len(ranks) * (row_h + gap) + 40
    c = Canvas(width, height)
    x_of = lambda t: left + (t - t0) / span * plot_w  # noqa: E731

    busy = 0.0
    for row, (rank, events) in enumerate(ranks.items()):
        y0 = top + row * (row_h + gap)
        c.text(8, y0 + row_h / 2 - 7, f"rank {rank}", INK, 2)
        c.rect(left, y0, left + plot_w, y0 + row_h, GRID)
        for e in events:
            a, b = max(e["ts"], t0), min(e["ts"] + e["dur"], t1)
            if b <= a:
                continue
            cat = e.get("cat")
            if cat in ("forward", "backward"):
                busy += b - a
                color = FORWARD if cat == "forward" else BACKWARD
                c.fill_rect(x_of(a), y0 + 1, x_of(b), y0 + row_h - 1, color)
                c.fill_rect(x_of(b) - 1, y0 + 1, x_of(b), y0 + row_h - 1, (255, 255, 255))
                name = e["name"]
                scale = 2 if c.text_width(name, 2) < x_of(b) - x_of(a) - 2 else 1
                if c.text_width(name, scale) < x_of(b) - x_of(a) - 1:
                    c.text((x_of(a) + x_of(b) - c.text_width(name, scale)) / 2, y0 + (row_h - 7 * scale) / 2, name,
                           (255, 255, 255), scale)
            elif cat in ("wait", "recv"):
                c.fill_rect(x_of(a), y0 + row_h - 5, x_of(b), y0 + row_h - 1, WAIT)
    bubble = 1.0 - busy / (len(ranks) * span)
    title = f"{label}: {span / 1000:.1f} ms, bubble {100 * bubble:.1f}%"
    if args.formula:
        s, m = args.formula
        title += f" (gpipe formula {100 * (s - 1) / (m + s - 1):.1f}%)"
    c.text(left, 12, title, INK, 2)
    axis_y = top + len(ranks) * (row_h + gap) + 4
    for k in range(11):
        x = left + k * plot_w / 10
        c.line(x, axis_y, x, axis_y + 4, INK)
        tick = f"{span / 1000 * k / 10:.0f}" if span >= 10000 else f"{span / 1000 * k / 10:.1f}"
        c.text(x - c.text_width(tick) / 2, axis_y + 7, tick, INK)
    c.text(left + plot_w - c.text_width("ms", 1), axis_y + 18, "ms", INK)
    c.save(args.output)
    formula = ""
    if args.formula:
        s, m = args.formula
        formula = f", formula {(s - 1) / (m + s - 1):.3f}"
    print(f"{args.output}: {label}, {len(ranks)} ranks, {span / 1000:.1f} ms, measured bubble {bubble:.3f}{formula}")


if __name__ == "__main__":
    main()
