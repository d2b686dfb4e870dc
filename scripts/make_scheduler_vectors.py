"""tests/data/scheduler_vectors.json: what diffusers' DDIMScheduler and LCMScheduler give, for the scheduler rules of
pocketdiff/scheduler_blocks.py, the torch samplers and web/static/schedulers.js (tests/runtime/test_scheduler_vectors.py
checks all three against it, and that this script still writes the same file).

    .venv/bin/python scripts/make_scheduler_vectors.py [--out tests/data/scheduler_vectors.json]

- ddim: timesteps for leading / trailing / linspace spacing, steps_offset 0 and 1, several step counts (1000 and 999
  train timesteps), and per strength (0.3 / 0.5 / 0.7 / 1.0) the img2img timesteps: set_timesteps(steps), then
  StableDiffusionImg2ImgPipeline.get_timesteps. null where diffusers gives a timestep outside [0, T) or none at all
  (pocketdiff refuses those).
- lcm: LCMScheduler.set_timesteps(steps, strength=s) (what LatentConsistencyModelImg2ImgPipeline calls) for several
  original_inference_steps; null where diffusers raises.
- add_noise: each scheduler's add_noise at a few timesteps; img2img walks: the start latents (add_noise at the first
  kept timestep) and every step after, DDIM and LCM, on SD's scaled-linear schedule.
No model, no network: a few seconds on CPU.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "scheduler_vectors.json"
BETAS = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}  # SD's
STRENGTHS = (0.3, 0.5, 0.7, 1.0)
DDIM_STEPS = (1, 2, 3, 4, 7, 10, 16, 20, 25, 48, 50, 61)
LCM_CASES = ((50, (1, 2, 4, 8, 16, 50)), (10, (1, 2, 3, 4, 10)), (8, (1, 3, 8)), (30, (4, 22)))  # (K, step counts)
SHAPE = (1, 4, 2, 2)


def _ddim(T: int, spacing: str, offset: int, **more):
    from diffusers import DDIMScheduler

    return DDIMScheduler(num_train_timesteps=T, **BETAS, clip_sample=False, set_alpha_to_one=False, steps_offset=offset,
                         timestep_spacing=spacing, **more)


def _lcm(K: int, **more):
    from diffusers import LCMScheduler

    return LCMScheduler(num_train_timesteps=1000, **BETAS, original_inference_steps=K, timestep_scaling=10.0, **more)


def _in_range(ts: list, T: int) -> bool:
    return bool(ts) and all(0 <= t < T for t in ts)


def _img2img(sched, steps: int, strength: float) -> list:
    """diffusers' StableDiffusionImg2ImgPipeline.get_timesteps on a scheduler already set to `steps`."""
    from diffusers import StableDiffusionImg2ImgPipeline

    holder = type("Holder", (), {"scheduler": sched})()
    ts, _ = StableDiffusionImg2ImgPipeline.get_timesteps(holder, steps, strength, "cpu")
    return ts.tolist()


def ddim_cases() -> list[dict]:
    cases = []
    for T, counts in ((1000, DDIM_STEPS), (999, (3, 7, 16, 48))):
        for spacing in ("leading", "trailing", "linspace"):
            for offset in (0, 1):
                for steps in counts:
                    sched = _ddim(T, spacing, offset)
                    sched.set_timesteps(steps)
                    full = sched.timesteps.tolist()
                    ok = _in_range(full, T) and len(full) == steps
                    img = {str(s): (kept if ok and _in_range(kept := _img2img(sched, steps, s), T) else None) for s in STRENGTHS}
                    cases.append({"num_train_timesteps": T, "timestep_spacing": spacing, "steps_offset": offset, "steps": steps,
                                  "timesteps": full if ok else None, "img2img": img})
    return cases


def lcm_cases() -> list[dict]:
    cases = []
    for K, counts in LCM_CASES:
        for steps in counts:
            img = {}
            for s in STRENGTHS:
                sched = _lcm(K)
                try:
                    sched.set_timesteps(steps, strength=s)
                    img[str(s)] = sched.timesteps.tolist()
                except ValueError:
                    img[str(s)] = None
            cases.append({"num_train_timesteps": 1000, "original_inference_steps": K, "steps": steps,
                          "timesteps": img["1.0"], "img2img": img})
    return cases


def _f32(seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _flat(x: torch.Tensor) -> list:
    return [float(v) for v in x.numpy().ravel()]


def add_noise_cases() -> list[dict]:
    cases = []
    for k, (kind, t) in enumerate([("ddim", 0), ("ddim", 501), ("ddim", 999), ("lcm", 19), ("lcm", 759)]):
        sched = _ddim(1000, "leading", 1) if kind == "ddim" else _lcm(50)
        x0, noise = _f32(100 + k), _f32(200 + k)
        noisy = sched.add_noise(x0, noise, torch.tensor([t]))
        cases.append({"type": kind, "t": t, "x0": _flat(x0), "noise": _flat(noise), "noisy": _flat(noisy)})
    return cases


def _ddim_walk(k: int, spacing: str, offset: int, steps: int, strength: float, ptype: str) -> dict:
    sched = _ddim(1000, spacing, offset, prediction_type=ptype)
    sched.set_timesteps(steps)
    block = {"type": "ddim", "prediction_type": ptype, "num_train_timesteps": 1000, "steps": steps,
             "timesteps": sched.timesteps.tolist(), "final_alpha_cumprod": float(sched.final_alpha_cumprod),
             "timestep_spacing": spacing, "steps_offset": offset, "eta": 0.0}
    kept = _img2img(sched, steps, strength)
    x0, noise = _f32(300 + k), _f32(400 + k)
    x = sched.add_noise(x0, noise, torch.tensor(kept[:1]))
    walk = {"block": block, "strength": strength, "timesteps": kept, "x0": _flat(x0), "noise": _flat(noise), "start": _flat(x), "steps": []}
    for i, t in enumerate(kept):
        out = _f32(500 + 10 * k + i)
        x = sched.step(out, t, x, eta=0.0).prev_sample
        walk["steps"].append({"t": t, "model_output": _flat(out), "noise": None, "prev_sample": _flat(x)})
    return walk


def _lcm_walk(k: int, K: int, steps: int, strength: float, ptype: str) -> dict:
    sched = _lcm(K, prediction_type=ptype)
    sched.set_timesteps(steps, strength=strength)
    full = _lcm(K)
    full.set_timesteps(steps)
    block = {"type": "lcm", "prediction_type": ptype, "num_train_timesteps": 1000, "steps": steps, "timesteps": full.timesteps.tolist(),
             "original_inference_steps": K, "timestep_scaling": 10.0, "sigma_data": 0.5, "clip_sample_range": None}
    kept = sched.timesteps.tolist()
    x0, noise = _f32(600 + k), _f32(700 + k)
    x = sched.add_noise(x0, noise, torch.tensor(kept[:1]))
    walk = {"block": block, "strength": strength, "timesteps": kept, "x0": _flat(x0), "noise": _flat(noise), "start": _flat(x), "steps": []}
    for i, t in enumerate(kept):
        out, seed = _f32(800 + 10 * k + i), 900 + 10 * k + i
        x = sched.step(out, t, x, generator=torch.Generator().manual_seed(seed)).prev_sample
        drawn = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)  # the step's own draw
        walk["steps"].append({"t": t, "model_output": _flat(out), "noise": _flat(drawn), "prev_sample": _flat(x)})
    return walk


def walks() -> list[dict]:
    return [_ddim_walk(0, "leading", 1, 10, 0.5, "epsilon"), _ddim_walk(1, "trailing", 0, 16, 0.7, "v_prediction"),
            _ddim_walk(2, "linspace", 0, 7, 0.3, "epsilon"), _lcm_walk(3, 50, 4, 0.5, "epsilon"), _lcm_walk(4, 10, 3, 0.7, "v_prediction")]


def make_vectors() -> dict:
    import diffusers

    torch.manual_seed(0)
    alphas = _ddim(1000, "leading", 1).alphas_cumprod.to(torch.float64)
    assert torch.equal(alphas, _lcm(50).alphas_cumprod.to(torch.float64))
    return {"about": "diffusers' DDIMScheduler / LCMScheduler timesteps, img2img timesteps, add_noise and img2img walks "
                     "(scripts/make_scheduler_vectors.py)",
            "diffusers": diffusers.__version__, "betas": BETAS, "shape": list(SHAPE), "strengths": list(STRENGTHS),
            "alphas_cumprod": [float(a) for a in alphas.numpy()],
            "ddim": ddim_cases(), "lcm": lcm_cases(), "add_noise": add_noise_cases(), "walks": walks()}


def dumps(vectors: dict) -> str:
    """One JSON line per case (reviewable diffs)."""
    parts = []
    for key, value in vectors.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            body = ",\n".join("  " + json.dumps(v) for v in value)
            parts.append(f"{json.dumps(key)}: [\n{body}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(make_vectors()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
