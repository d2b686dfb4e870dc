"""Residual-stream ("block-output") channels of a diffusers UNet2DConditionModel.

What a stream is
----------------
Tensors joined by identity residual additions share one channel index set: a
`ResnetBlock2D` without ``conv_shortcut`` returns ``x + conv2(..)``, a `Transformer2DModel`
returns ``proj_out(..) + x``, so the input and output of such blocks carry the same channels
(in SD, a down level's conv_in / downsampler output, every ResNet and attention block of that
level, and for the last level the whole mid block). Each stream has

- producers, whose *output* channels are the stream: conv_in, a ResNet's conv2 (and its
  conv_shortcut when the block changes width), a transformer's proj_out, a down/upsampler conv;
- consumers, whose *input* channels include the stream: GroupNorms (ResNet norm1, the
  transformer's norm, conv_norm_out), ResNet conv1 / conv_shortcut, transformer proj_in
  (Linear or 1x1 conv), down/upsampler convs, conv_out. In the up path a ResNet takes
  ``cat([up stream, skip from the down path], dim=1)``: its norm1, conv1 and conv_shortcut
  see two streams at two offsets (the same stream twice where the skip is the mid block's
  own level).

Streams are found by tracing one forward pass on the meta device (no compute): the known
blocks above get hooks that label their output tensors (a fresh stream for a new producer,
the input's label for an identity residual), and a torch-function mode follows
``torch.cat`` along channels. A labelled tensor used by anything else outside those blocks
(an unknown op or block) makes its stream fixed (never pruned), and the UNet output is
fixed; so nothing is sliced that the trace did not see. Nothing here names SD-2.1 blocks.

GroupNorm
---------
Stream channels always leave in whole GroupNorm groups of *every* GroupNorm that normalises
them, the ones over skip concatenations included (their groups may straddle the two
concatenated streams or sit at other offsets). A union-find over the groups of all those
norms gives the removable units ("atoms"); an atom that spans two streams, or touches a
fixed one, is kept. So every surviving channel is normalised over exactly the channels it
was normalised over before: removing channels that carry nothing leaves the function
unchanged (tested). Kept counts are multiples of ``round_to`` and never below the stream's
GroupNorm group count.

The result is not a stock-config diffusers model: diffusers gives every GroupNorm the same
group count (``norm_num_groups``) and ties the transformers' inner width to the block width,
while whole-group pruning changes group counts per norm and keeps the attention width. The
pruned UNet is saved like every pruned UNet here (stock config + ``pruning.json`` +
safetensors, `model`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pocketdiff.conditioning import placeholder_conditioning

from . import graph as pg

SCOPES = ("internal", "stream", "all")
PREFIX = "stream@"  # stream names: "stream@" + the module path of its first producer

_ACTIVATIONS = (nn.SiLU, nn.GELU, nn.ReLU, nn.Mish, nn.Identity, nn.Dropout, nn.Tanh, nn.Sigmoid)
# tensor methods / properties that read metadata only
_METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "is_contiguous", "__len__", "ndimension",
             "get_device", "is_complex", "element_size", "nelement"}


# --------------------------------------------------------------------------------------
# Data structures
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Member:
    """One place a stream's channels appear: a module's output (``out``), input (``in``) or
    normalised channels (``norm``), starting at `offset` along that dimension."""

    module: str
    role: str  # out | in | norm
    offset: int


@dataclasses.dataclass
class Stream:
    name: str
    channels: int
    members: list[Member]
    atoms: list[torch.Tensor]  # removable units (sorted channel indices), in channel order
    min_keep: int  # fewest channels allowed: the most GroupNorm groups it fills in one norm (1 without norms)
    norm_groups: int  # that group count

    @property
    def removable(self) -> int:
        return sum(a.numel() for a in self.atoms)

    def member_modules(self) -> list[str]:
        return sorted({m.module for m in self.members})


@dataclasses.dataclass
class StreamGraph:
    streams: list[Stream]  # prunable streams (at least one removable atom), trace order
    fixed: dict[str, str]  # stream name -> why it is never pruned
    layout: dict[str, dict[str, list[str]]]  # module -> role -> stream names along that dimension, in order
    channels: dict[str, int]  # every stream (fixed ones too) -> channel count
    block_outputs: dict[str, str]  # down/mid/up block -> stream of its (first) output

    def by_name(self) -> dict[str, Stream]:
        return {s.name: s for s in self.streams}


# --------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------

def _block_types():
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel
    from diffusers.models.upsampling import Upsample2D

    return ResnetBlock2D, Transformer2DModel, Downsample2D, Upsample2D


def _first_tensor(args, kwargs):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    for v in kwargs.values():
        if isinstance(v, torch.Tensor):
            return v
    return None


def _out_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    sample = getattr(output, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


def _dim_size(module: nn.Module, role: str) -> int:
    if isinstance(module, nn.Conv2d):
        return module.out_channels if role == "out" else module.in_channels
    if isinstance(module, nn.Linear):
        return module.out_features if role == "out" else module.in_features
    if isinstance(module, nn.GroupNorm):
        return module.num_channels
    raise TypeError(type(module).__name__)


class _Tracer(TorchFunctionMode):
    def __init__(self, model: nn.Module, feature_blocks: Sequence[str]):
        super().__init__()
        self.model = model
        self.mods = dict(model.named_modules())
        self.depth = 0
        self.stack: list[bool] = []
        self.labels: dict[int, tuple[str, ...]] = {}
        self.alive: list[torch.Tensor] = []  # keeps labelled tensors alive (ids stay unique)
        self.channels: dict[str, int] = {}
        self.fixed: dict[str, str] = {}
        self.layout: dict[str, dict[str, list[str]]] = {}
        self.block_outputs: dict[str, str] = {}
        self.handles = []
        Resnet, Transformer, Down, Up = _block_types()
        self.kinds = {Resnet: self._resnet, Transformer: self._transformer, Down: self._down, Up: self._up}
        for name, m in model.named_modules():
            handler = next((h for t, h in self.kinds.items() if isinstance(m, t)), None)
            if handler is None and isinstance(m, nn.Conv2d):
                handler = self._conv
            elif handler is None and isinstance(m, nn.GroupNorm):
                handler = self._norm
            elif handler is None and isinstance(m, _ACTIVATIONS):
                handler = self._passthrough
            if handler is not None:
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._make_post(name, handler), with_kwargs=True))
        for name in feature_blocks:
            self.handles.append(self.mods[name].register_forward_hook(self._make_feature(name)))

    # ---- bookkeeping
    def _label(self, t: Optional[torch.Tensor], label: Optional[tuple]) -> None:
        if t is not None and label:
            self.labels[id(t)] = label
            self.alive.append(t)

    def _get(self, t) -> Optional[tuple]:
        return self.labels.get(id(t)) if isinstance(t, torch.Tensor) else None

    def _new(self, name: str, channels: int) -> tuple[str, ...]:
        sname = PREFIX + name
        self.channels[sname] = channels
        return (sname,)

    def _fix(self, label, why: str) -> None:
        for s in label or ():
            self.fixed.setdefault(s, why)

    def _record(self, module: str, role: str, label: tuple) -> None:
        mod = self.mods[module]
        want = _dim_size(mod, role)
        got = sum(self.channels[s] for s in label)
        entry = self.layout.setdefault(module, {})
        if got != want:
            self._fix(label, f"{module} has {want} {role} channels, the trace gives {got}")
        elif role in entry and entry[role] != list(label):
            self._fix(label + tuple(entry[role]), f"{module} is called on different channel sets")
        entry[role] = list(label)

    # ---- hooks
    def _pre(self, module, args, kwargs):
        self.stack.append(self.depth == 0)
        self.depth += 1

    def _make_post(self, name: str, handler: Callable):
        def post(module, args, kwargs, output):
            self.depth -= 1
            top = self.stack.pop()
            if top:
                self.depth += 1  # the handler's own tensor calls are not part of the model's graph
                try:
                    handler(name, module, _first_tensor(args, kwargs), output)
                finally:
                    self.depth -= 1
        return post

    def _make_feature(self, name: str):
        def hook(module, args, output):
            label = self._get(_out_tensor(output))
            if label and len(label) == 1:
                self.block_outputs[name] = label[0]
        return hook

    def _untraced(self, name: str, module, x, output, why: str) -> None:
        label = self._get(x)
        self._fix(label, why)
        out = _out_tensor(output)
        if out is not None and out.dim() == 4:
            new = self._new(name, out.shape[1])
            self._fix(new, why)
            self._label(out, new)

    # ---- known blocks
    def _resnet(self, name, block, x, output):
        label = self._get(x)
        why = None
        if label is None:
            why = f"{name}: input channels not traced"
        elif not isinstance(block.norm1, nn.GroupNorm) or not isinstance(block.conv1, nn.Conv2d) or block.conv1.groups != 1:
            why = f"{name}: norm1 / conv1 are not GroupNorm / Conv2d"
        elif not isinstance(block.conv2, nn.Conv2d) or block.conv2.groups != 1:
            why = f"{name}: conv2 is not a Conv2d"
        elif block.conv_shortcut is not None and (not isinstance(block.conv_shortcut, nn.Conv2d) or block.conv_shortcut.groups != 1):
            why = f"{name}: conv_shortcut is not a Conv2d"
        if why:
            return self._untraced(name, block, x, output, why)
        self._record(f"{name}.norm1", "norm", label)
        self._record(f"{name}.conv1", "in", label)
        if block.conv_shortcut is None:
            out_label = label
        else:
            self._record(f"{name}.conv_shortcut", "in", label)
            out_label = self._new(name, block.conv2.out_channels)
            self._record(f"{name}.conv_shortcut", "out", out_label)
        self._record(f"{name}.conv2", "out", out_label)
        self._label(_out_tensor(output), out_label)

    def _transformer(self, name, block, x, output):
        label = self._get(x)
        ok = (label is not None and getattr(block, "is_input_continuous", False)
              and isinstance(getattr(block, "norm", None), nn.GroupNorm)
              and isinstance(getattr(block, "proj_in", None), (nn.Conv2d, nn.Linear))
              and isinstance(getattr(block, "proj_out", None), (nn.Conv2d, nn.Linear)))
        if ok and isinstance(block.proj_in, nn.Conv2d):
            ok = block.proj_in.groups == 1 and block.proj_out.groups == 1 and block.proj_in.kernel_size == (1, 1)
        if not ok:
            return self._untraced(name, block, x, output, f"{name}: not a continuous-input Transformer2DModel with a GroupNorm")
        self._record(f"{name}.norm", "norm", label)
        self._record(f"{name}.proj_in", "in", label)
        self._record(f"{name}.proj_out", "out", label)
        self._label(_out_tensor(output), label)

    def _sampler(self, name, block, x, output, kind):
        label = self._get(x)
        conv = getattr(block, "conv", None) if getattr(block, "use_conv", False) else None
        if label is None or getattr(block, "norm", None) is not None or getattr(block, "use_conv_transpose", False):
            return self._untraced(name, block, x, output, f"{name}: {kind} with a norm / transposed conv or untraced input")
        if conv is None:  # pooling / interpolation only: channels pass through
            self._label(_out_tensor(output), label)
            return
        if not isinstance(conv, nn.Conv2d) or conv.groups != 1:
            return self._untraced(name, block, x, output, f"{name}: {kind} conv is not a plain Conv2d")
        conv_name = next(n for n, m in block.named_children() if m is conv)
        self._record(f"{name}.{conv_name}", "in", label)
        out_label = self._new(name, conv.out_channels)
        self._record(f"{name}.{conv_name}", "out", out_label)
        self._label(_out_tensor(output), out_label)

    def _down(self, name, block, x, output):
        self._sampler(name, block, x, output, "Downsample2D")

    def _up(self, name, block, x, output):
        self._sampler(name, block, x, output, "Upsample2D")

    # ---- leaves outside known blocks (conv_in, conv_norm_out, conv_act, conv_out)
    def _conv(self, name, conv, x, output):
        label = self._get(x)
        if label is not None:
            if conv.groups != 1:
                self._fix(label, f"{name}: grouped convolution")
            else:
                self._record(name, "in", label)
        out = _out_tensor(output)
        if out is not None and out.dim() == 4:
            new = self._new(name, conv.out_channels)
            if conv.groups != 1:
                self._fix(new, f"{name}: grouped convolution")
            self._record(name, "out", new)
            self._label(out, new)

    def _norm(self, name, norm, x, output):
        label = self._get(x)
        if label is not None:
            self._record(name, "norm", label)
            self._label(_out_tensor(output), label)

    def _passthrough(self, name, module, x, output):
        self._label(_out_tensor(output), self._get(x))

    # ---- torch functions outside known blocks
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth != 0:
            return out
        fname = getattr(func, "__name__", str(func))
        if fname in _METADATA:
            return out
        self.depth += 1
        try:
            if func in (torch.cat, torch.concat, torch.concatenate):
                tensors = args[0] if args else kwargs.get("tensors", ())
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                labels = [self._get(t) for t in tensors]
                if any(labels):
                    if all(labels) and all(t.dim() == 4 for t in tensors) and dim in (1, -3):
                        self._label(out, tuple(s for lab in labels for s in lab))
                    else:
                        for lab in labels:
                            self._fix(lab, f"concatenated with untraced channels ({fname}, dim={dim})")
                return out
            flat = list(args) + list(kwargs.values())
            for a in list(flat):
                if isinstance(a, (list, tuple)):
                    flat.extend(a)
            for a in flat:
                self._fix(self._get(a), f"used by {fname} outside the known blocks")
        finally:
            self.depth -= 1
        return out

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.no_grad()
def trace_streams(unet: nn.Module) -> StreamGraph:
    """The streams of `unet` (any device: the trace runs on a meta twin), with their members,
    removable GroupNorm atoms and the fixed ones (and why)."""
    from .recovery import block_names

    model = pg._meta_twin(unet)
    cfg = model.config
    hw = tuple(int(s) for s in cfg.sample_size) if isinstance(cfg.sample_size, (list, tuple)) else (int(cfg.sample_size),) * 2
    tracer = _Tracer(model, block_names(model))
    kwargs = {}
    if getattr(cfg, "time_cond_proj_dim", None):
        kwargs["timestep_cond"] = torch.zeros(1, cfg.time_cond_proj_dim, device="meta")
    try:
        with tracer:
            out = model(torch.zeros(1, cfg.in_channels, *hw, device="meta"), torch.tensor([1], device="meta"),
                        **placeholder_conditioning(cfg, batch=1, tokens=4, device="meta").unet_kwargs(), **kwargs)
            tracer._fix(tracer._get(_out_tensor(out)), "the UNet output")
    finally:
        tracer.remove()
    return _graph(model, tracer)


def _graph(model: nn.Module, tr: _Tracer) -> StreamGraph:
    mods = dict(model.named_modules())
    members: dict[str, list[Member]] = {s: [] for s in tr.channels}
    for module, roles in tr.layout.items():
        for role, label in roles.items():
            off = 0
            for s in label:
                members[s].append(Member(module, role, off))
                off += tr.channels[s]
    # GroupNorm atoms: union-find over (stream, channel)
    base, total = {}, 0
    for s, c in tr.channels.items():
        base[s] = total
        total += c
    parent = list(range(total))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    own_groups: dict[str, int] = {}
    for module, roles in tr.layout.items():
        label = roles.get("norm")
        if not label:
            continue
        norm = mods[module]
        ids = torch.cat([torch.arange(tr.channels[s]) + base[s] for s in label]).tolist()
        gs = norm.num_channels // norm.num_groups
        for g in range(norm.num_groups):
            chunk = ids[g * gs:(g + 1) * gs]
            r0 = find(chunk[0])
            for i in chunk[1:]:
                r = find(i)
                if r != r0:
                    parent[r] = r0
        for s in label:  # groups this stream fills in that norm (all of them when it is the norm's only input)
            share = math.ceil(norm.num_groups * tr.channels[s] / norm.num_channels - 1e-9)
            own_groups[s] = max(own_groups.get(s, 0), share)
    owner = []
    for s, c in tr.channels.items():
        owner += [s] * c
    comps: dict[int, list[int]] = {}
    for i in range(total):
        comps.setdefault(find(i), []).append(i)
    atoms: dict[str, list[torch.Tensor]] = {s: [] for s in tr.channels}
    for comp in comps.values():
        streams = {owner[i] for i in comp}
        if len(streams) != 1:
            continue  # straddles two streams (a skip concatenation's group): kept
        s = streams.pop()
        if s in tr.fixed:
            continue
        atoms[s].append(torch.tensor(sorted(i - base[s] for i in comp), dtype=torch.long))
    result, fixed = [], dict(tr.fixed)
    for s, c in tr.channels.items():
        if s in fixed:
            continue
        if not any(m.role == "out" for m in members[s]):
            fixed[s] = "no producer traced"
            continue
        a = sorted(atoms[s], key=lambda t: int(t[0]))
        if not a:
            fixed[s] = "every GroupNorm group over it straddles another stream"
            continue
        g = own_groups.get(s, 1)
        result.append(Stream(s, c, members[s], a, min_keep=g, norm_groups=g))
    return StreamGraph(result, fixed, tr.layout, dict(tr.channels), dict(tr.block_outputs))
