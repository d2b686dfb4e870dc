"""Multi-step sampling of a consistency-distilled student (LCM), as diffusers' `LCMScheduler` does it.

A consistency model maps any point z_t of the teacher's probability-flow trajectory to its
end, ``f(z_t, t) = c_skip(t) z_t + c_out(t) x0_hat(z_t, t)``, with the boundary condition
f(z, 0) = z (c_skip(0) = 1, c_out(0) = 0). The scalings are LCM's discrete ones:

    s = t * timestep_scaling;  c_skip = sigma_data^2 / (s^2 + sigma_data^2);  c_out = s / sqrt(s^2 + sigma_data^2)

with sigma_data = 0.5 (fixed in diffusers' LCMScheduler, so a saved student folder samples the
same there). Sampling with N steps: f at the first timestep, then, before each later step,
re-noise the estimate to that timestep with fresh Gaussian noise (none after the last).

The timesteps are the LCMScheduler's: the student was trained on the skipping grid
t_n = (n + 1) k - 1 (k = T // original_inference_steps); N steps pick N evenly spaced points of
that grid, from its top down (`lcm_timesteps`). The training side lives in
`pocketdiff.train.consistency_targets`; it takes `boundary_scalings` from here. The sampler itself,
`pocketdiff.sampling.consistency_sample`, is beside the DDIM one (it shares its helpers).
"""
from __future__ import annotations

from typing import Union

import numpy as np
import torch

from . import scheduler_blocks
from .errors import PocketdiffError

SIGMA_DATA = 0.5  # diffusers' LCMScheduler hard-codes it


def is_consistency_scheduler(scheduler) -> bool:
    """True for diffusers' LCMScheduler (what a consistency student's folder holds)."""
    return type(scheduler).__name__ == "LCMScheduler"


def boundary_scalings(t: Union[int, torch.Tensor], timestep_scaling: float = 10.0,
                      sigma_data: float = SIGMA_DATA) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_skip, c_out) at integer timestep(s) `t` (float32 tensors of t's shape)."""
    s = torch.as_tensor(t).to(torch.float32) * float(timestep_scaling)
    c_skip = sigma_data ** 2 / (s ** 2 + sigma_data ** 2)
    c_out = s / (s ** 2 + sigma_data ** 2) ** 0.5
    return c_skip, c_out


def skipping_grid(num_train_timesteps: int, solver_steps: int) -> np.ndarray:
    """The ascending skipping-step grid t_n = (n + 1) k - 1, n = 0..solver_steps-1 (LCM's origin timesteps)."""
    T, N = int(num_train_timesteps), int(solver_steps)
    if not 1 <= N <= T:
        raise PocketdiffError(f"consistency solver steps must be in [1, {T}], got {N}")
    return np.arange(1, N + 1, dtype=np.int64) * (T // N) - 1


def lcm_timesteps(num_train_timesteps: int, solver_steps: int, steps: int) -> list[int]:
    """Descending timesteps of an N-step run: LCMScheduler.set_timesteps(steps, original_inference_steps=solver_steps)
    (pocketdiff/scheduler_blocks.py's rule, the one the bundle's manifest and runners use)."""
    return scheduler_blocks.lcm_timesteps(num_train_timesteps, solver_steps, steps)


def scheduler_lcm_timesteps(scheduler, steps: int, strength: float = 1.0) -> list[int]:
    """The scheduler's timesteps for `steps` (img2img: on the grid's first int(K x strength) points)."""
    c = scheduler.config
    return scheduler_blocks.lcm_timesteps(c.num_train_timesteps, c.get("original_inference_steps", 50), steps, strength)
