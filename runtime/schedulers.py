"""The runtime's schedulers: DDIM and the consistency (LCM) step behind one interface (numpy only).

The interface is diffusers' (`DDIMScheduler`, `LCMScheduler`; our own code, the same arithmetic):

    scheduler.set_timesteps(steps)           # or set_timesteps(timesteps=[...]): the manifest's, as given;
                                             # strength=s (img2img): a partial schedule
    for t in scheduler.timesteps:
        out = unet(x, t)                     # the (guided) model output
        x = scheduler.step(out, t, x, generator=rng).prev_sample

`step` returns a `StepOutput`: `prev_sample` (the latents for the next timestep; after the last one, what
the decoder gets) and `pred_original_sample` (DDIM: the clean-latent estimate x0; LCM: `denoised`, the
boundary-scaled estimate). A scheduler that re-noises between steps (LCM) draws its noise from `generator`
(numpy's `Generator`: one standard-normal draw of the sample's shape per step but the last, as run-bundle
draws it right after the initial latents) or takes it as `noise`; DDIM (eta 0) draws nothing.
`scheduler_for(manifest["scheduler"])` builds the bundle's scheduler with the manifest's timesteps (what
run-bundle and the page run; runtime/BUNDLE.md, "Order of calls").

img2img, as diffusers' img2img pipelines: `scheduler_for(block, strength=s)` (or `set_timesteps(steps, strength=s)`)
keeps a partial schedule, and the start latents are `add_noise(x0, noise, scheduler.timesteps[0])`. The timestep
rules, img2img's included, and the block's writer and checks live in pocketdiff/scheduler_blocks.py.
web/static/schedulers.js is the page's twin; tests/runtime/test_schedulers.py and test_scheduler_vectors.py check
both against diffusers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError
from pocketdiff.scheduler_blocks import DDIM, LCM, SCHEDULER_TYPES, add_noise, strength_timesteps, timesteps_for

from .lcm_step import lcm_step, renoise


@dataclass(frozen=True)
class StepOutput:
    prev_sample: np.ndarray  # float32: the latents at the next timestep (after the last: the final latents)
    pred_original_sample: np.ndarray  # float32: DDIM's x0 estimate; LCM's `denoised`


class Scheduler(Protocol):
    timesteps: list[int]

    def set_timesteps(self, num_inference_steps: Optional[int] = None, timesteps: Optional[Sequence[int]] = None,
                      strength: float = 1.0) -> None: ...

    def add_noise(self, original_samples: np.ndarray, noise: np.ndarray, timestep: int) -> np.ndarray: ...

    def step(self, model_output: np.ndarray, timestep: int, sample: np.ndarray,
             generator: Optional[np.random.Generator] = None, noise: Optional[np.ndarray] = None) -> StepOutput: ...


@dataclass(frozen=True)
class DDIMConfig:
    """A DDIM (eta 0) scheduler block: runtime/BUNDLE.md's `scheduler` fields."""

    num_train_timesteps: int
    alphas_cumprod: np.ndarray = field(repr=False)  # [T] float64
    final_alpha_cumprod: float
    prediction_type: str = "epsilon"  # epsilon | v_prediction
    timestep_spacing: Optional[str] = None  # leading | trailing | linspace: set_timesteps(steps) needs it (no default)
    steps_offset: Optional[int] = None  # likewise (diffusers' config default 0, SD checkpoints 1)
    clip_sample_range: Optional[float] = None  # None: x0 not clipped (diffusers' clip_sample off)


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

    def _rule(self) -> dict:
        """The config as the fields of a manifest block (pocketdiff.scheduler_blocks.timesteps_for reads them)."""
        raise NotImplementedError

    def set_timesteps(self, num_inference_steps: Optional[int] = None, timesteps: Optional[Sequence[int]] = None,
                      strength: float = 1.0) -> None:
        """The timesteps of a `num_inference_steps` run under the config's rule, or the ones given (a manifest's);
        with `strength` < 1 (img2img) the partial schedule diffusers' img2img pipelines run: given timesteps and
        DDIM's keep their last int(n * strength), LCM's come from the first int(K * strength) grid points.
        `num_inference_steps` stays the full count (DDIM's stride T // steps, as diffusers keeps it)."""
        _steps_or_timesteps(num_inference_steps, timesteps, self.name)
        T = int(self.config.num_train_timesteps)
        if timesteps is None:
            if not 1 <= int(num_inference_steps) <= T:
                raise PocketdiffError(f"{self.name}: num_inference_steps must be in [1, {T}], got {num_inference_steps}")
            n, kept = int(num_inference_steps), timesteps_for(self._rule(), int(num_inference_steps), strength)
        else:
            n = len(_given_timesteps(timesteps, T, self.name))
            kept = strength_timesteps(timesteps, strength)
        self.timesteps = _given_timesteps(kept, T, self.name)
        self.num_inference_steps = n

    def add_noise(self, original_samples: np.ndarray, noise: np.ndarray, timestep: int) -> np.ndarray:
        """The clean latents noised to `timestep`: sqrt(a_t) x0 + sqrt(1 - a_t) noise (img2img's start, float32)."""
        t = int(timestep)
        if not 0 <= t < len(self.alphas):
            raise PocketdiffError(f"{self.name}: add_noise at timestep {t}, outside [0, {len(self.alphas)})")
        return add_noise(original_samples, noise, float(self.alphas[t]))

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

    def _rule(self) -> dict:
        c = self.config
        fields = {"timestep_spacing": c.timestep_spacing, "steps_offset": c.steps_offset}
        return {"type": DDIM, "num_train_timesteps": c.num_train_timesteps, **{k: v for k, v in fields.items() if v is not None}}

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
        if self.config.clip_sample_range is not None:  # diffusers' clip_sample: x0 clipped, eps kept as predicted
            x0 = np.clip(x0, -self.config.clip_sample_range, self.config.clip_sample_range)
        prev_sample = (np.sqrt(a_prev) * x0 + np.sqrt(1.0 - a_prev) * eps).astype(np.float32)
        return StepOutput(prev_sample, np.asarray(x0, dtype=np.float32))


class LCMScheduler(_Base):
    """The consistency step: denoised = c_out x0 + c_skip x; before every step but the last, re-noised to
    the next timestep (runtime/lcm_step.py holds the arithmetic)."""

    name = LCM

    def _rule(self) -> dict:
        c = self.config
        return {"type": LCM, "num_train_timesteps": c.num_train_timesteps, "original_inference_steps": c.original_inference_steps}

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


def scheduler_for(block: dict, strength: float = 1.0) -> Scheduler:
    """The scheduler of a manifest's `scheduler` block, its timesteps the manifest's (checked beforehand by
    runtime/manifest_check.py; they are what `set_timesteps(steps)` gives for a bundle that passes it); with
    `strength` < 1 (img2img) `set_timesteps(steps, strength=strength)`'s partial schedule instead."""
    kind = block.get("type", DDIM)
    alphas = np.asarray(block["alphas_cumprod"], dtype=np.float64)
    T = int(block["num_train_timesteps"])
    if kind == DDIM:
        sched: Scheduler = DDIMScheduler(DDIMConfig(
            T, alphas, float(block["final_alpha_cumprod"]), block["prediction_type"],
            block.get("timestep_spacing"), block.get("steps_offset"), block.get("clip_sample_range")))
    elif kind == LCM:
        sched = LCMScheduler(LCMConfig(
            T, alphas, int(block["original_inference_steps"]), block["prediction_type"], float(block["timestep_scaling"]),
            float(block["sigma_data"]), block.get("clip_sample_range")))
    else:
        raise PocketdiffError(f"bundle: scheduler type {kind!r} is not supported (the runtime runs {', '.join(SCHEDULER_TYPES)})")
    sched.set_timesteps(timesteps=block["timesteps"])
    if int(block.get("steps", len(sched.timesteps))) != len(sched.timesteps):
        raise PocketdiffError(f"bundle: scheduler.steps is {block['steps']} with {len(sched.timesteps)} timesteps")
    if strength != 1.0:
        sched.set_timesteps(len(sched.timesteps), strength=strength)
    return sched


def sample_loop(scheduler: Scheduler, x: np.ndarray, model, generator: Optional[np.random.Generator] = None,
                after_step=None) -> np.ndarray:
    """Every timestep: `model(x, t)` -> the (guided) model output, then the scheduler's step; `after_step(i, x)` (when
    given) maps step i's latents before the next (inpainting's blend, runtime/image_tasks.py). Returns the final latents."""
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(model(x, t), t, x, generator=generator).prev_sample
        if after_step is not None:
            x = after_step(i, x)
    return x
