"""A user's LoRA swapped into a bundle exported with LoRA slots (manifest `lora_slots`: export/lora_slots.py), numpy only.

A slotted UNet takes, for every targeted attention projection, a down factor [in, rank] and an up factor [rank, out]
as graph inputs (role `lora_factors`, fed once per image like the prompt's states: runtime/pipeline.py). `LoraFeeds`
holds what is fed: zeros (no LoRA: the plain UNet) or a LoRA file's factors, the up factor scaled by
scale * alpha / rank (alpha / sqrt(rank) for rsLoRA) and both zero-padded to the slots' rank. Swapping a LoRA is
reading another file into these arrays: no model is reloaded or recompiled. A UNet in chunks: each chunk declares the
factor inputs of its own slots (by the whole UNet's names), so the slots are found among every component's declared
inputs and the factors enter the chunks' table of tensors with the UNet's other inputs (runtime/chunks.py run_parts).

The file is read here, without torch or safetensors' torch API: its header JSON and little-endian F32 / F16 / BF16 /
F64 buffers. Its keys are read with the rules the fusing side uses (pocketdiff/lora_keys.py: diffusers / PEFT,
kohya, LoCon 1x1). Refused in one line (PocketdiffError naming the flag and the file), before any feed changes: a
pickle (never opened), a corrupt or truncated file, a key of another kind or another component (a text-encoder LoRA:
fuse it at export with `model.lora`), a module with no slot or factors of another shape (a LoRA for another base:
the first such key named), a rank over the slots'.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError
from pocketdiff.lora_keys import (check_suffix, group_keys, header_length, is_kohya, key_target, layer_multiplier, metadata_alphas,
                                  parse_header, slot_input_names)

DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def read_safetensors(path, key: str) -> tuple[dict[str, np.ndarray], dict]:
    """(name -> float32 array, metadata) of a safetensors file; PocketdiffError naming `key` and the file."""
    p = check_suffix(path, key)
    data = p.read_bytes()
    n = header_length(data[:9], len(data), p, key)
    header = parse_header(data[8:8 + n], p, key, data_size=len(data) - 8 - n)
    body = memoryview(data)[8 + n:]
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise PocketdiffError(f"{key}: {path} is not a valid safetensors file (tensor {name!r}: corrupt entry)") from None
        if dtype not in DTYPES:
            raise PocketdiffError(f"{key}: {path}: tensor {name!r} is {dtype}; a LoRA's factors are F32, F16, BF16 or F64")
        if not (0 <= int(start) <= int(end)) or int(end) - int(start) != math.prod(shape) * DTYPES[dtype].itemsize:
            raise PocketdiffError(f"{key}: {path} is not a valid safetensors file (tensor {name!r}: {end} - {start} bytes for shape {shape})")
        a = np.frombuffer(body[int(start):int(end)], dtype=DTYPES[dtype]).reshape(shape)
        tensors[name] = (a.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else a.astype(np.float32)
    if not tensors:
        raise PocketdiffError(f"{key}: {path} holds no tensors (not a LoRA)")
    return tensors, meta


def _as_matrix(t: np.ndarray) -> Optional[np.ndarray]:
    """A Linear factor: 2-D, or a 1x1 conv's 4-D one flattened (LoCon)."""
    if t.ndim == 2:
        return t
    if t.ndim == 4 and t.shape[2:] == (1, 1):
        return t.reshape(t.shape[0], t.shape[1])
    return None


class LoraFeeds:
    """The `lora_factors` inputs of a slotted bundle (`man`'s `lora_slots` and its UNet's declared inputs): zeros until
    `load` reads a LoRA; `clear` goes back to zeros. `feeds`: input name -> float32 array, as the graph takes it."""

    def __init__(self, man: dict, bundle=None):
        self.slots = man.get("lora_slots") if isinstance(man.get("lora_slots"), dict) else None
        self.bundle = bundle
        self.rank = int(self.slots["rank"]) if self.slots else 0
        self.targets: list[str] = list(self.slots["targets"]) if self.slots else []
        declared = {i["name"]: i["shape"] for e in (man.get("components") or {}).values() if isinstance(e, dict)
                    for i in e.get("inputs") or [] if isinstance(i, dict)}
        self.shapes = {}  # module -> (in, out)
        for m in self.targets:
            d, u = slot_input_names(m)
            if d not in declared or u not in declared:
                raise PocketdiffError(f"bundle {bundle}: lora_slots names {m}, whose inputs {d} / {u} no component declares")
            self.shapes[m] = (int(declared[d][0]), int(declared[u][1]))
        self.loaded: Optional[dict] = None  # {file, scale, layers} of the LoRA fed, None: zeros
        self.clear()

    def clear(self) -> None:
        self.feeds = {}
        for m, (n_in, n_out) in self.shapes.items():
            d, u = slot_input_names(m)
            self.feeds[d] = np.zeros((n_in, self.rank), np.float32)
            self.feeds[u] = np.zeros((self.rank, n_out), np.float32)
        self.loaded = None

    def load(self, path, scale: float = 1.0, key: str = "--lora") -> dict:
        """Feed the LoRA in `path` at `scale` (every factor checked first: nothing changes on a refusal)."""
        if not self.slots:
            raise PocketdiffError(f"{key}: bundle {self.bundle} has no LoRA slots: export it with lora_slots: {{rank: 4, targets: [attn]}} "
                                  "(or fuse the LoRA at export with model.lora)")
        scale = check_scale(scale, "--lora-scale" if key == "--lora" else f"{key} scale")
        feeds = self.factors(path, scale, key)
        self.clear()
        self.feeds.update(feeds)
        self.loaded = {"file": str(Path(path).resolve()), "scale": scale, "layers": len(feeds) // 2}
        return self.loaded

    def factors(self, path, scale: float, key: str) -> dict[str, np.ndarray]:
        """The padded, scaled factors of every layer the file adapts (input name -> array)."""
        tensors, meta = read_safetensors(path, key)
        where = f"{key}: {path}"
        groups = group_keys(tensors, where)
        alphas = metadata_alphas(meta, where)
        underscored = {m.replace(".", "_"): m for m in self.targets}
        out: dict[str, np.ndarray] = {}
        for base, roles in groups.items():
            down_key = roles["down"]
            component, name = key_target(base, down_key, where)
            if component != "unet":
                raise PocketdiffError(f"{where}: key {down_key!r} adapts the {component}; the bundle's slots take the UNet's attention "
                                      "projections only (fuse it at export with model.lora)")
            module = underscored.get(name, name) if is_kohya(base) else name
            if module not in self.shapes:
                raise PocketdiffError(f"{where}: key {down_key!r} names unet.{module}, which has no LoRA slot in bundle {self.bundle} "
                                      f"(slots: {self.slots_summary()}; a LoRA for another base?)")
            d_in, u_in = slot_input_names(module)
            if d_in in out:
                raise PocketdiffError(f"{where}: key {down_key!r} adapts unet.{module} a second time")
            out[d_in], out[u_in] = self._layer(module, roles, tensors, alphas, scale, where)
        return out

    def _layer(self, module: str, roles: dict, tensors: dict, alphas: dict, scale: float, where: str):
        down_key = roles["down"]
        down, up = _as_matrix(tensors[down_key]), _as_matrix(tensors[roles["up"]])
        n_in, n_out = self.shapes[module]
        if down is None or up is None or down.shape[0] != up.shape[1] or down.shape[0] < 1:
            raise PocketdiffError(f"{where}: key {down_key!r}: down {list(tensors[down_key].shape)} and up "
                                  f"{list(tensors[roles['up']].shape)} are not LoRA factors of one rank of a linear layer")
        r = int(down.shape[0])
        if down.shape[1] != n_in or up.shape[0] != n_out:
            raise PocketdiffError(f"{where}: key {down_key!r}: down {list(down.shape)} x up {list(up.shape)} does not fit the slot of "
                                  f"unet.{module} ({n_in} -> {n_out}): a LoRA for another base?")
        if r > self.rank:
            raise PocketdiffError(f"{where}: key {down_key!r} has rank {r}, over the bundle's slots' rank {self.rank} "
                                  f"(export with lora_slots.rank >= {r})")
        if not (np.isfinite(down).all() and np.isfinite(up).all()):
            raise PocketdiffError(f"{where}: key {down_key!r}: its factors are not finite numbers")
        alpha_values = tensors[roles["alpha"]].reshape(-1).tolist() if "alpha" in roles else None
        mult = scale * layer_multiplier(roles, alpha_values, alphas, "unet", module, r, where)
        d = np.zeros((n_in, self.rank), np.float32)
        u = np.zeros((self.rank, n_out), np.float32)
        d[:, :r] = down.T
        u[:r] = up.T * mult
        return d, u

    def slots_summary(self) -> str:
        ends = sorted({".".join(m.split(".")[-2:]) for m in self.targets})
        return f"{len(self.targets)} projections ({', '.join(ends)}) at rank {self.rank}"


def check_scale(scale, flag: str = "--lora-scale") -> float:
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise PocketdiffError(f"{flag}: must be a number, got {scale!r}") from None
    if not math.isfinite(s):
        raise PocketdiffError(f"{flag}: must be a finite number, got {scale!r}")
    return s


def check_lora_flags(args) -> None:
    """run-bundle's --lora / --lora-scale before anything is read: a scale without a LoRA, a pickle (unopened), a
    file that is not .safetensors or not there, a scale that is no finite number."""
    path, scale = getattr(args, "lora", None), getattr(args, "lora_scale", None)
    if scale is not None and not path:
        raise PocketdiffError("--lora-scale: scales a LoRA; give it with --lora FILE")
    if path:
        check_suffix(path, "--lora")
        if scale is not None:
            check_scale(scale)
