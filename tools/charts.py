"""Small bar and line charts drawn on tools/pngcanvas.py, for the bench plots and run reports.

  from charts import bar_chart, line_chart
  bar_chart("tps.png", "tokens/s", ["single x1", "ddp x2"], [1650, 2840],
            lows=[1600, 2730], highs=[1700, 2925], unit="tokens/s")
  line_chart("loss.png", "loss", [("train", [(1, 6.2), (2, 5.9)]), ("eval", [(2, 6.0)])],
             "step", "loss")

Bars have min-max whiskers and their value on top; lines have a marker per point when a series
has fewer than 40 points, and a legend placed in the emptiest corner. Axes use "nice" ticks
(1, 2, 5 x 10^k). None, NaN and infinite values are skipped; a single point or all-equal values
still draw. Standard library only.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pngcanvas  # noqa: E402
from pngcanvas import Canvas, GLYPH_W  # noqa: E402

# Distinguishable on white, in this order (Tableau 10 without its grey, which is BASELINE's).
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (188, 189, 34), (23, 190, 207)]
BASELINE = (150, 150, 150)
INK, MUTED, GRID, FRAME, WHITE = (25, 25, 25), (95, 95, 95), (232, 232, 232), (160, 160, 160), (255, 255, 255)
WIDTH, HEIGHT = 800, 480
MARKER_LIMIT = 40  # series with fewer points than this get a marker per point


def lighten(color, amount=0.6):
    """`color` moved `amount` of the way towards white."""
    return tuple(int(round(c + (255 - c) * amount)) for c in color)


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


def nice_num(x, round_):
    """A 1, 2 or 5 x 10^k near x (Heckbert): rounded to the closest, or the next one up."""
    if x <= 0:
        return 1.0
    e = math.floor(math.log10(x))
    f = x / 10 ** e
    if round_:
        n = 1 if f < 1.5 else 2 if f < 3 else 5 if f < 7 else 10
    else:
        n = 1 if f <= 1 else 2 if f <= 2 else 5 if f <= 5 else 10
    return n * 10 ** e


def nice_ticks(lo, hi, count=5):
    """About `count` nice ticks covering [lo, hi]; returns (ticks, step)."""
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 if lo != 0 else 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_num(nice_num(hi - lo, False) / max(count - 1, 1), True)
    start, end = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    ticks = [_clean(k * step, step) for k in range(start, end + 1)]
    return ticks, step


def _clean(v, step):
    v = round(v / step) * step
    digits = max(0, -int(math.floor(math.log10(step))) + 1)
    v = round(v, digits)
    return 0.0 if v == 0 else v


def fmt_tick(v, step, largest=None):
    """A tick label with as many decimals as the tick step needs; k/M suffixes when `largest`
    (the largest tick's magnitude, default |v|) reaches 10^4, so one axis shares one style."""
    big = max(abs(v) if largest is None else largest, step)
    div, suffix = 1.0, ""
    if big >= 1e7:
        div, suffix = 1e6, "M"
    elif big >= 1e4:
        div, suffix = 1e3, "k"
    s = step / div
    decimals = max(0, -int(math.floor(math.log10(s) + 1e-9))) if s < 1 else 0
    text = f"{v / div:.{decimals}f}"
    if text.startswith("-") and float(text) == 0:
        text = text[1:]
    return text + (suffix if v != 0 else "")


def tick_labels(ticks, step):
    largest = max(abs(t) for t in ticks)
    return [fmt_tick(t, step, largest) for t in ticks]


def log_ticks(lo, hi):
    """Ticks for a log axis spanning [lo, hi] (positive): decades, or 1-2-5 (or 1..9) steps."""
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0 ** e for e in range(e0, e1 + 1) for m in mantissas
                 if lo * (1 - 1e-9) <= m * 10.0 ** e <= hi * (1 + 1e-9)]
        if len(ticks) >= 3:
            break
    if len(ticks) > 9:
        ticks = ticks[::int(math.ceil(len(ticks) / 8))]
    return ticks


def fmt_log_tick(v):
    return fmt3(v) if v >= 1 else f"{v:.6g}"


def time_unit(seconds):
    """(divisor, unit name) that keeps the largest time readable."""
    if seconds < 120:
        return 1.0, "seconds"
    if seconds < 120 * 60:
        return 60.0, "minutes"
    return 3600.0, "hours"


# ---------------------------------------------------------------------------------------------
# Drawing helpers


def text_center(c, x, y, text, color=INK, scale=1):
    c.text(x - c.text_width(text, scale) / 2, y, text, color, scale)


def thick_line(c, x0, y0, x1, y1, color, width=2):
    c.line(x0, y0, x1, y1, color)
    if width >= 2:
        c.line(x0 + 1, y0, x1 + 1, y1, color)
        c.line(x0, y0 + 1, x1, y1 + 1, color)
    if width >= 3:
        c.line(x0 - 1, y0, x1 - 1, y1, color)
        c.line(x0, y0 - 1, x1, y1 - 1, color)


def marker(c, x, y, color, size=3):
    """A filled disc-ish square with a white rim, `size` pixels from the centre."""
    x, y = int(round(x)), int(round(y))
    c.fill_rect(x - size - 1, y - size, x + size + 2, y + size + 1, WHITE)
    c.fill_rect(x - size, y - size - 1, x + size + 1, y + size + 2, WHITE)
    c.fill_rect(x - size + 1, y - size, x + size, y + size + 1, color)
    c.fill_rect(x - size, y - size + 1, x + size + 1, y + size, color)


def wrap_label(text, max_chars, max_lines=3):
    """Splits `text` into at most `max_lines` lines of at most `max_chars` characters, at spaces
    where it can; an overflowing last line ends in '..'."""
    max_chars = max(int(max_chars), 1)
    words, lines, current = str(text).split(), [], ""
    for word in words:
        while len(word) > max_chars:  # a word longer than a line: hard split
            if current:
                lines.append(current)
                current = ""
            lines.append(word[:max_chars])
            word = word[max_chars:]
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= max_chars:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        last = lines[max_lines - 1]
        lines = lines[:max_lines - 1] + [(last[:max(max_chars - 2, 1)] + "..")[:max_chars]]
    return lines or [""]


def _title(c, title, subtitle):
    """Draws the title (scale 2 when it fits) and an optional subtitle; returns the y below."""
    avail = c.width - 2 * 12
    scale = 2 if c.text_width(title, 2) <= avail else 1
    text_center(c, c.width / 2, 10, title, INK, scale)
    y = 10 + 7 * scale + 6
    if subtitle:
        sub = subtitle
        max_chars = avail // GLYPH_W
        if len(sub) > max_chars:
            sub = sub[:max_chars - 2] + ".."
        text_center(c, c.width / 2, y, sub, MUTED, 1)
        y += 7 + 6
    return y


# ---------------------------------------------------------------------------------------------
# Bar chart


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
    data = [v for v in values + lows + highs if v is not None]
    lo = min([0.0] + data)
    hi = max([0.0] + data)
    if hi == lo:
        hi = lo + 1.0
    ticks, step = nice_ticks(lo, hi + (hi - lo) * 0.06)
    y_labels = tick_labels(ticks, step)

    c = Canvas(width, height)
    top = _title(c, title, subtitle) + 22  # room for a value label above the tallest bar
    left = 12 + max(c.text_width(t) for t in y_labels) + 8
    right = 16
    slot = (width - left - right) / max(n, 1)
    max_chars = max(int((slot - 6) // GLYPH_W), 1)
    wrapped = [wrap_label(label, max_chars) for label in labels]
    label_lines = max([len(w) for w in wrapped] + [1])
    bottom = 10 + label_lines * 10 + 8
    plot_top, plot_bottom = top, height - bottom
    plot_h = plot_bottom - plot_top
    y_lo, y_hi = ticks[0], ticks[-1]
    y_of = lambda v: plot_bottom - (v - y_lo) / (y_hi - y_lo) * plot_h  # noqa: E731

    for t, label in zip(ticks, y_labels):
        y = y_of(t)
        c.fill_rect(left, y, width - right, y + 1, GRID)
        c.text(left - 6 - c.text_width(label), y - 3, label, MUTED)
    if unit:  # the axis' unit, above its tick labels
        c.text(12, plot_top - 14, unit, INK)

    bar_w = max(min(slot * 0.62, 120), 2)
    for i in range(n):
        cx = left + slot * (i + 0.5)
        v, color = values[i], colors[i % len(colors)]
        if v is not None:
            c.fill_rect(cx - bar_w / 2, min(y_of(v), y_of(0)), cx + bar_w / 2, max(y_of(v), y_of(0)) + 1, color)
        low, high = lows[i], highs[i]
        if low is not None or high is not None:
            low = low if low is not None else v if v is not None else high
            high = high if high is not None else v if v is not None else low
            ya, yb = y_of(low), y_of(high)
            cap = max(min(bar_w * 0.18, 9), 3)
            c.fill_rect(cx - 1, min(ya, yb), cx + 1, max(ya, yb) + 1, INK)
            c.fill_rect(cx - cap, ya - 1, cx + cap + 1, ya + 1, INK)
            c.fill_rect(cx - cap, yb - 1, cx + cap + 1, yb + 1, INK)
        label_top = [y_of(x) for x in (v, high if (low is not None or high is not None) else None, 0)
                     if x is not None]
        text = value_fmt(v) if v is not None else "n/a"
        scale = 2 if c.text_width(text, 2) <= slot - 4 else 1
        text_center(c, cx, min(label_top) - 5 - 7 * scale, text, INK, scale)
        for k, line in enumerate(wrapped[i]):
            text_center(c, cx, plot_bottom + 10 + k * 10, line, INK)
    c.fill_rect(left, plot_bottom, width - right, plot_bottom + 1, INK)  # baseline
    c.fill_rect(left, plot_top, left + 1, plot_bottom + 1, FRAME)
    c.save(path)
    return path


# ---------------------------------------------------------------------------------------------
# Line chart


def _series_parts(entry):
    if len(entry) >= 3:
        return entry[0], entry[1], dict(entry[2] or {})
    return entry[0], entry[1], {}


def line_chart(path, title, series, x_label, y_label, x_ticks=None, log_y=False, subtitle=None,
               width=WIDTH, height=HEIGHT, y_from_zero=False, dodge=0):
    """`series`: [(name, [(x, y), ...]), ...], optionally (name, points, style) with style keys
    color, width (1-3 px, default 2), markers (True/False; default: fewer than 40 points).
    Points with a None/NaN coordinate (or y <= 0 on a log axis) are skipped and break the line.
    `x_ticks`: explicit tick positions (e.g. world sizes 1, 2, 4, 8). `y_from_zero`: the y axis
    starts at 0. `dodge`: shift series k by (k - (n-1)/2) x dodge pixels so that equal points of
    different series stay visible side by side. Returns `path`."""
    parsed = []
    for k, entry in enumerate(series):
        name, points, style = _series_parts(entry)
        clean = []
        for p in points:
            x, y = finite(p[0]), finite(p[1])
            if x is None or y is None or (log_y and y <= 0):
                clean.append(None)
            else:
                clean.append((x, y))
        style.setdefault("color", PALETTE[k % len(PALETTE)])
        count = sum(1 for p in clean if p is not None)
        style.setdefault("markers", count < MARKER_LIMIT)
        style.setdefault("width", 2)
        parsed.append((str(name), clean, style))
    xs = [p[0] for _, pts, _ in parsed for p in pts if p is not None]
    ys = [p[1] for _, pts, _ in parsed for p in pts if p is not None]

    c = Canvas(width, height)
    top = _title(c, title, subtitle) + 8

    # y axis
    if log_y:
        y_min, y_max = (min(ys), max(ys)) if ys else (1.0, 10.0)
        if y_max == y_min:
            y_min, y_max = y_min / 2, y_max * 2
        l0, l1 = math.log10(y_min), math.log10(y_max)
        pad = (l1 - l0) * 0.06
        lo_t, hi_t = l0 - pad, l1 + pad
        ticks = log_ticks(10 ** lo_t, 10 ** hi_t)
        y_labels = [fmt_log_tick(t) for t in ticks]
        ty = math.log10
    else:
        y_min, y_max = (min(ys), max(ys)) if ys else (0.0, 1.0)
        margin = (y_max - y_min) * 0.03  # keep points off the frame when a tick meets the data
        y_min, y_max = y_min - (margin if not (y_from_zero and y_min >= 0) else 0), y_max + margin
        if y_from_zero:
            y_min = min(0.0, y_min)
        ticks, ystep = nice_ticks(y_min, y_max)
        lo_t, hi_t = ticks[0], ticks[-1]
        y_labels = tick_labels(ticks, ystep)
        ty = float

    # x axis
    if x_ticks:
        xt = sorted(set(float(t) for t in x_ticks))
        x_lo, x_hi = min(xt + xs), max(xt + xs)
        pad = 0.5 if x_hi == x_lo else (x_hi - x_lo) * 0.06
        x_lo, x_hi = x_lo - pad, x_hi + pad
        x_tick_labels = [fmt3(t) if t != int(t) else str(int(t)) for t in xt]
    else:
        a, b = (min(xs), max(xs)) if xs else (0.0, 1.0)
        xt, xstep = nice_ticks(a, b, 6)
        if xstep < 1 and xs and all(x == int(x) for x in xs):  # integer x (steps): no 1.5
            xt, xstep = [float(t) for t in range(int(a) - 1, int(b) + 2)], 1.0
        x_lo, x_hi = xt[0], xt[-1]
        x_tick_labels = tick_labels(xt, xstep)

    left = 12 + max(c.text_width(t) for t in y_labels) + 8
    right, bottom = 20, 44
    pl, pr, pt, pb = left, width - right, top, height - bottom
    x_of = lambda x: pl + (x - x_lo) / (x_hi - x_lo) * (pr - pl)  # noqa: E731
    y_of = lambda y: pb - (ty(y) - lo_t) / (hi_t - lo_t) * (pb - pt)  # noqa: E731

    for t, label in zip(ticks, y_labels):
        y = y_of(t)
        if pt - 1 <= y <= pb + 1:
            c.fill_rect(pl, y, pr, y + 1, GRID)
            c.text(pl - 6 - c.text_width(label), y - 3, label, MUTED)
    last_right = -1e9
    for t, label in zip(xt, x_tick_labels):
        x = x_of(t)
        c.fill_rect(x, pt, x + 1, pb, GRID)
        c.fill_rect(x, pb, x + 1, pb + 4, INK)
        w = c.text_width(label)
        if x - w / 2 > last_right + 4:  # skip a label that would touch the previous one
            c.text(x - w / 2, pb + 8, label, MUTED)
            last_right = x + w / 2
    c.rect(pl, pt, pr + 1, pb + 1, FRAME)
    text_center(c, (pl + pr) / 2, height - 16, x_label, INK)
    c.text(12, pt - 14, y_label, INK)  # the y axis' name, above its tick labels

    # data: lines first, then markers on top
    occupied = []
    for k, (name, pts, style) in enumerate(parsed):
        style["dx"] = (k - (len(parsed) - 1) / 2) * dodge
        prev = None
        for p in pts:
            if p is None:
                prev = None
                continue
            q = (x_of(p[0]) + style["dx"], y_of(p[1]))
            if prev is not None:
                thick_line(c, prev[0], prev[1], q[0], q[1], style["color"], style["width"])
                steps = int(max(abs(q[0] - prev[0]), abs(q[1] - prev[1])) // 8)
                for s in range(1, steps + 1):
                    f = s / (steps + 1)
                    occupied.append((prev[0] + (q[0] - prev[0]) * f, prev[1] + (q[1] - prev[1]) * f))
            occupied.append(q)
            prev = q
    for name, pts, style in parsed:
        if style["markers"]:
            for p in pts:
                if p is not None:
                    marker(c, x_of(p[0]) + style["dx"], y_of(p[1]), style["color"])
    if not xs:
        text_center(c, (pl + pr) / 2, (pt + pb) / 2, "no data", MUTED, 2)

    # legend, in the corner that covers the fewest drawn points
    named = [(name, style) for name, pts, style in parsed if name]
    if named:
        lw = max(c.text_width(n) for n, _ in named) + 40
        lh = len(named) * 14 + 8
        corners = [(pr - lw - 8, pt + 8), (pl + 8, pt + 8), (pr - lw - 8, pb - lh - 8), (pl + 8, pb - lh - 8)]

        def covered(corner):
            x0, y0 = corner
            return sum(1 for (x, y) in occupied if x0 - 4 <= x <= x0 + lw + 4 and y0 - 4 <= y <= y0 + lh + 4)

        lx, ly = min(corners, key=covered)
        c.fill_rect(lx, ly, lx + lw, ly + lh, WHITE)
        c.rect(lx, ly, lx + lw, ly + lh, FRAME)
        for k, (name, style) in enumerate(named):
            y = ly + 8 + k * 14
            thick_line(c, lx + 6, y + 3, lx + 26, y + 3, style["color"], max(style["width"], 2))
            if style["markers"]:
                marker(c, lx + 16, y + 3, style["color"])
            c.text(lx + 32, y, name, INK)
    c.save(path)
    return path
