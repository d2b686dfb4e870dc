"""The loss of one distillation round: draw a batch's noise, timesteps and w, build the teacher's target."""
from __future__ import annotations

from typing import Optional

import torch

from pocketdiff.conditioning import Conditioning, encode_conditioning, pixel_size

from .distill_config import Config
from .distill_data import _encode
from .distill_rounds import RoundSpec
from .distill_targets import GuidedTeacher, RoundPlan, guided_x_target, noisy_latents, student_forward, two_step_x_target, x_space_loss
from .loop import BatchRandom


def make_loss_fn(cfg: Config, spec: RoundSpec, teacher: GuidedTeacher, plan: Optional[RoundPlan], pipe, sched,
                 uncond: Optional[Conditioning], student_embed: Optional[int], device):
    """loss_fn(model, batch, rng) of one round; every random draw comes from `rng`."""
    T = sched.config.num_train_timesteps
    alphas = sched.alphas_cumprod.to(device=device, dtype=torch.float32)
    sf = pipe.vae.config.scaling_factor
    ptype = sched.config.prediction_type
    g = cfg.guidance
    clip = float(sched.config.get("clip_sample_range", 1.0)) if sched.config.get("clip_sample", False) else None
    top_noise = cfg.progressive.top_step_input == "noise"
    if plan is not None:
        p_t, p_mid, p_at, p_amid, p_aprev = (v.to(device) for v in (plan.t, plan.t_mid, plan.a_t, plan.a_mid, plan.a_prev))

    def loss_fn(model, batch, rng: BatchRandom):
        if "mean" in batch:
            mean, std = batch["mean"].to(device), batch["std"].to(device)
        else:
            mean, std = _encode(pipe.vae, batch["pixel_values"], device)
            mean, std = mean.to(device), std.to(device)
        x0 = (mean + std * rng.randn(*mean.shape[1:])) * sf
        eps = rng.randn(*mean.shape[1:])
        u = rng.rand()
        w = g.w_min + (g.w_max - g.w_min) * u if g.conditioned else torch.full_like(u, g.scale)
        cond = encode_conditioning(pipe, batch["text"], device, resolution=pixel_size(mean, pipe.vae))
        unc = uncond.to(device).expand(cond.batch_size) if uncond is not None else None
        if spec.stage == "guided":
            t = rng.randint(0, T)
            a_t = alphas[t]
            z_t = noisy_latents(x0, eps, a_t)
            target = guided_x_target(teacher, z_t, t, a_t, cond, unc, w)
        else:
            k = rng.randint(0, plan.steps)
            t, a_t = p_t[k], p_at[k]
            z_t = noisy_latents(x0, eps, a_t)
            if top_noise:  # the top transition starts from what the sampler starts from: pure noise
                z_t = torch.where((k == 0).view(-1, *([1] * (z_t.dim() - 1))), eps.float(), z_t)
            target = two_step_x_target(teacher, z_t, t, p_mid[k], a_t, p_amid[k], p_aprev[k], cond, unc, w, clip)
        out = student_forward(model, z_t, t, cond, w, cfg.speed.channels_last, student_embed)
        return x_space_loss(out, z_t, a_t, target, ptype, cfg.loss_weighting)

    return loss_fn
