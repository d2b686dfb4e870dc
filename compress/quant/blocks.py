"""The UNet split into reconstruction blocks, and capture of block inputs / outputs.

Blocks (BRECQ granularity): the stem (time embedding [+ class / addition embeddings] and
conv_in), every ResnetBlock2D, every Transformer2DModel, every down/upsampler, and the head
(norm_out -> act -> conv_out). A block has one or more *units*; a unit is a callable whose
inputs are captured with a forward pre-hook on its `entry` module and whose target is the
output of its `exit` module. Quantizable layers not inside any block (unusual UNets) form
a final "rest" block that is quantized without reconstruction.

Captures run the UNet on calibration inputs with hooks, stopping the forward early
(`_Stop`) once the last requested hook has fired. Tensors whose first dimension is the UNet
batch are concatenated over calibration batches; everything else (None, ints, flags) is
kept once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pocketdiff.conditioning import Conditioning
from pocketdiff.errors import PocketdiffError

from .cache_store import DiskRows, Store
from .quantizer import QUANTIZABLE, quantizable_layers

BLOCK_TYPES = {
    "ResnetBlock2D": "resnet",
    "Transformer2DModel": "transformer",
    "Downsample2D": "downsample",
    "Upsample2D": "upsample",
}
STEM_MODULES = ("time_embedding", "class_embedding", "add_embedding", "encoder_hid_proj", "conv_in")


class _Head(nn.Module):
    """norm_out -> act -> conv_out, sharing the UNet's modules."""

    def __init__(self, norm: Optional[nn.Module], act: Optional[nn.Module], conv: nn.Module):
        super().__init__()
        self.norm = norm
        self.act = act
        self.conv = conv

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        if self.act is not None:
            x = self.act(x)
        return self.conv(x)


@dataclass
class Unit:
    name: str  # path of the (main) module
    entry: str  # module path whose pre-hook captures the inputs
    exit: str  # module path whose forward hook gives the output
    module: nn.Module  # called with the captured (args, kwargs)
    layers: dict[str, str]  # local quantizable layer name (inside `module`) -> global name


@dataclass
class Block:
    name: str
    kind: str  # stem | resnet | transformer | downsample | upsample | head | rest
    units: list[Unit]
    order: int = -1  # position in the UNet's execution order

    @property
    def layers(self) -> list[str]:
        return [g for u in self.units for g in u.layers.values()]


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "sample"):
        return out.sample
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise PocketdiffError(f"cannot find the output tensor of a block (got {type(out).__name__})")


def skip_filter(unet: nn.Module, skip: Sequence[str]) -> set[str]:
    return set(quantizable_layers(unet, skip))


def build_blocks(unet: nn.Module, skip: Sequence[str] = ()) -> list[Block]:
    """The UNet's blocks in module-definition order (call `order_blocks` for execution order)."""
    kept = skip_filter(unet, skip)
    blocks: list[Block] = []
    children = dict(unet.named_children())

    stem_units = []
    for name in STEM_MODULES:
        if children.get(name) is not None:
            u = _make_unit(unet, name, kept)
            if u.layers:
                stem_units.append(u)
    if stem_units:
        blocks.append(Block("stem", "stem", stem_units))

    covered: set[str] = {g for b in blocks for g in b.layers}
    for path, module in unet.named_modules():
        kind = BLOCK_TYPES.get(type(module).__name__)
        if kind is None or any(path.startswith(b.name + ".") for b in blocks if b.kind in BLOCK_TYPES.values()):
            continue
        u = _make_unit(unet, path, kept)
        if u.layers:
            blocks.append(Block(path, kind, [u]))
            covered.update(u.layers.values())

    conv_out = children.get("conv_out")
    if conv_out is not None and "conv_out" in kept:
        norm = children.get("conv_norm_out")
        act = children.get("conv_act")
        head = _Head(norm, act, conv_out)
        entry = "conv_norm_out" if norm is not None else ("conv_act" if isinstance(act, nn.Module) else "conv_out")
        blocks.append(Block("head", "head", [Unit("head", entry, "conv_out", head, {"conv": "conv_out"})]))
        covered.add("conv_out")

    rest = sorted(kept - covered - {g for b in blocks for g in b.layers})
    if rest:
        blocks.append(Block("rest", "rest", [Unit("rest", "", "", nn.Identity(), {r: r for r in rest})]))
    return blocks


def _make_unit(unet: nn.Module, path: str, kept: set[str]) -> Unit:
    module = unet.get_submodule(path)
    if isinstance(module, QUANTIZABLE):
        layers = {"": path} if path in kept else {}
    else:
        layers = {ln: f"{path}.{ln}" for ln in quantizable_layers(module) if f"{path}.{ln}" in kept}
    return Unit(name=path, entry=path, exit=path, module=module, layers=layers)


# ----------------------------------------------------------------------- calibration set

# Conditioning field -> the CalibSet key it is stored under (the UNet's own names for them)
CONDITIONING_KEYS = {"prompt_embeds": "encoder_hidden_states", "pooled_embeds": "text_embeds", "time_ids": "time_ids"}


@dataclass
class CalibSet:
    """UNet inputs, one row per sample: sample [N, C, h, w], timestep [N], encoder_hidden_states
    [N, L, D], and optional timestep_cond [N, d] / class_labels [N]; a family with added conditions
    (SDXL) also text_embeds [N, P] / time_ids [N, 6] (`CONDITIONING_KEYS`)."""

    sample: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    timestep_cond: Optional[torch.Tensor] = None
    class_labels: Optional[torch.Tensor] = None
    text_embeds: Optional[torch.Tensor] = None
    time_ids: Optional[torch.Tensor] = None
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        d = {"sample": self.sample, "timestep": self.timestep, "encoder_hidden_states": self.encoder_hidden_states}
        for k in ("timestep_cond", "class_labels", "text_embeds", "time_ids"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    def select(self, idx) -> "CalibSet":
        t = {k: v[idx] for k, v in self.tensors().items()}
        return CalibSet(meta=dict(self.meta), **t)

    def batch_kwargs(self, start: int, end: int, device, dtype) -> dict:
        out = {}
        for k, v in self.tensors().items():
            v = v[start:end].to(device)
            if v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return out


def batch_conditioning(batch: dict) -> Conditioning:
    """The `Conditioning` of a `CalibSet` batch (its fields stored under `CONDITIONING_KEYS`)."""
    return Conditioning(**{name: batch[key] for name, key in CONDITIONING_KEYS.items() if batch.get(key) is not None})


def unet_forward(unet: nn.Module, batch: dict) -> torch.Tensor:
    return first_tensor(unet(batch["sample"], batch["timestep"], **batch_conditioning(batch).unet_kwargs(),
                             timestep_cond=batch.get("timestep_cond"), class_labels=batch.get("class_labels"),
                             return_dict=False))


# ----------------------------------------------------------------------- captures


class _Stop(Exception):
    pass


@dataclass
class Captured:
    """A unit's captured inputs (pytree spec + leaves) and / or output."""

    spec: Any = None
    leaves: list = field(default_factory=list)  # tensors [N, ...] (batched) or constants
    batched: list = field(default_factory=list)  # bool per leaf
    output: Optional[torch.Tensor] = None

    def n(self) -> int:
        for leaf, b in zip(self.leaves, self.batched):
            if b:
                return int(leaf.shape[0])
        return 0 if self.output is None else int(self.output.shape[0])

    def inputs(self, idx: Optional[torch.Tensor], device, dtype=None) -> tuple[tuple, dict]:
        leaves = []
        for leaf, b in zip(self.leaves, self.batched):
            if b:
                x = leaf if idx is None else leaf[idx.to(leaf.device)]
                x = x.to(device, non_blocking=True)
                if dtype is not None and x.is_floating_point():
                    x = x.to(dtype)
                leaves.append(x)
            else:
                leaves.append(leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf)
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)

    def nbytes(self, output: bool = True) -> int:
        """Bytes of the batched inputs (and of the output, with `output`)."""
        total = sum(l.numel() * l.element_size() for l, b in zip(self.leaves, self.batched) if b)
        if output and self.output is not None:
            total += self.output.numel() * self.output.element_size()
        return total

    def to(self, device, output: bool = True) -> "Captured":
        """A copy on `device` (the output left out unless `output`)."""
        leaves = [l.to(device, non_blocking=True) if isinstance(l, (torch.Tensor, DiskRows)) else l for l in self.leaves]
        out = self.output.to(device, non_blocking=True) if output and self.output is not None else None
        return Captured(self.spec, leaves, list(self.batched), out)


@dataclass
class Request:
    unit: Unit
    inputs: bool = False
    output: bool = False


@torch.no_grad()
def capture(
    unet: nn.Module,
    calib: CalibSet,
    requests: Sequence[Request],
    *,
    device,
    batch_size: int,
    store_device,
    store_dtype: torch.dtype = torch.float32,
    model_dtype: torch.dtype = torch.float32,
    autocast: Optional[torch.dtype] = None,
    disk_folder=None,
) -> list[Captured]:
    """Run `unet` over `calib` and return, per request, the unit's inputs and / or output
    (stored on `store_device`, or with `disk_folder` in files there: `cache_store.Store`)."""
    n = len(calib)
    results = [Captured() for _ in requests]
    in_stores: list[Optional[list]] = [None] * len(requests)
    out_stores = [Store(n, store_device, store_dtype, disk_folder) if r.output else None for r in requests]
    state = {"start": 0, "bs": 0, "pending": 0}
    handles = []
    n_hooks = sum(int(r.inputs) + int(r.output) for r in requests)

    def fired():
        state["pending"] -= 1
        if state["pending"] == 0:
            raise _Stop()

    def make_pre(i):
        def hook(module, args, kwargs):
            leaves, spec = pytree.tree_flatten((list(args), dict(kwargs)))
            res = results[i]
            if in_stores[i] is None:
                res.spec = spec
                res.batched = [isinstance(l, torch.Tensor) and l.dim() >= 1 and l.shape[0] == state["bs"] for l in leaves]
                in_stores[i] = [Store(n, store_device, store_dtype, disk_folder) if b else None for b in res.batched]
                res.leaves = [None if b else (l.detach().to(store_device) if isinstance(l, torch.Tensor) else l)
                              for l, b in zip(leaves, res.batched)]
            elif spec != res.spec:
                raise PocketdiffError(f"{requests[i].unit.name}: its call signature changed between calibration batches")
            for j, (leaf, b) in enumerate(zip(leaves, res.batched)):
                if b:
                    in_stores[i][j].put(state["start"], leaf)
            fired()
        return hook

    def make_post(i):
        def hook(module, args, output):
            out_stores[i].put(state["start"], first_tensor(output))
            fired()
        return hook

    try:
        for i, r in enumerate(requests):
            if r.inputs:
                handles.append(unet.get_submodule(r.unit.entry).register_forward_pre_hook(make_pre(i), with_kwargs=True))
            if r.output:
                handles.append(unet.get_submodule(r.unit.exit).register_forward_hook(make_post(i)))
        for start in range(0, n, batch_size):
            end = min(n, start + batch_size)
            state.update(start=start, bs=end - start, pending=n_hooks)
            batch = calib.batch_kwargs(start, end, device, model_dtype)
            try:
                with _autocast(device, autocast):
                    unet_forward(unet, batch)
            except _Stop:
                pass
            if state["pending"] != 0:
                raise PocketdiffError("capture: some block hooks never fired (the UNet skipped a block?)")
    finally:
        for h in handles:
            h.remove()
    for i, r in enumerate(requests):
        if r.inputs:
            results[i].leaves = [s.buf if s is not None else l for s, l in zip(in_stores[i], results[i].leaves)]
        if r.output:
            results[i].output = out_stores[i].buf
    return results


def _autocast(device, dtype: Optional[torch.dtype]):
    dev = torch.device(device)
    if dtype is None:
        return torch.autocast(dev.type, enabled=False)
    return torch.autocast(dev.type, dtype=dtype)


@torch.no_grad()
def order_blocks(unet: nn.Module, blocks: list[Block], calib: CalibSet, device, model_dtype=torch.float32) -> dict:
    """Sort `blocks` by execution order (one forward on one sample) and measure, per unit, the
    bytes per sample of its batched inputs and of its output. Checks every hook fires once."""
    calls: dict[str, list[int]] = {}
    sizes: dict[str, dict] = {}
    counter = [0]
    handles = []
    entries = {u.entry: u for b in blocks for u in b.units if u.entry}
    exits = {u.exit: u for b in blocks for u in b.units if u.exit}

    def pre(path):
        def hook(module, args, kwargs):
            counter[0] += 1
            calls.setdefault(path, []).append(counter[0])
            leaves = pytree.tree_leaves((list(args), dict(kwargs)))
            sizes.setdefault(path, {})["in"] = sum(l.numel() * 4 for l in leaves if isinstance(l, torch.Tensor) and l.dim() >= 1 and l.shape[0] == 1)
        return hook

    def post(path):
        def hook(module, args, output):
            sizes.setdefault(path, {})["out"] = first_tensor(output).numel() * 4
        return hook

    try:
        for path in entries:
            handles.append(unet.get_submodule(path).register_forward_pre_hook(pre(path), with_kwargs=True))
        for path in exits:
            handles.append(unet.get_submodule(path).register_forward_hook(post(path)))
        unet_forward(unet, calib.batch_kwargs(0, 1, device, model_dtype))
    finally:
        for h in handles:
            h.remove()
    for path in entries:
        c = calls.get(path, [])
        if len(c) != 1:
            raise PocketdiffError(f"block entry {path!r} ran {len(c)} times in one UNet forward (expected once)")
    for b in blocks:
        b.order = min(calls[u.entry][0] for u in b.units) if b.kind != "rest" else 10 ** 9
        b.units.sort(key=lambda u: calls[u.entry][0] if u.entry else 0)
    blocks.sort(key=lambda b: b.order)
    per_sample = {}
    for b in blocks:
        if b.kind == "rest":
            per_sample[b.name] = {"in": 0, "out": 0}
            continue
        per_sample[b.name] = {"in": sum(sizes[u.entry]["in"] for u in b.units),
                              "out": sum(sizes[u.exit]["out"] for u in b.units)}
    return per_sample


def group_by_budget(blocks: Sequence[Block], per_sample: dict, n: int, budget_bytes: float, keys=("in", "out")) -> list[list[Block]]:
    """Consecutive groups of blocks whose captured data (n samples) fits in `budget_bytes`."""
    groups: list[list[Block]] = []
    cur: list[Block] = []
    used = 0.0
    for b in blocks:
        size = n * sum(per_sample[b.name][k] for k in keys)
        if cur and used + size > budget_bytes:
            groups.append(cur)
            cur, used = [], 0.0
        cur.append(b)
        used += size
    if cur:
        groups.append(cur)
    return groups


def human_bytes(n: float) -> str:
    if n <= 0:
        return "0 B"
    k = min(4, int(math.log(n, 1024)))
    return f"{n / 1024 ** k:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][k]}"
