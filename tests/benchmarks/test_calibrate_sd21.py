"""benchmarks/calibrate_sd21.py's steps on a tiny UNet on the CPU: the result file's sections and a sweep row's fields
in the order the script writes them, every step's section saved, and bad recon overrides refused before anything is
built. No timings are asserted."""
from __future__ import annotations

import json

import pytest
from script_module import load_script  # tests/script_module.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROW = ["iters", "lr", "rounding_lrs", "variant", "wall_s", "mse_rtn", "mse_init", "mse_recon", "target_power",
       "soft_fraction", "ratio_vs_rtn", "holdout_mse_rtn", "holdout_mse_recon", "holdout_ratio_vs_rtn"]


@pytest.fixture(scope="module")
def cal():
    return load_script("benchmarks/calibrate_sd21.py", "calibrate_sd21_bench")


def test_a_tiny_run_writes_every_section_and_the_sweep_rows(cal, tmp_path):
    out = tmp_path / "tiny.json"
    assert cal.main(["--out", str(out), "--arch", "tiny", "--device", "cpu", "--trajectories", "1", "--steps", "1",
                     "--no-timing", "--blocks", "stem", "--iters", "0,1", "--sweep-variants", "lr=1e-3;",
                     "--holdout", "2", "--batch", "2"]) == 0
    r = json.loads(out.read_text())
    assert list(r) == ["args", "torch", "python", "device_name", "unet_params", "latent_size", "build_s", "calibration",
                       "blocks", "activations", "activations_max_abs", "recon_config", "holdout_samples", "sweep", "total_s"]
    assert r["calibration"]["samples"] == 2 and r["holdout_samples"] == 2  # one trajectory of one step, cond + uncond
    assert [b["name"] for b in r["sweep"]] == ["stem"]
    rows = r["sweep"][0]["rows"]
    assert [(row["iters"], row["variant"]) for row in rows] == [(0, "lr=1e-3"), (1, "lr=1e-3"), (1, "")]  # 0: the RTN row once
    assert all(list(row) == ROW for row in rows)


def test_bad_recon_overrides_exit_before_the_unet_is_built(cal, tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "build_unet", lambda *a: pytest.fail("built before the overrides were checked"))
    out = tmp_path / "bad.json"
    with pytest.raises(SystemExit, match="--sweep-variants"):
        cal.main(["--out", str(out), "--arch", "tiny", "--device", "cpu", "--sweep-variants", "no_such_field=1"])
    with pytest.raises(SystemExit, match="give one"):
        cal.main(["--out", str(out), "--arch", "tiny", "--device", "cpu", "--sweep-variants", "lr=1e-3", "--sweep-lrs", "0.1"])
    assert not out.exists()
