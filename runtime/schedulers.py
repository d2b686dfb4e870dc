"""The runtime's schedulers: DDIM and the consistency (LCM) step behind one interface (numpy only).

The interface is diffusers' (`DDIMScheduler`, `LCMScheduler`; our own code, the same arithmetic):

    scheduler.set_timesteps(steps)           # or set_timesteps(timesteps=[...]): the manifest's, as given
    for t in scheduler.timesteps:
        out = unet(x, t)                     # the (guided) model output
        x = scheduler.step(out, t, x, generator=rng).prev_sample

`step` returns a `StepOutput`: `prev_sample` (the latents for the next timestep; after the last one, what
the decoder gets) and `pred_original_sample` (DDIM: the clean-latent estimate x0; LCM: `denoised`, the
boundary-scaled estimate). A scheduler that re-noises between steps (LCM) draws its noise from `generator`
(numpy's `Generator`: one standard-normal draw of the sample's shape per step but the last, as run-bundle
draws it right after the initial latents) or takes it as `noise`; DDIM (eta 0) draws nothing.
`scheduler_for(manifest["scheduler"])` builds the bundle's scheduler with the manifest's timesteps (what
run-bundle and the page run; runtime/BUNDLE.md, "Order of calls"). web/static/schedulers.js is the page's
twin; tests/runtime/test_schedulers.py checks both against diffusers on the same vectors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError

from .lcm_step import LCM, lcm_step, lcm_timesteps, renoise
from .manifest_fields import spacing_timesteps

DDIM = "ddim"
SCHEDULER_TYPES = (DDIM, LCM)


@dataclass(frozen=True)
class StepOutput:
    prev_sample: np.ndarray  # float32: the latents at the next timestep (after the last: the final latents)
    pred_original_sample: np.ndarray  # float32: DDIM's x0 estimate; LCM's `denoised`


class Scheduler(Protocol):
    timesteps: list[int]

    def set_timesteps(self, num_inference_steps: Optional[int] = None, timesteps: Optional[Sequence[int]] = None) -> None: ...

    def step(self, model_output: np.ndarray, timestep: int, sample: np.ndarray,
             generator: Optional[np.random.Generator] = None, noise: Optional[np.ndarray] = None) -> StepOutput: ...


@dataclass(frozen=True)
class DDIMConfig:
    """A DDIM (eta 0) scheduler block: runtime/BUNDLE.md's `scheduler` fields."""

    num_train_timesteps: int
    alphas_cumprod: np.ndarray = field(repr=False)  # [T] float64
    final_alpha_cumprod: float
    prediction_type: str = "epsilon"  # epsilon | v_prediction
    timestep_spacing: str = "leading"  # leading | trailing | linspace
    steps_offset: int = 0


@dataclass(frozen=True)
class LCMConfig:
    """A consistency (LCM) scheduler block: runtime/BUNDLE.md's `scheduler` with `type: lcm`."""

    num_train_timesteps: int
    alphas_cumprod: np.ndarray = field(repr=False)  # [T] float64
    original_inference_steps: int  # K: the student's training grid
    prediction_type: str = "epsilon"  # epsilon | v_prediction | sample
    timestep_scaling: float = 10.0
    sigma_data: float = 0.5
    clip_sample_range: Optional[float] = None  # None: x0 not clipped


def _steps_or_timesteps(num_inference_steps: Optional[int], timesteps: Optional[Sequence[int]], what: str) -> None:
    if (num_inference_steps is None) == (timesteps is None):
        raise PocketdiffError(f"{what}.set_timesteps: give exactly one of num_inference_steps and timesteps")


def _given_timesteps(timesteps: Sequence[int], T: int, what: str) -> list[int]:
    ts = [int(t) for t in timesteps]
    if not ts or any(not 0 <= t < T for t in ts) or any(b >= a for a, b in zip(ts, ts[1:])):
        raise PocketdiffError(f"{what}: timesteps must be a non-empty strictly decreasing list in [0, {T}), got {ts}")
    return ts


class _Base:
    name = "scheduler"

    def __init__(self, config) -> None:
        self.config = config
        self.alphas = np.asarray(config.alphas_cumprod, dtype=np.float64)
        self.timesteps: list[int] = []
        self.num_inference_steps: Optional[int] = None

    def index_of(self, timestep: int) -> int:
        if self.num_inference_steps is None:
            raise PocketdiffError(f"{self.name}: call set_timesteps before step")
        try:
            return self.timesteps.index(int(timestep))
        except ValueError:
            raise PocketdiffError(f"{self.name}: timestep {timestep} is not one of its timesteps {self.timesteps}") from None


class DDIMScheduler(_Base):
    """DDIM with eta 0: x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, prev = t - T // steps."""

    name = DDIM

    def set_timesteps(self, num_inference_steps: Optional[int] = None, timesteps: Optional[Sequence[int]] = None) -> None:
        """Timesteps from the config's spacing for `num_inference_steps`, or the ones given (a manifest's)."""
        _steps_or_timesteps(num_inference_steps, timesteps, self.name)
        c, T = self.config, int(self.config.num_train_timesteps)
        if timesteps is None:
            if not 1 <= int(num_inference_steps) <= T:
                raise PocketdiffError(f"{self.name}: num_inference_steps must be in [1, {T}], got {num_inference_steps}")
            timesteps = spacing_timesteps(T, int(num_inference_steps), c.timestep_spacing, c.steps_offset)
        self.timesteps = _given_timesteps(timesteps, T, self.name)
        self.num_inference_steps = len(self.timesteps)

    def step(self, model_output: np.ndarray, timestep: int, sample: np.ndarray,
             generator: Optional[np.random.Generator] = None, noise: Optional[np.ndarray] = None) -> StepOutput:
        """One DDIM step at `timestep` (eta 0: no noise; `generator` and `noise` are not used)."""
        self.index_of(timestep)
        t = int(timestep)
        prev = t - int(self.config.num_train_timesteps) // self.num_inference_steps
        a_t = float(self.alphas[t])
        a_prev = float(self.alphas[prev]) if prev >= 0 else float(self.config.final_alpha_cumprod)
        x, out = sample, model_output
        if self.config.prediction_type == "epsilon":
            eps = out
            x0 = (x - np.sqrt(1.0 - a_t) * eps) / np.sqrt(a_t)
        elif self.config.prediction_type == "v_prediction":
            x0 = np.sqrt(a_t) * x - np.sqrt(1.0 - a_t) * out
            eps = np.sqrt(a_t) * out + np.sqrt(1.0 - a_t) * x
        else:
            raise PocketdiffError(f"bundle: prediction type {self.config.prediction_type!r} is not supported")
        prev_sample = (np.sqrt(a_prev) * x0 + np.sqrt(1.0 - a_prev) * eps).astype(np.float32)
        return StepOutput(prev_sample, np.asarray(x0, dtype=np.float32))


class LCMScheduler(_Base):
    """The consistency step: denoised = c_out x0 + c_skip x; before every step but the last, re-noised to
    the next timestep (runtime/lcm_step.py holds the arithmetic)."""

    name = LCM

    def set_timesteps(self, num_inference_steps: Optional[int] = None, timesteps: Optional[Sequence[int]] = None) -> None:
        """N evenly spaced points of the K-point training grid, from its top down, or the ones given."""
        _steps_or_timesteps(num_inference_steps, timesteps, self.name)
        c, T = self.config, int(self.config.num_train_timesteps)
        if timesteps is None:
            timesteps = lcm_timesteps(T, int(c.original_inference_steps), int(num_inference_steps))
        self.timesteps = _given_timesteps(timesteps, T, self.name)
        self.num_inference_steps = len(self.timesteps)

    def _block(self) -> dict:
        c = self.config
        return {"prediction_type": c.prediction_type, "clip_sample_range": c.clip_sample_range,
                "timestep_scaling": c.timestep_scaling, "sigma_data": c.sigma_data}

    def step(self, model_output: np.ndarray, timestep: int, sample: np.ndarray,
             generator: Optional[np.random.Generator] = None, noise: Optional[np.ndarray] = None) -> StepOutput:
        """One consistency step at `timestep`; the re-noising (every step but the last) uses `noise` when
        given, else draws `generator.standard_normal(sample.shape)`."""
        i = self.index_of(timestep)
        t = int(timestep)
        denoised = lcm_step(sample, model_output, t, float(self.alphas[t]), self._block())
        if i == len(self.timesteps) - 1:
            return StepOutput(denoised, denoised)
        if noise is None:
            if generator is None:
                raise PocketdiffError(f"{self.name}: step {i} at timestep {t} re-noises: give a generator or the noise")
            noise = generator.standard_normal(sample.shape).astype(np.float32)
        return StepOutput(renoise(denoised, float(self.alphas[self.timesteps[i + 1]]), noise), denoised)


def scheduler_for(block: dict) -> Scheduler:
    """The scheduler of a manifest's `scheduler` block, its timesteps the manifest's (checked beforehand by
    runtime/manifest_check.py; they are what `set_timesteps(steps)` gives for a bundle that passes it)."""
    kind = block.get("type", DDIM)
    alphas = np.asarray(block["alphas_cumprod"], dtype=np.float64)
    T = int(block["num_train_timesteps"])
    if kind == DDIM:
        sched: Scheduler = DDIMScheduler(DDIMConfig(
            T, alphas, float(block["final_alpha_cumprod"]), block["prediction_type"],
            block.get("timestep_spacing", "leading"), int(block.get("steps_offset", 0))))
    elif kind == LCM:
        sched = LCMScheduler(LCMConfig(
            T, alphas, int(block["original_inference_steps"]), block["prediction_type"], float(block["timestep_scaling"]),
            float(block["sigma_data"]), block.get("clip_sample_range")))
    else:
        raise PocketdiffError(f"bundle: scheduler type {kind!r} is not supported (the runtime runs {', '.join(SCHEDULER_TYPES)})")
    sched.set_timesteps(timesteps=block["timesteps"])
    if int(block.get("steps", len(sched.timesteps))) != len(sched.timesteps):
        raise PocketdiffError(f"bundle: scheduler.steps is {block['steps']} with {len(sched.timesteps)} timesteps")
    return sched


def sample_loop(scheduler: Scheduler, x: np.ndarray, model, generator: Optional[np.random.Generator] = None) -> np.ndarray:
    """Every timestep: `model(x, t)` -> the (guided) model output, then the scheduler's step. Returns the final latents."""
    for t in scheduler.timesteps:
        x = scheduler.step(model(x, t), t, x, generator=generator).prev_sample
    return x
