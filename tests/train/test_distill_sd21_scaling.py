"""benchmarks/distill_sd21.py's `scaling` on the CPU: weak scaling of an N-process run against the 1-process
run (N from the run's own report), the same over a span of log windows (`--window A:B`), and the steps it
was measured over; what scripts/gpu/sd21_distill_ngpu.sh writes into distill_sd21_4gpu_*.json."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import yaml

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("distill_sd21_scaling_bench", BENCHMARKS / "distill_sd21.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return mod


def _run(folder: Path, processes: int, batch: int, steady: float, window_rates: dict[int, float]) -> Path:
    """What `pocketdiff distill` leaves: report.json (the round's timing), config.yaml, logs.jsonl (one row per 5 steps)."""
    folder.mkdir(parents=True)
    timing = {"steady_samples_per_s": steady, "processes": processes, "steps_run": 40, "steady_steps": 38, "peak_gpu_mem_gib": 13.6}
    (folder / "report.json").write_text(json.dumps({"rounds": [{"round": 1, "stage": "progressive", "timing": timing,
                                                                  "losses": [[40, 1.0]]}]}))
    (folder / "config.yaml").write_text(yaml.safe_dump({"progressive": {"train": {"batch_size": batch}}}))
    rows = [{"phase": "round-1", "step": s, "loss": 1.0, "samples_per_s": window_rates[s]} for s in sorted(window_rates)]
    (folder / "logs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_weak_scaling_of_four_processes_with_windows(tmp_path, capsys):
    mod = _module()
    one = _run(tmp_path / "one", 1, 16, 32.0, {5: 30.0, 10: 32.0, 15: 32.0, 20: 32.0})
    many = _run(tmp_path / "four", 4, 64, 102.4, {5: 80.0, 10: 120.0, 15: 112.0, 20: 60.0})
    out = tmp_path / "s.json"
    assert mod.main(["scaling", "--out", str(out), "--one", str(one), "--multi", str(many), "--window", "5:15"]) == 0
    r = json.loads(out.read_text())["rounds"][0]
    assert r["processes"] == 4 and r["steps_run"] == 40 and r["steady_steps"] == 38
    assert abs(r["weak_scaling"] - 102.4 / (4 * 32.0)) < 1e-9  # 0.8
    w = r["window_5_15"]  # the windows ending at steps 10 and 15 (each 5 steps): harmonic means of their rates
    assert abs(w["one_gpu_samples_per_s"] - 32.0) < 1e-9
    assert abs(w["multi_gpu_samples_per_s"] - 2 / (1 / 120.0 + 1 / 112.0)) < 1e-9
    assert abs(w["weak_scaling"] - w["multi_gpu_samples_per_s"] / (4 * 32.0)) < 1e-9
    assert "4 GPUs" in capsys.readouterr().out
