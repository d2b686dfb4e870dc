"""What to prune: a shape-only profile of every conv (weight size, activation volume, MACs)
and the selection of target convs, mapped to internal groups (`graph`) and, with
``prune.scope: stream / all``, to residual streams (`stream`).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from pocketdiff.conditioning import placeholder_conditioning
from pocketdiff.errors import PocketdiffError

from . import graph as pg
from . import stream as ps

# --------------------------------------------------------------------------------------
# Conv profile: weight sizes, activation volumes and MACs from a shape-only pass
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class LayerStat:
    name: str
    kind: str  # conv | linear
    params: int  # weight + bias
    weight_params: int
    out_shape: tuple  # per sample, e.g. (C, H, W)
    macs: int  # per sample

    @property
    def activation(self) -> int:
        return int(math.prod(self.out_shape))


@torch.no_grad()
def layer_profile(unet: nn.Module, sample_size: Optional[int] = None, seq_len: int = 77) -> dict[str, LayerStat]:
    """Per Conv2d / Linear: parameters, output shape and MACs for one sample at `sample_size`
    (default: the UNet's config), from one forward pass on the meta device (no compute).

    MACs count convolutions and linear layers; the attention score / value matmuls are not
    included (pruning internal ResNet channels does not change them).
    """
    model = pg._meta_twin(unet)
    cfg = model.config
    size = int(sample_size or cfg.sample_size)
    if isinstance(cfg.sample_size, (list, tuple)) and sample_size is None:
        hw = tuple(int(s) for s in cfg.sample_size)
    else:
        hw = (size, size)
    stats: dict[str, LayerStat] = {}
    handles = []

    def make_hook(name):
        def hook(mod, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            per_sample = tuple(out.shape[1:])
            wp = mod.weight.numel()
            bp = mod.bias.numel() if getattr(mod, "bias", None) is not None else 0
            if isinstance(mod, nn.Conv2d):
                kind = "conv"
                macs = int(math.prod(per_sample)) * (mod.in_channels // mod.groups) * mod.kernel_size[0] * mod.kernel_size[1]
            else:
                kind = "linear"
                macs = int(math.prod(per_sample)) * mod.in_features
            if name in stats:  # called twice (shared module): add up
                stats[name].macs += macs
            else:
                stats[name] = LayerStat(name, kind, wp + bp, wp, per_sample, macs)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            handles.append(mod.register_forward_hook(make_hook(name)))
    try:
        x = torch.zeros(1, cfg.in_channels, *hw, device="meta")
        t = torch.tensor([1], device="meta")
        cond = placeholder_conditioning(cfg, batch=1, tokens=seq_len, device="meta")
        kwargs = {}
        if getattr(cfg, "time_cond_proj_dim", None):
            kwargs["timestep_cond"] = torch.zeros(1, cfg.time_cond_proj_dim, device="meta")
        model(x, t, **cond.unet_kwargs(), **kwargs)
    finally:
        for h in handles:
            h.remove()
    # modules that never ran (e.g. unused heads) still have parameters
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)) and name not in stats:
            bp = mod.bias.numel() if getattr(mod, "bias", None) is not None else 0
            stats[name] = LayerStat(name, "conv" if isinstance(mod, nn.Conv2d) else "linear", mod.weight.numel() + bp,
                                    mod.weight.numel(), (), 0)
    return stats


def iter_convs(unet: nn.Module) -> Iterable[tuple[str, nn.Conv2d]]:
    return ((n, m) for n, m in unet.named_modules() if isinstance(m, nn.Conv2d))

# --------------------------------------------------------------------------------------
# Target selection
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Selection:
    groups: list[pg.InternalGroup]  # groups to prune, module order
    targeted: dict[str, LayerStat]  # targeted convs that belong to a selected group
    unprunable: dict[str, str]  # targeted convs that no internal group covers -> reason


def matching_convs(
    profile: dict[str, LayerStat],
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    min_weight_params: Optional[int] = None,
    min_activation: Optional[int] = None,
) -> list[str]:
    """The targeted convs, in profile order (see `select_targets`); raises PocketdiffError when an
    `include` pattern matches no conv."""
    convs = [n for n, s in profile.items() if s.kind == "conv"]
    for pat in include:
        if not any(fnmatch.fnmatchcase(n, pat) for n in convs):
            raise PocketdiffError(f"prune.targets.include: pattern {pat!r} matches no Conv2d of the UNet "
                                  f"(examples: {', '.join(convs[:3])}, ...)")
    out = []
    for name in convs:
        if not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        st = profile[name]
        checks = []
        if min_weight_params is not None:
            checks.append(st.weight_params >= min_weight_params)
        if min_activation is not None:
            checks.append(st.activation >= min_activation)
        if checks and not any(checks):
            continue
        out.append(name)
    return out


def select_targets(
    unet: nn.Module,
    profile: dict[str, LayerStat],
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = (),
    min_weight_params: Optional[int] = None,
    min_activation: Optional[int] = None,
) -> Selection:
    """Convs matching an `include` pattern (fnmatch on module names), no `exclude` pattern,
    and at least one set threshold (weight elements >= `min_weight_params` or output
    elements per sample >= `min_activation`; no threshold set = every matching conv).

    Raises PocketdiffError when a pattern matches no conv or nothing prunable is selected.
    """
    groups = pg.find_internal_groups(unet)
    owner = {}
    for g in groups:
        for cname in g.conv_names:
            owner[cname] = g
    chosen: dict[str, pg.InternalGroup] = {}
    targeted: dict[str, LayerStat] = {}
    unprunable: dict[str, str] = {}
    for name in matching_convs(profile, include, exclude, min_weight_params, min_activation):
        st = profile[name]
        g = owner.get(name)
        if g is None:
            unprunable[name] = "block-output channels (residual / skip coupled): pruned only with prune.scope stream / all"
            continue
        targeted[name] = st
        chosen[g.name] = g
    if not chosen:
        why = f" ({len(unprunable)} selected convs are not prunable: {', '.join(list(unprunable)[:3])})" if unprunable else ""
        raise PocketdiffError(
            "prune.targets: the patterns and thresholds select no prunable conv (ResNet conv1/conv2)" + why
        )
    ordered = [g for g in groups if g.name in chosen]
    return Selection(ordered, targeted, unprunable)

# --------------------------------------------------------------------------------------
# Selection over internal groups and streams together
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Coupled:
    """What `plan_coupled` works on: the selected internal groups and streams, and for every
    targeted conv which group owns its output and input channels."""

    groups: list[pg.InternalGroup]
    streams: list[ps.Stream]
    graph: ps.StreamGraph
    targeted: dict[str, LayerStat]
    unprunable: dict[str, str]
    convs: dict[str, tuple[int, bool, list[tuple[Optional[str], int]], list[tuple[Optional[str], int]]]]


def select_coupled(unet: nn.Module, profile: dict, scope: str, include=("*",), exclude=(), min_weight_params=None,
                   min_activation=None, graph: Optional[ps.StreamGraph] = None) -> Coupled:
    """Targets (as `select_targets`) mapped to internal groups (scope internal /
    all) and streams (scope stream / all): a group or stream is selected when it owns a
    channel dimension of a targeted conv."""
    if scope not in ps.SCOPES:
        raise PocketdiffError(f"prune.scope must be one of {ps.SCOPES}, got {scope!r}")
    names = matching_convs(profile, include, exclude, min_weight_params, min_activation)
    graph = graph if graph is not None else ps.trace_streams(unet)
    internal = pg.find_internal_groups(unet) if scope in ("internal", "all") else []
    streams = graph.streams if scope in ("stream", "all") else []
    owners: dict[str, set] = {}
    for g in internal:
        for c in g.conv_names:
            owners.setdefault(c, set()).add(g.name)
    for s in streams:
        for m in s.members:
            if m.role != "norm":
                owners.setdefault(m.module, set()).add(s.name)
    chosen, targeted, unprunable = set(), {}, {}
    for name in names:
        if not owners.get(name):
            why = "no prunable channel dimension in this scope"
            for label in graph.layout.get(name, {}).values():
                for s in label:
                    if s in graph.fixed:
                        why = f"{s} is fixed: {graph.fixed[s]}"
            unprunable[name] = why
            continue
        targeted[name] = profile[name]
        chosen |= owners[name]
    if not chosen:
        raise PocketdiffError(f"prune.targets: the patterns and thresholds select no conv with prunable channels "
                              f"(prune.scope={scope})")
    groups = [g for g in internal if g.name in chosen]
    sel_streams = [s for s in streams if s.name in chosen]
    internal_by = {g.name: g for g in groups}
    stream_names = {s.name for s in sel_streams}
    mods = dict(unet.named_modules())
    convs = {}
    for name in targeted:
        conv = mods[name]
        kk = conv.kernel_size[0] * conv.kernel_size[1]
        dims = {}
        for role in ("out", "in"):
            label = graph.layout.get(name, {}).get(role)
            if label:
                dims[role] = [(s if s in stream_names else None, graph.channels[s]) for s in label]
            else:
                dims[role] = [(None, ps._dim_size(conv, role))]
        parent, _, leaf = name.rpartition(".")
        if parent in internal_by and leaf == "conv1":
            dims["out"] = [(parent, conv.out_channels)]
        if parent in internal_by and leaf == "conv2":
            dims["in"] = [(parent, conv.in_channels)]
        convs[name] = (kk, conv.bias is not None, dims["out"], dims["in"])
    return Coupled(groups, sel_streams, graph, targeted, unprunable, convs)
