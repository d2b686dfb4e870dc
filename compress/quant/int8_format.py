"""The quantized checkpoint format: what `calibrate` writes and `export` reads.

A quantized component is one safetensors file holding the component's full state dict,
where each quantized weight `W` (name `P.weight`, shape [out, ...]) is replaced by

- `P.weight`        int8 codes, same shape as W, values in [-qmax, qmax], qmax = 2**(bits-1) - 1
- `P.weight_scale`  float32 scales: shape [out] (per output channel) or [out, n_groups]
                    (group-wise over the flattened input dimension, `group_size` columns each)

so that W ~= codes * scale (broadcast per row, or per group). Everything else (biases, norm
affines, unquantized layers) is stored as float tensors under its usual name. A JSON recipe
beside it records per-layer bits, group size and method, the seed and library versions.
Symmetric quantization only: no zero points.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import atomic_path, atomic_write_text, read_safetensors

FORMAT_NAME = "pocketdiff-int8"
FORMAT_VERSION = 1
SCALE_SUFFIX = "_scale"


@dataclass
class LayerRecipe:
    bits: int
    group_size: Optional[int] = None  # None: per output channel
    method: str = "rtn"  # rtn | adaround | ...


@dataclass
class QuantRecipe:
    component: str  # "unet", "text_encoder", "vae_decoder"
    layers: dict[str, LayerRecipe] = field(default_factory=dict)  # module path -> recipe
    seed: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # method settings, source pipeline, ...
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "recipe") -> "QuantRecipe":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PocketdiffError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if raw.get("format") != FORMAT_NAME:
            raise PocketdiffError(f"{where}: format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
        if raw.get("version") != FORMAT_VERSION:
            raise PocketdiffError(f"{where}: format version {raw.get('version')!r} is not supported (expected {FORMAT_VERSION})")
        layers = {k: LayerRecipe(**v) for k, v in raw.pop("layers", {}).items()}
        return cls(layers=layers, **raw)


def qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise PocketdiffError(f"bits must be 4 or 8, got {bits}")
    return 2 ** (bits - 1) - 1


def _rows(weight: torch.Tensor, group_size: Optional[int]) -> torch.Tensor:
    """View W as [out, n_groups, group] (n_groups = 1 for per-channel)."""
    flat = weight.reshape(weight.shape[0], -1)
    if group_size is None:
        return flat.unsqueeze(1)
    if flat.shape[1] % group_size:
        raise PocketdiffError(f"group_size {group_size} does not divide the input size {flat.shape[1]}")
    return flat.reshape(flat.shape[0], flat.shape[1] // group_size, group_size)


def rtn_scale(weight: torch.Tensor, bits: int, group_size: Optional[int] = None) -> torch.Tensor:
    """Symmetric max-abs scale: [out] or [out, n_groups], float32, never zero."""
    amax = _rows(weight.detach().float(), group_size).abs().amax(dim=-1)
    scale = (amax / qmax(bits)).clamp_min(1e-12)
    return scale.squeeze(1) if group_size is None else scale


def expand_scale(scale: torch.Tensor, shape: torch.Size, group_size: Optional[int]) -> torch.Tensor:
    """Broadcast a [out] / [out, n_groups] scale to the weight's shape."""
    if group_size is None:
        return scale.reshape(shape[0], *([1] * (len(shape) - 1))).expand(shape)
    n_in = int(torch.Size(shape[1:]).numel())
    return scale.repeat_interleave(group_size, dim=1).reshape(shape[0], n_in).reshape(shape)


def quantize_codes(weight: torch.Tensor, scale: torch.Tensor, bits: int, group_size: Optional[int] = None) -> torch.Tensor:
    """Round-to-nearest codes for a given scale, clamped to [-qmax, qmax], dtype int8."""
    q = qmax(bits)
    full = expand_scale(scale.float(), weight.shape, group_size)
    return torch.clamp(torch.round(weight.detach().float() / full), -q, q).to(torch.int8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, group_size: Optional[int] = None) -> torch.Tensor:
    return codes.float() * expand_scale(scale.float(), codes.shape, group_size)


def save_quantized(state_dict: dict[str, torch.Tensor], recipe: QuantRecipe, path: str | Path) -> tuple[Path, Path]:
    """Write `path` (.safetensors) and `path` with .json (the recipe). Checks the invariants."""
    path = Path(path)
    for name, lr in recipe.layers.items():
        codes = state_dict.get(f"{name}.weight")
        scale = state_dict.get(f"{name}.weight{SCALE_SUFFIX}")
        if codes is None or scale is None:
            raise PocketdiffError(f"quantized layer {name!r} lacks its codes or scales")
        if codes.dtype != torch.int8:
            raise PocketdiffError(f"quantized layer {name!r}: codes must be int8, got {codes.dtype}")
        if int(codes.abs().max()) > qmax(lr.bits):
            raise PocketdiffError(f"quantized layer {name!r}: codes exceed the {lr.bits}-bit range")
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    with atomic_path(path) as tmp:  # written straight to disk, never a second in-memory copy
        save_file(tensors, str(tmp), metadata={"format": FORMAT_NAME, "component": recipe.component})
    recipe_path = path.with_suffix(".json")
    atomic_write_text(recipe_path, recipe.to_json())
    return path, recipe_path


def load_quantized(path: str | Path) -> tuple[dict[str, torch.Tensor], QuantRecipe]:
    """Read a quantized component (safetensors + recipe json); no dequantization."""
    path = Path(path)
    recipe_path = path.with_suffix(".json")
    if not path.is_file():
        raise PocketdiffError(f"quantized checkpoint not found: {path}")
    if not recipe_path.is_file():
        raise PocketdiffError(f"quantization recipe not found: {recipe_path}")
    state = read_safetensors(path)
    return state, QuantRecipe.from_json(recipe_path.read_text(encoding="utf-8"), where=str(recipe_path))


def dequantized_state_dict(state: dict[str, torch.Tensor], recipe: QuantRecipe, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The float state dict a stock diffusers module loads: codes * scales for quantized layers."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(f".weight{SCALE_SUFFIX}"):
            continue
        out[key] = value
    for name, lr in recipe.layers.items():
        out[f"{name}.weight"] = dequantize(state[f"{name}.weight"], state[f"{name}.weight{SCALE_SUFFIX}"], lr.group_size).to(dtype)
    return out
