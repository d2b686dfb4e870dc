"""benchmarks/trace_summary.py on a hand-made chrome trace: the step's GPU busy time is the union of
its kernels, NCCL apart, and each host thread's busy time counts nested operators once."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_summary.py"


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_a_step_is_split_into_gpu_nccl_and_host_time(tmp_path):
    events = [
        _x("ProfilerStep#4", "user_annotation", 0, 10_000),
        _x("aten::linear", "cpu_op", 0, 4_000),          # main thread: 4 ms + 1 ms, the nested op counted once
        _x("aten::addmm", "cpu_op", 1_000, 2_000),
        _x("Optimizer.step#AdamW.step", "user_annotation", 8_000, 1_000),
        _x("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", 4_000, 3_000, tid=2),
        _x("gemm", "kernel", 1_000, 2_000, tid=7),       # compute kernels overlapping: 1-3 and 2-4 ms -> 3 ms
        _x("gemm2", "kernel", 2_000, 2_000, tid=8),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 5_000, 2_500, tid=9),
        _x("Memcpy HtoD", "gpu_memcpy", 0, 500, tid=10),
        _x("ProfilerStep#5", "user_annotation", 10_000, 5_000),
        _x("gemm", "kernel", 10_000, 5_000, tid=7),
    ]
    trace = tmp_path / "r-rank0.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, str(BENCH), str(trace), "--out", str(out), "--label", f"two={trace.name}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())["traces"][0]
    first, second = s["steps"]
    assert s["label"] == "two" and first["step_ms"] == 10.0 and second["step_ms"] == 5.0
    assert first["gpu_compute_ms"] == 3.0 and first["gpu_compute_fraction"] == 0.3
    assert first["nccl_ms"] == 2.5 and first["memcpy_ms"] == 0.5
    main, autograd = first["host_threads"]
    assert main["busy_ms"] == 5.0 and main["top"][0] == ["aten::linear", 4.0]
    assert autograd["busy_ms"] == 3.0
    assert second["gpu_compute_fraction"] == 1.0 and s["mean_gpu_compute_fraction"] == 0.65
