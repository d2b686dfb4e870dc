"""The physical channel surgery: modules rebuilt smaller with the kept channels' weights.

`prune_internal` removes a ResNet block's internal channels (conv1 out, time_emb_proj rows,
norm2, conv2 in; see `graph`); `prune_streams` slices every producer and consumer of the
traced residual streams (see `stream`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

from . import graph as pg
from . import stream as ps

# --------------------------------------------------------------------------------------
# Internal groups
# --------------------------------------------------------------------------------------

def _new_like(module: nn.Module, factory) -> nn.Module:
    p = next(module.parameters())
    with torch.device(p.device):
        new = factory()
    return new.to(dtype=p.dtype)


@torch.no_grad()
def prune_internal(group: pg.InternalGroup, keep: torch.Tensor, mode: str) -> None:
    """Physically keep only the internal channels `keep` (sorted) of `group`'s block."""
    block = group.block
    n = group.channels
    keep = torch.as_tensor(keep, dtype=torch.long).reshape(-1).cpu()
    if keep.numel() == n:
        return
    if keep.numel() == 0 or not bool((keep[1:] > keep[:-1]).all()) or int(keep.min()) < 0 or int(keep.max()) >= n:
        raise PocketdiffError(f"{group.name}: keep indices must be sorted, unique and inside [0, {n})")
    k = keep.numel()
    G = group.num_groups
    gs = n // G
    if mode == "whole_groups":
        blocks = keep.reshape(-1, gs) if k % gs == 0 else None
        if blocks is None or not bool(((blocks - blocks[:, :1]) == torch.arange(gs)).all()) or bool((blocks[:, 0] % gs).any()):
            raise PocketdiffError(f"{group.name}: whole_groups mode keeps whole GroupNorm groups of {gs} channels")
        new_groups = k // gs
    else:
        per = torch.bincount(keep // gs, minlength=G)
        if not bool((per == per[0]).all()) or int(per[0]) == 0:
            raise PocketdiffError(f"{group.name}: per_group mode keeps the same number of channels in each of {G} groups")
        new_groups = G

    conv1, conv2, norm2, proj = group.conv1, group.conv2, group.norm2, group.time_emb_proj
    dev = conv1.weight.device
    kd = keep.to(dev) if dev.type != "meta" else keep

    def take(t: torch.Tensor, dim: int) -> torch.Tensor:
        if t.device.type == "meta":
            shape = list(t.shape)
            shape[dim] = k
            return torch.empty(shape, dtype=t.dtype, device="meta")
        return t.index_select(dim, kd.to(t.device)).clone()

    c1 = _new_like(conv1, lambda: nn.Conv2d(conv1.in_channels, k, conv1.kernel_size, conv1.stride, conv1.padding,
                                            conv1.dilation, 1, conv1.bias is not None, conv1.padding_mode))
    c1.weight = nn.Parameter(take(conv1.weight, 0), requires_grad=conv1.weight.requires_grad)
    if conv1.bias is not None:
        c1.bias = nn.Parameter(take(conv1.bias, 0), requires_grad=conv1.bias.requires_grad)
    block.conv1 = c1

    c2 = _new_like(conv2, lambda: nn.Conv2d(k, conv2.out_channels, conv2.kernel_size, conv2.stride, conv2.padding,
                                            conv2.dilation, 1, conv2.bias is not None, conv2.padding_mode))
    c2.weight = nn.Parameter(take(conv2.weight, 1), requires_grad=conv2.weight.requires_grad)
    if conv2.bias is not None:
        c2.bias = nn.Parameter(conv2.bias.detach().clone(), requires_grad=conv2.bias.requires_grad)
    block.conv2 = c2

    nm = _new_like(norm2, lambda: nn.GroupNorm(new_groups, k, eps=norm2.eps, affine=norm2.affine))
    if norm2.affine:
        nm.weight = nn.Parameter(take(norm2.weight, 0), requires_grad=norm2.weight.requires_grad)
        nm.bias = nn.Parameter(take(norm2.bias, 0), requires_grad=norm2.bias.requires_grad)
    block.norm2 = nm

    if proj is not None:
        rows = torch.cat([keep, keep + n]) if group.scale_shift else keep
        kr = rows.numel()
        pl = _new_like(proj, lambda: nn.Linear(proj.in_features, kr, bias=proj.bias is not None))

        def take_rows(t):
            if t.device.type == "meta":
                return torch.empty((kr,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta")
            return t.index_select(0, rows.to(t.device)).clone()

        pl.weight = nn.Parameter(take_rows(proj.weight), requires_grad=proj.weight.requires_grad)
        if proj.bias is not None:
            pl.bias = nn.Parameter(take_rows(proj.bias), requires_grad=proj.bias.requires_grad)
        block.time_emb_proj = pl

# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------

def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put `new` wherever `old` is a child (aliases such as Downsample2D's Conv2d_0 included)."""
    for m in root.modules():
        for k, child in list(m._modules.items()):
            if child is old:
                m._modules[k] = new


def _take(t: torch.Tensor, dim: int, idx: Optional[torch.Tensor]) -> torch.Tensor:
    if idx is None:
        return t.detach().clone()
    if t.device.type == "meta":
        shape = list(t.shape)
        shape[dim] = idx.numel()
        return torch.empty(shape, dtype=t.dtype, device="meta")
    return t.detach().index_select(dim, idx.to(t.device)).clone()


def _param(t: torch.Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


@torch.no_grad()
def slice_module(module: nn.Module, out_idx: Optional[torch.Tensor], in_idx: Optional[torch.Tensor], name: str) -> nn.Module:
    """A new Conv2d / Linear / GroupNorm holding the kept output / input (GroupNorm: `out_idx`)
    channels of `module` (None: all)."""
    if isinstance(module, nn.GroupNorm):
        n, G = module.num_channels, module.num_groups
        gs = n // G
        if out_idx is None:
            return module
        mask = torch.zeros(n, dtype=torch.bool)
        mask[out_idx] = True
        per = mask.reshape(G, gs).sum(1)
        if not bool(((per == 0) | (per == gs)).all()):
            raise PocketdiffError(f"{name}: stream pruning would split a GroupNorm group (internal error)")
        new = _new_like(module, lambda: nn.GroupNorm(int((per == gs).sum()), int(out_idx.numel()), eps=module.eps, affine=module.affine))
        if module.affine:
            new.weight = _param(_take(module.weight, 0, out_idx), module.weight)
            new.bias = _param(_take(module.bias, 0, out_idx), module.bias)
        return new
    if isinstance(module, nn.Conv2d):
        c_out = module.out_channels if out_idx is None else out_idx.numel()
        c_in = module.in_channels if in_idx is None else in_idx.numel()
        new = _new_like(module, lambda: nn.Conv2d(c_in, c_out, module.kernel_size, module.stride, module.padding,
                                                     module.dilation, 1, module.bias is not None, module.padding_mode))
    elif isinstance(module, nn.Linear):
        c_out = module.out_features if out_idx is None else out_idx.numel()
        c_in = module.in_features if in_idx is None else in_idx.numel()
        new = _new_like(module, lambda: nn.Linear(c_in, c_out, bias=module.bias is not None))
    else:
        raise PocketdiffError(f"{name}: cannot slice a {type(module).__name__}")
    new.weight = _param(_take(_take(module.weight, 0, out_idx), 1, in_idx), module.weight)
    if module.bias is not None:
        new.bias = _param(_take(module.bias, 0, out_idx), module.bias)
    return new


def module_indices(graph: ps.StreamGraph, keeps: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Per module and role, the kept indices along that dimension (only modules that change)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for module, roles in graph.layout.items():
        for role, label in roles.items():
            if not any(s in keeps and keeps[s].numel() < graph.channels[s] for s in label):
                continue
            parts, off = [], 0
            for s in label:
                k = keeps.get(s)
                parts.append((k if k is not None else torch.arange(graph.channels[s])) + off)
                off += graph.channels[s]
            out.setdefault(module, {})[role] = torch.cat(parts)
    return out


@torch.no_grad()
def apply_indices(unet: nn.Module, indices: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace every module named in `indices` by its sliced copy, then fix the blocks'
    recorded channel counts (`model.sync_channel_attributes`)."""
    from .model import sync_channel_attributes

    mods = dict(unet.named_modules())
    for module, roles in indices.items():
        old = mods[module]
        out_idx = roles.get("norm") if isinstance(old, nn.GroupNorm) else roles.get("out")
        new = slice_module(old, out_idx, roles.get("in"), module)
        if new is not old:
            _replace(unet, old, new)
    sync_channel_attributes(unet)


def prune_streams(unet: nn.Module, graph: ps.StreamGraph, keeps: dict[str, torch.Tensor]) -> None:
    """Keep only channels `keeps[stream]` (sorted indices) of each named stream, in place."""
    for s, k in keeps.items():
        if s not in graph.channels:
            raise PocketdiffError(f"unknown stream {s}")
        if k.numel() == 0 or int(k.max()) >= graph.channels[s] or not bool((k[1:] > k[:-1]).all()):
            raise PocketdiffError(f"{s}: keep indices must be sorted, unique and inside [0, {graph.channels[s]})")
    apply_indices(unet, module_indices(graph, keeps))
