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


@pytest.fixture
def sd21_meta_unet():
    """The SD-2.1-size UNet on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return UNet2DConditionModel(**unet_config("sd21", "v_prediction"))


def _meta_output_shape(unet) -> tuple:
    """Output shape of a meta-device SD-2.1-size UNet on a 96x96 latent."""
    return tuple(unet(torch.zeros(1, 4, 96, 96, device="meta"), torch.tensor([1], device="meta"),
                      encoder_hidden_states=torch.zeros(1, 77, 1024, device="meta")).sample.shape)


def _targeted_removed(before, after, targeted) -> float:
    """Fraction of the targeted convs' parameters that pruning removed."""
    from pocketdiff.compress.prune import graph as pg

    prof_b, prof_a = pg.layer_profile(before), pg.layer_profile(after)
    return 1 - sum(prof_a[n].params for n in targeted) / sum(prof_b[n].params for n in targeted)


@pytest.fixture(scope="session")
def meta_output_shape():
    return _meta_output_shape


@pytest.fixture(scope="session")
def targeted_removed():
    return _targeted_removed
