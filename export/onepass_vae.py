"""The torch graphs of a one-pass tiled decoder (runtime/onepass_decode.py drives them), and the
phone-profile sizing of its tile.

- head: `export.tiled_vae.VaeDecoderHead` (conv_in and the mid block on the whole latent)
- `VaeUpPathPlain`: a features tile [1, F, t, t] -> pixels [1, 3, t*f, t*f] through a norm-free up
  path (pocketdiff/normfree.py): up blocks, conv_norm_out (a ChannelAffine), conv_act, conv_out.
- `VaeUpPathPart`: a run of that up path's layers (`up_path_layers`: each up block's resnets and
  upsamplers, then the output head), one of `vae_tiling.up_parts` graphs cut by `plan_up_parts`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import count_params
from pocketdiff.normfree import has_group_norm_up_path


class VaeUpPathPlain(nn.Module):
    """Up blocks, conv_norm_out, conv_act, conv_out of a norm-free VAE decoder; output in [0, 1] up to the clamp."""

    def __init__(self, vae: nn.Module):
        super().__init__()
        dec = vae.decoder
        if getattr(dec, "up_blocks", None) is None:
            raise PocketdiffError(f"one-pass decode: {type(dec).__name__} has no up_blocks")
        if has_group_norm_up_path(vae):
            raise PocketdiffError("vae_tiling.scheme one_pass: the decoder's up path has GroupNorms (per-image statistics); "
                                  "give a norm-free decoder (pocketdiff distill-decoder) as model.vae, or set vae_tiling.fold_norms: true")
        if any(type(m).__name__ == "Attention" for m in dec.up_blocks.modules()):
            raise PocketdiffError("one-pass decode: attention in the decoder's up blocks is not supported (its view would be the tile)")
        self.up_blocks, self.conv_norm_out, self.conv_act, self.conv_out = dec.up_blocks, dec.conv_norm_out, dec.conv_act, dec.conv_out

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = features
        for block in self.up_blocks:
            h = block(h, None)
        return _to_pixels(self, h)


def _to_pixels(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The up path's output head on `h`: `m`'s conv_norm_out, conv_act, conv_out, then [-1, 1] to [0, 1]."""
    return m.conv_out(m.conv_act(m.conv_norm_out(h))) * 0.5 + 0.5


OUTPUT_HEAD = "conv_out"  # the up path's last layer: conv_norm_out, conv_act, conv_out, to [0, 1]


def up_path_layers(vae: nn.Module) -> dict[str, nn.Module]:
    """The layers of a norm-free up path in call order, by name: `up_blocks.i.resnets.j`, `up_blocks.i.upsamplers.j`,
    then `conv_out` (the output head, a module of its own here)."""
    dec = VaeUpPathPlain(vae)  # its checks: up blocks there, no GroupNorm, no attention
    layers: dict[str, nn.Module] = {}
    for i, block in enumerate(dec.up_blocks):
        for kind in ("resnets", "upsamplers"):
            for j, m in enumerate(getattr(block, kind, None) or []):
                layers[f"up_blocks.{i}.{kind}.{j}"] = m
    layers[OUTPUT_HEAD] = _OutputHead(dec.conv_norm_out, dec.conv_act, dec.conv_out)
    return layers


class _OutputHead(nn.Module):
    def __init__(self, norm: nn.Module, act: nn.Module, conv: nn.Module):
        super().__init__()
        self.conv_norm_out, self.conv_act, self.conv_out = norm, act, conv

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _to_pixels(self, h)


class VaeUpPathPart(nn.Module):
    """Some consecutive layers of a norm-free up path (`up_path_layers`' names): a tile's features or the previous
    part's output in, the next part's input (or, ending with the output head, the pixels) out."""

    def __init__(self, vae: nn.Module, names: list[str]):
        super().__init__()
        layers = up_path_layers(vae)
        self.names = list(names)
        self.layers = nn.ModuleList([layers[n] for n in self.names])
        self.resnet = [".resnets." in n for n in self.names]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer, resnet in zip(self.layers, self.resnet):
            h = layer(h, None) if resnet else layer(h)
        return h


def plan_up_parts(vae: nn.Module, parts: int) -> list[list[str]]:
    """The up path's layers cut into `parts` consecutive runs with the largest run's parameters as small as it
    can be (the weights are what a GPU delegate holds per graph whatever the tile): `vae_tiling.up_parts`."""
    layers = up_path_layers(vae)
    names, sizes = list(layers), [count_params(m) for m in layers.values()]
    if not 1 <= parts <= len(names):
        raise PocketdiffError(f"vae_tiling.up_parts: {parts}, but this decoder's up path has {len(names)} layers to cut between")
    # best[k][i]: the smallest largest-run total cutting names[:i] into k runs; cut[k][i] where its last run starts
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    inf = float("inf")
    best = [[inf] * (len(names) + 1) for _ in range(parts + 1)]
    cut = [[0] * (len(names) + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, len(names) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    runs, i = [], len(names)
    for k in range(parts, 0, -1):
        runs.append(names[cut[k][i]:i])
        i = cut[k][i]
    return runs[::-1]


@torch.no_grad()
def largest_activation_mb(module: nn.Module, inputs: tuple, activation_bytes: int = 2) -> float:
    """The largest tensor any leaf module of `module` takes or returns in one forward, in MB (2**20 bytes)
    at `activation_bytes` per element: the torch-side view of the device profile's max_tensor_mb."""
    peak = [0]

    def hook(_m, args, out):
        for t in list(args) + [out]:
            if isinstance(t, torch.Tensor):
                peak[0] = max(peak[0], t.numel())

    hooks = [m.register_forward_hook(hook) for m in module.modules() if not list(m.children())]
    try:
        module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return peak[0] * activation_bytes / 2**20


def largest_tile(mb_at_tile: float, tile: int, budget_mb: float) -> int:
    """The largest tile whose largest tensor fits `budget_mb`, from the size at `tile` (activations grow as tile^2)."""
    return max(0, int(math.floor(tile * math.sqrt(budget_mb / mb_at_tile))))


def check_tile_budget(up: nn.Module, features: int, tile: int, budget_mb: float, activation_bytes: int = 2) -> float:
    """The up tile's largest tensor (MB); over `budget_mb`: one line naming the largest tile that meets it."""
    mb = largest_activation_mb(up, (torch.zeros(1, features, tile, tile),), activation_bytes)
    if mb > budget_mb:
        fit = largest_tile(mb, tile, budget_mb)
        while fit > 0 and largest_activation_mb(up, (torch.zeros(1, features, fit, fit),), activation_bytes) > budget_mb:
            fit -= 1
        raise PocketdiffError(f"vae_tiling.tile: {tile} latents gives a {mb:.1f} MB tensor in the up tile, over "
                              f"device_profile.max_tensor_mb={budget_mb:g}; tile {fit} is the largest that meets it")
    return mb
