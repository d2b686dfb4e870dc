"""The manifest's scheduler block of a consistency-distilled (LCM) student, `type: "lcm"`.

What the bundle's consistency step (runtime/lcm_step.py) needs from the student's LCMScheduler:
the timesteps of the exported step count on the student's training grid (the grid
pocketdiff/consistency_sampling.py samples on), the noise schedule, the prediction type and the
boundary scalings' timestep_scaling and sigma_data. Schedulers the step does not implement
(dynamic thresholding) are refused by name.
"""
from __future__ import annotations

import numpy as np

from pocketdiff.consistency_sampling import SIGMA_DATA, scheduler_lcm_timesteps
from pocketdiff.errors import PocketdiffError


def lcm_schedule_timesteps(sched, steps: int) -> list[int]:
    """The descending timesteps of a `steps`-step run, as pocketdiff.sampling.consistency_sample takes them."""
    c = sched.config
    if c.get("thresholding", False):
        raise PocketdiffError("model.pretrained: the consistency student's scheduler uses dynamic thresholding, which the "
                              "bundle's lcm step does not implement")
    grid = int(c.get("original_inference_steps", 50))
    if not 1 <= int(steps) <= grid:
        raise PocketdiffError(f"steps: a consistency student trained on a {grid}-point grid (original_inference_steps) "
                              f"samples with 1 to {grid} steps, got {steps}")
    return scheduler_lcm_timesteps(sched, int(steps))


def lcm_scheduler_block(sched, steps: int, timesteps: list, alphas: np.ndarray) -> dict:
    """manifest.json's `scheduler` for a student whose folder holds diffusers' LCMScheduler."""
    c = sched.config
    return {
        "type": "lcm",
        "prediction_type": str(c.prediction_type),
        "num_train_timesteps": int(c.num_train_timesteps),
        "steps": int(steps),
        "timesteps": [int(t) for t in timesteps],
        "alphas_cumprod": [float(a) for a in alphas],
        "original_inference_steps": int(c.get("original_inference_steps", 50)),
        "timestep_scaling": float(c.get("timestep_scaling", 10.0)),
        "sigma_data": float(SIGMA_DATA),  # fixed in LCMScheduler and in pocketdiff's consistency sampler
        "clip_sample_range": float(c.get("clip_sample_range", 1.0)) if c.get("clip_sample", False) else None,
    }
