"""kxk convolutions lowered to k*k accumulated 1x1 convolutions over shifted slices of one padded input.

Why (issue 49): LiteRT's GPU accelerator (ML Drift) reads a 3x3 CONV_2D's weights as float and keeps them
Winograd-transformed (~9 bytes per weight at fp16), while a 1x1 CONV_2D whose filter is a per-channel int8 tensor
becomes FULLY_CONNECTED_INT8 with the int8 bytes uploaded raw (`int8.gpu_weights: direct`). On one H200 four
640->640 3x3 convs at 32x32 held 552 MB of GPU, the same as nine shifted 1x1 convs 225 MB (float weights).

`ShiftedConv2d` computes y = sum_{dy,dx} W[:, :, dy, dx] * x_pad[:, :, dy*d : ..., dx*d : ...] (+ bias once):
the input is padded once (zeros, the conv's own padding), each tap a 1x1 conv over the window of the padded input
its kernel position sees. Stride s > 1 (the UNet's and VAE's downsamplers) takes every s-th row/column of that
window (a strided slice), which is exact too.

It runs after the other rewrites, conv serialization included: a `SerializedConv2d` piece (a slice of the layer's
input and/or output channels, within `rewrites.conv_budget_mb`) is lowered piece by piece, so each 1x1 tap reads a
slice of the serialized piece's input (the same size) and the padded copy is that piece's input plus its border.
Every tap carries `pd_source` (the layer, the rows and cols of its piece) and `pd_tap` = (dy, dx): its int8 codes
are the layer's codes[rows, cols, dy, dx] with the same per-output-channel scales (export/int8.py `pieces_for`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

LOWERINGS = ("none", "shifted_1x1")


def lowerable(conv: nn.Module) -> bool:
    """A Conv2d this rewrite handles: kernel larger than 1x1, not grouped, zero padding given as numbers."""
    return (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) != (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros" and not isinstance(conv.padding, str))


class ShiftedConv2d(nn.Module):
    """A Conv2d (any kernel, stride, dilation; groups 1, zero padding) as kh*kw accumulated 1x1 convs."""

    def __init__(self, conv: nn.Conv2d, name: str = ""):
        super().__init__()
        if not lowerable(conv):
            raise PocketdiffError(f"{name}: only ungrouped, zero-padded kxk convolutions are lowered to 1x1 taps")
        self.kh, self.kw = conv.kernel_size
        self.stride, self.dilation = tuple(conv.stride), tuple(conv.dilation)
        ph, pw = conv.padding
        self.pad = (pw, pw, ph, ph)  # F.pad order: left, right, top, bottom
        src_name, rows, cols = getattr(conv, "pd_source", (name, None, None))
        if rows is None:
            rows = (0, conv.out_channels)
        if cols is None:
            cols = (0, conv.in_channels)
        self.taps = nn.ModuleList()
        w = conv.weight.detach()
        for dy in range(self.kh):
            for dx in range(self.kw):
                tap = nn.Conv2d(conv.in_channels, conv.out_channels, 1, bias=conv.bias is not None and not self.taps)
                with torch.no_grad():
                    tap.weight.copy_(w[:, :, dy, dx, None, None])
                    if tap.bias is not None:
                        tap.bias.copy_(conv.bias.detach())
                tap.pd_source = (src_name, rows, cols)
                tap.pd_tap = (dy, dx)
                if hasattr(conv, "pd_weight_factor"):
                    tap.pd_weight_factor = conv.pd_weight_factor
                self.taps.append(tap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sh, sw = self.stride
        dh, dw = self.dilation
        p = nn.functional.pad(x, self.pad) if any(self.pad) else x
        ho = (p.shape[2] - dh * (self.kh - 1) - 1) // sh + 1
        wo = (p.shape[3] - dw * (self.kw - 1) - 1) // sw + 1
        acc = None
        for k, tap in enumerate(self.taps):
            dy, dx = divmod(k, self.kw)
            y0, x0 = dy * dh, dx * dw
            window = p[:, :, y0 : y0 + (ho - 1) * sh + 1 : sh, x0 : x0 + (wo - 1) * sw + 1 : sw]
            y = tap(window)
            acc = y if acc is None else acc + y
        return acc


def applies_to(component: Optional[str], components) -> bool:
    """Whether a component's graph (e.g. "unet", a chunk "unet.3", a decoder tile "vae_up_tile") is lowered."""
    if component is None:
        return True
    for c in components:
        if component == c or component.startswith(c + ".") or (c == "vae_decoder" and component.startswith("vae_")):
            return True
    return False


def lower_convs(module: nn.Module, strided: bool = True) -> dict:
    """Swap every lowerable Conv2d of `module` (pieces of serialized convs included) for a ShiftedConv2d, in place.
    With `strided` false, convs of stride > 1 stay as they are. Returns {"lowered": n, "kept_strided": m,
    "kernels": {"3x3": n3, "3x3/s2": n2, ...}} (counted per lowered module: a serialized conv's pieces each count)."""
    kernels: dict[str, int] = {}
    kept = 0

    def visit(parent: nn.Module, prefix: str) -> None:
        nonlocal kept
        for child_name, m in list(parent.named_children()):
            full = f"{prefix}.{child_name}" if prefix else child_name
            if not lowerable(m):
                visit(m, full)
                continue
            if not strided and tuple(m.stride) != (1, 1):
                kept += 1
                continue
            key = f"{m.kernel_size[0]}x{m.kernel_size[1]}" + ("" if tuple(m.stride) == (1, 1) else f"/s{m.stride[0]}")
            kernels[key] = kernels.get(key, 0) + 1
            setattr(parent, child_name, ShiftedConv2d(m, full))

    visit(module, "")
    return {"lowered": sum(kernels.values()), "kept_strided": kept, "kernels": kernels}
