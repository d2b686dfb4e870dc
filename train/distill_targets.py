"""Targets and losses of guided and progressive distillation (the math of `pocketdiff distill`).

Notation: alpha_bar = diffusers' alphas_cumprod; alpha = sqrt(alpha_bar), sigma =
sqrt(1 - alpha_bar); z_t = alpha_t x + sigma_t eps.

Stage A (guided distillation, Meng et al. 2023): the student, conditioned on w, learns the
teacher's classifier-free-guided prediction ``u + w (c - u)`` at any timestep, compared in x
space (so the student may use another parameterisation than the teacher, e.g. v).

Stage B (progressive distillation, Salimans & Ho 2022): a student of N steps takes, from
each of its DDIM timesteps t, the jump that a stock `DDIMScheduler` with N steps takes
(t -> alpha_bar[t - T // N], or the final alpha). The teacher covers the same jump in two
DDIM steps through a midpoint (a point of the teacher's own 2N-step grid when one lies
inside). The student's x target is the x for which one DDIM step from z_t lands on the
teacher's z_prev:

    x~ = (z_prev - (sigma_prev / sigma_t) z_t) / (alpha_prev - (sigma_prev / sigma_t) alpha_t)

and the loss is ``max(SNR_t, 1) * |x_hat - x~|^2`` ("truncated SNR" weighting), or
``(SNR_t + 1) * |x_hat - x~|^2`` (= MSE in v space). All DDIM arithmetic comes from
`pocketdiff.sampling` (ddim_step, predict_x0_eps, step_alphas) and runs in float32.

`GuidedTeacher` is the frozen teacher with its speed switches (half-precision weights, no
autograd, one fused cond/uncond batch, channels_last, torch.compile / CUDA graphs).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Union

import torch

from pocketdiff.conditioning import Conditioning, as_conditioning
from pocketdiff.errors import PocketdiffError
from pocketdiff.sampling import ddim_step, predict_x0_eps, scheduler_timesteps, step_alphas

from .guidance_embedding import is_w_conditioned, w_condition

WEIGHTINGS = ("truncated_snr", "snr_plus_one")


# --------------------------------------------------------------------------------------
# Round plans: which transitions a student learns and where the teacher's midpoint lies
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class RoundPlan:
    """The N transitions of an N-step student and the teacher's two-step path for each."""

    steps: int
    t: torch.Tensor  # [N] long: the student's timesteps (descending, as DDIMScheduler)
    t_mid: torch.Tensor  # [N] long: the teacher's intermediate timestep
    a_t: torch.Tensor  # [N] float32 alpha_bar(t)
    a_mid: torch.Tensor  # [N] float32 alpha_bar(t_mid)
    a_prev: torch.Tensor  # [N] float32 alpha_bar after the student's step (final alpha at the end)

    def rows(self) -> list[tuple[int, int, float, float, float]]:
        return [(int(a), int(b), float(c), float(d), float(e)) for a, b, c, d, e in
                zip(self.t, self.t_mid, self.a_t, self.a_mid, self.a_prev)]


def round_plan(scheduler, steps: int, teacher_steps: Optional[int] = None) -> RoundPlan:
    """Transitions of a `steps`-step DDIM student under `scheduler` (exactly DDIMScheduler.step's),
    each with the teacher's midpoint: the point of the teacher's `teacher_steps` grid nearest the
    middle that lies strictly inside the jump, else the integer middle, else (a jump of one
    timestep) t itself, which makes the first teacher step the identity.
    """
    T = int(scheduler.config.num_train_timesteps)
    alphas = scheduler.alphas_cumprod.to(torch.float32)
    grid = scheduler_timesteps(scheduler, teacher_steps).tolist() if teacher_steps else []
    ts, mids, a_ts, a_mids, a_prevs = [], [], [], [], []
    for t, a_t, a_prev in step_alphas(scheduler, steps):
        lo = max(t - T // steps, 0)
        inside = [g for g in grid if lo < g < t]
        middle = (t + lo) / 2
        if inside:
            mid = min(inside, key=lambda g: (abs(g - middle), -g))
        elif t - lo >= 2:
            mid = int(round(middle))
        else:
            mid = t
        ts.append(t)
        mids.append(mid)
        a_ts.append(float(a_t))
        a_mids.append(float(alphas[mid]))
        a_prevs.append(float(a_prev))
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return RoundPlan(steps, torch.tensor(ts, dtype=torch.long), torch.tensor(mids, dtype=torch.long), f(a_ts), f(a_mids), f(a_prevs))


# --------------------------------------------------------------------------------------
# The frozen teacher
# --------------------------------------------------------------------------------------

def _quiet_cast(module, dtype: torch.dtype) -> None:
    """module.to(dtype) without diffusers' "modules that should be kept in float32: []" notice."""
    from diffusers.utils import logging as dlog

    before = dlog.get_verbosity()
    dlog.set_verbosity_error()
    try:
        module.to(dtype=dtype)
    finally:
        dlog.set_verbosity(before)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GuidedTeacher:
    """A frozen UNet that returns its (classifier-free-guided) output in float32.

    - w-conditioned UNet (a guided student): one pass with ``timestep_cond = w_condition(w)``.
    - plain UNet: ``u + w (c - u)``; with `fused_cfg` one batch ``cat([uncond, cond])``, else
      two calls. Rows with w == 1 still get both passes (the batch is fused).
    The teacher is never handed to accelerate's `prepare`; its weights are cast to `dtype`
    (no autocast weight copies per call; half-precision teachers run outside autocast, as a
    diffusers pipeline in bf16 does), it runs under `torch.no_grad`, optionally channels_last
    and compiled (`compile_mode`, e.g. "max-autotune-no-cudagraphs"; modes with CUDA graphs
    clone outputs before the next replay).
    """

    def __init__(self, unet, prediction_type: str, *, dtype: torch.dtype = torch.float32, fused_cfg: bool = True,
                 channels_last: bool = False, compile_mode: Optional[str] = None, device=None):
        self.unet = unet.requires_grad_(False).eval()
        if device is not None:
            self.unet.to(device=device)
        if dtype != next(self.unet.parameters()).dtype:
            _quiet_cast(self.unet, dtype)
        self.dtype = dtype
        self.prediction_type = prediction_type
        self.fused_cfg = fused_cfg
        self.channels_last = channels_last
        self.w_conditioned = is_w_conditioned(unet)
        self.cudagraphs = bool(compile_mode) and compile_mode in ("reduce-overhead", "max-autotune")
        if channels_last:
            self.unet.to(memory_format=torch.channels_last)
        self._forward = self.unet
        if compile_mode:
            self._forward = torch.compile(self.unet, mode=None if compile_mode == "default" else compile_mode)

    @property
    def config(self):
        return self.unet.config

    def _call(self, z, t, emb: Conditioning, cond_w=None) -> torch.Tensor:
        if self.channels_last:
            z = z.contiguous(memory_format=torch.channels_last)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        kwargs = {} if cond_w is None else {"timestep_cond": cond_w}
        # half-precision weights run as they are (as diffusers pipelines do): no autocast round trips
        # through fp32 for the norms between layers
        with torch.autocast(z.device.type, enabled=False) if self.dtype != torch.float32 else contextlib.nullcontext():
            out = self._forward(z, t, **emb.unet_kwargs(), return_dict=False, **kwargs)[0]
        return out.to(torch.float32, copy=True) if self.cudagraphs else out.to(torch.float32)

    @torch.no_grad()
    def __call__(self, z: torch.Tensor, t: torch.Tensor, cond: Union[Conditioning, torch.Tensor],
                 uncond: Union[Conditioning, torch.Tensor, None], w: torch.Tensor) -> torch.Tensor:
        """The (guided) output at (z, t); `cond` / `uncond` are `Conditioning`s (a tensor: prompt embeddings only)."""
        z = z.to(self.dtype)
        cond = as_conditioning(cond).to(dtype=self.dtype)
        w = w.to(device=z.device, dtype=torch.float32)
        if self.w_conditioned:
            return self._call(z, t, cond, w_condition(w, self.unet, dtype=self.dtype, device=z.device))
        if uncond is None:
            return self._call(z, t, cond)
        uncond = as_conditioning(uncond).to(dtype=self.dtype).expand(cond.batch_size, "uncond")
        if self.fused_cfg:
            out_u, out_c = self._call(torch.cat([z, z]), torch.cat([t, t]), Conditioning.cat([uncond, cond])).chunk(2)
        else:
            out_u, out_c = self._call(z, t, uncond), self._call(z, t, cond)
        wb = w.view(-1, *([1] * (out_c.dim() - 1)))
        return out_u + wb * (out_c - out_u)


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------

def _col(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.dim() - 1)))


def noisy_latents(x0: torch.Tensor, eps: torch.Tensor, a_t: torch.Tensor) -> torch.Tensor:
    """z_t = sqrt(a) x0 + sqrt(1 - a) eps (float32; a per sample)."""
    a = _col(a_t, x0)
    return a.sqrt() * x0.float() + (1 - a).sqrt() * eps.float()


def x_from_two_steps(z_t: torch.Tensor, z_prev: torch.Tensor, a_t: torch.Tensor, a_prev: torch.Tensor) -> torch.Tensor:
    """The x whose single DDIM step from z_t (alpha_bar a_t) lands on z_prev (alpha_bar a_prev)."""
    at, ap = _col(a_t, z_t), _col(a_prev, z_t)
    ratio = ((1 - ap) / (1 - at)).sqrt()
    return (z_prev.float() - ratio * z_t.float()) / (ap.sqrt() - ratio * at.sqrt())


def guided_x_target(teacher: GuidedTeacher, z_t, t, a_t, cond, uncond, w) -> torch.Tensor:
    """Stage A target: the x0 implied by the teacher's guided prediction at (z_t, t)."""
    out = teacher(z_t, t, cond, uncond, w)
    x0, _ = predict_x0_eps(out, z_t.float(), _col(a_t, z_t).view(-1), teacher.prediction_type)
    return x0


def two_step_x_target(teacher: GuidedTeacher, z_t, t, t_mid, a_t, a_mid, a_prev, cond, uncond, w,
                      clip_x0: Optional[float] = None) -> torch.Tensor:
    """Stage B target: two teacher DDIM steps t -> t_mid -> prev, then `x_from_two_steps`."""
    z_t = z_t.float()
    a_t, a_mid, a_prev = (_col(a, z_t).view(-1) for a in (a_t, a_mid, a_prev))
    out1 = teacher(z_t, t, cond, uncond, w)
    z_mid = ddim_step(z_t, out1, a_t, a_mid, teacher.prediction_type, clip_x0)
    out2 = teacher(z_mid, t_mid, cond, uncond, w)
    z_prev = ddim_step(z_mid, out2, a_mid, a_prev, teacher.prediction_type, clip_x0)
    return x_from_two_steps(z_t, z_prev, a_t, a_prev)


# --------------------------------------------------------------------------------------
# Student and loss
# --------------------------------------------------------------------------------------

def set_student_layout(student, channels_last: bool, compiled: bool):
    """channels_last parameters for an eager student only. A compiled student keeps the default
    layout (inductor picks conv layouts itself), which also lets it use fused AdamW
    (`train.loop.use_fused_adamw`). SD-2.1 size on one H200 (benchmarks/distill_step.py): 64.3
    samples/s so, 60.2 in an earlier run with channels_last parameters and foreach AdamW
    (benchmarks/results/distill_step_sd21_{fused_h200,h200}.json)."""
    if channels_last and not compiled:
        student.to(memory_format=torch.channels_last)
    return student


def student_forward(student, z_t, t, cond, w=None, channels_last: bool = False, embed_dim: Optional[int] = None) -> torch.Tensor:
    """The student's raw output (its own parameterisation); `student` may be DDP-wrapped; `cond` a
    `Conditioning` (a tensor: prompt embeddings only)."""
    kwargs = {}
    if embed_dim is not None:
        kwargs["timestep_cond"] = w_condition(w, embed_dim, device=z_t.device)
    if channels_last:
        z_t = z_t.contiguous(memory_format=torch.channels_last)
    return student(z_t, t, **as_conditioning(cond).unet_kwargs(), return_dict=False, **kwargs)[0]


def loss_weight(a_t: torch.Tensor, weighting: str) -> torch.Tensor:
    snr = a_t / (1 - a_t)
    if weighting == "truncated_snr":
        return snr.clamp(min=1.0)
    if weighting == "snr_plus_one":
        return snr + 1.0
    raise PocketdiffError(f"loss weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def x_space_loss(student_out, z_t, a_t, x_target, prediction_type: str, weighting: str = "truncated_snr") -> torch.Tensor:
    """Weighted MSE between the student's x prediction and the target x (mean over the batch)."""
    a = a_t.to(device=z_t.device, dtype=torch.float32).view(-1)
    x_hat, _ = predict_x0_eps(student_out.float(), z_t.float(), a, prediction_type)
    per_sample = (x_hat - x_target.float()).pow(2).flatten(1).mean(1)
    return (loss_weight(a, weighting) * per_sample).mean()
