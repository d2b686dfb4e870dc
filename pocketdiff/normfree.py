"""A norm-free up path for an AutoencoderKL decoder: GroupNorms folded into per-channel affines.

A GroupNorm normalises with its input's statistics over the whole image, which is what makes a
tiled decode differ from the whole one (export/tiled_vae.py needs passes of iterated statistics
to undo it). With fixed statistics (mean m, variance v per group, calibrated over many images)
the norm is a per-channel affine, x * a + c with a = weight / sqrt(v + eps) and
c = bias - m * a, and the up path is convolutions and pointwise ops only: tiles with a margin
decode it in one pass with plain overlap. The fixed statistics are an approximation of the
per-image ones; `pocketdiff distill-decoder` (train/decoder_distill.py) fine-tunes the folded
decoder to the original decoder's outputs.

The folded decoder is saved as a stock diffusers AutoencoderKL folder: the state dict keeps its
keys (a folded norm's `weight` / `bias` hold a and c) and config.json lists the folded norms
under `NORM_FREE_KEY`. `apply_norm_free` (called by `pocketdiff.models.load_vae`) puts the
affines back after loading. A stock diffusers load without that call computes GroupNorms with
a and c as their affines: a different function, so pocketdiff always loads through load_vae.

Only the up blocks and conv_norm_out are folded: the head (conv_in and the mid block, attention
included) runs once on the whole latent, where exact statistics cost nothing extra.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from .errors import PocketdiffError

NORM_FREE_KEY = "pocketdiff_norm_free"  # config.json: dotted names (under the VAE) of the folded norms


class ChannelAffine(nn.Module):
    """x * weight + bias per channel: a GroupNorm with fixed statistics, folded."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().float())
        self.bias = nn.Parameter(bias.detach().clone().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.weight.shape[0]
        return x * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


def up_path_norm_names(vae: nn.Module) -> list[str]:
    """Dotted names (under the VAE) of the GroupNorms of the decoder's up blocks and conv_norm_out."""
    dec = vae.decoder
    if getattr(dec, "up_blocks", None) is None or not isinstance(getattr(dec, "conv_norm_out", None), nn.GroupNorm):
        raise PocketdiffError(f"norm-free decoder: {type(dec).__name__} has no up_blocks / GroupNorm conv_norm_out to fold")
    names = [f"decoder.up_blocks.{n}" for n, m in dec.up_blocks.named_modules() if isinstance(m, nn.GroupNorm)]
    return names + ["decoder.conv_norm_out"]


def _set(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


@torch.no_grad()
def calibrate_group_stats(vae: nn.Module, latents: Iterable[torch.Tensor], names: list[str]) -> dict:
    """{name: (mean [G], variance [G])} of each named GroupNorm's input, pooled over every image of
    `latents` (batches of the VAE's unscaled latents, as `vae.decode` takes them): the mean of the
    images' group means and of their mean squares, so the variance includes the spread between images."""
    sums: dict = {n: [0.0, 0.0, 0] for n in names}
    hooks = []

    def hook_for(name: str, groups: int):
        def hook(_m, args):
            x = args[0].float()
            g = x.reshape(x.shape[0], groups, -1)
            acc = sums[name]
            acc[0] = acc[0] + g.mean(-1).sum(0)
            acc[1] = acc[1] + (g * g).mean(-1).sum(0)
            acc[2] += x.shape[0]
        return hook

    for n in names:
        m = vae.get_submodule(n)
        hooks.append(m.register_forward_pre_hook(hook_for(n, m.num_groups)))
    try:
        for z in latents:
            vae.decode(z)
    finally:
        for h in hooks:
            h.remove()
    if any(acc[2] == 0 for acc in sums.values()):
        raise PocketdiffError("norm-free decoder: calibration saw no images")
    out = {}
    for n, (s, s2, count) in sums.items():
        mean = s / count
        out[n] = (mean, (s2 / count - mean * mean).clamp_min(0.0))
    return out


@torch.no_grad()
def fold_group_norms(vae: nn.Module, stats: dict) -> list[str]:
    """Replace each GroupNorm named in `stats` by its ChannelAffine with those statistics (in place);
    records the names in the VAE's config (NORM_FREE_KEY). Returns the names."""
    for name, (mean, var) in stats.items():
        norm = vae.get_submodule(name)
        if not isinstance(norm, nn.GroupNorm):
            raise PocketdiffError(f"norm-free decoder: {name} is a {type(norm).__name__}, not a GroupNorm")
        per = norm.num_channels // norm.num_groups
        mean_c = mean.float().repeat_interleave(per)
        scale = norm.weight.float() * torch.rsqrt(var.float().repeat_interleave(per) + norm.eps)
        _set(vae, name, ChannelAffine(scale, norm.bias.float() - mean_c * scale))
    names = list(stats)
    vae.register_to_config(**{NORM_FREE_KEY: names})
    return names


def norm_free_names(vae_or_folder) -> list[str]:
    """The folded norms a VAE (its config) or a VAE folder (config.json) declares; [] for a plain VAE."""
    if isinstance(vae_or_folder, (str, Path)):
        cfg_path = Path(vae_or_folder) / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return list(cfg.get(NORM_FREE_KEY) or [])
    cfg = getattr(vae_or_folder, "config", {})
    return list((cfg.get(NORM_FREE_KEY) if hasattr(cfg, "get") else None) or [])


def apply_norm_free(vae: nn.Module, names: list[str]) -> bool:
    """After a stock load of a folded decoder: the named GroupNorms (holding the folded affines as
    their weight and bias) become ChannelAffines again. False when `names` is empty."""
    if not names:
        return False
    for name in names:
        try:
            norm = vae.get_submodule(name)
        except AttributeError:
            raise PocketdiffError(f"norm-free decoder: config lists {name}, which the VAE does not have") from None
        if isinstance(norm, ChannelAffine):
            continue
        if not isinstance(norm, nn.GroupNorm):
            raise PocketdiffError(f"norm-free decoder: {name} is a {type(norm).__name__}, not a folded GroupNorm")
        _set(vae, name, ChannelAffine(norm.weight, norm.bias))
    vae.register_to_config(**{NORM_FREE_KEY: list(names)})
    return True


def has_group_norm_up_path(vae: nn.Module) -> bool:
    """Whether the decoder's up path still normalises with per-image statistics."""
    dec = vae.decoder
    return any(isinstance(m, nn.GroupNorm) for m in list(dec.up_blocks.modules()) + [dec.conv_norm_out])
