"""The consistency pieces of the SD-2.1 benches on the CPU: benchmarks/distill_step.py's `ours_lcm`
(the trainer's consistency step on a tiny UNet) and benchmarks/distill_sd21.py's summary of a
consistency run (its one stage against `ours_lcm` at the consistency section's batch)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from script_module import load_script  # tests/script_module.py


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _module(name: str):
    """A benchmark script as a module (tests/script_module.py)."""
    return load_script(f"benchmarks/{name}.py", f"{name}_bench")


def test_ours_lcm_times_the_consistency_step(tmp_path):
    out = tmp_path / "step.json"
    args = ["--out", str(out), "--arch", "tiny", "--device", "cpu", "--variants", "ours_lcm", "--compile", "off",
            "--batches", "2", "--iters", "1", "--warmup", "1"]
    assert _module("distill_step").main(args) == 0
    result = json.loads(out.read_text())
    r = result["variants"]["ours_lcm@2"]
    assert r["samples_per_s"] > 0 and r["batch"] == 2 and r["loss"] > 0
    assert (r["teacher_passes_per_step"], r["target_network_passes_per_step"]) == (2, 1)
    # a fused cond/uncond teacher pair + the target network + the student's forward and backward ~ 6 forwards
    assert 5 < r["forward_equivalents_per_sample"] < 7
    assert [row["variant"] for row in result["batch_sweep"]] == ["ours_lcm"]


def _consistency_run(run: Path) -> None:
    """What `pocketdiff distill` leaves for the summary: report.json, config.yaml, logs.jsonl."""
    run.mkdir()
    timing = {"steady_samples_per_s": 10.0, "first_step_s": 3.0, "peak_gpu_mem_gib": 19.5, "processes": 1, "memory_cap_gib": 24.0}
    report = {"method": "consistency", "complete": True, "rounds": [
        {"round": 0, "stage": "consistency", "steps": 4, "teacher_steps": 50, "train_steps": 8, "timing": timing,
         "eval": {"1": {}, "2": {}, "4": {}}}]}
    (run / "report.json").write_text(json.dumps(report))
    (run / "config.yaml").write_text(yaml.safe_dump({"method": "consistency", "progressive": {"train": {"batch_size": 8}},
                                                     "consistency": {"train": {"batch_size": 16}}}))
    (run / "logs.jsonl").write_text("".join(json.dumps({"phase": "round-0", "step": s, "loss": 0.1}) + "\n" for s in (1, 2)))


def test_summary_of_a_consistency_run_is_against_ours_lcm(tmp_path, capsys):
    _consistency_run(tmp_path / "distill")
    bench = {"variants": {"ours_lcm@16": {"samples_per_s": 12.5, "peak_mem_gib": 17.0},
                          "ours_wcond@8": {"samples_per_s": 99.0, "peak_mem_gib": 11.0}},
             "batch_sweep": [{"variant": "ours_lcm", "batch": 16, "oom": False, "samples_per_s": 12.5}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    out = tmp_path / "summary.json"
    assert _module("distill_sd21").main(["summary", "--out", str(out), "--distill", str(tmp_path / "distill"),
                                         "--bench", str(tmp_path / "bench.json")]) == 0
    d = json.loads(out.read_text())["distill"]
    assert d["method"] == "consistency" and d["complete"] is True and d["peak_gpu_mem_gib"] == 19.5
    [r] = d["rounds"]
    assert (r["stage"], r["batch"], r["bench_variant"], r["sampled_steps"]) == ("consistency", 16, "ours_lcm", [1, 2, 4])
    assert r["bench_samples_per_s"] == 12.5 and r["verb_over_bench"] == pytest.approx(0.8) and r["bench_peak_mem_gib"] == 17.0
    assert "round 0 (consistency)" in capsys.readouterr().out
