"""The runtime's schedulers (runtime/schedulers.py) and the page's (web/static/schedulers.js) against diffusers'
DDIMScheduler and LCMScheduler on the same inputs: one test per scheduler, its vectors made here from diffusers,
written to one JSON file that numpy and node (tests/web/js_harness.mjs) each read. No model files: seconds."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.schedulers import (DDIMConfig, DDIMScheduler, LCMConfig, LCMScheduler, sample_loop,
                                           scheduler_for)

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "web" / "js_harness.mjs"
SHAPE = (1, 4, 3, 3)
BETAS = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}

DDIM_CASES = [  # (prediction_type, timestep_spacing, steps_offset, set_alpha_to_one, steps, clip_sample)
    ("epsilon", "leading", 1, False, 4, False),  # the last step's prev < 0: final_alpha_cumprod = alphas[0]
    ("v_prediction", "trailing", 0, True, 16, False),  # T / 16 = 62.5: numpy rounds the halves to even
    ("epsilon", "linspace", 0, True, 7, False),
    ("epsilon", "leading", 1, True, 4, True),  # clip_sample at 1.5: x0 at t=751 is far outside it
]
LCM_CASES = [  # (prediction_type, original_inference_steps, steps, clip)
    ("epsilon", 50, 4, False),
    ("v_prediction", 10, 3, False),
    ("sample", 10, 3, True),  # model outputs x 3: the clip at 1.5 bites
    ("epsilon", 10, 1, False),  # one step: no re-noising
]


def _alphas(sched) -> list:
    return sched.alphas_cumprod.to(torch.float64).tolist()


def _walk(sched, step, steps: int, seed: int, scale: float = 1.0) -> list[dict]:
    """Every timestep of a diffusers scheduler from a seeded sample, each fed a seeded model output; each step's
    inputs, noise (LCM: diffusers' own draw, reproduced from the same torch seed) and outputs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    rows = []
    for i, t in enumerate(sched.timesteps.tolist()):
        out = (scale * rng.standard_normal(SHAPE)).astype(np.float32)
        noise_seed = 1000 * seed + i
        prev, x0 = step(torch.from_numpy(out), t, torch.from_numpy(x), torch.Generator().manual_seed(noise_seed))
        noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(noise_seed), dtype=torch.float32).numpy()
        rows.append({"t": t, "sample": x.ravel().tolist(), "model_output": out.ravel().tolist(), "noise": noise.ravel().tolist(),
                     "prev_sample": prev.numpy().ravel().tolist(), "pred_original_sample": x0.numpy().ravel().tolist()})
        x = prev.numpy().astype(np.float32)
    return rows


def _ddim_vectors() -> list[dict]:
    from diffusers import DDIMScheduler as Ref

    cases = []
    for k, (ptype, spacing, offset, to_one, steps, clip) in enumerate(DDIM_CASES):
        ref = Ref(num_train_timesteps=1000, **BETAS, clip_sample=clip, clip_sample_range=1.5, set_alpha_to_one=to_one,
                  steps_offset=offset, timestep_spacing=spacing, prediction_type=ptype)
        ref.set_timesteps(steps)
        block = {"type": "ddim", "prediction_type": ptype, "num_train_timesteps": 1000, "steps": steps,
                 "timesteps": ref.timesteps.tolist(), "alphas_cumprod": _alphas(ref), "final_alpha_cumprod": float(ref.final_alpha_cumprod),
                 "timestep_spacing": spacing, "steps_offset": offset, "eta": 0, "clip_sample_range": 1.5 if clip else None}

        def step(out, t, x, gen, ref=ref):
            r = ref.step(out, t, x, eta=0.0)
            return r.prev_sample, r.pred_original_sample

        cases.append({"block": block, "steps": steps, "inputs": _walk(ref, step, steps, seed=k)})
    return cases


def _lcm_vectors() -> list[dict]:
    from diffusers import LCMScheduler as Ref

    cases = []
    for k, (ptype, K, steps, clip) in enumerate(LCM_CASES):
        ref = Ref(num_train_timesteps=1000, **BETAS, prediction_type=ptype, original_inference_steps=K, timestep_scaling=10.0,
                  clip_sample=clip, clip_sample_range=1.5)
        ref.set_timesteps(steps)
        block = {"type": "lcm", "prediction_type": ptype, "num_train_timesteps": 1000, "steps": steps,
                 "timesteps": ref.timesteps.tolist(), "alphas_cumprod": _alphas(ref), "original_inference_steps": K,
                 "timestep_scaling": 10.0, "sigma_data": 0.5, "clip_sample_range": 1.5 if clip else None}

        def step(out, t, x, gen, ref=ref):
            r = ref.step(out, t, x, generator=gen)
            return r.prev_sample, r.denoised

        cases.append({"block": block, "steps": steps, "inputs": _walk(ref, step, steps, seed=10 + k, scale=3.0 if clip else 1.0)})
    return cases


def _arr(row: dict, key: str) -> np.ndarray:
    return np.asarray(row[key], np.float32).reshape(SHAPE)


def _check_python(cases: list[dict], fresh) -> None:
    """Ours on diffusers' vectors: the timesteps set_timesteps gives, and every step's two outputs."""
    for case in cases:
        block = case["block"]
        own = fresh(block)
        own.set_timesteps(case["steps"])
        assert own.timesteps == block["timesteps"], block
        sched = scheduler_for(block)
        assert sched.timesteps == block["timesteps"]
        for row in case["inputs"]:
            res = sched.step(_arr(row, "model_output"), row["t"], _arr(row, "sample"), noise=_arr(row, "noise"))
            assert res.prev_sample.dtype == np.float32 and res.prev_sample.shape == SHAPE
            for got, key in ((res.prev_sample, "prev_sample"), (res.pred_original_sample, "pred_original_sample")):
                np.testing.assert_allclose(got.ravel(), row[key], rtol=1e-5, atol=2e-5, err_msg=f"{block['type']} {key} t={row['t']}")


def _check_js(cases: list[dict], vectors: Path, tmp_path: Path) -> None:
    """schedulers.js on the same file: its timesteps for `steps`, the manifest's, every step's outputs."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the Python side passed, the page's schedulers.js was not run")
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"tokenizer_json": str(ROOT / "pocketdiff/assets/shapes-teacher/tokenizer/tokenizer.json"),
                               "tokenizer": {"max_length": 77, "pad_id": 593, "bos_id": 592, "eos_id": 593}, "prompts": [],
                               "files": [], "npy": [], "npz": [], "scheduler_vectors": str(vectors)}))
    res = subprocess.run([node, str(HARNESS), str(ROOT / "web" / "static"), str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    got_cases = json.loads(res.stdout)["scheduler_cases"]
    assert len(got_cases) == len(cases)
    for case, got in zip(cases, got_cases):
        assert got["timesteps"] == case["block"]["timesteps"] == got["manifest_timesteps"], case["block"]
        for row, step in zip(case["inputs"], got["steps"], strict=True):
            np.testing.assert_allclose(step["prev"], row["prev_sample"], rtol=1e-5, atol=2e-5)
            np.testing.assert_allclose(step["x0"], row["pred_original_sample"], rtol=1e-5, atol=2e-5)


def _write(tmp_path: Path, name: str, cases: list[dict]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cases))
    return path


def test_ddim_matches_diffusers_in_numpy_and_in_the_page(tmp_path):
    cases = _ddim_vectors()
    vectors = _write(tmp_path, "ddim_vectors.json", cases)
    assert 811 in cases[1]["block"]["timesteps"] and 812 not in cases[1]["block"]["timesteps"]  # 812.5 rounds to 812, minus 1
    assert cases[0]["block"]["final_alpha_cumprod"] < 1.0 and cases[0]["block"]["timesteps"][-1] == 1
    clipped = cases[3]
    unclipped = scheduler_for({**clipped["block"], "clip_sample_range": None})
    row = clipped["inputs"][0]
    free = unclipped.step(_arr(row, "model_output"), row["t"], _arr(row, "sample"))
    assert np.abs(free.pred_original_sample.ravel() - row["pred_original_sample"]).max() > 1e-2  # the clip changed something
    _check_python(json.loads(vectors.read_text()), lambda b: DDIMScheduler(DDIMConfig(
        1000, np.asarray(b["alphas_cumprod"]), b["final_alpha_cumprod"], b["prediction_type"], b["timestep_spacing"], b["steps_offset"],
        b["clip_sample_range"])))
    _check_js(cases, vectors, tmp_path)


def test_lcm_matches_diffusers_in_numpy_and_in_the_page(tmp_path):
    cases = _lcm_vectors()
    vectors = _write(tmp_path, "lcm_vectors.json", cases)
    clipped = cases[2]
    unclipped = scheduler_for({**clipped["block"], "clip_sample_range": None})
    row = clipped["inputs"][0]
    free = unclipped.step(_arr(row, "model_output"), row["t"], _arr(row, "sample"), noise=_arr(row, "noise"))
    assert np.abs(free.pred_original_sample.ravel() - row["pred_original_sample"]).max() > 1e-2  # the clip changed something
    last = [c["inputs"][-1] for c in cases]
    assert all(r["prev_sample"] == r["pred_original_sample"] for r in last)  # after the last step: the denoised latents
    _check_python(json.loads(vectors.read_text()), lambda b: LCMScheduler(LCMConfig(
        1000, np.asarray(b["alphas_cumprod"]), b["original_inference_steps"], b["prediction_type"], b["timestep_scaling"],
        b["sigma_data"], b["clip_sample_range"])))
    _check_js(cases, vectors, tmp_path)


def test_lcm_loop_draws_its_noise_after_each_step_but_the_last():
    """sample_loop with the runner's generator: one standard-normal draw per re-noising, none for one step."""
    block = _lcm_vectors()[1]["block"]  # 3 steps
    seen, x = [], np.ones(SHAPE, np.float32)
    rng = np.random.default_rng(5)
    sample_loop(scheduler_for(block), x, lambda z, t: seen.append(t) or 0.1 * z, generator=rng)
    want = np.random.default_rng(5)
    for _ in range(2):
        want.standard_normal(SHAPE)
    assert seen == block["timesteps"] and rng.bit_generator.state == want.bit_generator.state
    one = scheduler_for({**block, "steps": 1, "timesteps": block["timesteps"][:1]})
    rng = np.random.default_rng(5)
    state = rng.bit_generator.state
    sample_loop(one, x, lambda z, t: 0.1 * z, generator=rng)
    assert rng.bit_generator.state == state
    with pytest.raises(PocketdiffError, match="re-noises: give a generator or the noise"):
        sample_loop(scheduler_for(block), x, lambda z, t: 0.1 * z)


def test_scheduler_misuse_is_one_line():
    block = _ddim_vectors()[0]["block"]
    with pytest.raises(PocketdiffError, match="call set_timesteps before step"):
        DDIMScheduler(DDIMConfig(1000, np.asarray(block["alphas_cumprod"]), 1.0)).step(np.zeros(SHAPE), 1, np.zeros(SHAPE))
    with pytest.raises(PocketdiffError, match="timestep 500 is not one of its timesteps"):
        scheduler_for(block).step(np.zeros(SHAPE, np.float32), 500, np.zeros(SHAPE, np.float32))
    with pytest.raises(PocketdiffError, match="scheduler type 'euler' is not supported"):
        scheduler_for({**block, "type": "euler"})
    with pytest.raises(PocketdiffError, match="strictly decreasing"):
        scheduler_for({**block, "timesteps": [1, 501]})
