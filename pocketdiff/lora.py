"""A user's LoRAs fused into the UNet and text encoder (`model.lora: [{path, scale}]`), without peft.

Every verb loads its model through `pocketdiff.models.load_or_build`, which calls `fuse_loras` last:
each LoRA's factors are read, matched to the model's layers and checked, all of them, before any
weight changes; then every targeted weight gets `W += scale * alpha / rank * up @ down` (a conv
LoRA's down factor carries the layer's kernel, its up factor is 1x1, as diffusers and LyCORIS
LoCon store them), computed in float32.

Files: safetensors only (a pickle is refused by its suffix or its first bytes, never opened).
Key formats read (the ones people share for SD 1.x / 2.x):

- diffusers / PEFT: `unet.<module>.lora_A.weight` / `.lora_B.weight` (and `text_encoder.`), the
  alphas from diffusers' `lora_adapter_metadata` (`unet.lora_alpha`, `alpha_pattern`,
  `use_rslora`), else alpha = rank, as diffusers loads them; PEFT's own `base_model.model.`
  prefix (a UNet's adapter) too;
- diffusers' older names: `<module>.lora.down.weight` / `.lora.up.weight`,
  `.lora_linear_layer.down/up`, attention processors' `processor.to_q_lora.down.weight`, with
  `<module>.alpha` where present;
- kohya / A1111 (and LyCORIS LoCon): `lora_unet_<module with _>.lora_down.weight` /
  `.lora_up.weight` / `.alpha`, `lora_te_` (or `lora_te1_`) for the text encoder.

LoHa, LoKr, Tucker (`lora_mid`), DoRA, full diffs, LoRA biases and SDXL's second text encoder are
refused with one line naming the first such key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import nn

from .errors import ConfigError, PocketdiffError
from .lora_keys import (COMPONENTS, check_file, check_suffix, group_keys, header_length, is_kohya, key_target,
                        layer_multiplier, metadata_alphas, parse_header)
from .outputs import sha256_file


@dataclasses.dataclass
class LoraSpec:
    """One entry of `model.lora`: a LoRA file and the scale it is fused at."""

    path: str = ""
    scale: float = 1.0


def check_lora_specs(specs: Any, key: str = "model.lora") -> list[LoraSpec]:
    """`specs` (LoraSpec or {path, scale} items) checked: a .safetensors file that exists and opens as
    one, a finite scale. Returns LoraSpecs; raises ConfigError naming `key[i]` and the file."""
    if specs is None:
        return []
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"{key}: must be a list of {{path, scale}}, got {type(specs).__name__}")
    out = []
    for i, item in enumerate(specs):
        where = f"{key}[{i}]"
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"path", "scale"})
            if unknown:
                raise ConfigError(f"{where}: unknown key {unknown[0]!r} (an entry is {{path, scale}})")
            item = LoraSpec(**item)
        if not isinstance(item, LoraSpec):
            raise ConfigError(f"{where}: must be {{path, scale}}, got {type(item).__name__}")
        check_file(item.path, f"{where}.path")
        try:
            scale = float(item.scale)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}.scale: must be a number, got {item.scale!r}") from None
        if not math.isfinite(scale):
            raise ConfigError(f"{where}.scale: must be a finite number, got {item.scale!r}")
        out.append(LoraSpec(path=str(item.path), scale=scale))
    return out


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass
class Factor:
    """One adapted layer of a LoRA file."""

    component: str  # unet | text_encoder
    name: str  # module name inside the component (kohya: with '_' for '.', resolved against the model)
    key: str  # the file's key of the down factor (named in errors)
    down: torch.Tensor
    up: torch.Tensor
    multiplier: float  # alpha / rank (alpha / sqrt(rank) for rsLoRA)
    kohya: bool = False


@dataclasses.dataclass
class LoraFile:
    path: Path
    sha256: str
    format: str  # diffusers | kohya
    factors: list[Factor]


def read_lora(path: Path, key: str) -> LoraFile:
    """Read, hash and parse one LoRA file (the hash is of the bytes parsed). PocketdiffError naming `key`."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    path = check_suffix(path, key)  # the header is checked below, from the bytes parsed
    data = path.read_bytes()
    n = header_length(data[:9], len(data), path, key)
    header = parse_header(data[8:8 + n], path, key, data_size=len(data) - 8 - n)
    meta = header.get("__metadata__") or {}
    try:
        tensors = load_bytes(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PocketdiffError(f"{key}: {path} is not a valid safetensors file ({first})") from None
    if not tensors:
        raise PocketdiffError(f"{key}: {path} holds no tensors (not a LoRA)")
    fmt, factors = parse_factors(tensors, meta, f"{key}: {path}")
    return LoraFile(path=path, sha256=hashlib.sha256(data).hexdigest(), format=fmt, factors=factors)


def parse_factors(tensors: dict, meta: dict, where: str) -> tuple[str, list[Factor]]:
    """(format, factors) of a LoRA state dict: every key a down / up / alpha of some layer, or refused
    (the key rules: pocketdiff/lora_keys.py, shared with the runtime's swapped LoRAs)."""
    groups = group_keys(tensors, where)
    kohya = any(is_kohya(b) for b in groups)
    alphas = metadata_alphas(meta, where)
    factors = []
    for base, roles in groups.items():
        down_key, down, up = roles["down"], tensors[roles["down"]], tensors[roles["up"]]
        component, name = key_target(base, down_key, where)
        rank = int(down.shape[0]) if down.dim() >= 2 else 0
        if rank < 1 or up.dim() < 2 or int(up.shape[1]) != rank:
            raise PocketdiffError(f"{where}: key {down_key!r}: down {tuple(down.shape)} and up {tuple(up.shape)} are not LoRA factors of one rank")
        alpha_values = tensors[roles["alpha"]].float().reshape(-1).tolist() if "alpha" in roles else None
        multiplier = layer_multiplier(roles, alpha_values, alphas, component, name, rank, where)
        factors.append(Factor(component, name, down_key, down, up, multiplier, kohya=is_kohya(base)))
    return ("kohya" if kohya else "diffusers"), factors


# ----------------------------------------------------------------------------- matching and fusing


def _as_linear(t: torch.Tensor) -> Optional[torch.Tensor]:
    if t.dim() == 2:
        return t
    if t.dim() == 4 and t.shape[2] == 1 and t.shape[3] == 1:
        return t.flatten(1)
    return None


def _delta_shape_ok(layer: nn.Module, down: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether down / up fit `layer`'s weight (a Linear, or a Conv2d with the kernel on down)."""
    w = layer.weight
    up2 = _as_linear(up)
    if up2 is None or up2.shape[0] != w.shape[0]:
        return False
    if isinstance(layer, nn.Linear):
        down2 = _as_linear(down)
        return down2 is not None and down2.shape[1] == w.shape[1]
    if layer.groups != 1:
        return False
    if down.dim() == 2:
        return tuple(w.shape[2:]) == (1, 1) and down.shape[1] == w.shape[1]
    return down.dim() == 4 and tuple(down.shape[1:]) == tuple(w.shape[1:])


def _module_index(module: nn.Module) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """{name: module} and {name with '_' for '.': name}, a CLIP text encoder's layers under both spellings
    (transformers 5 dropped the `text_model.` level that LoRA files name)."""
    named = {n: m for n, m in module.named_modules() if n}
    if hasattr(module, "text_model"):
        named.update({n.removeprefix("text_model."): m for n, m in list(named.items()) if n.startswith("text_model.")})
    elif hasattr(module, "encoder") and hasattr(module, "embeddings"):
        named.update({f"text_model.{n}": m for n, m in list(named.items())})
    canonical = {m: n for n, m in module.named_modules() if n}
    return named, {n.replace(".", "_"): canonical[m] for n, m in named.items()}


def plan_fusion(pipe, loras: list[tuple[LoraFile, float, str]]) -> list[tuple[nn.Parameter, Factor, float]]:
    """(weight, factor, scale) for every factor of every LoRA, all checked against `pipe` first:
    PocketdiffError naming the first key whose layer is missing or whose shapes do not fit."""
    index = {}
    for comp in COMPONENTS:
        module = getattr(pipe, comp, None)
        if module is not None:
            index[comp] = _module_index(module)
    plan = []
    for lora, scale, key in loras:
        where = f"{key}: {lora.path}"
        for f in lora.factors:
            if f.component not in index:
                raise PocketdiffError(f"{where}: key {f.key!r} adapts the {f.component}, which this pipeline lacks")
            named, underscored = index[f.component]
            name = underscored.get(f.name, f.name) if f.kohya else f.name
            layer = named.get(name)
            if layer is None:
                raise PocketdiffError(f"{where}: key {f.key!r} names {f.component}.{name}, which this model does not have "
                                      "(a LoRA for another base?)")
            if not isinstance(layer, (nn.Linear, nn.Conv2d)):
                raise PocketdiffError(f"{where}: key {f.key!r} names {f.component}.{name}, a {type(layer).__name__}, "
                                      "not a linear or conv layer")
            if not _delta_shape_ok(layer, f.down, f.up):
                raise PocketdiffError(f"{where}: key {f.key!r}: down {tuple(f.down.shape)} x up {tuple(f.up.shape)} does not fit "
                                      f"{f.component}.{name} (weight {tuple(layer.weight.shape)}): a LoRA for another base?")
            for t, part in ((f.down, "down"), (f.up, "up")):
                if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                    raise PocketdiffError(f"{where}: key {f.key!r}: its {part} factor is not finite floats")
            plan.append((layer.weight, f, scale))
    return plan


def lora_delta(weight: torch.Tensor, f: Factor, scale: float) -> torch.Tensor:
    """scale * alpha / rank * up @ down in float32, shaped as `weight`."""
    up = f.up.to(device=weight.device, dtype=torch.float32).flatten(1)
    down = f.down.to(device=weight.device, dtype=torch.float32).flatten(1)
    return (up @ down).reshape(weight.shape) * (scale * f.multiplier)


_FUSED: dict[str, dict] = {}  # resolved path -> {sha256, format}: what was fused in this process (for reports)


@torch.no_grad()
def fuse_loras(pipe, specs: Iterable[LoraSpec], key: str = "model.lora") -> list[dict]:
    """Fuse every LoRA of `specs` into `pipe`'s UNet and text encoder; nothing changes unless all fit.
    Returns the provenance entries ({key, file, sha256, scale, format, layers})."""
    specs = check_lora_specs(list(specs), key)
    loras = [(read_lora(Path(s.path), f"{key}[{i}]"), s.scale, f"{key}[{i}]") for i, s in enumerate(specs)]
    plan = plan_fusion(pipe, loras)
    for weight, f, scale in plan:
        delta = lora_delta(weight, f, scale)
        fused = weight.float() + delta
        if not bool(torch.isfinite(fused).all()):
            raise PocketdiffError(f"{key}: key {f.key!r} at scale {scale} makes the weight non-finite")  # before the copy: unchanged
    for weight, f, scale in plan:
        weight.copy_((weight.float() + lora_delta(weight, f, scale)).to(weight.dtype))
    entries = []
    for (lora, scale, k) in loras:
        _FUSED[str(lora.path.resolve())] = {"sha256": lora.sha256, "format": lora.format}
        layers: dict[str, int] = {}
        for f in lora.factors:
            layers[f.component] = layers.get(f.component, 0) + 1
        entries.append({"key": k, "file": str(lora.path.resolve()), "sha256": lora.sha256, "scale": scale,
                        "format": lora.format, "layers": layers})
    return entries


# ----------------------------------------------------------------------------- provenance


def lora_entries(specs: Iterable[Any], key: str = "model.lora") -> list[dict]:
    """{key, file, sha256, scale} of each LoRA of `specs`: the hash of the bytes fused in this process
    when it fused that file, else of the file now."""
    out = []
    for i, s in enumerate(specs or []):
        path, scale = (s.get("path"), s.get("scale", 1.0)) if isinstance(s, dict) else (s.path, s.scale)
        p = Path(str(path)).expanduser().resolve()
        fused = _FUSED.get(str(p))
        sha = fused["sha256"] if fused else (sha256_file(p) if p.is_file() else None)
        out.append({"key": f"{key}[{i}]", "file": str(p), "sha256": sha, "scale": float(scale)})
    return out


def config_lora_entries(cfg: Any, prefix: str = "") -> list[dict]:
    """Every LoRA a verb's config names (`model.lora`, evaluate's `models[i].lora` ...), as `lora_entries`."""
    found: list[dict] = []
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.name == "lora" and isinstance(value, (list, tuple)) and all(isinstance(v, (LoraSpec, dict)) for v in value):
                found += lora_entries(value, f"{prefix}lora")
            else:
                found += config_lora_entries(value, f"{prefix}{f.name}.")
    elif isinstance(cfg, (list, tuple)):
        for i, v in enumerate(cfg):
            found += config_lora_entries(v, f"{prefix.rstrip('.')}[{i}].")
    return found
