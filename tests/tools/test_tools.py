#!/usr/bin/env python3
"""Tests of the Python tools: python/report.py on a fake run directory and python/plot_bench.py on
a fake `trainer bench` JSON, each run as a subprocess in a temporary folder.

  /usr/bin/python3 tests/tools/test_tools.py        (from the repository root, or anywhere)

Checks the outputs exist and are PNGs (signature, IHDR size), the report holds the final
perplexity, the command and links that resolve, degenerate runs (one step, no eval, no epoch,
no command.txt, a torn last line) still report, and a missing metrics.jsonl or bench JSON is
refused with one line and a non-zero exit. Needs matplotlib (Debian's python3-matplotlib: run it
with /usr/bin/python3); a few seconds.
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(ROOT, "python", "report.py")
PLOT_BENCH = os.path.join(ROOT, "python", "plot_bench.py")
COMMAND = "cd /work/main && build/trainer --config configs/quickstart.toml --plugin ddp --nproc 2"

CONFIG = """[model]
preset = "tiny"
config = ""
weights = ""

[data]
seq_len = 64

[train]
mode = "full"
batch_size = 4
grad_accum_steps = 1
lr = 0.002
schedule = "cosine"
warmup_steps = 2
precision = "bf16"
plugin = "ddp"
out_dir = "runs/fake"

[plugin]
bucket_mb = 4
"""


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)


def png_size(path):
    """(width, height) from the IHDR chunk; fails unless the file is a PNG."""
    with open(path, "rb") as f:
        head = f.read(33)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG signature"
    length, kind = struct.unpack(">I4s", head[8:16])
    assert kind == b"IHDR" and length == 13, f"{path}: first chunk is not IHDR"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 0 and height > 0, f"{path}: empty image"
    return width, height


def write_lines(path, records, tail=""):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)


def fake_run(folder, steps=30, eval_every=10, command=True, resumed=True):
    """A run of `steps` steps, one epoch record per 15 steps and an eval every `eval_every`
    (0 = none); with `resumed`, steps 21.. appear twice (the second copy must win)."""
    os.makedirs(folder, exist_ok=True)
    t0 = 1795384972.0
    records, final_ppl = [], None
    for s in range(1, steps + 1):
        records.append({"type": "step", "step": s, "epoch": 1 + (s - 1) // 15, "loss": 6.0 - 0.1 * s,
                        "lr": 0.001, "grad_norm": 1.0, "step_time_s": 0.5, "tokens_per_s": 500.0 + s,
                        "time": t0 + s * 0.5, "comm_wait_s": 0.05, "comm_bytes": 2000000})
        if eval_every and s % eval_every == 0:
            final_ppl = 30.0 / s + 1.234567
            records.append({"type": "eval", "step": s, "epoch": 1, "loss": 3.0 / s, "perplexity": final_ppl,
                            "tokens": 1000, "seconds": 0.1, "best": True, "time": t0 + s * 0.5})
        if s % 15 == 0:
            records.append({"type": "epoch", "epoch": s // 15, "step": s, "time_s": 7.5, "tokens_per_s": 510.0,
                            "eval_loss": None, "perplexity": None, "time": t0 + s * 0.5})
    if resumed and steps > 20:
        # a resumed segment repeats steps 21.. with different (final) values
        for s in range(21, steps + 1):
            records.append({"type": "step", "step": s, "epoch": 2, "loss": 9.5, "lr": 0.001, "grad_norm": 1.0,
                            "step_time_s": 0.5, "tokens_per_s": 777.0, "time": t0 + 100 + s})
    records.append({"type": "summary", "steps": steps, "epochs": steps // 15, "steps_per_epoch": 15,
                    "epoch_seconds": [7.5] * (steps // 15), "tokens_per_s": 505.0, "peak_rss_mib": 321.5,
                    "comm_wait_fraction": 0.1, "comm_bytes_per_step": 2000000, "plugin.bubble": 0.25,
                    "interrupted": False, "early_stopped": False, "time": t0 + 200,
                    "adalora_ranks": {"model.layers.0.self_attn.q_proj": 3, "model.layers.0.self_attn.v_proj": 0}})
    write_lines(os.path.join(folder, "metrics.jsonl"), records, tail='{"type": "step", "st')  # torn last line
    with open(os.path.join(folder, "config.toml"), "w") as f:
        f.write(CONFIG)
    if command:
        with open(os.path.join(folder, "command.txt"), "w") as f:
            f.write(COMMAND + "\n")
    return final_ppl


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def report(self, run_dir, *extra):
        result = run(REPORT, run_dir, *extra)
        self.assertEqual(result.returncode, 0, result.stderr)
        return result

    def test_full_run(self):
        run_dir = os.path.join(self.dir, "run-a")
        final_ppl = fake_run(run_dir)
        out = os.path.join(self.dir, "out", "report.md")
        result = self.report(run_dir, "-o", out)
        self.assertIn(out, result.stdout)
        with open(out) as f:
            text = f.read()
        self.assertIn(f"{final_ppl:.3f}", text)  # final held-out perplexity
        self.assertIn("```sh\n" + COMMAND + "\n```", text)  # Reproduce, verbatim
        self.assertIn("```toml\n" + CONFIG.rstrip("\n") + "\n```", text)  # configuration, verbatim
        self.assertIn("run-a", text.splitlines()[0])
        self.assertIn("`ddp`", text)
        self.assertIn("bucket_mb=4", text)
        self.assertIn("2 processes", text)
        self.assertIn("10.0% of step time", text)
        self.assertIn("2.00 MB/step", text)
        self.assertIn("plugin.bubble", text)
        self.assertIn("321.5 MiB", text)
        self.assertIn("0:00:08", text)  # 7.5 s per epoch as h:mm:ss
        self.assertIn("9.5000 (step 30)", text)  # the resumed segment's last occurrence wins
        self.assertIn("## AdaLoRA ranks", text)  # train.mode = adalora: each layer's final rank
        self.assertIn("| `model.layers.0.self_attn.q_proj` | 3 |", text)
        self.assertIn("3 over 2 layers", text)
        links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
        self.assertEqual(sorted(os.path.basename(p) for p in links),
                         ["epoch_time.png", "loss.png", "perplexity.png", "throughput.png"])
        for link in links:
            self.assertFalse(os.path.isabs(link), link)
            path = os.path.join(os.path.dirname(out), link)
            self.assertEqual(os.path.dirname(path), os.path.join(os.path.dirname(out), "report"))
            self.assertGreaterEqual(png_size(path)[0], 200)
        self.assertFalse(os.path.exists(os.path.join(run_dir, "report.md")))  # -o: nothing in the run dir

    def test_classifier_run(self):
        """A classifier's evaluations (train.task = "classification"): its task metrics in the summary
        instead of a perplexity, their chart, and the last evaluation's confusion matrix."""
        run_dir = os.path.join(self.dir, "run-cls")
        os.makedirs(run_dir)
        records = [{"type": "step", "step": s, "epoch": 1, "loss": 1.0 / s, "lr": 0.001, "tokens_per_s": 500.0,
                    "time": 1795384972.0 + s} for s in range(1, 11)]
        for s, acc in ((5, 0.5), (10, 0.75)):
            records.append({"type": "eval", "step": s, "epoch": 1, "loss": 0.6, "perplexity": 1.8, "tokens": 8,
                            "seconds": 0.1, "best": True, "accuracy": acc, "macro_f1": acc - 0.1,
                            "confusion": [[3, 1], [1, 3]], "classes": ["no", "yes"], "time": 1795384972.0 + s})
        records.append({"type": "summary", "steps": 10, "eval_accuracy": 0.75, "time": 1795384990.0})
        write_lines(os.path.join(run_dir, "metrics.jsonl"), records)
        self.report(run_dir)
        with open(os.path.join(run_dir, "report.md")) as f:
            text = f.read()
        self.assertIn("| Final held-out metrics | accuracy 0.7500, macro_f1 0.6500 (step 10) |", text)
        self.assertNotIn("perplexity", text.split("## Configuration")[0].lower())
        for image in ("task_metrics.png", "confusion.png"):
            self.assertIn(f"report/{image}", text)
            png_size(os.path.join(run_dir, "report", image))

    def test_pretrained_model_run(self):
        """A run from a checkpoint (the quick start's): the summary's model (the file the weights came
        from, its shape), the held-out loss before training (eval.on_start's step 0), a plugin list."""
        run_dir = os.path.join(self.dir, "run-gguf")
        os.makedirs(run_dir)
        t0 = 1795384972.0
        records = [{"type": "eval", "step": 0, "epoch": 1, "loss": 3.6636, "perplexity": 39.001, "tokens": 7860,
                    "seconds": 14.0, "best": True, "time": t0}]
        records += [{"type": "step", "step": s, "epoch": 1, "loss": 3.5 - 0.1 * s, "lr": 0.001, "tokens_per_s": 260.0,
                     "time": t0 + s} for s in range(1, 5)]
        records.append({"type": "eval", "step": 4, "epoch": 1, "loss": 3.3056, "perplexity": 27.264, "tokens": 7860,
                        "seconds": 14.0, "best": True, "time": t0 + 5})
        records.append({"type": "summary", "steps": 4, "time": t0 + 6,
                        "model": {"weights": "data/models/SmolLM2-135M-Instruct.Q4_1.gguf", "layers": 30,
                                  "hidden_size": 576, "heads": 9, "kv_heads": 3, "vocab_size": 49152,
                                  "parameters": 134515008, "trainable_parameters": 4884480}})
        write_lines(os.path.join(run_dir, "metrics.jsonl"), records)
        with open(os.path.join(run_dir, "config.toml"), "w") as f:
            f.write(CONFIG.replace('plugin = "ddp"', 'plugin = ["ddp"]'))
        self.report(run_dir)
        with open(os.path.join(run_dir, "report.md")) as f:
            text = f.read()
        self.assertIn("| Model | `data/models/SmolLM2-135M-Instruct.Q4_1.gguf`: 30 layers, hidden 576, 9 heads (3 kv), "
                      "vocab 49152, 134.52M parameters (4.88M trained)", text)
        self.assertIn("| Held-out before training | loss 3.6636, perplexity 39.001 (step 0) |", text)
        self.assertIn("| Final held-out perplexity | 27.264 (step 4) |", text)
        self.assertIn("| Plugin | `ddp`", text)

    def test_default_output_in_run_dir(self):
        run_dir = os.path.join(self.dir, "run-b")
        fake_run(run_dir)
        self.report(run_dir)
        self.assertTrue(os.path.isfile(os.path.join(run_dir, "report.md")))
        png_size(os.path.join(run_dir, "report", "loss.png"))

    def test_single_step_no_eval_no_command(self):
        run_dir = os.path.join(self.dir, "tiny")
        fake_run(run_dir, steps=1, eval_every=0, command=False, resumed=False)
        out = os.path.join(self.dir, "t", "report.md")
        self.report(run_dir, "-o", out)
        with open(out) as f:
            text = f.read()
        self.assertIn("No command.txt", text)
        self.assertIn("build/trainer --config", text)
        self.assertIn("none recorded", text)  # no held-out evaluation
        images = os.path.join(self.dir, "t", "report")
        self.assertFalse(os.path.exists(os.path.join(images, "perplexity.png")))
        self.assertFalse(os.path.exists(os.path.join(images, "epoch_time.png")))
        png_size(os.path.join(images, "loss.png"))
        png_size(os.path.join(images, "throughput.png"))

    def test_missing_metrics_is_one_line_error(self):
        run_dir = os.path.join(self.dir, "empty")
        os.makedirs(run_dir)
        result = run(REPORT, run_dir, "-o", os.path.join(self.dir, "x", "report.md"))
        self.assertNotEqual(result.returncode, 0)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
        self.assertIn("metrics.jsonl", result.stderr)
        self.assertNotIn("Traceback", result.stderr)


class PlotBenchTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    @staticmethod
    def variant(name, plugin, nproc, kind, tps):
        return {"name": name, "plugin": plugin, "nproc": nproc, "kind": kind,
                "step_time_s": {"median": 2048 / tps, "min": 2048 / tps * 0.95, "max": 2048 / tps * 1.05},
                "tokens_per_s": {"median": tps, "min": tps * 0.95, "max": tps * 1.05},
                "epoch_s": {"median": 1759 * 2048 / tps, "min": 1759 * 2048 / tps * 0.95,
                            "max": 1759 * 2048 / tps * 1.05},
                "peak_rss_mib_per_rank": [400.0] * nproc, "comm_wait_fraction": None, "comm_bytes_per_step": None,
                "bubble": None, "bubble_formula": None,
                "runs": [{"repetition": 1, "step_time_s": 2048 / tps, "tokens_per_s": tps}]}

    def test_plots(self):
        bench = {"command": "trainer bench", "config": "configs/small-bench.toml", "warmup_steps": 3, "steps": 10,
                 "repetitions": 3, "tokens_per_step": 2048, "steps_per_epoch": 1759,
                 "variants": [self.variant("single x1", "single", 1, "weft", 1650.0),
                              self.variant("ddp x1", "ddp", 1, "weft", 1620.0),
                              self.variant("ddp x2", "ddp", 2, "weft", 2840.0),
                              self.variant("pytorch-ddp x2", None, 2, "pytorch", 2500.0)],
                 "ratios": [{"a": "ddp x2", "b": "single x1", "tokens_per_s": 1.72,
                             "per_repetition": [1.7, 1.75, 1.72]}]}
        path = os.path.join(self.dir, "bench.json")
        with open(path, "w") as f:
            json.dump(bench, f)
        out = os.path.join(self.dir, "plots")
        result = run(PLOT_BENCH, path, "-o", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        names = ["tokens_per_s.png", "epoch_time.png", "scaling.png", "scaling_epoch.png"]
        for name in names:
            self.assertIn(os.path.join(out, name), result.stdout)
            self.assertGreaterEqual(png_size(os.path.join(out, name))[0], 200)
        # default output folder: the JSON's
        result = run(PLOT_BENCH, path)
        self.assertEqual(result.returncode, 0, result.stderr)
        png_size(os.path.join(self.dir, "tokens_per_s.png"))
        self.assertFalse(os.path.exists(os.path.join(out, "bubble.png")))  # no pipeline variant

    def test_bubble_plot(self):
        variants = []
        for plugin in ("gpipe", "pipedream"):
            for nproc in (2, 4):
                for micro in (4, 8, 16):
                    v = self.variant(f"{plugin} microbatches={micro} x{nproc}", plugin, nproc, "weft", 1500.0)
                    v["bubble_formula"] = (nproc - 1) / (micro + nproc - 1)
                    v["bubble"] = v["bubble_formula"] * 1.2
                    variants.append(v)
        for micro in (4, 8, 16):  # interleaved 1F1B, 2 chunks: its own formula
            v = self.variant(f'gpipe schedule="interleaved1f1b" microbatches={micro} x2', "gpipe", 2, "weft", 1500.0)
            v["bubble_formula"] = 1 / (2 * micro + 1)
            v["bubble"] = v["bubble_formula"] * 1.5
            variants.append(v)
        for micro in (4, 8):  # ZB-H1: its own formula too
            v = self.variant(f'pipedream schedule="zbh1" microbatches={micro} x2', "pipedream", 2, "weft", 1500.0)
            v["bubble_formula"] = 1 / (3 * micro + 1)
            v["bubble"] = v["bubble_formula"] * 2
            variants.append(v)
        variants.append(self.variant("gpipe x2", "gpipe", 2, "weft", 1500.0))  # no micro-batches named: not drawn
        bench = {"config": "configs/small-bench.toml", "steps": 6, "repetitions": 3, "variants": variants}
        path = os.path.join(self.dir, "bench.json")
        with open(path, "w") as f:
            json.dump(bench, f)
        result = run(PLOT_BENCH, path)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(os.path.join(self.dir, "bubble.png"), result.stdout)
        self.assertGreaterEqual(png_size(os.path.join(self.dir, "bubble.png"))[0], 200)
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import plot_bench
        drawn = []
        plot_bench.line_chart = lambda path, title, series, *a, **k: drawn.append(series) or path
        plot_bench.bubble(os.path.join(self.dir, "b.png"), variants, "")
        names = [name for name, _, _ in drawn[0]]
        self.assertEqual(names[:6], ['gpipe schedule="interleaved1f1b" x2', "gpipe x2", "gpipe x4",
                                     'pipedream schedule="zbh1" x2', "pipedream x2", "pipedream x4"])
        self.assertEqual(dict(drawn[0][1][1]), {4: 1.2 / 5, 8: 1.2 / 9, 16: 1.2 / 17})
        formulas = [(name, dict(points)) for name, points, style in drawn[0] if style.get("dashed")]
        self.assertEqual([name for name, _ in formulas], ["formula (S - 1) / (vM + S - 1), interleaved x2",
                                                          "formula (S - 1) / (M + S - 1), x2",
                                                          "formula (S - 1) / (3M + S - 1), ZB-H1 x2",
                                                          "formula (S - 1) / (M + S - 1), x4"])
        self.assertAlmostEqual(formulas[0][1][4], 1 / 9)
        self.assertAlmostEqual(formulas[2][1][4], 1 / 13)
        self.assertAlmostEqual(formulas[3][1][4], 3 / 7)

    def test_missing_json_is_one_line_error(self):
        result = run(PLOT_BENCH, os.path.join(self.dir, "nope.json"))
        self.assertNotEqual(result.returncode, 0)
        self.assertEqual(len(result.stderr.strip().splitlines()), 1, result.stderr)
        self.assertNotIn("Traceback", result.stderr)


class ChartsTest(unittest.TestCase):
    """Degenerate inputs draw without raising."""

    def test_degenerate(self):
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import charts
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "c.png")
            nan = float("nan")
            charts.line_chart(p, "one point", [("a", [(1, 2.0)])], "x", "y")
            charts.line_chart(p, "equal", [("a", [(1, 2.0), (2, 2.0), (3, None), (4, nan)])], "x", "y", log_y=True)
            charts.line_chart(p, "empty", [("a", [])], "x", "y", x_ticks=[1, 2, 4])
            charts.line_chart(p, "none", [], "x", "y")
            charts.bar_chart(p, "bars", ["a", "b", "c"], [0, None, nan], lows=[None, 1, 2], highs=[1, None, 3])
            charts.bar_chart(p, "no bars", [], [])
            self.assertEqual(png_size(p), (charts.WIDTH, charts.HEIGHT))
        ticks = charts.axis_ticks(0, 2925)  # a value axis steps by 1, 2, 2.5 or 5 x 10^k
        self.assertEqual(ticks[0], 0)
        self.assertIn(ticks[1] - ticks[0], (500, 1000))
        self.assertGreaterEqual(ticks[-1], 2925)
        self.assertEqual(charts.fmt3(18444), "18.4k")
        self.assertEqual(charts.fmt3(2840), "2840")


if __name__ == "__main__":
    unittest.main()
