"""benchmarks/distill_scaling.py on the CPU: a tiny UNet under `accelerate launch` with 1 and with
2 processes (gloo: the student DDP-wrapped, the teacher not), then the merge mode."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from cpu_launch import accelerate_cpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "distill_scaling.py"
TINY = ["--arch", "tiny", "--batch", "2", "--iters", "2", "--warmup", "1", "--no-sync-iters", "1"]


def _launch(n: int, out: Path, *extra: str) -> None:
    proc = accelerate_cpu(n, str(SCRIPT), "--out", str(out), *TINY, *extra, cwd=out.parent, timeout=300)
    assert f"[distill_scaling N={n}]" in proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("scaling")
    _launch(1, d / "n1.json")
    _launch(2, d / "n2.json", "--variant", "ours_wcond")
    return {n: json.loads((d / f"n{n}.json").read_text()) for n in (1, 2)} | {"dir": d}


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("distill_scaling_bench", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mod


def test_one_process(runs):
    r = runs[1]
    assert r["benchmark"] == "distill_scaling" and r["complete"] is True
    assert r["num_processes"] == 1 and r["distributed_type"] == "NO" and r["devices"] == [r["devices"][0]]
    assert r["variant"] == "ours" and r["arch"] == "tiny" and r["mixed_precision"] == "no" and r["compiled"] is False
    assert r["batch_per_process"] == 2 and r["global_batch"] == 2
    assert r["step_s"] > 0 and r["samples_per_s"] == pytest.approx(2 / r["step_s"])
    assert r["samples_per_s_per_gpu"] == pytest.approx(r["samples_per_s"])
    assert r["no_sync_step_s"] is None and r["comm_share"] is None  # one process: nothing to all-reduce
    # ours: 4 teacher passes (two fused cond/uncond pairs) + the student's forward and backward ~ 7 forwards
    assert 6 < r["forward_equivalents_per_sample"] < 8 and r["tflops_per_s_per_gpu"] > 0
    assert r["settings"]["iters"] == 2 and r["settings"]["variant"] == "ours"


def test_two_processes_are_ddp_with_twice_the_global_batch(runs):
    r = runs[2]
    assert r["complete"] is True and r["num_processes"] == 2
    assert r["distributed_type"] == "MULTI_CPU" and r["backend"] == "gloo" and len(r["devices"]) == 2
    assert r["variant"] == "ours_wcond" and r["batch_per_process"] == 2 and r["global_batch"] == 2 * r["batch_per_process"]
    assert r["samples_per_s"] == pytest.approx(r["global_batch"] / r["step_s"])
    assert r["samples_per_s_per_gpu"] == pytest.approx(r["samples_per_s"] / 2)
    assert len(r["step_s_per_rank"]) == 2 and r["step_s"] == r["step_s_per_rank"][0]
    # each rank draws its own batch: the two losses differ
    assert len(r["loss_per_rank"]) == 2 and r["loss_per_rank"][0] != r["loss_per_rank"][1]
    assert r["no_sync_step_s"] > 0 and 0.0 <= r["comm_share"] < 1.0
    # ours_wcond: 2 teacher passes + forward and backward ~ 5 forwards
    assert 4 < r["forward_equivalents_per_sample"] < 6


def test_merge(runs, bench, tmp_path, capsys):
    d = runs["dir"]
    four = dict(runs[2], num_processes=4, global_batch=8, step_s=2 * runs[1]["step_s"], samples_per_s=8 / (2 * runs[1]["step_s"]))
    (tmp_path / "n4.json").write_text(json.dumps(four))
    out = tmp_path / "scaling.json"
    assert bench.main(["--merge", str(tmp_path / "n4.json"), str(d / "n2.json"), str(d / "n1.json"), "--out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["benchmark"] == "distill_scaling_merged" and m["baseline"] == str(d / "n1.json")
    assert [row["num_processes"] for row in m["runs"]] == [1, 2, 4]
    base, two, four_row = m["runs"]
    assert base["speedup"] == pytest.approx(1.0) and base["efficiency"] == pytest.approx(1.0)
    assert two["speedup"] == pytest.approx(runs[2]["samples_per_s"] / runs[1]["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert four_row["speedup"] == pytest.approx(2.0) and four_row["efficiency"] == pytest.approx(0.5)
    assert four_row["step_time_ratio"] == pytest.approx(2.0) and four_row["global_batch"] == 8
    assert m["mismatched"] == {"variant": ["ours", "ours_wcond"]}  # named, not hidden
    assert "differ" in capsys.readouterr().out

    with pytest.raises(SystemExit):  # not a distill_scaling result
        (tmp_path / "other.json").write_text(json.dumps({"benchmark": "distill_step"}))
        bench.main(["--merge", str(tmp_path / "other.json"), "--out", str(tmp_path / "x.json")])
