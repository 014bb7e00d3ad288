"""Bar and line charts with matplotlib (Agg backend), for the bench plots and run reports.

  from charts import bar_chart, line_chart
  bar_chart("tps.png", "tokens/s", ["single x1", "ddp x2"], [1650, 2840],
            lows=[1600, 2730], highs=[1700, 2925], unit="tokens/s")
  line_chart("loss.png", "loss", [("train", [(1, 6.2), (2, 5.9)]), ("eval", [(2, 6.0)])],
             "step", "loss")

Bars have min-max whiskers and their value on top; lines have a marker per point when a series
has fewer than 40 points, and matplotlib places the legend where it covers the least. None, NaN
and infinite values are skipped; a single point or all-equal values still draw. Every chart is
WIDTH x HEIGHT pixels.
"""
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

# Distinguishable on white, in this order (Tableau 10 without its grey, which is BASELINE's), RGB.
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207)]
BASELINE = (150, 150, 150)
INK, MUTED, GRID = (25, 25, 25), (95, 95, 95), (232, 232, 232)
WIDTH, HEIGHT = 800, 480
DPI = 100
MARKER_LIMIT = 40  # series with fewer points than this get a marker per point


def lighten(color, amount=0.6):
    """`color` moved `amount` of the way towards white."""
    return tuple(int(round(c + (255 - c) * amount)) for c in color)


def rgb(color):
    """An RGB tuple of 0-255 as matplotlib's 0-1 floats."""
    return tuple(c / 255.0 for c in color)


def finite(v):
    """v as a float, or None when it is None, NaN, infinite or not a number."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


# ---------------------------------------------------------------------------------------------
# Numbers


def fmt3(v):
    """Three significant digits, k/M suffixes from 10^4 up: 0.0523, 1.27, 2840, 18.4k, 24.5M."""
    v = finite(v)
    if v is None:
        return "n/a"
    if v == 0:
        return "0"
    a = abs(v)
    for limit, div, suffix in ((1e10, 1e9, "G"), (1e7, 1e6, "M"), (1e4, 1e3, "k")):
        if a >= limit:
            return _sig3(v / div) + suffix
    return _sig3(v)


def _sig3(v):
    a = abs(v)
    if a >= 100:
        return str(int(round(v)))  # 2840 rather than 2.84e+03
    if a < 1e-3:
        return f"{v:.2e}"
    digits = 2 - int(math.floor(math.log10(a)))
    r = round(v, digits)
    if abs(r) >= 100:
        return str(int(round(v)))
    return f"{r:.{max(digits, 0)}f}"


def axis_ticks(lo, hi):
    """The ticks a chart's value axis gets for data in [lo, hi]: 1, 2, 2.5 or 5 x 10^k steps."""
    return list(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi))


def tick_label(v, _position=None):
    """An axis tick: 0.5, 6, 2500; 18k, 1.2M from 10^4 up."""
    return fmt3(v) if abs(v) >= 1e4 else f"{v:g}"


def time_unit(seconds):
    """(divisor, unit name) that keeps the largest time readable."""
    if seconds < 120:
        return 1.0, "seconds"
    if seconds < 120 * 60:
        return 60.0, "minutes"
    return 3600.0, "hours"


# ---------------------------------------------------------------------------------------------
# Figures


def _figure(title, subtitle, width, height):
    fig, ax = plt.subplots(figsize=(width / DPI, height / DPI), dpi=DPI)
    fig.suptitle(title, fontsize=13, color=rgb(INK), x=0.02, ha="left", y=0.98)
    if subtitle:
        ax.set_title(subtitle, fontsize=9, color=rgb(MUTED), loc="left")
    ax.grid(True, axis="y", color=rgb(GRID), linewidth=1)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.yaxis.set_major_formatter(FuncFormatter(tick_label))
    return fig, ax


def _save(fig, path):
    fig.savefig(path, dpi=DPI)  # exactly WIDTH x HEIGHT: no tight bounding box
    plt.close(fig)
    return path


def bar_chart(path, title, labels, values, lows=None, highs=None, unit="", colors=None,
              subtitle=None, value_fmt=fmt3, width=WIDTH, height=HEIGHT):
    """Vertical bars from 0 with optional min-max whiskers (`lows`/`highs`, None entries skipped)
    and each value printed above its bar. `colors`: one RGB per bar (default: the palette's
    first colour). Returns `path`."""
    n = len(labels)
    values = [finite(v) for v in values]
    lows = [finite(v) for v in lows] if lows is not None else [None] * n
    highs = [finite(v) for v in highs] if highs is not None else [None] * n
    colors = list(colors) if colors else [PALETTE[0]] * n
    fig, ax = _figure(title, subtitle, width, height)
    xs = list(range(n))
    ax.bar(xs, [v if v is not None else 0.0 for v in values], width=0.62,
           color=[rgb(colors[i % len(colors)]) for i in range(n)])
    for i in range(n):
        v, low, high = values[i], lows[i], highs[i]
        if low is not None or high is not None:
            low = low if low is not None else v if v is not None else high
            high = high if high is not None else v if v is not None else low
            ax.errorbar([i], [low], yerr=[[0], [high - low]], fmt="none", ecolor=rgb(INK), capsize=6, linewidth=1.5)
        top = max([x for x in (v, high, 0.0) if x is not None])
        ax.annotate(value_fmt(v) if v is not None else "n/a", (i, top), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=11, color=rgb(INK))
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=9)
    ax.set_xlim(-0.6, max(n, 1) - 0.4)
    data = [x for x in values + lows + highs if x is not None]
    ax.set_ylim(min([0.0] + data), max([1.0] + data) * 1.12)
    if unit:
        ax.set_ylabel(unit)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _save(fig, path)


def _series_parts(entry):
    if len(entry) >= 3:
        return entry[0], entry[1], dict(entry[2] or {})
    return entry[0], entry[1], {}


def line_chart(path, title, series, x_label, y_label, x_ticks=None, log_y=False, subtitle=None,
               width=WIDTH, height=HEIGHT, y_from_zero=False, dodge=0):
    """`series`: [(name, [(x, y), ...]), ...], optionally (name, points, style) with style keys
    color (RGB), width (1-3, default 2), markers (True/False; default: fewer than 40 points),
    dashed (True/False, default False: e.g. a formula beside the measured line).
    Points with a None/NaN coordinate (or y <= 0 on a log axis) are skipped and break the line.
    `x_ticks`: explicit tick positions (e.g. world sizes 1, 2, 4, 8). `y_from_zero`: the y axis
    starts at 0. `dodge`: shift series k by (k - (n-1)/2) x dodge thousandths of the x range, so
    that equal points of different series stay visible side by side. Returns `path`."""
    fig, ax = _figure(title, subtitle, width, height)
    parsed = []
    for k, entry in enumerate(series):
        name, points, style = _series_parts(entry)
        xs, ys = [], []
        for p in points:
            x, y = finite(p[0]), finite(p[1])
            bad = x is None or y is None or (log_y and y <= 0)
            xs.append(float("nan") if bad else x)
            ys.append(float("nan") if bad else y)
        count = sum(1 for y in ys if not math.isnan(y))
        parsed.append((str(name), xs, ys, style, count))
    all_x = [x for _, xs, _, _, _ in parsed for x in xs if not math.isnan(x)]
    span = (max(all_x) - min(all_x)) if all_x else 1.0
    for k, (name, xs, ys, style, count) in enumerate(parsed):
        shift = (k - (len(parsed) - 1) / 2) * dodge * 0.001 * (span or 1.0)
        markers = style.get("markers", count < MARKER_LIMIT)
        ax.plot([x + shift for x in xs], ys, label=name or None,
                color=rgb(style.get("color", PALETTE[k % len(PALETTE)])), linewidth=style.get("width", 2),
                linestyle="--" if style.get("dashed") else "-", marker="o" if markers else None, markersize=4)
    if log_y:
        ax.set_yscale("log")
    elif y_from_zero:
        ax.set_ylim(bottom=0)
    if x_ticks:
        ax.set_xticks(sorted(set(float(t) for t in x_ticks)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: str(int(v)) if v == int(v) else fmt3(v)))
    elif all_x and all(x == int(x) for x in all_x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, axis="x", color=rgb(GRID), linewidth=1)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    if not all_x:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", fontsize=14,
                color=rgb(MUTED))
    if sum(1 for name, _, _, _, _ in parsed if name) > 6:  # many lines: the legend beside the plot, not over it
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=True)
    elif any(name for name, _, _, _, _ in parsed):
        ax.legend(loc="best", fontsize=9, frameon=True)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return _save(fig, path)


def confusion_chart(path, title, classes, counts, subtitle=None, width=WIDTH, height=HEIGHT):
    """A confusion matrix as a heat map: row = true class, column = predicted, each cell shaded by
    its share of its row (so small classes read as well as large ones) and labeled with its count
    when there are at most 12 classes."""
    k = len(classes)
    side = max(width, height) if k > 12 else None
    fig, ax = _figure(title, subtitle, side or width, side or height)
    ax.grid(False)
    shares = [[c / max(sum(row), 1) for c in row] for row in counts]
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1, aspect="auto")
    ticks = range(k)
    size = 8 if k <= 12 else max(4, 9 - k // 8)
    ax.set_xticks(list(ticks), classes, rotation=45 if k > 4 else 0, ha="right" if k > 4 else "center", fontsize=size)
    ax.set_yticks(list(ticks), classes, fontsize=size)
    ax.set_xlabel("predicted", color=rgb(MUTED))
    ax.set_ylabel("true", color=rgb(MUTED))
    if k <= 12:
        for t in ticks:
            for p in ticks:
                ax.text(p, t, str(counts[t][p]), ha="center", va="center", fontsize=8,
                        color="white" if shares[t][p] > 0.6 else rgb(INK))
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return _save(fig, path)
