"""benchmarks/web_node.py's match of its GPU memory series with the Node runner's memory events (which phase of a
run holds the GPU's peak), without a GPU."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _web_node():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("web_node")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _events():
    names = [("open", "unet.0"), ("compiled", "unet.0"), ("close", "unet.0"), ("open", "unet.1"), ("compiled", "unet.1"), ("close", "unet.1")]
    live = {"open": 0, "compiled": 150, "close": 0}
    return [{"event": k, "model": m, "epoch_s": 100.0 + 10 * i, "webgpu_live_mb": live[k] * (1 + (m == "unet.1")),
             "webgpu_live_rounded_mb": 1.5 * live[k] * (1 + (m == "unet.1"))} for i, (k, m) in enumerate(names)]


def test_each_event_gets_the_gpu_after_it_and_the_peak_phase_is_named():
    web_node = _web_node()
    events = _events()
    # 50 MB before, 400 while unet.0 runs (compiled -> close), 60 after its release, 900 while unet.1 compiles
    level = {0: 50, 1: 200, 2: 400, 3: 60, 4: 900, 5: 300, 6: 55}
    samples = [[95.0 + t, level[max(0, min(6, int((95.0 + t - 100.0) // 10) + 1))]] for t in range(0, 70, 2)]
    out = web_node.gpu_by_event(events, samples)
    assert out["gpu_peak_phase"] == {"from": "open unet.1", "to": "compiled unet.1", "peak_mb": 900}
    assert out["gpu_at_close_max_mb"] == 60 and out["gpu_at_end_mb"] == 55
    # right after unet.0 compiled 400 MB against its 150 in buffers; after unet.1 300 against 300
    assert out["gpu_beyond_ledger_at_compiled_max"] == {"model": "unet.0", "mb": 250}
    assert out["gpu_beyond_rounded_at_compiled_max"] == {"model": "unet.0", "mb": 175}  # 400 against 225 as rounded
    close0 = events[2]
    assert close0["gpu_mb"] == 60 and close0["gpu_peak_since_previous_mb"] == 400


def test_no_series_or_no_events_gives_nones():
    web_node = _web_node()
    empty = {"gpu_peak_phase": None, "gpu_at_close_max_mb": None, "gpu_at_end_mb": None, "gpu_beyond_ledger_at_compiled_max": None,
             "gpu_beyond_rounded_at_compiled_max": None}
    assert web_node.gpu_by_event([], []) == empty
    assert web_node.gpu_by_event(_events(), []) == empty
    assert web_node.gpu_by_event([], [[1.0, 5.0]])["gpu_at_end_mb"] == 5.0
