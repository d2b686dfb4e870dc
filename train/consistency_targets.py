"""The math of consistency distillation with guidance as input (`distill.method: consistency`).

Latent consistency distillation (Luo et al. 2023, after Song et al. 2023's consistency
distillation), written for this project:

- the skipping-step grid: t_n = (n + 1) k - 1 with k = T // N (N = `consistency.solver_steps`);
  a training pair is (t_{n+k} -> t_n) = (t, t - k), the lower end clamped at 0;
- the teacher's solver: one DDIM step from z_t to t - k with classifier-free guidance at a
  sampled w, ``u + w (c - u)`` (the teacher's own parameterisation), i.e. `pocketdiff.sampling.ddim_step`;
- the consistency function f(z, t) = c_skip(t) z + c_out(t) x0_hat(z, t) of the student
  (`pocketdiff.consistency_sampling.boundary_scalings`: f(z, 0) = z);
- the target: the same function of the target network (an EMA of the student, `TargetNetwork`;
  with decay 0 the student itself) at the teacher's solver output, no gradient;
- the loss: pseudo-Huber, ``mean(sqrt((f - f_target)^2 + c^2) - c)``.

The student is w-conditioned through the project's guidance embedding
(`pocketdiff.train.guidance_embedding`: ``timestep_cond``), so a stock pipeline passes w itself.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch

from pocketdiff.conditioning import as_conditioning
from pocketdiff.consistency_sampling import boundary_scalings, skipping_grid
from pocketdiff.sampling import ddim_step, predict_x0_eps

from .checkpoints import load_exactly, model_state
from .distill_lora import is_lora_unet


@dataclasses.dataclass
class SkippingPlan:
    """The N training pairs (t_hi -> t_lo) of the skipping-step solver and their alpha_bar."""

    t_hi: torch.Tensor  # [N] long: the grid, ascending
    t_lo: torch.Tensor  # [N] long: t_hi - k, clamped at 0
    a_hi: torch.Tensor  # [N] float32
    a_lo: torch.Tensor  # [N] float32


def skipping_plan(scheduler, solver_steps: int) -> SkippingPlan:
    T = int(scheduler.config.num_train_timesteps)
    hi = torch.from_numpy(skipping_grid(T, solver_steps))
    lo = (hi - T // solver_steps).clamp(min=0)
    alphas = scheduler.alphas_cumprod.to(torch.float32)
    return SkippingPlan(hi, lo, alphas[hi], alphas[lo])


def consistency_function(model_out: torch.Tensor, z: torch.Tensor, t: torch.Tensor, a_t: torch.Tensor, prediction_type: str,
                         timestep_scaling: float) -> torch.Tensor:
    """f(z, t) = c_skip(t) z + c_out(t) x0_hat (float32; t and a_t per sample)."""
    x0, _ = predict_x0_eps(model_out.float(), z.float(), a_t.to(device=z.device, dtype=torch.float32), prediction_type)
    c_skip, c_out = (c.to(z.device).view(-1, *([1] * (z.dim() - 1))) for c in boundary_scalings(t, timestep_scaling))
    return c_skip * z.float() + c_out * x0


def pseudo_huber(pred: torch.Tensor, target: torch.Tensor, c: float) -> torch.Tensor:
    """mean(sqrt((pred - target)^2 + c^2) - c): quadratic near 0, linear in the tails."""
    return (((pred.float() - target.float()) ** 2 + c * c).sqrt() - c).mean()


def solver_step(teacher_out: torch.Tensor, z_hi: torch.Tensor, a_hi: torch.Tensor, a_lo: torch.Tensor, prediction_type: str,
                clip_x0: Optional[float] = None) -> torch.Tensor:
    """The skipping DDIM step z_{t_hi} -> z_{t_lo} from the teacher's (guided) output."""
    return ddim_step(z_hi.float(), teacher_out.float(), a_hi, a_lo, prediction_type, clip_x0)


class TargetNetwork:
    """The target network: a frozen float32 copy of the student, moved towards it after every
    optimizer step (theta^- <- mu theta^- + (1 - mu) theta). Every process keeps its own copy and
    updates it from its own (DDP-equal) parameters, so the copies stay equal with no communication.
    As a `train_loop` companion it is saved in each checkpoint and restored on resume.

    With decay 0 the copy would equal the student after every step, so the target is the student
    itself (`live`): its current weights under no_grad, no second copy of the UNet (3.5 GB in float32
    at SD-2.1 size) and nothing to checkpoint."""

    def __init__(self, student: torch.nn.Module, decay: float, device=None):
        from diffusers import UNet2DConditionModel

        self.decay = float(decay)
        self.live = self.decay == 0.0
        # a LoRA student (train/distill_lora.py): only its factors move, so only they are averaged and checkpointed
        self.lora = is_lora_unet(student)
        if self.live:
            self.net = student
            return
        if self.lora:
            self.net = copy.deepcopy(student)  # the peft layers too (a plain UNet has no place for the factors)
        else:
            self.net = UNet2DConditionModel.from_config(student.config)
            self.net.load_state_dict(student.state_dict())
        self.net.to(device=device, dtype=torch.float32).requires_grad_(False).eval()
        trained = set(model_state(student, trainable_only=True)) if self.lora else None
        self.moving = [(n, p) for n, p in self.net.named_parameters() if trained is None or n in trained]

    @torch.no_grad()
    def after_update(self, student: torch.nn.Module) -> None:
        if self.live:
            return
        live = dict(student.named_parameters())
        for name, p in self.moving:
            p.lerp_(live[name].detach().to(p.dtype), 1.0 - self.decay)

    def state_dict(self) -> dict:
        if self.lora:
            return {n: p.detach() for n, p in self.moving}
        return {k: v.detach() for k, v in self.net.state_dict().items()}

    def load_state_dict(self, state: dict) -> None:
        if not self.lora:
            self.net.load_state_dict(state)
            return
        load_exactly(self.net, state, {n for n, _ in self.moving})

    @torch.no_grad()
    def __call__(self, z, t, cond, timestep_cond: Optional[torch.Tensor]) -> torch.Tensor:
        kwargs = {} if timestep_cond is None else {"timestep_cond": timestep_cond}
        return self.net(z, t, **as_conditioning(cond).unet_kwargs(), return_dict=False, **kwargs)[0]
