"""The manifest's scheduler block of a consistency-distilled (LCM) student, `type: "lcm"`.

What the bundle's consistency step (runtime/lcm_step.py) needs from the student's LCMScheduler: the
timesteps of the exported step count on the student's training grid, the noise schedule, the prediction
type and the boundary scalings' timestep_scaling and sigma_data. pocketdiff/scheduler_blocks.py writes it
(`block_for`), as it writes DDIM's and as the runners read both; schedulers the step does not implement
(dynamic thresholding) are refused there by name.
"""
from __future__ import annotations

import numpy as np

from pocketdiff.errors import PocketdiffError
from pocketdiff.scheduler_blocks import LCM, block_for, config_timesteps


def lcm_schedule_timesteps(sched, steps: int) -> list[int]:
    """The descending timesteps of a `steps`-step run, as pocketdiff.sampling.consistency_sample takes them
    (a step count off the student's grid is refused naming `steps`)."""
    return config_timesteps(LCM, sched.config, int(steps))


def lcm_scheduler_block(sched, steps: int, timesteps: list, alphas: np.ndarray) -> dict:
    """manifest.json's `scheduler` for a student whose folder holds diffusers' LCMScheduler (its timesteps
    the golden inputs' `timesteps`)."""
    block = block_for(LCM, sched.config, int(steps), alphas)
    if block["timesteps"] != [int(t) for t in timesteps]:
        raise PocketdiffError(f"export: the lcm block's timesteps {block['timesteps']} are not the golden run's {list(timesteps)}")
    return block
