"""A tiny UNet with trained-like norms, 8 random calibration inputs and its W8 layer specs (no pipeline,
no sampling): what the calibration tests reconstruct."""
from __future__ import annotations

import torch


def tiny_unet_calib():
    """(unet, calib, specs)."""
    from diffusers import UNet2DConditionModel

    from pocketdiff.compress.quant.blocks import CalibSet
    from pocketdiff.compress.quant.quantizer import layer_specs, quantizable_layers
    from pocketdiff.models import perturb_norm_affines, unet_config

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**unet_config("tiny", resolution=32)).eval().requires_grad_(False)
    perturb_norm_affines(unet, 0, scale=0.3)
    g = torch.Generator().manual_seed(1)
    side = unet.config.sample_size
    calib = CalibSet(sample=torch.randn(8, unet.config.in_channels, side, side, generator=g),
                     timestep=torch.randint(0, 1000, (8,), generator=g),
                     encoder_hidden_states=torch.randn(8, 77, unet.config.cross_attention_dim, generator=g))
    names = list(quantizable_layers(unet))
    return unet, calib, layer_specs(names, {n: unet.get_submodule(n).weight.shape for n in names}, 8, None)
