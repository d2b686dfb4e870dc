"""The `consistency:` section of a distill recipe (`method: consistency`, see `consistency_targets`)."""
from __future__ import annotations

import dataclasses
import math

from pocketdiff.errors import require

from .loop import LoopConfig


@dataclasses.dataclass
class ConsistencyConfig:
    """Latent consistency distillation with w as an input: one stage, teacher -> a student of 1..N steps."""

    # N of the skipping-step grid t_n = (n + 1) k - 1, k = T // N: the teacher's DDIM solver jumps k
    # timesteps per pair, and the student samples with 1..N of those points (LCMScheduler's
    # original_inference_steps)
    solver_steps: int = 50
    sample_steps: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8])  # grids and metrics; the last is the folder's default
    target_ema_decay: float = 0.95  # the target network: theta^- <- mu theta^- + (1 - mu) theta after every step
    huber_c: float = 0.001  # pseudo-Huber loss constant (in latent units)
    timestep_scaling: float = 10.0  # c_skip / c_out of t * scaling (LCMScheduler's timestep_scaling)
    train: LoopConfig = dataclasses.field(default_factory=lambda: LoopConfig(max_steps=4000, lr=1e-5, checkpoint_every=500))

    def __post_init__(self) -> None:
        require(self.solver_steps >= 1, "consistency.solver_steps", f"must be >= 1, got {self.solver_steps}")
        require(len(self.sample_steps) > 0, "consistency.sample_steps", "must not be empty")
        for n in self.sample_steps:
            require(isinstance(n, int) and 1 <= n <= self.solver_steps, "consistency.sample_steps",
                    f"{n} cannot be reached: a consistency student samples with 1 to consistency.solver_steps={self.solver_steps} steps")
        require(list(self.sample_steps) == sorted(set(self.sample_steps)), "consistency.sample_steps",
                f"must be distinct and ascending, got {self.sample_steps}")
        require(0.0 <= self.target_ema_decay < 1.0, "consistency.target_ema_decay", f"must be in [0, 1), got {self.target_ema_decay}")
        require(math.isfinite(self.huber_c) and self.huber_c > 0, "consistency.huber_c", f"must be a finite number > 0, got {self.huber_c}")
        require(math.isfinite(self.timestep_scaling) and self.timestep_scaling > 0, "consistency.timestep_scaling",
                f"must be a finite number > 0, got {self.timestep_scaling}")
