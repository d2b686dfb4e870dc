"""Weight quantizers: round-to-nearest, MSE-optimal scale search and AdaRound.

All quantization is symmetric, per output channel (scale [out]) or group-wise over the
flattened input dimension (scale [out, n_groups]), exactly as `int8_format` stores it:
W ~= codes * scale, codes in [-qmax, qmax].

AdaRound (Nagel et al. 2020) learns, per weight, whether to round down or up:

    W_soft = s * clamp(floor(W / s0) + h(V), -qmax, qmax),  h(V) = clamp(sigmoid(V) * (zeta - gamma) + gamma, 0, 1)

with the rectified sigmoid (zeta = 1.1, gamma = -0.1). V starts where h(V) equals the
fractional part of W / s0, so the soft weight starts at the float weight (inside the range).
The regulariser sum(1 - |2 h(V) - 1|^beta), beta annealed from high to low, pushes every
h(V) to 0 or 1; the hard codes are floor(W / s0) + [V >= 0]. `s` equals `s0` unless the
scale is learned (s = s0 * exp(log_scale), the integer base stays floor(W / s0)).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

from .int8_format import SCALE_SUFFIX, _rows, expand_scale, qmax, quantize_codes, rtn_scale

GAMMA, ZETA = -0.1, 1.1
QUANTIZABLE = (nn.Conv2d, nn.Linear)


@dataclass(frozen=True)
class LayerSpec:
    """How one layer is quantized: bits and group size (None: per output channel)."""

    bits: int
    group_size: Optional[int] = None


def quantizable_layers(module: nn.Module, skip: Iterable[str] = ()) -> dict[str, nn.Module]:
    """Conv2d / Linear submodules by path, minus those matching a `skip` fnmatch pattern."""
    skip = list(skip)
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, QUANTIZABLE) and name and not any(fnmatch.fnmatchcase(name, p) for p in skip):
            out[name] = sub
    return out


def layer_specs(
    layers: Iterable[str], shapes: dict[str, torch.Size], bits: int, group_size: Optional[int] = None,
    overrides: Optional[dict[str, int]] = None,
) -> dict[str, LayerSpec]:
    """Per-layer spec: `bits` unless an fnmatch pattern in `overrides` gives other bits; group-wise
    only where `group_size` divides the flattened input size (else per output channel)."""
    overrides = dict(overrides or {})
    specs = {}
    for name in layers:
        b = bits
        for pattern, ob in overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                b = int(ob)
        qmax(b)  # validates
        n_in = int(torch.Size(shapes[name][1:]).numel())
        gs = group_size if group_size is not None and n_in % group_size == 0 and n_in > group_size else None
        specs[name] = LayerSpec(b, gs)
    return specs


# ------------------------------------------------------------------------- scales


@torch.no_grad()
def search_scale(weight: torch.Tensor, spec: LayerSpec, grid: int = 50, min_ratio: Optional[float] = None) -> torch.Tensor:
    """Per-row (channel or group) scale minimising ||W - Q(W)||^2 over clipping ratios in
    [min_ratio, 1] x max-abs. Never worse than max-abs (ratio 1 is in the grid)."""
    q = qmax(spec.bits)
    rows = _rows(weight.detach().float(), spec.group_size)  # [out, ng, g]
    amax = rows.abs().amax(dim=-1).clamp_min(1e-12)  # [out, ng]
    if min_ratio is None:
        min_ratio = 0.5 if spec.bits >= 8 else 0.25
    best_scale = amax / q
    best_err = _quant_err(rows, best_scale, q)
    if grid > 1:
        for r in torch.linspace(min_ratio, 1.0, grid).tolist()[:-1]:
            s = amax * (r / q)
            err = _quant_err(rows, s, q)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, s, best_scale)
    return best_scale.squeeze(1) if spec.group_size is None else best_scale


def _quant_err(rows: torch.Tensor, scale: torch.Tensor, q: int) -> torch.Tensor:
    s = scale.unsqueeze(-1)
    return ((torch.clamp(torch.round(rows / s), -q, q) * s - rows) ** 2).sum(dim=-1)


def rtn(weight: torch.Tensor, spec: LayerSpec, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8, scale float32): round to nearest with `scale` (default: max-abs)."""
    if scale is None:
        scale = rtn_scale(weight, spec.bits, spec.group_size)
    scale = scale.float()
    return quantize_codes(weight, scale, spec.bits, spec.group_size), scale


def dequant(codes: torch.Tensor, scale: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    return codes.float() * expand_scale(scale.float(), codes.shape, spec.group_size)


# ------------------------------------------------------------------------- AdaRound


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def inverse_rectified_sigmoid(h: torch.Tensor) -> torch.Tensor:
    """V with rectified_sigmoid(V) == h for h in [0, 1) (no clamping is active there)."""
    p = (h - GAMMA) / (ZETA - GAMMA)
    return torch.log(p / (1 - p))


class AdaRoundQuantizer(nn.Module):
    """Learnable rounding of one weight tensor (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, spec: LayerSpec, scale: torch.Tensor, learn_scale: bool = False):
        super().__init__()
        self.spec = spec
        self.qmax = qmax(spec.bits)
        self.shape = weight.shape
        w = weight.detach().float()
        scale = scale.detach().float().to(w.device)
        self.register_buffer("scale0", scale)
        x = w / expand_scale(scale, w.shape, spec.group_size)
        base = torch.floor(x)
        self.register_buffer("base", base)
        self.v = nn.Parameter(inverse_rectified_sigmoid((x - base).clamp(0.0, 1.0 - 1e-6)))
        self.log_scale = nn.Parameter(torch.zeros_like(scale)) if learn_scale else None

    def scale(self) -> torch.Tensor:
        return self.scale0 if self.log_scale is None else self.scale0 * torch.exp(self.log_scale)

    def _full_scale(self) -> torch.Tensor:
        return expand_scale(self.scale(), self.shape, self.spec.group_size)

    def soft_h(self) -> torch.Tensor:
        return rectified_sigmoid(self.v)

    def soft_weight(self) -> torch.Tensor:
        return torch.clamp(self.base + self.soft_h(), -self.qmax, self.qmax) * self._full_scale()

    @torch.no_grad()
    def codes(self) -> torch.Tensor:
        return torch.clamp(self.base + (self.v >= 0).float(), -self.qmax, self.qmax).to(torch.int8)

    @torch.no_grad()
    def hard_weight(self) -> torch.Tensor:
        return self.codes().float() * self._full_scale()

    def round_loss(self, beta: float) -> torch.Tensor:
        return (1 - (2 * self.soft_h() - 1).abs().pow(beta)).sum()

    @torch.no_grad()
    def soft_fraction(self, eps: float = 1e-2) -> float:
        """Fraction of weights whose h(V) is not yet within eps of 0 or 1."""
        h = self.soft_h()
        return float(((h > eps) & (h < 1 - eps)).float().mean())


def beta_schedule(it: int, iters: int, warmup: float, beta_start: float, beta_end: float) -> Optional[float]:
    """None during warm-up (no regulariser), then beta linearly from beta_start to beta_end."""
    start = int(warmup * iters)
    if it < start:
        return None
    rel = (it - start) / max(1, iters - start)
    return beta_end + (beta_start - beta_end) * max(0.0, 1.0 - rel)


# ------------------------------------------------------------------------- state dicts


def quantized_state_dict(
    float_state: dict[str, torch.Tensor], layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """`float_state` with each quantized layer's `.weight` replaced by int8 codes and its
    `.weight_scale` added (the `int8_format` layout)."""
    out = {k: v.detach().cpu().contiguous() for k, v in float_state.items()}
    for name, (codes, scale) in layers.items():
        key = f"{name}.weight"
        if key not in out:
            raise PocketdiffError(f"quantized layer {name!r} is not in the model's state dict")
        if tuple(codes.shape) != tuple(out[key].shape):
            raise PocketdiffError(f"quantized layer {name!r}: codes {tuple(codes.shape)} vs weight {tuple(out[key].shape)}")
        out[key] = codes.detach().cpu().to(torch.int8).contiguous()
        out[f"{key}{SCALE_SUFFIX}"] = scale.detach().cpu().float().contiguous()
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||^2 / ||b||^2 (float64 accumulation)."""
    a, b = a.double(), b.double()
    den = float((b * b).sum())
    return float(((a - b) ** 2).sum()) / den if den > 0 else math.inf
