"""A consistency-distilled (LCM) student through `pocketdiff export` and run-bundle: the manifest's
lcm scheduler block, the runner's consistency step against pocketdiff.sampling.consistency_sample
in torch (1 step: no noise; 2 steps: fed the runner's own noise), malformed lcm blocks named by
field, and DDIM blocks unchanged.

The student (tests/conftest.py, `lcm_student`): the shipped shapes teacher's weights in a w-conditioned UNet (the
guidance embedding, time_cond_proj, small and random) under an LCMScheduler on a 10-point grid,
the layout `pocketdiff distill` with `method: consistency` writes. Its predictions are the
teacher's (sensible images), so the image comparison is not between two saturated clips."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from pocketdiff.cli import main as cli_main
from pocketdiff.errors import PocketdiffError

TEACHER = "pocketdiff:shapes-teacher"
PROMPT = "a small blue square at the top left"
SCALE = 2.0

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def student_dir(lcm_student):
    return lcm_student  # tests/conftest.py: the teacher's weights, w-conditioned, under an LCMScheduler (10-point grid)


@pytest.fixture(scope="module")
def lcm_bundle(lcm_bundle_2_steps):
    from pocketdiff.runtime.bundle import load_manifest

    out = lcm_bundle_2_steps  # tests/conftest.py: the student exported for 2 steps at SCALE
    return {"out": out, "manifest": json.loads((out / "manifest.json").read_text()), "loaded": load_manifest(out)}


@pytest.fixture(scope="module")
def torch_student(student_dir):
    from pocketdiff.models import ModelConfig, load_or_build
    from pocketdiff.sampling import encode_prompts

    pipe = load_or_build(ModelConfig(pretrained=str(student_dir)))
    pipe.unet.eval()
    return pipe, encode_prompts(pipe, PROMPT)


def _torch_image(pipe, cond, latents: np.ndarray, steps: int) -> np.ndarray:
    from pocketdiff.sampling import consistency_sample, decode_latents

    with torch.no_grad():
        lat = consistency_sample(pipe.unet, pipe.scheduler, cond, torch.from_numpy(latents), steps=steps, guidance_scale=SCALE)
        return decode_latents(pipe.vae, lat)[0].permute(1, 2, 0).numpy()


def _one_step(man: dict) -> dict:
    """The bundle's manifest at 1 step: the first point of the same grid (1 step of 10 is 999, as 2 steps' first)."""
    return {**man, "scheduler": {**man["scheduler"], "steps": 1, "timesteps": man["scheduler"]["timesteps"][:1]}}


def test_export_writes_the_lcm_scheduler_block(lcm_bundle, student_dir):
    from pocketdiff.consistency_sampling import scheduler_lcm_timesteps
    from pocketdiff.models import ModelConfig, load_or_build
    from pocketdiff.runtime.manifest_check import manifest_problems

    man = lcm_bundle["manifest"]
    s = man["scheduler"]
    sched = load_or_build(ModelConfig(pretrained=str(student_dir))).scheduler
    assert s["type"] == "lcm" and s["prediction_type"] == "epsilon" and s["num_train_timesteps"] == 1000
    assert s["steps"] == 2 and s["timesteps"] == scheduler_lcm_timesteps(sched, 2) == [999, 499]
    assert (s["original_inference_steps"], s["timestep_scaling"], s["sigma_data"], s["clip_sample_range"]) == (10, 10.0, 0.5, None)
    assert np.allclose(s["alphas_cumprod"], sched.alphas_cumprod.double().numpy(), rtol=0, atol=0)
    assert "final_alpha_cumprod" not in s and "eta" not in s  # DDIM's fields only
    assert man["guidance"] == {"mode": "embedded", "scale": SCALE, "unet_batch": 1}
    assert manifest_problems(lcm_bundle["out"], man) == []
    assert manifest_problems(lcm_bundle["out"], _one_step(man), files=False) == []


def test_one_step_image_matches_the_torch_consistency_sampler(lcm_bundle, torch_student):
    """1 step draws no noise: run-bundle (fp32 .tflite on the CPU) and consistency_sample in torch from the
    same latents. What differs is only the converted graphs' fp32 arithmetic (and the rewrites' clamped
    tanh-GELU): measured 85 dB PSNR here, cosine 0.999999999. The bar, 60 dB (RMS error 1e-3 on the
    [0, 1] image), leaves 25 dB for other CPUs' kernels, and a wrong step is far below it: the same
    bundle read as v_prediction measured 12 dB; wrong noise or a DDIM step at 2 steps ~27 dB (next test).
    Cosine alone does not tell (0.999 for those), so PSNR is the judge."""
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import generate

    man = _one_step(lcm_bundle["loaded"])
    latents = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
    ref = _torch_image(*torch_student, latents, steps=1)
    image, stats = generate(lcm_bundle["out"], PROMPT, seed=5, accelerator="cpu", init_latents=latents, manifest=man)
    m = metrics(ref, image)
    assert stats["finite"] and m["cosine"] > 0.9999 and m["psnr_db"] > 60, m
    assert 0.05 < float(ref.std())  # a real image, not a flat clip


def test_two_steps_match_the_torch_sampler_fed_the_runners_noise(lcm_bundle, torch_student, monkeypatch):
    """2 steps: run-bundle --seed 7 draws the latents and then the re-noising from numpy's default_rng(7);
    the torch sampler is fed exactly those draws (pocketdiff.sampling.randn_latents replaced). Measured 103 dB;
    the same bundle with seed 8's noise measured 27 dB against it, a DDIM step 26 dB: the 60 dB bar tells them apart."""
    import pocketdiff.sampling as sampling
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import generate

    rng = np.random.default_rng(7)
    latents = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    noise = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    drawn = []

    def fed(shape, generator=None, device=None):
        drawn.append(tuple(shape))
        return torch.from_numpy(noise)

    monkeypatch.setattr(sampling, "randn_latents", fed)
    ref = _torch_image(*torch_student, latents, steps=2)
    assert drawn == [(1, 4, 8, 8)]  # one re-noising between the two steps
    man = lcm_bundle["loaded"]
    image, stats = generate(lcm_bundle["out"], PROMPT, seed=7, accelerator="cpu", manifest=man)
    m = metrics(ref, image)
    assert stats["finite"] and m["cosine"] > 0.9999 and m["psnr_db"] > 60, m
    # the latents given (the web page's reference) or drawn: the same re-noising, the same image
    given, _ = generate(lcm_bundle["out"], PROMPT, seed=7, accelerator="cpu", init_latents=latents, manifest=man)
    assert np.array_equal(given, image)
    other, _ = generate(lcm_bundle["out"], PROMPT, seed=8, accelerator="cpu", init_latents=latents, manifest=man)
    assert not np.array_equal(other, image)  # the second step's noise is the seed's


def test_malformed_lcm_blocks_are_refused_naming_the_field(lcm_bundle, tmp_path, capsys):
    from pocketdiff.runtime.manifest_check import check_bundle, manifest_problems

    man = lcm_bundle["manifest"]
    cases = {
        "scheduler.type": {"type": "euler"},
        "scheduler.prediction_type": {"prediction_type": "flow"},
        "scheduler.original_inference_steps": {"original_inference_steps": 0},
        "scheduler.timesteps[1]": {"timesteps": [999, 500]},
        "scheduler.timestep_scaling": {"timestep_scaling": -1.0},
        "scheduler.sigma_data": {"sigma_data": None},
        "scheduler.clip_sample_range": {"clip_sample_range": "1"},
    }
    for field, change in cases.items():
        bad = {**man, "scheduler": {**man["scheduler"], **change}}
        wheres = [p.where for p in manifest_problems(lcm_bundle["out"], bad, files=False)]
        # an unknown type: its fields are then read as DDIM's, whose own problems follow the type's
        assert wheres[0] == field and (field == "scheduler.type" or len(wheres) == 1), (field, wheres)
        with pytest.raises(PocketdiffError, match=re.escape(f"{field}: ")):
            check_bundle(lcm_bundle["out"], manifest=bad)
    # through the CLI: a tampered manifest on disk, one line, exit 2
    import shutil

    bundle = tmp_path / "bundle"
    shutil.copytree(lcm_bundle["out"], bundle, ignore=shutil.ignore_patterns("_export"))
    raw = json.loads((bundle / "manifest.json").read_text())
    raw["scheduler"]["sigma_data"] = 0
    (bundle / "manifest.json").write_text(json.dumps(raw))
    rc = cli_main(["run-bundle", str(bundle), "--prompt", "x", "--output", str(tmp_path / "out"), "--accelerator", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "scheduler.sigma_data" in err and not (tmp_path / "out").exists()


def test_ddim_scheduler_block_is_unchanged():
    """The shipped web smoke bundle was exported before lcm blocks existed: today's export writes its DDIM
    block byte for byte (same keys in the same order, same numbers)."""
    from pathlib import Path

    from pocketdiff.export.verb import Config, _scheduler_block
    from pocketdiff.models import ModelConfig, load_or_build
    from pocketdiff.sampling import scheduler_timesteps

    shipped = json.loads((Path(__file__).resolve().parents[1] / "web" / "smoke_bundle" / "manifest.json").read_text())["scheduler"]
    sched = load_or_build(ModelConfig(pretrained=TEACHER)).scheduler
    block = _scheduler_block(Config(steps=4), sched, scheduler_timesteps(sched, 4).tolist())
    assert json.dumps(block) == json.dumps(shipped)
