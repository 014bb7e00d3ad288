#!/usr/bin/env python3
"""Sums a Kineto Chrome trace (trainer's log.torch_profile, or torch.profiler's
export_chrome_trace) by GPU kernel, and by CPU operator's self time when there are no kernels:
what took the device's time over the recorded steps. Standard library only.

  python3 tools/gpu/profile_summary.py TRACE.json [--top 25] [--steps N]
"""
import argparse
import collections
import json
import re


def short(name, width=90):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def self_times(ops):
    """Each CPU operator's duration less its children's (the operators nested in it on its thread)."""
    out = {}
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack = []
        for e in events:
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= e["ts"]:
                stack.pop()
            out[id(e)] = e.get("dur", 0)
            if stack:
                out[id(stack[-1])] -= e.get("dur", 0)
            stack.append(e)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=1, help="recorded steps (per-step figures)")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    chosen, what = (kernels, "GPU kernels") if kernels else (ops, "CPU operators' self time (no GPU kernels in the trace)")
    total = collections.Counter()
    count = collections.Counter()
    durations = self_times(chosen) if not kernels else {id(e): e.get("dur", 0) for e in chosen}
    for e in chosen:
        total[e["name"]] += durations[id(e)]
        count[e["name"]] += 1
    busy = sum(total.values())
    if kernels:
        start = min(e["ts"] for e in kernels)
        end = max(e["ts"] + e.get("dur", 0) for e in kernels)
        print(f"{what}: {len(kernels)} launches, busy {busy / 1e3:.1f} ms of a {(end - start) / 1e3:.1f} ms span "
              f"({100.0 * busy / max(end - start, 1):.0f}% busy), per step {busy / 1e3 / args.steps:.1f} ms busy")
    else:
        print(f"{what}: {len(ops)} calls, {busy / 1e3:.1f} ms, per step {busy / 1e3 / args.steps:.1f} ms "
              f"(each operator's time less the operators it called)")
    groups = collections.Counter()
    for name, us in total.items():
        low = name.lower()
        cpu_gemm = low in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addbmm")
        key = ("gemm" if cpu_gemm or any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")) else
               "attention" if any(k in low for k in ("flash", "fmha", "attention", "sdpa", "causal_softmax")) else
               "memcpy/memset" if "memcpy" in low or "memset" in low else
               "optimizer" if any(k in low for k in ("adam", "multi_tensor", "foreach")) else
               "reduction" if "reduce" in low else "elementwise/other")
        groups[key] += us
    print("by kind: " + ", ".join(f"{k} {v / 1e3:.1f} ms ({100.0 * v / max(busy, 1):.0f}%)" for k, v in groups.most_common()))
    print(f"{'ms':>9} {'%':>5} {'calls':>7}  name")
    for name, us in total.most_common(args.top):
        print(f"{us / 1e3:9.2f} {100.0 * us / max(busy, 1):5.1f} {count[name]:7d}  {short(name)}")


if __name__ == "__main__":
    main()
