"""benchmarks/web_node.py's result file: rewritten whole after every row (a device call stopped at its budget returns
the rows that ran), beside a copy in $OUT, without a GPU."""
from __future__ import annotations

import argparse
import json
import shutil

import pytest
from script_module import load_script  # tests/script_module.py


def _run(total_ms: float) -> dict:
    report = {"ok": True, "failures": [], "latency_ms": {"total_ms": total_ms}, "image": {"psnr_db": 55.0},
              "gpu_memory": {"peak_mb": 12.0, "live_mb": 0}, "devices": {"created": 4, "collected": 4}}
    return {"exit": 0, "wall_s": 3.0, "memory": {"gpu_peak_mb": 900.0, "peak_pss_mb": 700.0, "gpu_source": "nvml"},
            "report": report, "log_tail": []}


def test_the_result_is_rewritten_after_every_row_here_and_in_out(tmp_path, monkeypatch, capsys):
    if shutil.which("node") is None:
        pytest.skip("node is not installed (the result names its version)")
    web_node = load_script("benchmarks/web_node.py", "web_node_bench")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"image": {"width": 512}, "components": {"unet.0": {"weights": "int8", "bytes": 9}}}))
    out, copy = tmp_path / "runs" / "web_tiny_node_resident-streamed_per-model_h100.json", tmp_path / "out"
    monkeypatch.setenv("OUT", str(copy))
    args = argparse.Namespace(bundle=str(bundle), out=str(out), unets=["resident", "streamed"], devices=["per-model"],
                              variants=["plain"], reference=None, reference_accelerator="gpu")
    runs = {("resident", "per-model", "plain"): _run(20_000)}
    web_node.write_result(args, runs, None, 4.0)
    assert "(1 of 2 rows)" in capsys.readouterr().out
    first = json.loads(out.read_text())
    assert [r["unet"] for r in first["rows"]] == ["resident"] and first["rows"][0]["total_s"] == 20.0
    runs[("streamed", "per-model", "plain")] = _run(45_000)
    web_node.write_result(args, runs, None, 4.0)
    for path in (out, copy / out.name):
        rows = json.loads(path.read_text())["rows"]
        assert [(r["unet"], r["total_s"], r["gpu_peak_mb"]) for r in rows] == [("resident", 20.0, 900.0), ("streamed", 45.0, 900.0)]
    assert sorted(p.name for p in copy.iterdir()) == [out.name]  # no temporary file left beside it
