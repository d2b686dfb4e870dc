"""The VAE decoder split for tiled decoding that matches the whole decode: two torch graphs.

Independent tiles (each a whole decoder run) differ from the whole decode in two ways: every
GroupNorm normalises with its tile's statistics, and the mid block's attention sees only the
tile (17.6 dB PSNR on the tiny VAE; `benchmarks/tiled_decode_bounds.py`). So:

- `VaeDecoderHead`: latents [1, C, h, w] -> features [1, F, h, w]: post_quant_conv, conv_in and
  the mid block (its attention included), once on the whole latent. It runs at latent
  resolution, where activations are small (64 x 64 x 512 at 512 px).
- `VaeUpPathTile`: a features tile [1, F, t, t], its blend weights [t, t], per-norm statistics
  `stats` [K, 2, G] and `own` [1] -> pixels [1, 3, t*f, t*f] and sums [K, 5, G]: per group the
  blend-weighted sum, sum of squares and weight of every norm's input (each divided by the group's
  element count in the tile, which cancels in the totals' ratios), then the tile's own mean and
  variance. Every GroupNorm of the up path (and conv_norm_out) normalises with
      mean = own * tile mean + stats[0],  variance = (own * tile variance + 1 - own) * stats[1]
  so own = 0 takes `stats` as the statistics, and own = 1 corrects the tile's own ones by a mean
  shift and a variance ratio (zeros and ones: the tile's own): elementwise ops, no graph switch.

`runtime.tiled_decode.tiled_decode_with_stats` drives them: pass 1 with the tile's own statistics,
then, from the totals of the sums, either those statistics (scheme "plain") or per-tile corrections
of the tile's own (scheme "control_variate"). Only tensors of one tile's size are alive in the up
path, however large the image.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

from .components import VaeDecoderGraph


class VaeDecoderHead(VaeDecoderGraph):
    """The decoder up to the end of its mid block, on the whole latent (VaeDecoderGraph's input
    handling: scaling, shift, post_quant_conv)."""

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder.mid_block(self.decoder.conv_in(self.decoder_input(latents)), None)


class _Inputs:
    """What the norms of one forward read: set by VaeUpPathTile.forward, cleared after."""

    def __init__(self):
        self.tile: Optional[int] = None
        self.weight = self.stats = self.own = None
        self.sums: list[torch.Tensor] = []


class _StatsGroupNorm(nn.Module):
    """Group statistics through per-channel sums and constant group matrices (channel -> group
    and back as matmuls): no 3-D group reshapes or broadcasts, which the GPU delegate rejects."""

    def __init__(self, norm: nn.GroupNorm, index: int, inputs: _Inputs):
        super().__init__()
        self.groups, self.eps, self.index = norm.num_groups, float(norm.eps), index
        self.weight, self.bias = norm.weight, norm.bias
        c = norm.num_channels
        onehot = torch.zeros(self.groups, c)
        onehot[torch.arange(c) // (c // self.groups), torch.arange(c)] = 1.0
        self.register_buffer("group_to_channel", onehot, persistent=False)  # [G, C]
        self.register_buffer("channel_to_group", onehot.t().contiguous() / (c // self.groups), persistent=False)  # [C, G], means
        self.register_buffer("ones", torch.ones(1, self.groups), persistent=False)
        self._inputs = [inputs]  # a list: not a submodule, not a parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp = self._inputs[0]
        _, c, h, w = x.shape
        r = h // inp.tile  # this layer's resolution over the latent tile's
        wmap = inp.weight.reshape(1, 1, inp.tile, inp.tile)
        if r > 1:
            wmap = nn.functional.interpolate(wmap, scale_factor=float(r), mode="nearest")
        to_group = self.channel_to_group
        mean_own = x.mean((2, 3)) @ to_group  # [1, G]
        var_own = (x * x).mean((2, 3)) @ to_group - mean_own * mean_own
        # blend-weighted sums per group, each divided by the group's element count in this tile (the
        # same for every tile, so it cancels in the totals' ratios; it keeps the outputs in fp16's range),
        # then the tile's own mean and variance (the runner's control variate for the next pass)
        inp.sums.append(torch.cat([(x * wmap).mean((2, 3)) @ to_group,
                                   (x * x * wmap).mean((2, 3)) @ to_group,
                                   wmap.mean((2, 3)) @ self.ones,  # [1, 1] @ [1, G]: no scalar broadcast
                                   mean_own, var_own], 0))
        stats = inp.stats[self.index]  # [2, G]
        # own = 1: the tile's statistics corrected (mean + shift, variance * ratio); own = 0: the given ones
        mean = inp.own * mean_own + stats[0:1]
        var = (inp.own * var_own + (1.0 - inp.own)) * stats[1:2]
        mean_c = (mean @ self.group_to_channel).reshape(1, c, 1, 1)
        rstd_c = (torch.rsqrt(var + self.eps) @ self.group_to_channel).reshape(1, c, 1, 1)
        return (x - mean_c) * rstd_c * self.weight.view(1, c, 1, 1) + self.bias.view(1, c, 1, 1)


class VaeUpPathTile(nn.Module):
    """Up blocks, conv_norm_out, conv_act, conv_out of a VAE decoder, norms fed from outside."""

    def __init__(self, vae: nn.Module, tile: int):
        super().__init__()
        dec = vae.decoder
        if getattr(dec, "up_blocks", None) is None or getattr(dec, "conv_norm_out", None) is None:
            raise PocketdiffError(f"tiled VAE: {type(dec).__name__} has no up_blocks / conv_norm_out to tile")
        self.tile = tile
        self._inputs = _Inputs()
        # copies: the norms inside are swapped, and the VAE itself must stay as it was
        self.up_blocks = copy.deepcopy(dec.up_blocks)
        self.conv_act, self.conv_out = dec.conv_act, dec.conv_out
        norms = [(name, m) for name, m in self.up_blocks.named_modules() if isinstance(m, nn.GroupNorm)]
        if any(type(m).__name__ == "Attention" for m in self.up_blocks.modules()):
            raise PocketdiffError("tiled VAE: attention in the decoder's up blocks is not supported (its view would be the tile)")
        groups = {m.num_groups for _, m in norms} | {dec.conv_norm_out.num_groups}
        if len(groups) != 1:
            raise PocketdiffError(f"tiled VAE: the up path's GroupNorms use different group counts {sorted(groups)}")
        self.groups = groups.pop()
        for i, (name, norm) in enumerate(norms):
            parent = self.up_blocks.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.up_blocks
            setattr(parent, name.rsplit(".", 1)[-1], _StatsGroupNorm(norm, i, self._inputs))
        self.conv_norm_out = _StatsGroupNorm(dec.conv_norm_out, len(norms), self._inputs)
        self.num_norms = len(norms) + 1

    def forward(self, features: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor, own: torch.Tensor):
        inp = self._inputs
        inp.tile, inp.weight, inp.stats, inp.own, inp.sums = self.tile, weight, stats, own, []
        try:
            h = features
            for block in self.up_blocks:
                h = block(h, None)
            image = self.conv_out(self.conv_act(self.conv_norm_out(h))) * 0.5 + 0.5
            return image, torch.stack(inp.sums)
        finally:
            inp.weight = inp.stats = inp.own = None
            inp.sums = []
