#!/usr/bin/env python
"""Where a training step's time goes, from the torch.profiler traces of `train.profile_steps`.

  python benchmarks/trace_summary.py OUT/profile/round-1-rank0.json.gz [more traces] --out summary.json

Per profiled step: its wall time; the GPU's compute kernels (busy milliseconds and the fraction of
the step they fill: well under 1 means the GPU waits for the host), NCCL kernels and memory copies;
and per host thread (the main thread, the autograd engine's) the milliseconds spent in top-level
operators, with the largest of them. A step whose host threads are busier than its GPU is
host-bound: more GPUs do not make each process's host faster.
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def _events(path: Path) -> list[dict]:
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    return [e for e in data["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _top_level(events: list[dict]) -> list[dict]:
    """Events not nested in an earlier one (one thread's)."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def summarize_step(events: list[dict], step: dict, top: int = 6) -> dict:
    a, b = step["ts"], step["ts"] + step["dur"]
    inside = [e for e in events if a <= e["ts"] < b]
    gpu = defaultdict(list)
    for e in inside:
        if e.get("cat") == "kernel":
            gpu["nccl" if "nccl" in e["name"].lower() else "compute"].append((e["ts"], min(e["ts"] + e["dur"], b)))
        elif e.get("cat") == "gpu_memcpy":
            gpu["memcpy"].append((e["ts"], min(e["ts"] + e["dur"], b)))
    threads = defaultdict(list)
    for e in inside:
        if e.get("cat") in HOST_CATS and not e["name"].startswith("ProfilerStep"):
            threads[e["tid"]].append(e)
    host = []
    for tid, evs in threads.items():
        tops = _top_level(evs)
        per = defaultdict(float)
        for e in tops:
            per[e["name"][:60]] += e["dur"] / 1e3
        host.append({"thread": tid, "busy_ms": round(sum(e["dur"] for e in tops) / 1e3, 1),
                     "top": [[k, round(v, 1)] for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]]})
    host.sort(key=lambda h: -h["busy_ms"])
    ms = step["dur"] / 1e3
    compute = _busy(gpu["compute"]) / 1e3
    return {"step": step["name"], "step_ms": round(ms, 1), "gpu_compute_ms": round(compute, 1),
            "gpu_compute_fraction": round(compute / ms, 3) if ms else None,
            "nccl_ms": round(_busy(gpu["nccl"]) / 1e3, 1), "memcpy_ms": round(_busy(gpu["memcpy"]) / 1e3, 1),
            "host_threads": host[:2]}


def summarize(path: Path) -> dict:
    events = _events(path)
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    rows = [summarize_step(events, s) for s in steps]
    mean = (lambda k: round(sum(r[k] for r in rows) / len(rows), 3)) if rows else (lambda k: None)
    return {"trace": path.name, "steps": rows, "mean_step_ms": mean("step_ms"),
            "mean_gpu_compute_fraction": mean("gpu_compute_fraction"), "mean_nccl_ms": mean("nccl_ms"),
            "mean_host_busy_ms": [round(sum(r["host_threads"][i]["busy_ms"] for r in rows) / len(rows), 1)
                                  for i in range(min(len(r["host_threads"]) for r in rows))] if rows else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", action="append", default=[], help="NAME=TRACE_FILE_NAME: a name per trace in the JSON")
    args = ap.parse_args()
    names = dict(reversed(spec.split("=", 1)) for spec in args.label)
    result = {"benchmark": "trace_summary", "traces": []}
    for t in args.traces:
        s = summarize(Path(t))
        s["label"] = names.get(Path(t).name, Path(t).parent.name + "/" + Path(t).name)
        result["traces"].append(s)
        print(f"[trace] {s['label']}: step {s['mean_step_ms']} ms, GPU compute {s['mean_gpu_compute_fraction']} of it, "
              f"NCCL {s['mean_nccl_ms']} ms, host threads busy {s['mean_host_busy_ms']} ms")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
