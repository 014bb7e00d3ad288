#!/usr/bin/env python3
"""Turns a weft training run directory (finished or interrupted) into a Markdown report with
plots: a summary table (steps, epochs, time per epoch, tokens/s, held-out loss and perplexity,
memory, communication, plugin metrics), loss / throughput / perplexity / epoch-time charts, the
resolved configuration and the command that reproduces the run.

  python/report.py RUN_DIR [-o REPORT_MD]

Reads RUN_DIR/metrics.jsonl, RUN_DIR/config.toml and RUN_DIR/command.txt (optional); writes
REPORT_MD (default RUN_DIR/report.md) and its PNGs into the folder report/ next to it, linked
with relative paths. Prints the paths written. Plots with matplotlib (python/charts.py).
"""
import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from charts import PALETTE, bar_chart, confusion_chart, finite, fmt3, lighten, line_chart, time_unit  # noqa: E402

try:
    import tomllib
except ImportError:  # Python < 3.11: the configuration is still shown verbatim
    tomllib = None


# The run's files the report reads.
INPUTS = ("metrics.jsonl", "config.toml", "command.txt")


def fail(message):
    sys.exit(f"report: {message}")


# ---------------------------------------------------------------------------------------------
# Reading the run


class Run:
    def __init__(self, run_dir):
        self.dir = run_dir
        self.name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
        path = os.path.join(run_dir, "metrics.jsonl")
        if not os.path.isfile(path):
            fail(f"no metrics.jsonl in {run_dir} (not a weft run directory, or the run wrote log.metrics_file elsewhere)")
        self.bad_lines = 0
        self.segments = 1
        steps, evals, epochs, self.summary = {}, {}, {}, None
        self.first_step_time = None
        last_step = None
        try:
            with open(path, "rb") as f:
                raw_lines = f.readlines()
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror}")
        lines = []
        for number, raw in enumerate(raw_lines, 1):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                fail(f"{path} line {number}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                     "is it a weft metrics file?")
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.bad_lines += 1  # e.g. the last line of a run killed mid-write
                continue
            if not isinstance(record, dict):
                self.bad_lines += 1
                continue
            kind = record.get("type")
            if kind == "step" and finite(record.get("step")) is not None:
                step = int(record["step"])
                if last_step is not None and step <= last_step:
                    self.segments += 1  # a resumed run appends a segment whose steps repeat
                last_step = step
                if self.first_step_time is None:
                    self.first_step_time = finite(record.get("time"))
                steps[step] = record  # the last occurrence wins
            elif kind == "eval" and finite(record.get("step")) is not None:
                evals[int(record["step"])] = record
            elif kind == "epoch" and finite(record.get("epoch")) is not None:
                epochs[int(record["epoch"])] = record
            elif kind == "summary":
                self.summary = record
        self.steps = [steps[k] for k in sorted(steps)]
        self.evals = [evals[k] for k in sorted(evals)]
        self.epochs = [epochs[k] for k in sorted(epochs)]

        self.config_text, self.config, self.config_error = None, {}, None
        config_path = os.path.join(run_dir, "config.toml")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                self.config_text = f.read()
            if tomllib is not None:
                try:
                    self.config = tomllib.loads(self.config_text)
                except tomllib.TOMLDecodeError as e:
                    self.config_error = str(e)
        self.command = None
        command_path = os.path.join(run_dir, "command.txt")
        if os.path.isfile(command_path):
            with open(command_path, encoding="utf-8") as f:
                self.command = f.read().strip() or None

    def cfg(self, section, key, default=None):
        value = self.config.get(section, {})
        return value.get(key, default) if isinstance(value, dict) else default

    def step_values(self, key):
        return [(s["step"], finite(s.get(key))) for s in self.steps if finite(s.get(key)) is not None]


# ---------------------------------------------------------------------------------------------
# Formatting


def hms(seconds):
    seconds = finite(seconds)
    if seconds is None:
        return "n/a"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def fmt_loss(v):
    v = finite(v)
    return "n/a" if v is None else f"{v:.4f}"


def fmt_ppl(v):
    v = finite(v)
    if v is None:
        return "n/a"
    return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"


def fmt_num(v, digits=1):
    v = finite(v)
    return "n/a" if v is None else f"{v:,.{digits}f}"


def md_escape(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def moving_average(points, window):
    """Centred moving average of [(x, y)] over `window` points (narrower towards the ends)."""
    ys = [y for _, y in points]
    half, n = window // 2, len(ys)
    prefix = [0.0]
    for y in ys:
        prefix.append(prefix[-1] + y)
    out = []
    for i, (x, _) in enumerate(points):
        h = min(half, i, n - 1 - i)  # symmetric, so the ends follow the data instead of lagging
        a, b = i - h, i + h + 1
        out.append((x, (prefix[b] - prefix[a]) / (b - a)))
    return out


def smoothing_window(n):
    return max(3, min(100, n // 20)) if n >= 10 else 0


def world_size(run):
    if run.command:
        m = re.search(r"--nproc(?:[= ]+)(\d+)", run.command)
        if m:
            return int(m.group(1))
        m = re.search(r"--nproc[-_]per[-_]node(?:[= ]+)(\d+)", run.command)
        if m:
            return int(m.group(1))
    per_rank = (run.summary or {}).get("activation_peak_mib_per_rank")
    if isinstance(per_rank, list) and per_rank:
        return len(per_rank)
    return None


# ---------------------------------------------------------------------------------------------
# The report


def summary_rows(run):
    s = run.summary or {}
    rows = []
    add = lambda k, v: rows.append((k, v))  # noqa: E731

    if run.summary is None:
        status = "no summary record: interrupted or still running"
    elif s.get("interrupted"):
        status = "interrupted"
    elif s.get("early_stopped"):
        status = "early-stopped (no held-out improvement within eval.patience)"
    else:
        status = "completed"
    if run.segments > 1:
        status += f"; resumed ({run.segments} segments in metrics.jsonl, the last value of each step kept)"
    add("Status", status)

    plugin = run.cfg("train", "plugin") or ""
    if isinstance(plugin, list):  # a composition over a device mesh: its plugins in order
        plugin = ",".join(str(p) for p in plugin)
    plugin_text = f"`{plugin}`" if plugin else "single (built into the trainer: one process)"
    settings = run.config.get("plugin")
    if isinstance(settings, dict) and settings:
        plugin_text += " (" + ", ".join(f"{k}={json.dumps(v)}" for k, v in settings.items()) + ")"
    world = world_size(run)
    if world:
        plugin_text += f", {world} process{'es' if world != 1 else ''}"
    add("Plugin", plugin_text)

    model = run.cfg("model", "config") or ""
    trained = s.get("model") if isinstance(s.get("model"), dict) else None
    if trained:  # what the trainer loaded: the weights' file or folder and the shape it had
        model_text = (f"`{trained.get('weights')}`: {trained.get('layers')} layers, hidden {trained.get('hidden_size')}, "
                      f"{trained.get('heads')} heads ({trained.get('kv_heads')} kv), vocab {trained.get('vocab_size')}, "
                      f"{fmt_num(trained.get('parameters', 0) / 1e6, 2)}M parameters")
        if trained.get("trainable_parameters") not in (None, trained.get("parameters")):
            model_text += f" ({fmt_num(trained['trainable_parameters'] / 1e6, 2)}M trained)"
    else:
        model_text = f"`{model}`" if model else (f"preset `{run.cfg('model', 'preset')}`" if run.cfg("model", "preset")
                                                 else "n/a")
        if run.cfg("model", "weights"):
            model_text += f", weights `{run.cfg('model', 'weights')}`"
    mode = run.cfg("train", "mode")
    if mode:
        model_text += f", {mode} fine-tuning"
        if mode == "lora":
            model_text += f" (r={run.cfg('lora', 'r')}, alpha={run.cfg('lora', 'alpha')})"
    if run.config:
        add("Model", model_text)
    if run.cfg("train", "precision"):
        add("Precision", str(run.cfg("train", "precision")))
    batch, accum, seq = run.cfg("train", "batch_size"), run.cfg("train", "grad_accum_steps"), run.cfg("data", "seq_len")
    if batch is not None or seq is not None:
        text = f"batch size {batch}"
        if accum not in (None, 1):
            text += f" x {accum} accumulation steps"
        text += f", seq_len {seq}"
        if isinstance(batch, int) and isinstance(seq, int):
            text += f" ({batch * (accum or 1) * seq:,} tokens per step)"
        add("Batch", text)
    lr = run.cfg("train", "lr")
    if lr is not None:
        text = f"{lr:g}" if isinstance(lr, (int, float)) else str(lr)
        extra = [f"{run.cfg('train', 'schedule')} schedule"] if run.cfg("train", "schedule") else []
        if run.cfg("train", "warmup_steps"):
            extra.append(f"{run.cfg('train', 'warmup_steps')} warm-up steps")
        add("Learning rate", text + (" (" + ", ".join(extra) + ")" if extra else ""))

    steps = s.get("steps", run.steps[-1]["step"] if run.steps else 0)
    add("Steps", f"{steps}" + (f" ({s['steps_per_epoch']} per epoch)" if s.get("steps_per_epoch") else ""))
    epoch_times = epoch_seconds(run)
    add("Epochs completed", str(len(epoch_times) if run.epochs or "epoch_seconds" in s else s.get("epochs", 0)))
    if epoch_times:
        add("Time per epoch", ", ".join(f"epoch {e}: {hms(t)}" for e, t in epoch_times))
    else:  # no epoch finished: what one would take at this run's pace
        step_times = [y for _, y in run.step_values("step_time_s")]
        if step_times and s.get("steps_per_epoch"):
            add("Time per epoch (projected)", f"{hms(s['steps_per_epoch'] * statistics.median(step_times))} "
                f"({s['steps_per_epoch']} steps x median step time {statistics.median(step_times):.3f} s)")
    if run.steps:
        start = run.first_step_time
        end = max((finite(r.get("time")) or 0) for r in run.steps + run.evals + run.epochs + [s])
        first_step = finite(run.steps[0].get("step_time_s")) or 0
        if start is not None and end:
            add("Wall time", hms(end - start + first_step))
    tps = [y for _, y in run.step_values("tokens_per_s")]
    if tps or finite(s.get("tokens_per_s")) is not None:
        parts = []
        if finite(s.get("tokens_per_s")) is not None:
            parts.append(f"{fmt_num(s['tokens_per_s'], 0)} over the run")
        if tps:
            parts.append(f"{fmt_num(statistics.fmean(tps), 0)} mean of steps, {fmt_num(statistics.median(tps), 0)} median")
        add("Tokens/s", "; ".join(parts))
    losses = run.step_values("loss")
    if losses:
        text = fmt_loss(losses[-1][1]) + f" (step {losses[-1][0]})"
        w = smoothing_window(len(losses))
        if w:
            text += f", moving average over {w} steps {fmt_loss(statistics.fmean(y for _, y in losses[-w:]))}"
        add("Final train loss", text)

    final_eval = run.evals[-1] if run.evals else None
    final_loss = final_eval.get("loss") if final_eval else s.get("eval_loss")
    final_ppl = final_eval.get("perplexity") if final_eval else s.get("perplexity")
    metrics = task_metrics(final_eval)
    if metrics:  # a classifier (train.task = "classification"): its task's metrics, not a perplexity
        where = f" (step {final_eval['step']})"
        add("Final held-out loss", fmt_loss(final_loss) + where)
        add("Final held-out metrics", ", ".join(f"{k} {v:.4f}" for k, v in metrics) + where)
    elif finite(final_loss) is not None or finite(final_ppl) is not None:
        where = f" (step {final_eval['step']})" if final_eval else ""
        add("Final held-out loss", fmt_loss(final_loss) + where)
        add("Final held-out perplexity", fmt_ppl(final_ppl) + where)
        evals = [e for e in run.evals if finite(e.get("loss")) is not None]
        start = next((e for e in evals if e.get("step") == 0), None)
        if start:  # eval.on_start: the model the run started from
            add("Held-out before training", f"loss {fmt_loss(start['loss'])}, perplexity {fmt_ppl(start.get('perplexity'))} (step 0)")
        if evals:
            best = min(evals, key=lambda e: e["loss"])
            add("Best held-out loss", f"{fmt_loss(best['loss'])} (step {best['step']}, perplexity {fmt_ppl(best.get('perplexity'))})")
    else:
        add("Held-out evaluation", "none recorded")

    memory = []
    if finite(s.get("peak_rss_mib")) is not None:
        memory.append(f"RSS {fmt_num(s['peak_rss_mib'])} MiB")
    per_rank = s.get("activation_peak_mib_per_rank")
    if isinstance(per_rank, list) and per_rank:
        memory.append("activations per rank " + ", ".join(f"r{i}: {fmt_num(v)}" for i, v in enumerate(per_rank)) + " MiB")
    elif finite(s.get("activation_peak_mib")) is not None:
        memory.append(f"activations {fmt_num(s['activation_peak_mib'])} MiB")
    else:
        act = [y for _, y in run.step_values("activation_peak_mib")]
        if act:
            memory.append(f"activations {fmt_num(max(act))} MiB (largest step)")
    if memory:
        add("Peak memory", "; ".join(memory))

    comm = []
    wait = finite(s.get("comm_wait_fraction"))
    if wait is None:
        waits, times = run.step_values("comm_wait_s"), dict(run.step_values("step_time_s"))
        total = sum(times.get(k, 0) for k, _ in waits)
        if waits and total > 0:
            wait = sum(y for _, y in waits) / total
    if wait is not None:
        comm.append(f"{100 * wait:.1f}% of step time waiting (rank 0)")
    per_step = finite(s.get("comm_bytes_per_step"))
    if per_step is None:
        b = [y for _, y in run.step_values("comm_bytes")]
        per_step = statistics.fmean(b) if b else None
    if per_step is not None:
        comm.append(f"{per_step / 1e6:,.2f} MB/step")
    if comm:
        add("Communication", "; ".join(comm))

    plugin_keys = [k for k in s if k.startswith("plugin.")]
    for k in plugin_keys:
        add(f"`{k}`", md_plain(s[k]))
    step_keys = sorted({k for r in run.steps for k in r if k.startswith("plugin.")} - set(plugin_keys))
    for k in step_keys:
        values = [y for _, y in run.step_values(k)]
        if values:
            add(f"`{k}`", f"{fmt3(statistics.fmean(values))} (mean over {len(values)} step{'s' * (len(values) != 1)}, "
                          f"last {fmt3(values[-1])})")
    return rows


def md_plain(v):
    if isinstance(v, float):
        return fmt3(v)
    if isinstance(v, list):
        return ", ".join(md_plain(x) for x in v)
    return md_escape(v)


def epoch_seconds(run):
    """[(epoch, seconds)] from the epoch records, else the summary's epoch_seconds."""
    out = [(int(e["epoch"]), finite(e.get("time_s"))) for e in run.epochs if finite(e.get("time_s")) is not None]
    if not out and isinstance((run.summary or {}).get("epoch_seconds"), list):
        out = [(i + 1, finite(t)) for i, t in enumerate(run.summary["epoch_seconds"]) if finite(t) is not None]
    return out


# A classifier's evaluation metrics (core/train/task_metrics.h), as metrics.jsonl names them.
TASK_METRICS = ("accuracy", "macro_f1", "f1", "matthews_correlation", "pearson", "spearmanr", "mse")


def task_metrics(record):
    """[(name, value)] of an eval record's task metrics (MNLI's "mismatched_" ones too), in order."""
    if not record:
        return []
    return [(k, record[k]) for k in record if finite(record.get(k)) is not None and
            (k in TASK_METRICS or (k.endswith(TASK_METRICS) and k.startswith("mismatched_") and k != "mismatched_loss"))]


def draw_plots(run, image_dir):
    """Writes the charts; returns [(title, path)]."""
    os.makedirs(image_dir, exist_ok=True)
    plots = []
    losses = run.step_values("loss")
    eval_loss = [(e["step"], finite(e.get("loss"))) for e in run.evals if finite(e.get("loss")) is not None]
    if losses or eval_loss:
        series = [("train loss", losses, {"color": lighten(PALETTE[0], 0.55), "width": 1})]
        w = smoothing_window(len(losses))
        if w:
            series.append((f"train, moving average ({w} steps)", moving_average(losses, w),
                           {"color": PALETTE[0], "markers": False}))
        if eval_loss:
            series.append(("held-out loss", eval_loss, {"color": PALETTE[1], "markers": True}))
        plots.append(("Loss", line_chart(os.path.join(image_dir, "loss.png"), f"Loss: {run.name}", series,
                                         "step", "loss")))
    tps = run.step_values("tokens_per_s")
    if tps:
        series = [("tokens/s", tps, {"color": lighten(PALETTE[2], 0.5), "width": 1})]
        w = smoothing_window(len(tps))
        if w:
            series.append((f"moving average ({w} steps)", moving_average(tps, w), {"color": PALETTE[2], "markers": False}))
        sub = f"median {fmt3(statistics.median(y for _, y in tps))} tokens/s over {len(tps)} steps"
        plots.append(("Throughput", line_chart(os.path.join(image_dir, "throughput.png"), f"Throughput: {run.name}",
                                               series, "step", "tokens/s", subtitle=sub, y_from_zero=True)))
    classifier = bool(run.evals and task_metrics(run.evals[-1]))
    if classifier:
        names = [k for k, _ in task_metrics(run.evals[-1])]
        series = [(name, [(e["step"], finite(e.get(name))) for e in run.evals if finite(e.get(name)) is not None],
                   {"color": PALETTE[i % len(PALETTE)], "markers": True}) for i, name in enumerate(names)]
        plots.append(("Held-out metrics", line_chart(os.path.join(image_dir, "task_metrics.png"),
                                                     f"Held-out metrics: {run.name}", series, "step", "value")))
        last = run.evals[-1]
        if isinstance(last.get("confusion"), list) and isinstance(last.get("classes"), list):
            total = sum(sum(row) for row in last["confusion"])
            plots.append(("Confusion matrix", confusion_chart(
                os.path.join(image_dir, "confusion.png"), f"Confusion matrix: {run.name}", last["classes"],
                last["confusion"], subtitle=f"held-out, step {last['step']}, {total} examples; "
                                            f"shade = share of the true class")))
    ppl = [(e["step"], finite(e.get("perplexity"))) for e in run.evals if finite(e.get("perplexity")) is not None]
    if ppl and not classifier:
        ys = [y for _, y in ppl]
        log_y = min(ys) > 0 and max(ys) / min(ys) > 20
        plots.append(("Held-out perplexity", line_chart(
            os.path.join(image_dir, "perplexity.png"), f"Held-out perplexity: {run.name}",
            [("perplexity", ppl, {"color": PALETTE[1], "markers": True})], "step",
            "perplexity" + (" (log scale)" if log_y else ""), log_y=log_y)))
    epochs = epoch_seconds(run)
    if epochs:
        div, unit = time_unit(max(t for _, t in epochs))
        plots.append(("Time per epoch", bar_chart(
            os.path.join(image_dir, "epoch_time.png"), f"Time per epoch: {run.name}",
            [f"epoch {e}" for e, _ in epochs], [t / div for _, t in epochs], unit=unit,
            colors=[PALETTE[4]], value_fmt=lambda v: hms(v * div))))
    return plots


def started(run):
    t = run.first_step_time
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def fallback_command(run):
    run_dir = os.path.relpath(run.dir)
    if run_dir.startswith(".."):
        run_dir = os.path.abspath(run.dir)
    command = f"build/trainer --config {shlex.quote(os.path.join(run_dir, 'config.toml'))}"
    world = world_size(run)
    if world and world > 1:
        command += f" --nproc {world}"
    return command


def render(run, plots, report_dir):
    out = [f"# weft run `{run.name}`", ""]
    when = started(run)
    out.append(f"Started {when}." if when else "No training step was recorded.")
    out.append("")
    if run.bad_lines:
        out += [f"_{run.bad_lines} unreadable line(s) of metrics.jsonl were skipped (a run stopped mid-write?)._", ""]
    out += ["## Summary", "", "| | |", "|---|---|"]
    out += [f"| {md_escape(k)} | {v} |" for k, v in summary_rows(run)]
    out.append("")
    ranks = (run.summary or {}).get("adalora_ranks")
    if isinstance(ranks, dict) and ranks:
        kept = sum(v for v in ranks.values() if isinstance(v, (int, float)))
        out += ["## AdaLoRA ranks", "",
                f"Each adapted layer's rank at the end (kept triplets): {kept:g} over {len(ranks)} layers "
                f"(mean {kept / len(ranks):.2f}).", "", "| layer | rank |", "|---|---|"]
        out += [f"| `{md_escape(name)}` | {md_plain(rank)} |" for name, rank in ranks.items()]
        out.append("")
    if plots:
        out += ["## Plots", ""]
        for title, path in plots:
            rel = os.path.relpath(path, report_dir).replace(os.sep, "/")
            out += [f"### {title}", "", f"![{title}]({rel})", ""]
    out += ["## Configuration", ""]
    if run.config_text is not None:
        out.append("The resolved configuration (`config.toml`, every key):")
        out.append("")
        if run.config_error:
            out += [f"_It did not parse as TOML: {md_escape(run.config_error)}._", ""]
        out += ["```toml", run.config_text.rstrip("\n"), "```", ""]
    else:
        out += ["_No config.toml in the run directory._", ""]
    out += ["## Reproduce", ""]
    if run.command:
        out += ["The command that produced this run (`command.txt`):", "", "```sh", run.command, "```", ""]
    else:
        out += ["_No command.txt in the run directory (runs from before weft recorded its command line)._ "
                "The closest equivalent, from the repository root, with the resolved configuration"
                + (" (the number of processes is not recorded: add `--nproc N` for a multi-process run)"
                   if not world_size(run) and run.cfg("train", "plugin") else "") + ":",
                "", "```sh", fallback_command(run), "```", ""]
    out += ["`train.out_dir` in the configuration names this run's directory: add "
            "`--set train.out_dir=runs/NEW` to train into a fresh one.", ""]
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("-o", "--output", default=None, help="report path (default RUN_DIR/report.md)")
    args = parser.parse_args()

    if not os.path.isdir(args.run_dir):
        fail(f"{args.run_dir} is not a directory")
    report = args.output or os.path.join(args.run_dir, "report.md")
    for name in INPUTS:  # the report must never replace what it is made from
        source = os.path.join(args.run_dir, name)
        if os.path.exists(source) and os.path.exists(report) and os.path.samefile(source, report):
            fail(f"{report} is an input of the report ({name} of the run); write the report elsewhere (-o REPORT.md)")
    run = Run(args.run_dir)
    report_dir = os.path.dirname(os.path.abspath(report))
    os.makedirs(report_dir, exist_ok=True)
    plots = draw_plots(run, os.path.join(report_dir, "report"))
    text = render(run, plots, report_dir)
    with open(report, "w", encoding="utf-8") as f:
        f.write(text)
    print(report)
    for _, path in plots:
        print(path)


if __name__ == "__main__":
    main()
