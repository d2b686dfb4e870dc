"""The SDXL-size benches (issue 63 item 3, scripts/gpu/sdxl_size.sh) on the CPU with tiny SDXL-shaped models:
benchmarks/distill_step.py --arch tiny_xl (time ids, levers, a variant out of memory, bad arguments),
benchmarks/calibrate_sd21.py's calibration set for an SDXL family (and the SD one unchanged), and
benchmarks/sdxl_size.py (the folder calibrate loads, the verb on it with configs/sdxl/calibrate_smoke.yaml, the rows)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from script_module import load_script  # tests/script_module.py

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _module(name: str):
    """A benchmark script as a module (tests/script_module.py)."""
    return load_script(f"benchmarks/{name}.py", f"{name}_sdxl_bench")


@pytest.fixture(scope="module")
def ds():
    return _module("distill_step")


@pytest.fixture(scope="module")
def size():
    return _module("sdxl_size")


def test_sdxl_batch_carries_the_pipelines_time_ids_and_pooled_embeddings(ds):
    unet = ds.build_unet("tiny_xl", 8)
    assert ds.vae_factor("tiny_xl") == 4 and ds.vae_factor("sdxl") == 8 and ds.vae_factor("sd21") == 8
    b = ds.Batch(unet, 3, 8, 4, torch.device("cpu"), pixels=32)
    # StableDiffusionXLPipeline's defaults at 32 px: original = target size, crop (0, 0); the same rows unconditioned
    assert b.cond.time_ids.tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]] * 3
    assert b.uncond.time_ids.tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]
    assert b.cond.pooled_embeds.shape == (3, 32) and float(b.cond.pooled_embeds.std()) > 0.1  # drawn, not zeros
    assert b.cond.prompt_embeds.shape == (3, 77, 64)  # both towers' widths side by side (32 + 32)


def test_distill_step_tiny_xl_rows_name_their_levers_without_flops(ds, tmp_path):
    out = tmp_path / "step.json"
    args = ["--out", str(out), "--arch", "tiny_xl", "--device", "cpu", "--variants", "eager,ours_wcond", "--compile", "off",
            "--flops", "off", "--batch", "2", "--iters", "1", "--warmup", "1"]
    assert ds.main(args) == 0
    r = json.loads(out.read_text())
    assert (r["arch"], r["latent"], r["params"] > 0) == ("tiny_xl", 8, True)
    eager, ours = r["variants"]["eager"], r["variants"]["ours_wcond"]
    assert eager["tflops_per_s"] is None and eager["forward_equivalents_per_sample"] is None  # --flops off
    assert eager["levers"]["fused_cond_uncond"] is False and eager["levers"]["channels_last"] is False
    assert ours["levers"]["fused_cond_uncond"] is True and ours["levers"]["channels_last"] is True
    assert ours["levers"]["compiled"] is False and ours["levers"]["teacher_dtype"] == "float32"  # CPU: fp32, no autocast
    assert ours["samples_per_s"] > 0 and ours["loss"] > 0
    assert set(r["speedup_vs_eager"]) == {"eager", "ours_wcond"}


def test_a_variant_out_of_memory_is_a_row_and_the_others_still_run(ds, tmp_path, monkeypatch):
    real = ds.measure

    def measure(name, *a, **k):
        if name == "eager":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(name, *a, **k)

    monkeypatch.setattr(ds, "measure", measure)
    out = tmp_path / "step.json"
    assert ds.main(["--out", str(out), "--arch", "tiny_xl", "--device", "cpu", "--variants", "eager,ours_eager",
                    "--compile", "off", "--flops", "off", "--batch", "2", "--iters", "1", "--warmup", "1"]) == 0
    r = json.loads(out.read_text())
    assert r["variants"]["eager"] == {"variant": "eager", "batch": 2, "oom": True, "peak_mem_gib": None}
    assert r["variants"]["ours_eager"]["samples_per_s"] > 0
    assert "speedup_vs_eager" not in r  # no eager row to compare with


@pytest.mark.parametrize("bad", [["--arch", "sdxxl"], ["--latent", "0"], ["--variants", "eager,fast"], ["--flops", "maybe"]])
def test_distill_step_bad_arguments_exit_2_before_building(ds, tmp_path, bad):
    out = tmp_path / "step.json"
    with pytest.raises(SystemExit) as e:
        ds.main(["--out", str(out), "--device", "cpu", "--arch", "tiny_xl", *bad])
    assert e.value.code == 2 and not out.exists()


def test_calibration_set_of_an_sdxl_family_and_the_sd_draws_unchanged():
    cal = _module("calibrate_sd21")
    unet, sched, cfg = cal.build_unet("tiny_xl", 32, 0, "cpu", 0.1)
    calib = cal.calib_set(unet, sched, cfg, 2, 2, 1, "cpu", pixels=32)
    assert len(calib) == 2 * 2 * 2  # trajectories x steps x cond/uncond
    assert calib.text_embeds.shape == (8, 32)
    assert calib.time_ids.unique(dim=0).tolist() == [[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]
    # SD: the prompt embeddings are the draws the harness made before the family seam (same seed, same order), so
    # earlier results (--reference) stay comparable
    unet, sched, cfg = cal.build_unet("tiny", 32, 0, "cpu", 0.1)
    calib = cal.calib_set(unet, sched, cfg, 2, 1, 1, "cpu")
    g = torch.Generator("cpu").manual_seed(1)
    cond, uncond = torch.randn(2, 77, 64, generator=g), torch.randn(1, 77, 64, generator=g)
    got = calib.encoder_hidden_states
    assert getattr(calib, "text_embeds", None) is None
    assert any(torch.equal(row, cond[0]) for row in got) and any(torch.equal(row, uncond[0]) for row in got)


def test_calibrate_verb_on_the_built_folder_and_its_rows(size, tmp_path):
    """The script's path on a tiny SDXL: the folder built and saved, `pocketdiff calibrate` with the SDXL smoke config
    loading it (model.pretrained), then the summary rows with the host peak from /usr/bin/time -v's line."""
    from pocketdiff.cli import run_stage

    folder = tmp_path / "xl"
    assert size.main(["build", str(folder), "--arch", "tiny_xl"]) == 0
    built = json.loads((tmp_path / "xl.json").read_text())
    assert (folder / "text_encoder_2").is_dir() and (folder / "tokenizer_2").is_dir() and built["params"]["unet"] > 0
    assert json.loads((folder / "model_index.json").read_text())["force_zeros_for_empty_prompt"] is True
    run = tmp_path / "cal"
    report = run_stage("calibrate", str(ROOT / "configs/sdxl/calibrate_smoke.yaml"), run,
                       [f"model.pretrained={folder}", "device=cpu", "memory_cap_gib=null", "recon.autocast=off",
                        "recon.iters=1", "calib.steps=2"])
    assert report["parity"]["passed"] and report["iters"] == 1 and report["calibration"]["samples"] == 4 * 2 * 2
    time_v = tmp_path / "time_v.txt"
    time_v.write_text("\tMaximum resident set size (kbytes): 52428800\n")  # 50 GiB: over the 48 GiB target
    step = {"device": "cpu", "torch": torch.__version__, "batch": 2, "latent": 8, "arch": "tiny_xl", "variants": {
        "eager": {"variant": "eager", "batch": 2, "samples_per_s": 2.0, "peak_mem_bytes": 100},
        "ours_wcond": {"variant": "ours_wcond", "batch": 2, "samples_per_s": 3.2, "peak_mem_bytes": 80}}}
    (tmp_path / "step.json").write_text(json.dumps(step))
    (tmp_path / "meta.json").write_text(json.dumps({"calibrate_exit": 0, "device": "cpu"}))
    d_out, c_out = tmp_path / "d.json", tmp_path / "c.json"
    assert size.main(["summary", "--distill", str(tmp_path / "step.json"), "--calibrate", str(run), "--time-v", str(time_v),
                      "--meta", str(tmp_path / "meta.json"), "--out-distill", str(d_out), "--out-calibrate", str(c_out)]) == 0
    c = json.loads(c_out.read_text())
    assert c["time_v_max_rss_bytes"] == 50 * 2 ** 30 and c["targets"]["host_peak_gib"] == 50.0
    assert c["targets"]["host_ok"] is False and c["iters"] == 1 and c["blocks"]
    assert c["host_memory"]["predicted_gb"] > 0
    d = json.loads(d_out.read_text())
    ours = next(r for r in d["rows"] if r["variant"] == "ours_wcond")
    assert ours["samples_per_s_vs_eager"] == pytest.approx(1.6) and ours["peak_mem_vs_eager"] == pytest.approx(0.8)
    assert d["best"] == {"variant": "ours_wcond", "batch": 2, "ratio": pytest.approx(1.6)} and d["meets_target"] is True


def test_rows_compare_each_batch_with_its_own_eager_row(size):
    """A batch-1 fallback (eager out of memory at 2): ratios only where an eager row of the same batch ran."""
    at2 = {"batch": 2, "variants": {"eager": {"variant": "eager", "batch": 2, "oom": True},
                                    "ours_wcond": {"variant": "ours_wcond", "batch": 2, "samples_per_s": 5.0}}}
    at1 = {"batch": 1, "variants": {"eager": {"variant": "eager", "batch": 1, "samples_per_s": 2.0},
                                    "ours_wcond": {"variant": "ours_wcond", "batch": 1, "samples_per_s": 2.8}}}
    d = size.distill_rows([at2, at1])
    by = {(r["variant"], r["batch"]): r for r in d["rows"]}
    assert by[("eager", 2)]["oom"] and "samples_per_s_vs_eager" not in by[("ours_wcond", 2)]
    assert by[("ours_wcond", 1)]["samples_per_s_vs_eager"] == pytest.approx(1.4)
    assert d["best"]["batch"] == 1 and d["meets_target"] is False


def test_the_device_script_parses():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu/sdxl_size.sh")]).returncode == 0


def test_docs_text_is_filled_from_the_rows(size, tmp_path):
    """benchmarks/sdxl_size_text.py: the MEASUREMENTS sections and the README sentence carry the rows' figures, the
    result files' names and each step's levers; a missing file is one line, exit 2."""
    text_mod = _module("sdxl_size_text")
    gib = 2 ** 30
    step = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "batch": 2, "latent": 128, "params": 2_567_463_684,
            "dtype": "bf16", "variants": {
                "eager": {"variant": "eager", "batch": 2, "samples_per_s": 4.0, "peak_mem_bytes": 70 * gib,
                          "levers": {"teacher_dtype": "float32", "fused_cond_uncond": False}},
                "ours_wcond": {"variant": "ours_wcond", "batch": 2, "samples_per_s": 6.4, "peak_mem_bytes": 63 * gib,
                               "levers": {"teacher_dtype": "bfloat16", "fused_cond_uncond": True, "channels_last": True,
                                          "compiled": False, "fused_adamw": True}}}}
    (tmp_path / "step.json").write_text(json.dumps(step))
    size.main(["summary", "--distill", str(tmp_path / "step.json"), "--out-distill", str(tmp_path / "sdxl_distill_step_h100.json")])
    cal = {"meta": {"device": "NVIDIA H100 80GB HBM3"}, "iters": 20, "wall_time_s": 231.4, "calibration": {"samples": 32},
           "timings": {"load_s": 20.0, "reconstruct_s": 150.2}, "blocks": [{}] * 34, "unet_cosine": 0.9999, "unet_cosine_rtn": 0.9998,
           "host_memory": {"predicted_gb": 43.2}, "targets": {"host_peak_gib": 45.6, "gpu_peak_gib": 41.0, "host_ok": True, "gpu_ok": False}}
    (tmp_path / "sdxl_calibrate_h100.json").write_text(json.dumps(cal))
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert text_mod.main(["--distill", str(tmp_path / "sdxl_distill_step_h100.json"),
                              "--calibrate", str(tmp_path / "sdxl_calibrate_h100.json"), "--date", "2026-12-07"]) == 0
    distill, calibrate, readme = buf.getvalue().split("\n\n----\n\n")
    assert "(NVIDIA H100 80GB HBM3, 2026-12-07)" in distill and "2,567 M parameters" in distill
    row = next(line for line in distill.splitlines() if "progressive round" in line)
    assert "| 6.40 | 1.60 | 63.0 GiB | 0.90 |" in row
    assert "bf16 teacher weights, one cond/uncond batch, channels_last, fused AdamW" in row and "torch.compile |" not in row
    assert "is met: the best is ours_wcond at 1.60×" in distill and "torch.compile was off" in distill
    assert "20 iterations per block (34 blocks), 32 calibration inputs" in calibrate
    assert "peak GPU 41.0 GiB (over the 40 GiB target)" in calibrate and "45.6 GiB (within the 48 GiB target; predicted 43.2" in calibrate
    assert "1.60× diffusers' default eager step's samples/s, 63.0 GiB of GPU against 70.0 GiB" in readme
    assert "`benchmarks/results/sdxl_distill_step_h100.json`" in readme and "`benchmarks/results/sdxl_calibrate_h100.json`" in readme
    assert text_mod.main(["--distill", str(tmp_path / "missing.json"), "--calibrate", str(tmp_path / "sdxl_calibrate_h100.json")]) == 2
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # a call that measured the step only: no calibrate section, and the sentence says so
        assert text_mod.main(["--distill", str(tmp_path / "sdxl_distill_step_h100.json"), "--date", "2026-12-07"]) == 0
    distill_only, readme_only = buf.getvalue().split("\n\n----\n\n")
    assert distill_only == distill and "calibrate at SDXL size is not yet measured on a GPU" in readme_only
