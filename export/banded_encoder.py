"""The VAE encoder in row bands inside one graph: no activation tensor over the device profile's max_tensor_mb.

SD's encoder holds its largest tensors at full resolution: the first down block's resnets (128 x H x W) and its
downsampler's padded input (128 x (H + 1) x (W + 1)); at 512 px the latter is 64.3 MB at fp16, over the phone profile's
64 MB, at 768 px the resnets alone are 144 MB. Rewriting the downsampler's pad alone would fit 512 px only, so the
leading down blocks that hold a tensor over budget run here on horizontal bands of rows, every tensor one band's size:

- a 3x3 conv takes its band with one row of each neighbour band above and below (the image edge: the conv's own zero
  padding) and keeps the band's own output rows: the whole conv's values, exactly;
- the stride-2 downsampler's asymmetric pad (one zero column right, one zero row at the bottom) pads each band's
  right edge, the last band's bottom, and takes the next band's first row below: again the whole conv's values;
- every GroupNorm normalises with the whole tensor's group statistics, gathered from the bands' per-channel sums
  (a mean pass, then the centred, rescaled squares: `band_group_norm`), so this is GroupNorm, not a per-tile one.

After the banded blocks the bands are concatenated (the tensor is under budget there) and the rest (later blocks, mid
block with its attention, conv_out, quant_conv) runs whole, through the same modules. The graph computes what the
whole encoder computes, up to float rounding: `check_band_parity` compares them in torch at export and raises a
ParityError under `parity.encoder_bands_psnr_db`. The bundle's `vae_encoder` keeps its io (pixels -> latents): no
runner changes. What this does not reduce: all bands of a level are alive together (GroupNorm needs every band
before any is normalised), so the GPU holds about what the whole encoder holds; the budget bounds each tensor.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.runtime.parity import metrics

from .vae_encoder import VaeEncoderGraph

MAX_BANDS = 64


def _level_tensors(chans: list[int], level: int, h: int, w: int, rows: Optional[int]) -> int:
    """Elements of the largest tensor of down block `level` (h x w its input's size); `rows`: a band of that many rows
    (with the halo rows a 3x3 conv reads), None: whole."""
    prev = chans[max(0, level - 1)]
    c, last = chans[level], level == len(chans) - 1
    r = h if rows is None else rows + 2
    best = max(prev, c) * r * w  # resnets (their conv inputs / outputs with halos)
    if not last:
        best = max(best, c * ((h + 1) if rows is None else rows + 1) * (w + 1))  # the downsampler's padded input
    return best


def band_rows(height: int, bands: int, unit: int) -> list[int]:
    """Band boundaries (rows at full resolution, bands + 1 numbers): multiples of `unit`, as even as they can be."""
    units = height // unit
    return [round(k * units / bands) * unit for k in range(bands + 1)]


def plan_bands(chans: list[int], height: int, width: int, limit_elems: Optional[float]) -> dict:
    """{levels, bands, largest, what}: the down blocks to run in bands (the leading ones holding a tensor over
    `limit_elems`), how many bands, and the largest tensor then (elements). levels 0: the whole encoder fits."""
    chans = [int(c) for c in chans]
    sides = [(height >> i, width >> i) for i in range(len(chans))]
    whole = [_level_tensors(chans, i, *sides[i], None) for i in range(len(chans))]
    over = [i for i, n in enumerate(whole) if limit_elems is not None and n > limit_elems]
    levels = max(over) + 1 if over else 0
    if not levels:
        return {"levels": 0, "bands": 1, "largest": max(whole), "what": "whole"}
    unit = 1 << min(levels, len(chans) - 1)  # every banded downsampler halves even band heights
    if height % unit:
        raise PocketdiffError(f"resolution: the encoder's bands need a height divisible by {unit}, got {height}")
    rest = max(whole[levels:], default=0)
    for n in range(2, min(MAX_BANDS, height // unit) + 1):
        edges = band_rows(height, n, unit)
        rows = max(b - a for a, b in zip(edges, edges[1:]))
        banded = max(_level_tensors(chans, i, sides[i][0], sides[i][1], rows >> i) for i in range(levels))
        if banded <= limit_elems:
            return {"levels": levels, "bands": n, "largest": max(banded, rest), "what": f"{n} bands over {levels} down blocks"}
    raise PocketdiffError(f"device_profile.max_tensor_mb: the VAE encoder at {height}x{width} px does not fit in "
                          f"{min(MAX_BANDS, height // unit)} bands of rows; export at a lower resolution")


def _onehot(c: int, g: int) -> torch.Tensor:
    m = torch.zeros(c, g)
    m[torch.arange(c), torch.arange(c) // (c // g)] = 1.0
    return m


def band_group_norm(norm: nn.Module, bands: list[torch.Tensor], fractions: list[float], onehot: torch.Tensor) -> list[torch.Tensor]:
    """GroupNorm of the tensor the bands stack to, band by band. Group statistics from per-channel band means
    (weighted by the bands' row fractions) through a channel -> group matrix (no group reshapes); the squares are of
    the centred values divided by a bound of the group's largest |x - mean| (GroupNorm is scale-invariant; eps is
    scaled with them), so they stay <= 4 in fp16."""
    per = float(onehot.shape[0] // onehot.shape[1])
    to_group, to_channel = onehot / per, onehot.t()

    def group(c_stat: torch.Tensor) -> torch.Tensor:  # [1, C] per channel -> [1, C] its group's mean of it
        return (c_stat @ to_group) @ to_channel

    mean = group(sum(b.mean((2, 3)) * f for b, f in zip(bands, fractions)))
    m4 = mean[:, :, None, None]
    amax = functools.reduce(torch.maximum, [(b - m4).abs().amax((2, 3)) for b in bands])
    inv = 1.0 / (((amax @ onehot) @ to_channel).clamp_min(1e-2))  # 1 / (sum of the group's channel maxima)
    i4 = inv[:, :, None, None]
    var = group(sum((((b - m4) * i4) ** 2).mean((2, 3)) * f for b, f in zip(bands, fractions)))
    scale = inv * torch.rsqrt(var + float(norm.eps) * inv * inv)
    if norm.weight is not None:
        scale = scale * norm.weight
    shift = -mean * scale + (norm.bias if norm.bias is not None else 0.0)
    s4, t4 = scale[:, :, None, None], shift[:, :, None, None]
    return [b * s4 + t4 for b in bands]


def conv_bands(conv: nn.Module, bands: list[torch.Tensor]) -> list[torch.Tensor]:
    """A 3x3, stride 1, padding 1 conv over the bands: each with its neighbours' edge rows, its own rows kept."""
    out, n = [], len(bands)
    for i, b in enumerate(bands):
        parts = ([bands[i - 1][:, :, -1:]] if i else []) + [b] + ([bands[i + 1][:, :, :1]] if i < n - 1 else [])
        y = conv(torch.cat(parts, 2) if len(parts) > 1 else b)
        start = 1 if i else 0
        out.append(y[:, :, start:start + b.shape[2]])
    return out


def down_bands(down: nn.Module, bands: list[torch.Tensor]) -> list[torch.Tensor]:
    """diffusers' Downsample2D (pad right and bottom by one, 3x3 stride-2 conv) over bands of even height."""
    out, n = [], len(bands)
    for i, b in enumerate(bands):
        last = i == n - 1
        ext = b if last else torch.cat([b, bands[i + 1][:, :, :1]], 2)
        out.append(down.conv(F.pad(ext, (0, 1, 0, 1 if last else 0))))
    return out


def _check_block(i: int, block: nn.Module) -> None:
    """What the banded path reproduces: a DownEncoderBlock2D of plain resnets and an unnormed pad-0 conv downsampler."""
    name = type(block).__name__
    ok = name == "DownEncoderBlock2D"
    for r in getattr(block, "resnets", []):
        ok = ok and r.upsample is None and r.downsample is None and r.time_emb_proj is None
        ok = ok and all(tuple(getattr(c, "kernel_size", ())) == (3, 3) and tuple(c.padding) == (1, 1) and tuple(c.stride) == (1, 1)
                        for c in (r.conv1, r.conv2))
    for d in getattr(block, "downsamplers", None) or []:
        ok = ok and d.use_conv and d.padding == 0 and d.norm is None and tuple(d.conv.stride) == (2, 2)
    if not ok:
        raise PocketdiffError(f"device_profile.max_tensor_mb: the VAE encoder's down_blocks.{i} ({name}) cannot run in bands "
                              "(plain DownEncoderBlock2D only); export the image tasks at a lower resolution")


class BandedEncoderGraph(VaeEncoderGraph):
    """VaeEncoderGraph whose first `levels` down blocks run on `bands` horizontal bands (module names unchanged, so
    rewrites and int8 apply to it as to the whole graph)."""

    def __init__(self, vae: nn.Module, levels: int, bands: int):
        super().__init__(vae)
        self.levels, self.bands = int(levels), int(bands)
        blocks = self.encoder.down_blocks
        for i in range(self.levels):
            _check_block(i, blocks[i])
        self.unit = 1 << min(self.levels, len(blocks) - 1)
        groups = {}
        for i in range(self.levels):
            for r in blocks[i].resnets:
                for norm in (r.norm1, r.norm2):
                    groups[(int(norm.num_channels), int(norm.num_groups))] = True
        for c, g in groups:
            self.register_buffer(f"onehot_{c}_{g}", _onehot(c, g), persistent=False)

    def _norm_act(self, norm, act, bands, fractions):
        c = bands[0].shape[1]
        onehot = getattr(self, f"onehot_{c}_{int(norm.num_groups)}")
        return [act(b) for b in band_group_norm(norm, bands, fractions, onehot)]

    def _resnet(self, r, bands, fractions):
        h = conv_bands(r.conv1, self._norm_act(r.norm1, r.nonlinearity, bands, fractions))
        h = conv_bands(r.conv2, [r.dropout(t) for t in self._norm_act(r.norm2, r.nonlinearity, h, fractions)])
        skip = [r.conv_shortcut(b) for b in bands] if r.conv_shortcut is not None else bands
        return [(s + t) / r.output_scale_factor for s, t in zip(skip, h)]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        height = pixels.shape[2]
        edges = band_rows(height, self.bands, self.unit)
        x = pixels * 2.0 - 1.0
        bands = conv_bands(self.encoder.conv_in, [x[:, :, a:b] for a, b in zip(edges, edges[1:])])
        fractions = [(b - a) / height for a, b in zip(edges, edges[1:])]
        blocks = self.encoder.down_blocks
        for i in range(self.levels):
            for r in blocks[i].resnets:
                bands = self._resnet(r, bands, fractions)
            for d in blocks[i].downsamplers or []:
                bands = down_bands(d, bands)
        h = torch.cat(bands, 2)
        for block in list(blocks)[self.levels:]:
            h = block(h)
        enc = self.encoder
        h = enc.conv_out(enc.conv_act(enc.conv_norm_out(enc.mid_block(h))))
        return self.latents_from(h)


def plan_for_budget(chans, height: int, width: int, max_tensor_mb: Optional[float], activation_bytes: int = 2) -> dict:
    """plan_bands under `max_tensor_mb` (None: no budget) at `activation_bytes` an element, with the largest tensor in
    MB (`largest_mb`)."""
    limit = None if max_tensor_mb is None else max_tensor_mb * 2**20 / activation_bytes
    plan = plan_bands(list(chans), int(height), int(width), limit)
    return {**plan, "largest_mb": round(plan["largest"] * activation_bytes / 2**20, 2)}


def encoder_graph(vae: nn.Module, height: int, width: int, max_tensor_mb: Optional[float], activation_bytes: int = 2):
    """(graph, plan): the whole VaeEncoderGraph when every tensor fits `max_tensor_mb` (or there is none), else the
    banded one."""
    plan = plan_for_budget(vae.config.block_out_channels, height, width, max_tensor_mb, activation_bytes)
    if not plan["levels"]:
        return VaeEncoderGraph(vae), plan
    return BandedEncoderGraph(vae, plan["levels"], plan["bands"]), plan


def psnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """PSNR over the reference's peak-to-peak range: the runtime's parity metric (NaN when `out` is not finite)."""
    return metrics(ref.detach().cpu().numpy(), out.detach().cpu().numpy())["psnr_db"]


def check_band_parity(vae: nn.Module, graph: nn.Module, pixels: torch.Tensor, min_psnr_db: float) -> float:
    """The banded graph (before rewrites) against the whole encoder in torch on `pixels`; ParityError under the bar."""
    with torch.no_grad():
        db = psnr_db(VaeEncoderGraph(vae)(pixels), graph(pixels))
    if not db >= min_psnr_db:
        raise ParityError(f"vae_encoder: the banded encoder scores {db:.1f} dB against the whole encoder in torch, under "
                          f"parity.encoder_bands_psnr_db={min_psnr_db}")
    return db
