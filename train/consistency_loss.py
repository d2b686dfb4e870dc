"""The loss of the consistency stage: draw a batch's noise, grid point and w; teacher solver step; target network.

`pair_loss` is the arithmetic of one batch once its draws are made (benchmarks/distill_step.py's
`ours_lcm` times it as the trainer runs it)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from pocketdiff.conditioning import Conditioning, encode_conditioning, pixel_size

from .consistency_targets import SkippingPlan, TargetNetwork, consistency_function, pseudo_huber, solver_step
from .distill_config import Config
from .distill_data import _encode
from .distill_targets import GuidedTeacher, noisy_latents, student_forward
from .guidance_embedding import w_condition
from .loop import BatchRandom


def draw_w(cfg: Config, rng: BatchRandom) -> torch.Tensor:
    """w per sample: uniform in [w_min, w_max] for a w-conditioned student, else the fixed guidance.scale."""
    g, u = cfg.guidance, rng.rand()
    return g.w_min + (g.w_max - g.w_min) * u if g.conditioned else torch.full_like(u, g.scale)


@dataclasses.dataclass(frozen=True)
class PairSettings:
    """What `pair_loss` needs besides the batch's tensors."""

    prediction_type: str  # the student's (and the target network's)
    timestep_scaling: float  # consistency.timestep_scaling
    huber_c: float  # consistency.huber_c
    channels_last: bool = False  # speed.channels_last: the student's input layout
    student_embed: Optional[int] = None  # the w embedding's width (None: a folded-guidance student)
    clip_x0: Optional[float] = None  # the teacher scheduler's clip_sample_range, when it clips


def pair_loss(model, teacher: GuidedTeacher, target: TargetNetwork, s: PairSettings, z_hi, hi: tuple, lo: tuple, cond, unc, w):
    """pseudo-Huber(f_student(z_hi, t_hi, w), f_target(z_lo, t_lo, w)) of one batch, where z_lo is one
    guided DDIM step of the teacher from z_hi; `hi` and `lo` are (timesteps, alpha_bar) per sample."""
    (t_hi, a_hi), (t_lo, a_lo) = hi, lo
    z_lo = solver_step(teacher(z_hi, t_hi, cond, unc, w), z_hi, a_hi, a_lo, teacher.prediction_type, s.clip_x0)
    w_emb = w_condition(w, s.student_embed, device=z_hi.device) if s.student_embed is not None else None
    with torch.no_grad():
        f_target = consistency_function(target(z_lo, t_lo, cond, w_emb), z_lo, t_lo, a_lo, s.prediction_type, s.timestep_scaling)
    out = student_forward(model, z_hi, t_hi, cond, w, s.channels_last, s.student_embed)
    f_student = consistency_function(out, z_hi, t_hi, a_hi, s.prediction_type, s.timestep_scaling)
    return pseudo_huber(f_student, f_target, s.huber_c)


def make_consistency_loss_fn(cfg: Config, teacher: GuidedTeacher, target: TargetNetwork, plan: SkippingPlan, pipe, sched,
                             uncond: Conditioning, student_embed: Optional[int], device):
    """loss_fn(model, batch, rng) of the consistency stage; every random draw comes from `rng`.

    z_hi = noisy latents at a grid point t_hi; z_lo = one guided DDIM step of the teacher to t_lo;
    loss = pseudo-Huber(f_student(z_hi, t_hi, w), f_target(z_lo, t_lo, w)) (`pair_loss`).
    """
    c = cfg.consistency
    sf = pipe.vae.config.scaling_factor
    clip = float(sched.config.get("clip_sample_range", 1.0)) if sched.config.get("clip_sample", False) else None
    settings = PairSettings(sched.config.prediction_type, c.timestep_scaling, c.huber_c, cfg.speed.channels_last, student_embed, clip)
    t_hi, t_lo, a_hi, a_lo = (v.to(device) for v in (plan.t_hi, plan.t_lo, plan.a_hi, plan.a_lo))

    def loss_fn(model, batch, rng: BatchRandom):
        if "mean" in batch:
            mean, std = batch["mean"].to(device), batch["std"].to(device)
        else:
            mean, std = (v.to(device) for v in _encode(pipe.vae, batch["pixel_values"], device))
        x0 = (mean + std * rng.randn(*mean.shape[1:])) * sf
        eps = rng.randn(*mean.shape[1:])
        n = rng.randint(0, len(plan.t_hi))
        w = draw_w(cfg, rng)
        cond = encode_conditioning(pipe, batch["text"], device, resolution=pixel_size(mean, pipe.vae))
        unc = uncond.to(device).expand(cond.batch_size)
        z_hi = noisy_latents(x0, eps, a_hi[n])
        return pair_loss(model, teacher, target, settings, z_hi, (t_hi[n], a_hi[n]), (t_lo[n], a_lo[n]), cond, unc, w)

    return loss_fn
