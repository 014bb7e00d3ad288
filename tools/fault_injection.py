#!/usr/bin/env python3
"""Kills a rank with SIGKILL at chosen points of training and counts what survives (issue 17).

For each plugin (single, ddp, zero at stage 3, tensor_parallel, gpipe, pipedream; and the
out-of-tree DiLoCo, whose workers' own state checkpoints keep per rank; 2 ranks where it splits or
replicates) it first trains an uninterrupted reference run (tiny preset, the bundled corpus, a
checkpoint and an evaluation every 2 steps, 8 steps). Then each trial kills one rank the n-th
time it reaches a point (WEFT_FAULT_INJECT=<rank>:<point>:<n>; core/util/fault_injection.h):
forward, backward, inside a collective, during a checkpoint save, during evaluation (and for
DiLoCo while a rank writes its own state: save_local). A trial
counts as
  stopped       the run ended non-zero, the launcher named the dead rank, and it ended within
                train.collective_timeout_s (+ 5 s) of the kill
  intact        `latest` names a complete checkpoint (or none exists) and no checkpoint folder
                is incomplete
  exact         checkpoint.resume = auto then finished the run, and every step after the one it
                resumed from has exactly the reference run's loss (fp32, bit for bit)
Trials whose point is never reached (n past the last visit) are drawn again, below that n; one
process has no collective, so single skips that point.

  tools/fault_injection.py build/trainer                      5 trials per plugin and point
  tools/fault_injection.py build/trainer --trials 1 --json out.json
Exits non-zero unless every trial was stopped, intact and exact.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = [("single", 1), ("ddp", 2), ("zero", 2), ("tensor_parallel", 2), ("gpipe", 2), ("pipedream", 2),
           ("diloco", 2)]
POINTS = ["forward", "backward", "collective", "save", "eval"]
# What a plugin runs with beyond its name: zero at stage 3 (parameters sharded too); DiLoCo, an
# out-of-tree example built into the tests' fixtures, with an outer step every 3 steps (so that
# checkpoints fall between outer steps, where each worker's state is its own) and its extra point.
SETTINGS = {"zero": ["--set", "plugin.stage=3"], "diloco": ["--set", "plugin.inner_steps=3"]}
EXTRA_POINTS = {"diloco": ["save_local"]}


def plugin_path(trainer, plugin):
    """The --plugin value: a name the trainer finds, or the fixture build of an out-of-tree example."""
    if plugin == "diloco":
        return os.path.join(os.path.dirname(os.path.abspath(trainer)), "tests", "plugin_fixtures", "diloco.so")
    return plugin
STEPS, EVERY, TIMEOUT = 8, 2, 10


def run_args(trainer, plugin, nproc, out):
    args = [trainer, "--config", f"{ROOT}/configs/tiny.toml",
            "--set", f"data.path={ROOT}/data/austen/austen.jsonl", "--set", f"data.cache_dir={out}/../cache",
            "--set", f"train.out_dir={out}", "--set", f"train.max_steps={STEPS}",
            "--set", f"checkpoint.every_steps={EVERY}", "--set", "checkpoint.keep_last=2",
            "--set", f"eval.every_steps={EVERY}", "--set", "eval.max_batches=2",
            "--set", f"train.collective_timeout_s={TIMEOUT}", "--set", "log.progress=off"]
    if plugin != "single":
        args += ["--plugin", plugin_path(trainer, plugin), "--nproc", str(nproc)] + SETTINGS.get(plugin, [])
    return args


def run(args, env_extra=None, limit=300):
    """(exit status, output, seconds from the fault's line to the exit or None)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace")
    lines, fault_at, start = [], None, time.monotonic()
    for line in proc.stdout:
        lines.append(line)
        if fault_at is None and "fault injection: SIGKILL" in line:
            fault_at = time.monotonic()
        if time.monotonic() - start > limit:
            proc.kill()
    status = proc.wait()
    return status, "".join(lines), None if fault_at is None else time.monotonic() - fault_at


def losses(out):
    """{step: loss}; a resumed run's records come after the killed run's, so the last one wins."""
    found = {}
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return found
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("type") == "step":
                found[record["step"]] = record["loss"]
    return found


def checkpoints_intact(out):
    """(intact, the latest checkpoint's step or 0, what is wrong)."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return True, 0, ""
    for name in os.listdir(root):
        if not name.startswith("step-"):
            continue
        folder = os.path.join(root, name)
        need = ["trainer_state.json", "rng.pt"]
        sharded = os.path.isdir(os.path.join(folder, "shards"))
        need += ["shards/index.json"] if sharded else ["model.safetensors", "optimizer.safetensors"]
        index = os.path.join(folder, "local", "index.json")
        if os.path.isdir(os.path.join(folder, "local")):  # every rank's own state (LOCAL parameters)
            need.append("local/index.json")
            if os.path.exists(index):
                ranks = json.load(open(index)).get("world_size", 0)
                need += [f"local/rank-{r:05}.safetensors" for r in range(ranks)]
        missing = [f for f in need if not os.path.exists(os.path.join(folder, f))]
        if missing:
            return False, 0, f"{name} lacks {', '.join(missing)}"
    latest = os.path.join(root, "latest")
    if not os.path.exists(latest):
        return True, 0, ""
    name = open(latest).read().strip()
    if not os.path.isdir(os.path.join(root, name)):
        return False, 0, f"latest names {name}, which does not exist"
    return True, int(name[len("step-"):]), ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trainer")
    parser.add_argument("--trials", type=int, default=5, help="kills per plugin and point")
    parser.add_argument("--plugins", default=",".join(p for p, _ in PLUGINS))
    parser.add_argument("--points", default=",".join(POINTS))
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", help="write the counts and every trial here")
    parser.add_argument("--work", help="folder for the runs (default: a temporary one, removed)")
    a = parser.parse_args()
    rng = random.Random(a.seed)
    work = a.work or tempfile.mkdtemp(prefix="weft_fault_injection_")
    wanted = a.plugins.split(",")
    summary, trials = {}, []
    try:
        for plugin, nproc in PLUGINS:
            if plugin not in wanted:
                continue
            if not os.path.exists(plugin_path(a.trainer, plugin)) and "/" in plugin_path(a.trainer, plugin):
                sys.exit(f"fault_injection: {plugin_path(a.trainer, plugin)} is not built")
            base = os.path.join(work, plugin)
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base)
            ref_out = os.path.join(base, "reference")
            status, output, _ = run(run_args(a.trainer, plugin, nproc, ref_out))
            reference = losses(ref_out)
            if status != 0 or len(reference) != STEPS:
                print(output, file=sys.stderr)
                sys.exit(f"fault_injection: the reference run of {plugin} failed (exit {status})")
            counts = dict(tried=0, stopped=0, intact=0, exact=0)
            for point in a.points.split(",") + EXTRA_POINTS.get(plugin, []):
                if point == "collective" and nproc == 1:
                    continue  # one process issues no collective: every draw would run to the end
                done, draws = 0, 0
                limit = 24 if not point.startswith("save") else 4  # the largest n not yet seen past the last visit
                while done < a.trials and draws < 10 * a.trials and limit >= 1:
                    draws += 1
                    rank, nth = rng.randrange(nproc), rng.randint(1, limit)
                    out = os.path.join(base, f"{point}-{draws}")
                    args = run_args(a.trainer, plugin, nproc, out)
                    status, output, after = run(args, {"WEFT_FAULT_INJECT": f"{rank}:{point}:{nth}"})
                    if after is None:
                        shutil.rmtree(out, ignore_errors=True)
                        limit = nth - 1  # the point was not reached n times: draw again, below n
                        continue
                    done += 1
                    named = nproc == 1 or f"rank {rank} failed (signal" in output
                    stopped = status != 0 and named and after <= TIMEOUT + 5
                    intact, saved_step, wrong = checkpoints_intact(out)
                    r_status, r_output, _ = run(args + ["--set", "checkpoint.resume=auto"])
                    resumed = losses(out)
                    exact = r_status == 0 and all(resumed.get(s) == reference[s] for s in reference if s > saved_step)
                    trial = dict(plugin=plugin, rank=rank, point=point, n=nth, exit=status,
                                 seconds_to_stop=round(after, 2), stopped=stopped, intact=intact,
                                 resumed_from=saved_step, exact=exact)
                    if wrong:
                        trial["checkpoint_problem"] = wrong
                    if not exact:
                        trial["resume_exit"] = r_status
                        trial["resume_tail"] = r_output[-600:]
                        trial["differences"] = {s: [reference[s], resumed.get(s)] for s in reference
                                                if s > saved_step and resumed.get(s) != reference[s]}
                    if not stopped:
                        trial["kill_tail"] = output[-600:]
                    trials.append(trial)
                    counts["tried"] += 1
                    counts["stopped"] += stopped
                    counts["intact"] += intact
                    counts["exact"] += exact
                    print(f"fault_injection: {plugin:15} rank {rank} {point:10} #{nth:<2} exit {status:4} "
                          f"stopped in {after:5.2f} s  resumed from step {saved_step}  "
                          f"{'ok' if stopped and intact and exact else 'FAILED'}", flush=True)
                    if stopped and intact and exact:
                        shutil.rmtree(out, ignore_errors=True)
            summary[plugin] = counts
    finally:
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"fault_injection: {'plugin':15} {'tried':>6} {'stopped':>8} {'intact':>7} {'exact':>6}")
    for plugin, c in summary.items():
        print(f"fault_injection: {plugin:15} {c['tried']:6} {c['stopped']:8} {c['intact']:7} {c['exact']:6}")
    total = {k: sum(c[k] for c in summary.values()) for k in ("tried", "stopped", "intact", "exact")}
    print(f"fault_injection: {'all':15} {total['tried']:6} {total['stopped']:8} {total['intact']:7} {total['exact']:6}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(summary=summary, total=total, trials=trials), f, indent=1)
    ok = total["tried"] > 0 and total["tried"] == total["stopped"] == total["intact"] == total["exact"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
