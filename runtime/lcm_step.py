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
`denoised` is what the decoder gets (runtime/schedulers.py's LCMScheduler runs the loop). The timesteps are N evenly
spaced points, from the top down, of the grid the student was trained on, t_n = (n + 1) * (T // K) - 1 for n < K
(K = `original_inference_steps`): pocketdiff/scheduler_blocks.py's `lcm_timesteps`, which lives with the block's
writer and reader (`lcm_field_problems`: the problems of a manifest's lcm block beyond the fields every scheduler
has); the torch sampler takes it from there too.
"""
from __future__ import annotations

import math

import numpy as np

from pocketdiff.errors import PocketdiffError


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
