"""Residual-stream rescaling for fp16 range: the layers that write a diffusers UNet's or VAE decoder's residual
stream scale by a power of two `s`, the norms that read it absorb s (their eps scales by s^2), so the output is the
same and the activations in between are s times smaller (rewrites.residual_scale; export/rewrites.py applies it).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.normfree import ChannelAffine


def _scale_param(module: nn.Module, name: str, factor: float) -> None:
    p = getattr(module, name, None)
    if p is not None:
        with torch.no_grad():
            p.mul_(factor)


def _scale_writer(conv: nn.Module, s: float) -> None:
    """A layer whose input is normalized (unscaled) and whose output joins the stream: W, b * s."""
    _scale_param(conv, "weight", s)
    _scale_param(conv, "bias", s)
    conv.pd_weight_factor = getattr(conv, "pd_weight_factor", 1.0) * s


def _scale_passthrough(conv: Optional[nn.Module], s: float) -> None:
    """A linear layer from the (scaled) stream to the stream: only the bias scales."""
    if conv is not None:
        _scale_param(conv, "bias", s)


def _scale_norm_eps(norm: Optional[nn.Module], s: float) -> None:
    """A norm reading the scaled stream: its output is unchanged when eps scales by s^2. A folded norm
    (pocketdiff.normfree.ChannelAffine, x * w + b with fixed statistics) is not scale-invariant: its
    weight divides by s instead (the statistics it stands for scale with the stream)."""
    if norm is None:
        return
    if isinstance(norm, ChannelAffine):
        with torch.no_grad():
            norm.weight.div_(s)
        return
    norm.eps = float(norm.eps) * s * s


def rescale_residual_stream(model: nn.Module, s: float) -> dict:
    """Multiply the residual stream of a diffusers UNet2DConditionModel or VAE Decoder by `s`.

    Every norm that reads the stream is scale-invariant (its eps scales by s^2), so only the
    layers that write the stream change: conv_in (W, b * s), each resnet's conv2 (W, b * s) and
    shortcut bias, each transformer's proj_out / VAE attention's to_out (W, b * s), the
    down/upsampler biases. The output (after conv_norm_out) is the same; the activations in
    between are s times smaller, which keeps an fp16 graph inside its range. `s` is a power of
    two, so the scaled weights are exact (int8 codes are unchanged; their scales absorb s).
    """
    counts = {"writers": 0, "passthrough": 0, "norms": 0}
    conv_in = getattr(model, "conv_in", None)
    if conv_in is None or getattr(model, "conv_norm_out", None) is None:
        raise PocketdiffError(f"residual rescaling: {type(model).__name__} has no conv_in / conv_norm_out")
    _scale_writer(conv_in, s)
    counts["writers"] += 1
    _scale_norm_eps(model.conv_norm_out, s)
    counts["norms"] += 1
    handled = set()
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in ("ResnetBlock2D",):
            temb_mode = getattr(m, "time_embedding_norm", "default") if getattr(m, "time_emb_proj", None) is not None else "default"
            if temb_mode != "default" or getattr(m, "upsample", None) is not None or getattr(m, "downsample", None) is not None:
                raise PocketdiffError(f"residual rescaling: resnet {name} ({m.time_embedding_norm}, up/down inside) is not supported")
            _scale_norm_eps(m.norm1, s)
            _scale_writer(m.conv2, s)
            _scale_passthrough(m.conv_shortcut, s)
            counts["writers"] += 1
            counts["norms"] += 1
            handled.add(name)
        elif kind == "Transformer2DModel":
            if not getattr(m, "is_input_continuous", True):
                raise PocketdiffError(f"residual rescaling: transformer {name} is not a continuous-input transformer")
            _scale_norm_eps(m.norm, s)
            _scale_writer(m.proj_out, s)
            counts["writers"] += 1
            counts["norms"] += 1
            handled.add(name)
        elif kind == "Attention" and getattr(m, "residual_connection", False):  # the VAE's spatial attention
            _scale_norm_eps(m.group_norm, s)
            _scale_writer(m.to_out[0], s)
            counts["writers"] += 1
            counts["norms"] += 1
            handled.add(name)
        elif kind in ("Downsample2D", "Upsample2D"):
            conv = getattr(m, "conv", None) or getattr(m, "Conv2d_0", None)
            if getattr(m, "norm", None) is not None:
                raise PocketdiffError(f"residual rescaling: {kind} {name} with a norm is not supported")
            _scale_passthrough(conv if isinstance(conv, nn.Conv2d) else None, s)
            counts["passthrough"] += 1
        elif kind in ("ResnetBlock2DSimple", "ResnetBlockCondNorm2D", "SpatialNorm", "KDownsample2D", "KUpsample2D", "DualTransformer2DModel"):
            raise PocketdiffError(f"residual rescaling: {kind} ({name}) is not supported")
    return counts
