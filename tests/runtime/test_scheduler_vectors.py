"""The scheduler rules against diffusers' own numbers (tests/data/scheduler_vectors.json, written by
scripts/make_scheduler_vectors.py from DDIMScheduler / LCMScheduler and the img2img pipelines' get_timesteps):
the torch-free module (pocketdiff/scheduler_blocks.py) and the runtime's schedulers built on it, the torch samplers
(pocketdiff.sampling, consistency_sampling), and the page's schedulers.js under node. Timesteps are compared
exactly; latents to 2e-6 (float32 arithmetic in a different order: diffusers casts alphas_cumprod to float32 before
the square root, numpy and JS take it in float64)."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pocketdiff import scheduler_blocks as sb
from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.schedulers import DDIMConfig, DDIMScheduler, LCMConfig, LCMScheduler, scheduler_for

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "data" / "scheduler_vectors.json"
SCRIPT = ROOT / "scripts" / "make_scheduler_vectors.py"
HARNESS = ROOT / "tests" / "web" / "scheduler_vectors.mjs"
TOL = {"rtol": 1e-5, "atol": 2e-6}


@pytest.fixture(scope="module")
def vec() -> dict:
    return json.loads(VECTORS.read_text())


def _or_none(f):
    try:
        return f()
    except PocketdiffError:
        return None


def _ddim_block(c: dict, alphas: list) -> dict:
    return {"type": "ddim", "num_train_timesteps": c["num_train_timesteps"], "timestep_spacing": c["timestep_spacing"],
            "steps_offset": c["steps_offset"], "alphas_cumprod": alphas, "final_alpha_cumprod": alphas[0], "prediction_type": "epsilon"}


def _lcm_block(c: dict, alphas: list) -> dict:
    return {"type": "lcm", "num_train_timesteps": c["num_train_timesteps"], "original_inference_steps": c["original_inference_steps"],
            "alphas_cumprod": alphas, "prediction_type": "epsilon", "timestep_scaling": 10.0, "sigma_data": 0.5, "clip_sample_range": None}


def test_the_vectors_cover_what_they_claim(vec):
    """Every spacing x offset, refusals on both sides (so the null path is exercised), strengths that cut."""
    combos = {(c["timestep_spacing"], c["steps_offset"]) for c in vec["ddim"]}
    assert combos == {(s, o) for s in sb.SPACINGS for o in (0, 1)}
    assert any(c["timesteps"] is None for c in vec["ddim"])  # diffusers' trailing at 61 of 1000 steps ends at -1
    assert any(v is None for c in vec["lcm"] for v in c["img2img"].values())
    kept = [len(v) for c in vec["ddim"] for k, v in c["img2img"].items() if v and k != "1.0"]
    assert min(kept) >= 1 and any(len(c["img2img"]["0.3"] or []) < c["steps"] for c in vec["ddim"])
    sd = [c for c in vec["ddim"] if (c["num_train_timesteps"], c["timestep_spacing"], c["steps_offset"], c["steps"]) == (1000, "leading", 1, 4)]
    plain = [c for c in vec["ddim"] if (c["num_train_timesteps"], c["timestep_spacing"], c["steps_offset"], c["steps"]) == (1000, "leading", 0, 4)]
    assert sd[0]["timesteps"] == [751, 501, 251, 1] and plain[0]["timesteps"] == [750, 500, 250, 0]  # SD's offset 1, diffusers' default 0


def test_torch_free_rules_and_runtime_schedulers_match_diffusers(vec):
    alphas = vec["alphas_cumprod"]
    for c in vec["ddim"]:
        b = _ddim_block(c, alphas)
        got = _or_none(lambda: sb.ddim_timesteps(c["num_train_timesteps"], c["steps"], spacing=c["timestep_spacing"], steps_offset=c["steps_offset"]))
        assert got == c["timesteps"], c
        for k, want in c["img2img"].items():
            assert _or_none(lambda: sb.timesteps_for(b, c["steps"], float(k))) == want, (c, k)
            sched = DDIMScheduler(DDIMConfig(c["num_train_timesteps"], np.asarray(alphas), alphas[0], "epsilon", c["timestep_spacing"], c["steps_offset"]))
            if want is None:
                with pytest.raises(PocketdiffError):
                    sched.set_timesteps(c["steps"], strength=float(k))
            else:
                sched.set_timesteps(c["steps"], strength=float(k))
                assert sched.timesteps == want and sched.num_inference_steps == c["steps"]  # the full count: DDIM's stride
    for c in vec["lcm"]:
        b = _lcm_block(c, alphas)
        for k, want in c["img2img"].items():
            assert _or_none(lambda: sb.lcm_timesteps(1000, c["original_inference_steps"], c["steps"], float(k))) == want, (c, k)
            assert _or_none(lambda: sb.timesteps_for(b, c["steps"], float(k))) == want, (c, k)
            sched = LCMScheduler(LCMConfig(1000, np.asarray(alphas), c["original_inference_steps"]))
            assert _or_none(lambda: sched.set_timesteps(c["steps"], strength=float(k)) or sched.timesteps) == want, (c, k)


def test_the_torch_samplers_take_the_same_rules(vec):
    import torch
    from diffusers import DDIMScheduler as Ref

    from pocketdiff.consistency_sampling import lcm_timesteps
    from pocketdiff.sampling import ddim_timesteps, scheduler_timesteps

    for c in vec["ddim"]:
        args = (c["num_train_timesteps"], c["steps"])
        got = _or_none(lambda: ddim_timesteps(*args, steps_offset=c["steps_offset"], spacing=c["timestep_spacing"]).tolist())
        assert got == c["timesteps"], c
        if c["timesteps"] is not None:
            ref = Ref(num_train_timesteps=c["num_train_timesteps"], timestep_spacing=c["timestep_spacing"], steps_offset=c["steps_offset"])
            assert scheduler_timesteps(ref, c["steps"]).dtype == torch.long
            assert scheduler_timesteps(ref, c["steps"]).tolist() == c["timesteps"]
    for c in vec["lcm"]:
        assert _or_none(lambda: lcm_timesteps(1000, c["original_inference_steps"], c["steps"])) == c["timesteps"], c


def test_add_noise_and_img2img_walks_match_diffusers(vec):
    """add_noise at a few timesteps; whole img2img runs: scheduler_for(block, strength), the start latents
    add_noise(x0, noise, timesteps[0]), every step after (DDIM's stride stays T // steps; LCM re-noises)."""
    alphas = np.asarray(vec["alphas_cumprod"])
    shape = tuple(vec["shape"])
    for c in vec["add_noise"]:
        x0, noise = np.asarray(c["x0"], np.float32), np.asarray(c["noise"], np.float32)
        np.testing.assert_allclose(sb.add_noise(x0, noise, alphas[c["t"]]), c["noisy"], **TOL)
        sched = (LCMScheduler(LCMConfig(1000, alphas, 50)) if c["type"] == "lcm" else DDIMScheduler(DDIMConfig(1000, alphas, 1.0)))
        out = sched.add_noise(x0, noise, c["t"])
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, c["noisy"], **TOL)
    for w in vec["walks"]:
        sched = scheduler_for({**w["block"], "alphas_cumprod": vec["alphas_cumprod"]}, strength=w["strength"])
        assert sched.timesteps == w["timesteps"] != w["block"]["timesteps"]  # a partial schedule (lcm: as many, lower)
        x = sched.add_noise(np.asarray(w["x0"], np.float32).reshape(shape), np.asarray(w["noise"], np.float32).reshape(shape), sched.timesteps[0])
        np.testing.assert_allclose(x.ravel(), w["start"], **TOL)
        for row in w["steps"]:
            noise = None if row["noise"] is None else np.asarray(row["noise"], np.float32).reshape(shape)
            x = sched.step(np.asarray(row["model_output"], np.float32).reshape(shape), row["t"], x, noise=noise).prev_sample
            np.testing.assert_allclose(x.ravel(), row["prev_sample"], rtol=1e-5, atol=2e-5, err_msg=f"{w['block']['type']} t={row['t']}")


def test_the_page_schedulers_match_diffusers(vec):
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the Python side passed, the page's schedulers.js was not run")
    res = subprocess.run([node, str(HARNESS), str(ROOT / "web" / "static"), str(VECTORS)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    for c, got, spaced in zip(vec["ddim"], out["ddim"], out["ddim_spacing"], strict=True):
        assert got["timesteps"] == spaced == c["timesteps"], c
        assert got["img2img"] == c["img2img"], c
        for k, want in c["img2img"].items():
            assert got["objects"][k] == (None if want is None else {"ts": want, "n": c["steps"]}), (c, k)
    for c, got in zip(vec["lcm"], out["lcm"], strict=True):
        assert got["timesteps"] == c["timesteps"] and got["img2img"] == c["img2img"], c
        assert {k: (o or {}).get("ts") for k, o in got["objects"].items()} == c["img2img"], c
    for c, got in zip(vec["add_noise"], out["add_noise"], strict=True):
        np.testing.assert_allclose(got["fn"], c["noisy"], **TOL)
        np.testing.assert_allclose(got["method"], c["noisy"], **TOL)
    for w, got in zip(vec["walks"], out["walks"], strict=True):
        assert got["timesteps"] == w["timesteps"]
        np.testing.assert_allclose(got["start"], w["start"], **TOL)
        for row, x in zip(w["steps"], got["steps"], strict=True):
            np.testing.assert_allclose(x, row["prev_sample"], rtol=1e-5, atol=2e-5, err_msg=f"{w['block']['type']} t={row['t']}")
    assert out["bad_strength"] == [None] * 5 and out["no_offset"] is None


def test_the_script_still_writes_this_file(vec):
    """The committed vectors are what the script makes with the installed diffusers (timesteps exactly)."""
    spec = importlib.util.spec_from_file_location("make_scheduler_vectors", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fresh = json.loads(mod.dumps(mod.make_vectors()))
    for key in ("ddim", "lcm"):
        assert fresh[key] == vec[key], key
    np.testing.assert_allclose(fresh["alphas_cumprod"], vec["alphas_cumprod"], rtol=1e-12)
    for a, b in zip(fresh["walks"], vec["walks"], strict=True):
        assert a["timesteps"] == b["timesteps"] and a["block"] == b["block"]
        np.testing.assert_allclose(a["steps"][-1]["prev_sample"], b["steps"][-1]["prev_sample"], rtol=1e-6, atol=1e-6)
