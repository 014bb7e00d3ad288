#!/usr/bin/python3
"""Strategies A/B-timed where the network matters: 2 nodes (tools/cluster.sh) with the inter-node
link at each of --rates, every variant started the way users start a job on machines (torchrun
--nnodes 2 --node-rank r --master-addr <node 0> in each node).

For each rate and variant it records, from rank 0's metrics.jsonl and node 1's interface counters
(sampled every 0.1 s while the job runs): the median step time and tokens/s over the steps after
--warmup, the bytes that crossed the inter-node link per step (node 1's sent + received: with two
nodes, all inter-node traffic) within those steps' own intervals (evaluations between them left
out: ZeRO-3 gathers the parameters for every evaluation batch), the bytes before the first step
(the setup: rendezvous, replica fingerprints, what differed), the host's comm wait per step, and
held-out loss against wall time. Writes OUT/cluster_bench.json, OUT/cluster_bench.md (one table per rate) and
OUT/loss_<rate>.png (held-out loss against seconds since the first step, one line per variant).

    tools/cluster_bench.py --config configs/small-bench.toml --rates 1gbit,100mbit --steps 20 --out runs/cluster-bench

Needs root and namespaces (tools/cluster.sh check) and a torchrun of the trainer's LibTorch
(WEFT_PYTHON or ~/.cache/weft/venv/bin/python). Both nodes share this machine's cores: a variant
with 2 ranks per node runs 4 processes on them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "cluster.sh")

# name, ranks per node, trainer arguments
DEFAULT_VARIANTS = [
    ("ddp", 1, "--plugin ddp"),
    ("zero-1", 1, "--plugin zero --set plugin.stage=1"),
    ("zero-2", 1, "--plugin zero --set plugin.stage=2"),
    ("zero-3", 1, "--plugin zero --set plugin.stage=3"),
    ("gpipe (pp across)", 1, "--plugin gpipe --set plugin.microbatches=4"),
    ("tp within x dp across", 2, "--plugin tensor_parallel,ddp --set mesh.tp=2"),
    ("diloco H=10", 1, "--plugin {diloco} --set plugin.inner_steps=10"),
]


def sh(*args, check=True):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and r.returncode != 0:
        sys.exit(f"cluster_bench: {' '.join(args)} failed: {r.stdout.strip()}")
    return r.stdout


class Counters(threading.Thread):
    """Node 1's eth0 (tx, rx) bytes with the time, every `period` seconds."""

    def __init__(self, name, period=0.1):
        super().__init__(daemon=True)
        self.name_, self.period, self.samples, self.stop = name, period, [], threading.Event()

    def read(self):
        tx, rx = (int(x) for x in sh(TOOL, "bytes", self.name_, "1").split())
        self.samples.append((time.time(), tx + rx))

    def run(self):
        while not self.stop.is_set():
            self.read()
            time.sleep(self.period)

    def at(self, t):
        """Bytes at time t, linearly between the samples around it."""
        s = self.samples
        if t <= s[0][0]:
            return s[0][1]
        for (t0, b0), (t1, b1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-9)
        return s[-1][1]


def records(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def run_variant(args, cluster, name, per_node, plugin_args, out):
    os.makedirs(out, exist_ok=True)
    trainer = [args.trainer, "--config", args.config, "--set", f"train.max_steps={args.warmup + args.steps}",
               "--set", f"eval.every_steps={args.eval_every}", "--set", "checkpoint.save_final=false",
               "--set", "log.progress=off", "--set", f"train.out_dir={out}",
               "--set", f"train.collective_timeout_s={args.timeout}"] + plugin_args.split() + args.set
    procs = []
    counters = Counters(cluster)
    counters.read()
    counters.start()
    launched = time.time()
    for node in (1, 0):
        cmd = [TOOL, "exec", cluster, str(node), "env", "OMP_NUM_THREADS=1", args.python, "-m",
               "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node), "--node-rank", str(node),
               "--master-addr", "10.99.0.1", "--master-port", "29400", "--no-python"] + trainer
        log = open(os.path.join(out, f"node{node}.log"), "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    ended = time.time()
    counters.stop.set()
    counters.join()
    if any(codes):
        print(f"  {name}: exit statuses {codes}, see {out}/node0.log", flush=True)
        return {"variant": name, "failed": codes}
    rs = records(os.path.join(out, "metrics.jsonl"))
    steps = [r for r in rs if r.get("type") == "step"]
    evals = [r for r in rs if r.get("type") == "eval"]
    measured = steps[args.warmup:]
    first_start = steps[0]["time"] - steps[0]["step_time_s"]
    # Bytes within the measured steps' own intervals (an evaluation runs between two steps).
    link = sum(counters.at(r["time"]) - counters.at(r["time"] - r["step_time_s"]) for r in measured) / len(measured)
    with open(os.path.join(out, "link_bytes.json"), "w") as f:
        json.dump(counters.samples, f)
    setup = counters.at(first_start) - counters.samples[0][1]
    eval_times = [e["time"] for e in evals]
    wait = [r.get("comm_wait_s", 0.0) for r in measured]
    return {
        "variant": name, "ranks": 2 * per_node, "plugin": plugin_args,
        "step_s": statistics.median(r["step_time_s"] for r in measured),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "link_bytes_per_step": link, "setup_bytes": setup, "setup_s": first_start - launched,
        "comm_wait_s": statistics.median(wait), "comm_bytes_per_step": statistics.median(r.get("comm_bytes", 0) for r in measured),
        "wall_s": ended - launched,
        "held_out": [(e["time"] - first_start, e["loss"]) for e in evals],
        "final_loss": evals[-1]["loss"] if evals else None,
        "eval_s": sum(e.get("seconds", 0.0) for e in evals),
    }


def table(rate, results):
    lines = [f"### inter-node link {rate}", "",
             "| variant | ranks | step s | tokens/s | link MB/step | comm wait s | setup MB | setup s | held-out loss | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['variant']} | failed {r['failed']} | | | | | | | | |")
            continue
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.3f}"
        lines.append(f"| {r['variant']} | {r['ranks']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['link_bytes_per_step'] / 1e6:.2f} | {r['comm_wait_s']:.2f} | {r['setup_bytes'] / 1e6:.2f} | "
                     f"{r['setup_s']:.1f} | {loss} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rate, results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if "failed" in r or not r["held_out"]:
            continue
        xs, ys = zip(*r["held_out"])
        ax.plot(xs, ys, marker="o", label=r["variant"])
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("held-out loss")
    ax.set_title(f"2 nodes, inter-node link {rate}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "small-bench.toml"))
    p.add_argument("--rates", default="1gbit,100mbit", help="tc rates of every node's link, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps per run not measured")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300, help="train.collective_timeout_s")
    p.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--set", action="append", default=[], help="--set KEY=VALUE for every run")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "cluster-bench"))
    p.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    p.add_argument("--diloco", default=os.path.join(ROOT, "build", "tests", "plugin_fixtures", "diloco.so"))
    p.add_argument("--python", default=os.environ.get("WEFT_PYTHON",
                                                      os.path.expanduser("~/.cache/weft/venv/bin/python")))
    p.add_argument("--name", default=f"cb{os.getpid() % 100000}")
    p.add_argument("--plot", metavar="JSON", help="only draw OUT/loss_<rate>.png from a cluster_bench.json")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            for rate, results in json.load(f).items():
                if not plot(rate, results, os.path.join(args.out, f"loss_{rate}.png")):
                    sys.exit("cluster_bench: no matplotlib in this Python (Debian's python3-matplotlib, tools/setup.sh)")
        return
    args.set = [x for kv in args.set for x in ("--set", kv)]
    args.config = os.path.abspath(args.config)
    if args.warmup < 1:
        sys.exit("cluster_bench: --warmup must be at least 1")
    why = subprocess.run([TOOL, "check"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if why.returncode != 0:
        sys.exit(f"cluster_bench: tools/cluster.sh check: {why.stdout.strip()}")
    variants = [(n, k, a.format(diloco=args.diloco)) for n, k, a in DEFAULT_VARIANTS]
    if args.only:
        wanted = set(args.only.split(","))
        variants = [v for v in variants if v[0] in wanted]
    os.makedirs(args.out, exist_ok=True)
    sh(TOOL, "up", args.name, "2")
    report, everything = ["# Strategies across 2 nodes", "", f"`{' '.join(sys.argv)}`", ""], {}
    try:
        for rate in args.rates.split(","):
            for node in (0, 1):
                sh(TOOL, "rate", args.name, str(node), rate)
            results = []
            for name, per_node, plugin_args in variants:
                print(f"{rate}: {name} ...", flush=True)
                slug = "".join(c if c.isalnum() else "_" for c in name)
                r = run_variant(args, args.name, name, per_node, plugin_args, os.path.join(args.out, rate, slug))
                results.append(r)
                if "failed" not in r:
                    print(f"  step {r['step_s']:.2f} s, {r['tokens_per_s']:.0f} tokens/s, "
                          f"link {r['link_bytes_per_step'] / 1e6:.2f} MB/step, setup {r['setup_bytes'] / 1e6:.2f} MB",
                          flush=True)
            everything[rate] = results
            report.append(table(rate, results))
            if plot(rate, results, os.path.join(args.out, f"loss_{rate}.png")):
                report.append(f"![held-out loss, {rate}](loss_{rate}.png)\n")
            else:
                report.append("(no plot: this Python has no matplotlib; `--plot OUT/cluster_bench.json` with one that has)\n")
    finally:
        sh(TOOL, "down", args.name, check=False)
    with open(os.path.join(args.out, "cluster_bench.json"), "w") as f:
        json.dump(everything, f, indent=1)
    with open(os.path.join(args.out, "cluster_bench.md"), "w") as f:
        f.write("\n".join(report))
    print("\n".join(report))


if __name__ == "__main__":
    main()
