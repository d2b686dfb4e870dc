"""int8 weights for export: the quantized checkpoint (compress's format) -> pieces to carry.

`load_component_checkpoints` finds calibrate's files (`<component>_int8.safetensors` + JSON
recipe, or any file whose recipe names the component). `apply_to_module` loads the
dequantized weights (codes * scales) into the torch component, so conversion sees exactly
the float values the codes stand for; after the rewrites, `pieces_for` walks the converted
module's convs and returns, for each, the codes and scales of the slice of the layer it holds.
Group-wise scales are carried by splitting the layer's input channels at group boundaries
(one per-channel-quantized conv per group, summed), since TFLite's per-channel quantization
has a single axis.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pocketdiff.compress.quant.int8_format import (
    SCALE_SUFFIX,
    QuantRecipe,
    dequantized_state_dict,
    load_quantized,
    quantize_codes,
    rtn_scale,
)
from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.components import COMPONENTS, REGISTRY, STAGE_COMPONENTS

from .convert import Int8Piece
from .rewrites import Conv1x1Linear, SerializedConv2d, swap_modules

# component -> prefix of its names inside the exported graph module (the registry's graph_prefix)
GRAPH_PREFIX = {n: REGISTRY[n].graph_prefix for n in STAGE_COMPONENTS}  # SDXL's text_encoder_2 too


@dataclasses.dataclass
class QuantizedComponent:
    component: str
    state: dict[str, torch.Tensor]
    recipe: QuantRecipe
    path: Optional[Path] = None


def load_component_checkpoints(source: str | Path) -> dict[str, QuantizedComponent]:
    """A calibrate output folder (or one .safetensors file) -> component -> checkpoint."""
    source = Path(source)
    files = [source] if source.is_file() else sorted(source.glob("*.safetensors")) if source.is_dir() else []
    if not files:
        raise PocketdiffError(f"int8 checkpoint: no .safetensors with a recipe .json in {source}")
    found: dict[str, QuantizedComponent] = {}
    for f in files:
        if not f.with_suffix(".json").is_file():
            continue
        state, recipe = load_quantized(f)
        if recipe.component in found:
            raise PocketdiffError(f"int8 checkpoint: two files for {recipe.component} in {source}")
        found[recipe.component] = QuantizedComponent(recipe.component, state, recipe, f)
    if not found:
        raise PocketdiffError(f"int8 checkpoint: no .safetensors with a recipe .json in {source}")
    return found


def rtn_checkpoint(module: nn.Module, component: str, bits: int = 8, skip: tuple[str, ...] = ()) -> QuantizedComponent:
    """Round-to-nearest per-output-channel int8 of every Conv2d / Linear weight (benchmarks, smoke). The tensors under
    `skip` are left out of the checkpoint: two components of one module (the VAE's decoder and encoder) each apply
    theirs without undoing the other's."""
    from pocketdiff.compress.quant.int8_format import LayerRecipe

    state = {k: v.detach().clone() for k, v in module.state_dict().items() if not any(k.startswith(s) for s in skip)}
    recipe = QuantRecipe(component=component, extra={"method": "rtn", "made_by": "pocketdiff export"})
    for name, m in module.named_modules():
        if not isinstance(m, (nn.Conv2d, nn.Linear)) or any(name.startswith(s) for s in skip):
            continue
        scale = rtn_scale(m.weight, bits)
        state[f"{name}.weight"] = quantize_codes(m.weight, scale, bits)
        state[f"{name}.weight{SCALE_SUFFIX}"] = scale
        recipe.layers[name] = LayerRecipe(bits=bits)
    return QuantizedComponent(component, state, recipe)


def apply_to_module(module: nn.Module, q: QuantizedComponent) -> None:
    """Load codes * scales (and the checkpoint's float tensors) into `module` (its own names)."""
    float_state = dequantized_state_dict(q.state, q.recipe)
    own = module.state_dict()
    missing = [k for k in float_state if k not in own]
    if missing:
        raise PocketdiffError(
            f"int8 checkpoint for {q.component}: {len(missing)} tensors do not exist in the model "
            f"(e.g. {missing[0]}); was it calibrated from another architecture?"
        )
    for k, v in float_state.items():
        if tuple(own[k].shape) != tuple(v.shape):
            raise PocketdiffError(f"int8 checkpoint for {q.component}: {k} has shape {list(v.shape)}, the model {list(own[k].shape)}")
    module.load_state_dict(float_state, strict=False)


def split_groupwise(graph: nn.Module, q: QuantizedComponent) -> list[str]:
    """Serialize every group-wise quantized layer so each piece holds exactly one group."""
    prefix = GRAPH_PREFIX[q.component]
    grouped = {prefix + name: lr for name, lr in q.recipe.layers.items() if lr.group_size is not None}
    if not grouped:
        return []

    def match(name: str, m: nn.Module) -> bool:
        src = getattr(m, "pd_source", (name, None, None))[0]
        return isinstance(m, nn.Conv2d) and src in grouped

    def make(name: str, m: nn.Conv2d) -> nn.Module:
        src = m.pd_source[0]
        lr = grouped[src]
        if hasattr(m, "pd_tap"):
            raise PocketdiffError(f"int8 layer {src[len(prefix):]}: group-wise scales and rewrites.conv_lowering together are not supported")
        kk = m.kernel_size[0] * m.kernel_size[1]
        if lr.group_size % kk:
            raise PocketdiffError(
                f"int8 layer {src[len(prefix):]}: group size {lr.group_size} does not align with input channels "
                f"(kernel {m.kernel_size}); TFLite per-channel scales cannot carry it"
            )
        per_group = lr.group_size // kk
        if m.pd_source[2] is not None:
            raise PocketdiffError(f"int8 layer {src[len(prefix):]}: group-wise scales and conv serialization together are not supported")
        return SerializedConv2d(m, m.in_channels // per_group, 1, name=name)

    return swap_modules(graph, match, make)


def pieces_for(graph: nn.Module, q: QuantizedComponent) -> list[Int8Piece]:
    """Codes and scales for every conv / linear of the (rewritten) graph that holds a quantized layer."""
    prefix = GRAPH_PREFIX[q.component]
    pieces: list[Int8Piece] = []
    seen_layers = set()
    unused = tuple(getattr(graph, "unused_modules", lambda: ())())  # modules its forward never runs: no tensor to hold codes
    for name, m in graph.named_modules():
        if not isinstance(m, (nn.Conv2d, nn.Linear)):
            continue
        src, rows, cols = getattr(m, "pd_source", (name, None, None))
        if not src.startswith(prefix) or src.startswith(unused or ("\0",)):
            continue
        layer = src[len(prefix) :]
        lr = q.recipe.layers.get(layer)
        if lr is None:
            continue
        codes = q.state[f"{layer}.weight"]
        scale = q.state[f"{layer}.weight{SCALE_SUFFIX}"].float()
        r0, r1 = rows if rows is not None else (0, codes.shape[0])
        c0, c1 = cols if cols is not None else (0, codes.shape[1])
        piece_codes = codes[r0:r1, c0:c1]
        tap = getattr(m, "pd_tap", None)  # a 1x1 tap of a lowered kxk conv (export/conv_lowering.py)
        if tap is not None:
            if lr.group_size is not None:
                raise PocketdiffError(f"int8 layer {layer}: group-wise scales and rewrites.conv_lowering together are not supported")
            piece_codes = piece_codes[:, :, tap[0], tap[1]]
        if lr.group_size is None:
            piece_scale = scale[r0:r1]
        else:
            kk = int(torch.Size(codes.shape[2:]).numel()) if codes.dim() > 2 else 1
            per_group = lr.group_size // kk
            g0 = c0 // per_group
            if c0 % per_group or (c1 - c0) != per_group:
                raise PocketdiffError(f"int8 layer {layer}: piece columns {c0}:{c1} do not match one group of {per_group} channels")
            piece_scale = scale[r0:r1, g0]
        factor = float(getattr(m, "pd_weight_factor", 1.0))  # a power of two from residual rescaling
        if factor != 1.0:
            piece_scale = piece_scale * factor
        target_shape = tuple(m.weight.shape)
        if piece_codes.numel() != m.weight.numel():
            raise PocketdiffError(f"int8 layer {layer}: piece {list(piece_codes.shape)} does not fit module weight {list(target_shape)}")
        piece_codes = piece_codes.reshape(target_shape).contiguous()
        # the module must hold exactly codes * scale (it was loaded from the checkpoint)
        expect = piece_codes.float() * piece_scale.reshape(-1, *([1] * (piece_codes.dim() - 1)))
        if not torch.equal(expect, m.weight.detach().float()):
            raise PocketdiffError(f"int8 layer {layer}: module weight differs from codes * scales (was the checkpoint applied?)")
        pieces.append(Int8Piece(layer, piece_codes, piece_scale.contiguous(), rows=(r0, r1), cols=(c0, c1), scale_factor=factor,
                              tap=None if tap is None else tuple(tap)))
        seen_layers.add(layer)
    return pieces


def unexported_layers(graph: nn.Module, q: QuantizedComponent, pieces: list[Int8Piece]) -> list[str]:
    """Quantized layers with no piece in the graph (e.g. the time embedding computed outside)."""
    have = {p.layer for p in pieces}
    return [n for n in q.recipe.layers if n not in have]
