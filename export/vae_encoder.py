"""The VAE encoder's exported graph (export `tasks: [image_to_image | inpaint]`, the registry's `vae_encoder`):
pixels [1, 3, H, W] in [0, 1] -> latents [1, C, h, w] as the sampler takes them: the mean of the VAE's latent
distribution, shifted and scaled (deterministic, no sampling). The whole encoder at once; where a tensor of it is over
the device profile's max_tensor_mb, export/banded_encoder.py runs its leading down blocks in row bands instead.

int8 (`encoder_int8`): under `weights: int8` the encoder is int8 too, whatever gives the others theirs. A checkpoint
that holds a `vae_encoder` component, or `int8.rtn` with `vae_encoder` in `int8.components`, is used as for any component;
otherwise (a calibrate output, which quantizes the UNet and optionally the text encoders and decoder; RTN of other
components) its convolutions and linears are rounded to nearest per output channel at 8 bits, weight-only, as export's RTN does
for the decoder: the 1x1 quant_conv (sliced to its mean half in the graph) and everything outside the encoder stay
float. The graph then goes through the same int8 storage, band plan and parity gates as the float one.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

ENCODER = "vae_encoder"
ENCODER_INT8_BITS = 8  # the encoder's own int8 (no calibration): 8 bits whatever int8.bits says for the listed components


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


def smooth_picture(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """[1, 3, H, W] in [0, 1]: 4 x 4 random colours, bilinear (a picture-like input, not noise)."""
    low = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.interpolate(low, size=(height, width), mode="bilinear", align_corners=False)


def encoder_int8(weights: str, components, pipe, quantized: dict) -> dict:
    """{"vae_encoder": its QuantizedComponent} when the export asks int8 (`weights`), exports the encoder (`components`)
    and `quantized` (the checkpoint's or RTN's components) has none for it; else {}. Round to nearest per output
    channel at ENCODER_INT8_BITS over every conv and linear of the encoder (the registry's int8_skip leaves the decoder and
    quant_conv float), from the float weights; the recipe's extra says why and how far the encoder's latents move on a
    64 px smooth picture (`latents_psnr_db_vs_float`, PSNR over the float latents' range). `pipe.vae` is left as it
    was: the caller applies the codes with the other components'."""
    if weights != "int8" or ENCODER not in components or quantized.get(ENCODER) is not None:
        return {}
    from pocketdiff.runtime.components import component
    from pocketdiff.runtime.parity import metrics

    from .int8 import apply_to_module, rtn_checkpoint

    vae = pipe.vae
    q = rtn_checkpoint(vae, ENCODER, ENCODER_INT8_BITS, skip=component(ENCODER).int8_skip)
    graph, px = VaeEncoderGraph(vae).eval(), smooth_picture(64, 64)
    saved = {k: v.clone() for k, v in vae.encoder.state_dict().items()}
    with torch.no_grad():
        before = graph(px)
        apply_to_module(vae, q)
        after = graph(px)
        vae.encoder.load_state_dict(saved)
    db = round(metrics(before.numpy(), after.numpy())["psnr_db"], 2)  # over the float latents' peak-to-peak range
    q.recipe.extra.update(method="rtn", bits=ENCODER_INT8_BITS, latents_psnr_db_vs_float=db,
                          why="weights: int8 with no vae_encoder weights in the int8 checkpoint or int8.components")
    print(f"export: vae_encoder: int8 by round to nearest per output channel ({len(q.recipe.layers)} layers, "
          f"{ENCODER_INT8_BITS} bits): latents {db} dB from the float encoder's on a smooth picture", file=sys.stderr, flush=True)
    return {ENCODER: q}
