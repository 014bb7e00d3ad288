#!/usr/bin/python3
"""Strategies A/B-timed where the network matters: `trainer bench` across 2 nodes (tools/cluster.sh
namespaces) with every node's link at each of --rates.

For each rate the same `trainer bench ... --nnodes 2 --node-rank r --master-addr <node 0>` runs in
both nodes, as on two machines: its variants (ddp, ZeRO stages 1-3, gpipe with its stages on the
two nodes, tensor parallelism within each node of 2 ranks with data parallelism across, DiLoCo)
run in alternation, each run a job across the nodes. trainer bench measures, from rank 0's
metrics: step time and tokens/s over the steps after --warmup, the bytes node 0's link carried per
step (its interface's counters around each step: with two nodes, all inter-node traffic), and the
held-out loss every --eval-every steps against training time. This tool puts each rate's bench
in OUT/<rate>/ (bench.md, bench.json, the plots: held_out_loss.png among them) and writes
OUT/cluster_bench.md (one table per rate) and OUT/cluster_bench.json (each rate's bench.json).

    tools/cluster_bench.py --config configs/small-bench.toml --rates 1gbit,100mbit --steps 20 --out runs/cluster-bench

Needs root and namespaces (tools/cluster.sh check). Both nodes share this machine's cores: a
variant with 2 ranks per node runs 4 processes on them.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "cluster.sh")

# trainer bench's --plugin, ranks per node
DEFAULT_VARIANTS = [
    ("ddp", 1),
    ("zero --set plugin.stage=1", 1),
    ("zero --set plugin.stage=2", 1),
    ("zero --set plugin.stage=3", 1),
    ("gpipe --set plugin.microbatches=4", 1),
    ("tensor_parallel,ddp --set mesh.tp=2", 2),
    ("{diloco} --set plugin.inner_steps=10", 1),
]


def sh(*args, check=True):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and r.returncode != 0:
        sys.exit(f"cluster_bench: {' '.join(args)}: {r.stdout.strip()}")
    return r


def bench_command(args, variants, node, out):
    cmd = [TOOL, "exec", args.name, str(node), "env", "OMP_NUM_THREADS=1", args.trainer, "bench",
           "--config", args.config, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--repetitions", str(args.repetitions), "--eval-every", str(args.eval_every), "--out", out,
           "--nnodes", "2", "--node-rank", str(node), "--master-addr", "10.99.0.1", "--master-port", "29400",
           "--set", f"train.collective_timeout_s={args.timeout}"]
    for plugin, per_node in variants:
        cmd += ["--plugin", plugin, "--nproc", str(per_node)]
    for kv in args.set:
        cmd += ["--set", kv]
    return cmd


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "small-bench.toml"))
    p.add_argument("--rates", default="1gbit,100mbit", help="tc rates of every node's link, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps per run not measured")
    p.add_argument("--repetitions", type=int, default=1, help="runs per variant, alternated")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300, help="train.collective_timeout_s")
    p.add_argument("--only", default="", help="comma-separated indices of DEFAULT_VARIANTS to run (default: all)")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "cluster-bench"))
    p.add_argument("--trainer", default=os.path.join(ROOT, "build", "trainer"))
    p.add_argument("--diloco", default=os.path.join(ROOT, "build", "tests", "plugin_fixtures", "diloco.so"))
    p.add_argument("--name", default=f"cb{os.getpid() % 100000}")
    args = p.parse_args()
    args.config = os.path.abspath(args.config)
    args.out = os.path.abspath(args.out)
    why = sh(TOOL, "check", check=False)
    if why.returncode != 0:
        sys.exit(f"cluster_bench: tools/cluster.sh check: {why.stdout.strip()}")
    variants = [(plugin.format(diloco=args.diloco), n) for plugin, n in DEFAULT_VARIANTS]
    if args.only:
        variants = [variants[int(i)] for i in args.only.split(",")]
    os.makedirs(args.out, exist_ok=True)
    report = ["# Strategies across 2 nodes", "", f"`{' '.join(sys.argv)}`", ""]
    everything, failed = {}, False
    sh(TOOL, "up", args.name, "2")
    try:
        for rate in args.rates.split(","):
            for node in (0, 1):
                sh(TOOL, "rate", args.name, str(node), rate)
            out = os.path.join(args.out, rate)
            shutil.rmtree(out, ignore_errors=True)
            print(f"{rate}: trainer bench on both nodes, {len(variants)} variants ...", flush=True)
            logs = [open(os.path.join(args.out, f"{rate}.node{node}.log"), "w") for node in (0, 1)]
            procs = [subprocess.Popen(bench_command(args, variants, node, out), stdout=logs[node],
                                      stderr=subprocess.STDOUT) for node in (1, 0)]
            codes = [proc.wait() for proc in procs]
            failed = failed or any(codes)
            path = os.path.join(out, "bench.json")
            if not os.path.exists(path):
                report.append(f"### inter-node link {rate}\n\nno bench.json (exit statuses {codes}; "
                              f"see {args.out}/{rate}.node0.log)\n")
                continue
            with open(path) as f:
                everything[rate] = json.load(f)
            with open(os.path.join(out, "bench.md")) as f:
                report.append(f"### inter-node link {rate}\n\n{f.read()}")
            if os.path.exists(os.path.join(out, "held_out_loss.png")):
                report.append(f"![held-out loss, {rate}]({rate}/held_out_loss.png)\n")
            print(f"  done (exit statuses {codes})", flush=True)
    finally:
        sh(TOOL, "down", args.name, check=False)
    with open(os.path.join(args.out, "cluster_bench.json"), "w") as f:
        json.dump(everything, f, indent=1)
    with open(os.path.join(args.out, "cluster_bench.md"), "w") as f:
        f.write("\n".join(report))
    print("\n".join(report))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
