"""The consistency (LCM) step of a bundle whose manifest says `scheduler.type: "lcm"` (numpy only).

A consistency-distilled student maps a noisy latent at timestep t straight to an estimate of the
trajectory's end. One step, with `out` the UNet's (guided) output at x_t:

    x0       = the prediction type's estimate of the clean latent (epsilon, v_prediction or sample),
               clipped to +-clip_sample_range when the block has one
    s        = t * timestep_scaling
    c_skip   = sigma_data^2 / (s^2 + sigma_data^2),   c_out = s / sqrt(s^2 + sigma_data^2)
    denoised = c_out * x0 + c_skip * x_t

After every step but the last, the estimate is noised again to the next timestep t':
x_{t'} = sqrt(a_t') * denoised + sqrt(1 - a_t') * noise, with standard normal noise; the last step's
`denoised` is what the decoder gets (runtime/schedulers.py's LCMScheduler runs the loop). The timesteps are N evenly spaced points, from the top down, of
the grid the student was trained on, t_n = (n + 1) * (T // K) - 1 for n < K
(K = `original_inference_steps`): `lcm_timesteps`, the rule pocketdiff/consistency_sampling.py
follows (a test keeps the two equal).

`check_lcm_block` lists the problems of a manifest's lcm scheduler block beyond the fields every
scheduler has (prediction type, num_train_timesteps, steps, timesteps, alphas_cumprod).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

LCM = "lcm"


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_positive(v: Any) -> bool:
    return isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def lcm_timesteps(num_train_timesteps: int, solver_steps: int, steps: int) -> list[int]:
    """Descending timesteps of an N-step run on the K-point training grid (K = solver_steps, the manifest's
    original_inference_steps)."""
    T, K, N = int(num_train_timesteps), int(solver_steps), int(steps)
    if not 1 <= K <= T:
        raise PocketdiffError(f"original_inference_steps must be in [1, {T}], got {K}")
    if not 1 <= N <= K:
        raise PocketdiffError(f"a consistency student trained on a {K}-point grid samples with 1 to {K} steps, got {N}")
    grid = (np.arange(1, K + 1, dtype=np.int64) * (T // K) - 1)[::-1]
    idx = np.floor(np.linspace(0, K, num=N, endpoint=False)).astype(np.int64)
    return [int(t) for t in grid[idx]]


def boundary_scalings(t: int, timestep_scaling: float, sigma_data: float) -> tuple[float, float]:
    """(c_skip, c_out) at integer timestep t."""
    s = float(t) * float(timestep_scaling)
    d = s * s + float(sigma_data) ** 2
    return float(sigma_data) ** 2 / d, s / math.sqrt(d)


def predicted_x0(x: np.ndarray, out: np.ndarray, a_t: float, prediction_type: str) -> np.ndarray:
    """The clean-latent estimate from the model output at x_t (float64 arithmetic on float32 arrays)."""
    sa, sb = math.sqrt(a_t), math.sqrt(1.0 - a_t)
    if prediction_type == "epsilon":
        return (x - sb * out) / sa
    if prediction_type == "v_prediction":
        return sa * x - sb * out
    if prediction_type == "sample":
        return out
    raise PocketdiffError(f"bundle: prediction type {prediction_type!r} is not supported by the lcm step")


def lcm_step(x: np.ndarray, out: np.ndarray, t: int, a_t: float, sched: dict) -> np.ndarray:
    """The boundary-scaled estimate `denoised` of one consistency step at timestep t (float32)."""
    x0 = predicted_x0(x, out, a_t, sched["prediction_type"])
    clip = sched.get("clip_sample_range")
    if clip is not None:
        x0 = np.clip(x0, -float(clip), float(clip))
    c_skip, c_out = boundary_scalings(t, sched["timestep_scaling"], sched["sigma_data"])
    return (c_out * x0 + c_skip * x).astype(np.float32)


def renoise(denoised: np.ndarray, a_next: float, noise: np.ndarray) -> np.ndarray:
    """The estimate noised to the next timestep (alphas_cumprod a_next there)."""
    return (math.sqrt(a_next) * denoised + math.sqrt(1.0 - a_next) * noise).astype(np.float32)


def check_lcm_block(s: dict, T: Optional[int], steps: Optional[int], timesteps_ok: bool) -> list[tuple[str, str, str]]:
    """(field, check, message) problems of an lcm scheduler block: original_inference_steps, the
    timesteps on its grid, timestep_scaling, sigma_data, clip_sample_range (T, steps: None when invalid)."""
    problems = []
    K = s.get("original_inference_steps")
    if not _is_int(K) or K <= 0 or (T is not None and K > T):
        problems.append(("scheduler.original_inference_steps", "type",
                         f"must be an integer in [1, num_train_timesteps={T}] (the student's training grid), got {K!r}"))
    elif steps is not None and steps > K:
        problems.append(("scheduler.steps", "range", f"{steps} steps, but a student trained on a {K}-point grid samples with 1 to {K}"))
    elif timesteps_ok and T is not None and steps is not None:
        want, ts = lcm_timesteps(T, K, steps), list(s["timesteps"])
        if ts != want:
            i = next(i for i, (a, b) in enumerate(zip(ts, want)) if a != b)
            problems.append((f"scheduler.timesteps[{i}]", "spacing",
                             f"{ts[i]}, but {steps} lcm steps on the {K}-point grid over {T} give {want[i]} ({want[:8]}{' ...' if len(want) > 8 else ''})"))
    for key in ("timestep_scaling", "sigma_data"):
        if not _is_positive(s.get(key)):
            problems.append((f"scheduler.{key}", "value", f"must be a finite number > 0 (the boundary scalings), got {s.get(key)!r}"))
    clip = s.get("clip_sample_range")
    if clip is not None and not _is_positive(clip):
        problems.append(("scheduler.clip_sample_range", "value", f"must be null (no clipping) or a finite number > 0, got {clip!r}"))
    return problems
