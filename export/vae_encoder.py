"""The VAE encoder's exported graph (export `tasks: [image_to_image | inpaint]`, the registry's `vae_encoder`):
pixels [1, 3, H, W] in [0, 1] -> latents [1, C, h, w] as the sampler takes them: the mean of the VAE's latent
distribution, shifted and scaled (deterministic, no sampling). The whole encoder at once; where a tensor of it is over
the device profile's max_tensor_mb, export/banded_encoder.py runs its leading down blocks in row bands instead.
"""
from __future__ import annotations

import torch
from torch import nn


class VaeEncoderGraph(nn.Module):
    """The VAE encoder to the sampler's latents: (mean - shift_factor) * scaling_factor. diffusers' img2img pipelines
    sample the latent distribution with their generator; the bundle takes its mean (its mode), so an image has one
    latent and the runners need no second noise draw (runtime/BUNDLE.md). Only the mean half of `quant_conv` is kept:
    the log-variance is never computed."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        self.encoder = vae.encoder
        self.quant_conv = None
        channels = int(vae.config.latent_channels)
        qc = getattr(vae, "quant_conv", None)
        if qc is not None:  # moments = quant_conv(h): [mean, logvar] on the channel axis
            self.quant_conv = nn.Conv2d(qc.in_channels, channels, qc.kernel_size, qc.stride, qc.padding)
            with torch.no_grad():
                self.quant_conv.weight.copy_(qc.weight[:channels])
                self.quant_conv.bias.copy_(qc.bias[:channels])
        self.channels = channels
        self.scaling_factor = float(vae.config.scaling_factor)
        shift = getattr(vae.config, "shift_factor", None)
        self.shift_factor = float(shift) if shift is not None else 0.0

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.latents_from(self.encoder(pixels * 2.0 - 1.0))

    def latents_from(self, h: torch.Tensor) -> torch.Tensor:
        """The encoder's output -> the sampler's latents (quant_conv's mean half, shifted and scaled)."""
        mean = self.quant_conv(h) if self.quant_conv is not None else h[:, : self.channels]
        if self.shift_factor:
            mean = mean - self.shift_factor
        return mean * self.scaling_factor
