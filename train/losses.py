"""Losses shared by the training recipes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .loop import BatchRandom


def diffusion_target(scheduler, latents, noise, timesteps) -> torch.Tensor:
    """epsilon or v (Salimans & Ho) target for the scheduler's prediction type."""
    kind = scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unsupported prediction_type {kind!r}")


def diffusion_loss(predict, scheduler, latents: torch.Tensor, rng: BatchRandom) -> torch.Tensor:
    """The ordinary denoising loss at uniformly drawn training timesteps.

    `predict(noisy_latents, timesteps)` is the model's output (through the wrapped module's
    forward, so that DDP sees the call)."""
    noise = rng.randn(*latents.shape[1:]).to(latents.dtype)
    t = rng.randint(0, scheduler.config.num_train_timesteps)
    noisy = scheduler.add_noise(latents, noise, t)
    pred = predict(noisy, t)
    return F.mse_loss(pred.float(), diffusion_target(scheduler, latents, noise, t).float())
