"""Shared tiny UNets and inputs of the pruning tests."""
from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel

from pocketdiff.models import perturb_norm_affines, unet_config


def _tiny_unet(seed: int = 0, **overrides) -> UNet2DConditionModel:
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**{**unet_config("tiny", resolution=32, vae_factor=4), **overrides}).eval()
    perturb_norm_affines(unet, seed)  # trained-like norms: identity affines would hide bugs
    with torch.no_grad():  # non-zero biases everywhere, so a wrong slice shows
        for m in unet.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)) and m.bias is not None:
                m.bias.normal_(0, 0.05)
    return unet


@pytest.fixture(scope="session")
def make_tiny_unet():
    """`make_tiny_unet(seed=0, **config_overrides)`: a tiny UNet with perturbed norms and non-zero biases."""
    return _tiny_unet


@pytest.fixture(scope="module")
def unet():
    return _tiny_unet()


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([10, 700]), torch.randn(2, 77, 64, generator=g))
