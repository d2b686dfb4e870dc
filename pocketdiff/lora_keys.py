"""A LoRA file's keys and header, read without torch: shared by the fusing side (pocketdiff/lora.py) and the
runtime's swapped LoRAs (runtime/lora_slots.py), so both name the same modules for the same keys.

- the file: `.safetensors` only; a pickle (`.ckpt`, `.pt`, `.bin` ...) is refused by its suffix or first bytes,
  never opened; the header's tensors must end where the file does (else corrupt or truncated);
- the keys: every key a down / up factor or an alpha of some layer (diffusers / PEFT `lora_A` / `lora_B`, the older
  `.lora.down` / `lora_linear_layer` / processor spellings, kohya / LoCon `lora_down` / `lora_up` / `.alpha`), other
  adapter kinds (LoHa, LoKr, DoRA, ...) named and refused;
- the module a key names (`key_target`: component and module name; kohya's names keep `_` for `.`) and its alpha
  from diffusers' `lora_adapter_metadata` (`lora_alpha`, `alpha_pattern`, `use_rslora`) when the file has no
  `.alpha` key.
"""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError, PocketdiffError

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")
COMPONENTS = ("unet", "text_encoder")

# (suffix of a key, role): the down / up factors and the alpha of one adapted layer
ROLES = (
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".lora.down.weight", "down"), (".lora.up.weight", "up"),
    (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"),
    ("_lora.down.weight", "down"), ("_lora.up.weight", "up"),  # attention processors: processor.to_q_lora
    (".alpha", "alpha"),
)
# keys of adapter kinds we do not fuse (regex searched in the key) -> what to call them
UNSUPPORTED = (
    (r"\.hada_", "a LyCORIS LoHa factor"), (r"\.lokr_", "a LyCORIS LoKr factor"), (r"\.lora_mid\.", "a LyCORIS Tucker (lora_mid) factor"),
    (r"\.dora_scale$|lora_magnitude_vector", "a DoRA magnitude"), (r"lora_embedding_", "an embedding LoRA"),
    (r"\.lora_(B|up)\.bias$", "a LoRA bias"), (r"\.diff(_b)?$", "a full weight difference"), (r"\.oft_", "an OFT factor"),
)


# ----------------------------------------------------------------------------- the file


def check_suffix(path: Any, key: str) -> Path:
    """A LoRA file's path by its name: a pickle refused unopened, anything but .safetensors refused."""
    text = str(path or "").strip()
    if not text:
        raise ConfigError(f"{key}: must name a .safetensors LoRA file")
    p = Path(text).expanduser()
    suffix = p.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise ConfigError(f"{key}: {p} is a pickle ({suffix}); pocketdiff never unpickles files: convert the LoRA to .safetensors")
    if suffix != ".safetensors":
        raise ConfigError(f"{key}: {p} must be a .safetensors file, got suffix {suffix or '(none)'!r}")
    if not p.is_file():
        raise ConfigError(f"{key}: {p} not found")
    return p


def header_length(head: bytes, size: int, path: Path, key: str) -> int:
    """The safetensors header length from a file's first 9 bytes (8-byte length, then '{'); a pickle
    or torch zip archive is named as one, anything else called corrupt."""
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 9 else -1
    if n >= 2 and 8 + n <= size and head[8:9] == b"{":
        return n
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        raise ConfigError(f"{key}: {path} holds a pickle / torch archive, not safetensors; pocketdiff never unpickles files")
    raise ConfigError(f"{key}: {path} is not a valid safetensors file (corrupt or truncated header)")


def parse_header(raw: bytes, path: Path, key: str, data_size: int) -> dict:
    """The JSON header, its tensors' byte ranges ending where the file does (else corrupt or truncated)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{key}: {path} is not a valid safetensors file (corrupt header)")
    try:
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"], default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ConfigError(f"{key}: {path} is not a valid safetensors file (corrupt header)") from None
    if end != data_size:
        raise ConfigError(f"{key}: {path} is not a valid safetensors file (its tensors need {end} bytes, it holds {data_size}: truncated?)")
    return header


def check_file(path: Any, key: str) -> Path:
    """A LoRA file path: .safetensors, present, its header readable. Pickles are refused by name, unopened."""
    p = check_suffix(path, key)
    with open(p, "rb") as f:
        head = f.read(9)
        n = header_length(head, p.stat().st_size, p, key)
        f.seek(8)
        parse_header(f.read(n), p, key, data_size=p.stat().st_size - 8 - n)
    return p


# ----------------------------------------------------------------------------- the keys


def key_role(k: str) -> tuple[str, str]:
    """(base, role) of a key: role down / up / alpha, or "" when the key is no LoRA factor."""
    for suffix, role in ROLES:
        if k.endswith(suffix):
            return k[: -len(suffix)], role
    return k, ""


def unsupported(k: str) -> Optional[str]:
    for pattern, what in UNSUPPORTED:
        if re.search(pattern, k):
            return what
    return None


def group_keys(keys, where: str) -> dict[str, dict[str, str]]:
    """base -> {role: key} over a file's keys (sorted): every key a down / up / alpha, each base with both factors."""
    groups: dict[str, dict[str, str]] = {}
    for k in sorted(keys):
        what = unsupported(k)
        if what is not None:
            raise PocketdiffError(f"{where}: key {k!r} is {what}; pocketdiff fuses LoRA / LoCon down-up factors only")
        base, role = key_role(k)
        if not role:
            raise PocketdiffError(f"{where}: key {k!r} is not a LoRA factor (lora_down / lora_up / lora_A / lora_B / alpha)")
        groups.setdefault(base, {})[role] = k
    for roles in groups.values():
        if "down" not in roles or "up" not in roles:
            missing = "up" if "down" in roles else "down"
            raise PocketdiffError(f"{where}: key {next(iter(roles.values()))!r} has no {missing} factor beside it")
    return groups


def is_kohya(base: str) -> bool:
    return base.startswith(("lora_unet_", "lora_te"))


def key_target(base: str, key: str, where: str) -> tuple[str, str]:
    """(component, module name) a key's base names (kohya: the name with '_' for '.', resolved by the caller)."""
    for prefix, comp in (("lora_unet_", "unet"), ("lora_te1_", "text_encoder"), ("lora_te_", "text_encoder")):
        if base.startswith(prefix):
            return comp, base[len(prefix):]
    if base.startswith(("lora_te2_", "text_encoder_2.")):
        raise PocketdiffError(f"{where}: key {key!r} adapts a second text encoder (SDXL); this model has one (a LoRA for another base)")
    if base.startswith("lora_"):
        raise PocketdiffError(f"{where}: key {key!r}: unknown kohya prefix (lora_unet_ / lora_te_ expected)")
    name = base.removeprefix("base_model.model.")
    component = "unet"
    for comp in COMPONENTS:
        if name.startswith(comp + "."):
            component, name = comp, name[len(comp) + 1:]
            break
    else:
        if name.startswith("text_model."):
            component = "text_encoder"
    name = re.sub(r"\.processor\.(to_[qkv])$", r".\1", name)  # attention processors' to_q_lora ...
    name = re.sub(r"\.processor\.to_out$", ".to_out.0", name)
    return component, name


def metadata_alphas(meta: dict, where: str) -> dict[str, dict]:
    """diffusers' `lora_adapter_metadata` per component: {lora_alpha, alpha_pattern, use_rslora}."""
    raw = meta.get("lora_adapter_metadata")
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise PocketdiffError(f"{where}: its lora_adapter_metadata is not valid JSON") from None
    out: dict[str, dict] = {}
    for k, v in (data.items() if isinstance(data, dict) else []):
        comp, _, field = k.partition(".")
        if comp in COMPONENTS or comp == "text_encoder_2":
            out.setdefault(comp, {})[field] = v
    for comp, fields in out.items():
        if fields.get("use_dora"):
            raise PocketdiffError(f"{where}: its {comp} adapter is DoRA (use_dora); pocketdiff fuses LoRA factors only")
    return out


def metadata_alpha(alphas: dict, component: str, name: str, rank: int, where: str) -> float:
    """A layer's alpha from the metadata (no `.alpha` key): its alpha_pattern entry, else lora_alpha, else the rank."""
    fields = alphas.get(component)
    if not fields:
        return float(rank)  # no alpha: scale 1, as diffusers loads such files
    for pattern, value in (fields.get("alpha_pattern") or {}).items():
        try:
            if re.match(rf"(.*\.)?({pattern})$", name):  # PEFT's rule: the pattern names the module or its tail
                return float(value)
        except re.error:
            raise PocketdiffError(f"{where}: its {component} alpha_pattern key {pattern!r} is not a valid pattern") from None
    return float(fields.get("lora_alpha", rank))


def layer_multiplier(roles: dict, alpha_values: Optional[list], alphas: dict, component: str, name: str, rank: int,
                     where: str) -> float:
    """alpha / rank of one layer (alpha / sqrt(rank) for rsLoRA): alpha from its `.alpha` key (`alpha_values`: that
    tensor's values, flat) when `roles` has one, else from the metadata (`metadata_alpha`)."""
    if "alpha" in roles:
        if alpha_values is None or len(alpha_values) != 1 or not math.isfinite(alpha_values[0]):
            raise PocketdiffError(f"{where}: key {roles['alpha']!r} must be one finite number")
        alpha = float(alpha_values[0])
    else:
        alpha = metadata_alpha(alphas, component, name, rank, where)
    return alpha / (math.sqrt(rank) if alphas.get(component, {}).get("use_rslora") else rank)


# ----------------------------------------------------------------------------- a bundle's LoRA slots


SLOT_ATTENTIONS = {"attn": ("attn1", "attn2"), "attn1": ("attn1",), "attn2": ("attn2",)}  # export `lora_slots.targets`
SLOT_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")  # MediaPipe's choice: q, k, v and out of each attention


def slot_input_names(module: str) -> tuple[str, str]:
    """The graph inputs of one slotted projection (a UNet module name): its down [in, rank] and up [rank, out] factors."""
    stem = "lora_" + module.replace(".", "_")
    return f"{stem}_down", f"{stem}_up"
