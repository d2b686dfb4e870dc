"""Dependency groups of a diffusers UNet2DConditionModel and the physical channel surgery.

What can be removed, and what must move with it
------------------------------------------------
The unit of structured pruning here is the *internal* channel set of a `ResnetBlock2D`:

    x -> norm1 -> SiLU -> conv1 --(+ time_emb_proj(temb))--> norm2 -> SiLU -> conv2 -> (+ shortcut) -> out
                          ^^^^^ out channels        ^^^^ rows     ^^^^^ GroupNorm   ^^^^^ in channels

Removing conv1's output channel ``c`` removes row ``c`` of ``time_emb_proj`` (rows ``c``
and ``n + c`` with ``time_embedding_norm="scale_shift"``), channel ``c`` of ``norm2``
(weight, bias and group membership) and input channel ``c`` of ``conv2``. The block's
external interface (its input and output channel counts) is unchanged, so residual
additions, the shortcut conv, the next block and the up-block skip concatenations need
no change at all. These groups hold most of the large convolutions (every ResNet conv1 /
conv2, e.g. the 3x3 up-block conv1 over 1920 input channels of SD).

Block-output channels (coupled with the residual stream, the shortcut, the next blocks and
the skip concatenation) are not pruned here: with ``prune.scope: internal`` (the default)
those convs are reported as "not prunable"; ``prune.scope: stream / all`` prunes them
through `stream`, which traces the streams and slices every producer and consumer.

GroupNorm semantics
-------------------
``norm2`` normalises contiguous groups of channels. Removing arbitrary channels would move
channels between groups and change every group's statistics. Two modes keep it well defined:

- ``whole_groups`` (default, exact): a GroupNorm group is the pruning unit. The group
  count shrinks (``num_groups = kept groups``) and every surviving channel is normalised
  over exactly the same channels as before. If removed channels contribute nothing
  downstream, the pruned block computes the same function (tested).
- ``per_group``: ``num_groups`` is kept and the same number of channels is removed from
  every group (the least important ones inside each group), so each group keeps its
  members minus the removed ones, in order. Group statistics are then computed over fewer
  channels: an approximation that the recovery fine-tune absorbs.

Channel counts after pruning are always multiples of ``round_to`` and, in ``per_group``
mode, of the group count; in ``whole_groups`` mode of the group size.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from pocketdiff.errors import PocketdiffError

GROUPNORM_MODES = ("whole_groups", "per_group")


# --------------------------------------------------------------------------------------
# Dependency groups
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class InternalGroup:
    """The internal channels of one ResnetBlock2D (conv1 out = norm2 = conv2 in = time_emb_proj rows)."""

    name: str  # module path of the ResnetBlock2D, e.g. "up_blocks.1.resnets.0"
    block: nn.Module

    @property
    def conv1(self) -> nn.Conv2d:
        return self.block.conv1

    @property
    def conv2(self) -> nn.Conv2d:
        return self.block.conv2

    @property
    def norm2(self) -> nn.GroupNorm:
        return self.block.norm2

    @property
    def time_emb_proj(self) -> Optional[nn.Linear]:
        return getattr(self.block, "time_emb_proj", None)

    @property
    def scale_shift(self) -> bool:
        return getattr(self.block, "time_embedding_norm", "default") == "scale_shift"

    @property
    def channels(self) -> int:
        return self.conv1.out_channels

    @property
    def num_groups(self) -> int:
        return self.norm2.num_groups

    @property
    def group_size(self) -> int:
        return self.channels // self.num_groups

    @property
    def conv_names(self) -> tuple[str, str]:
        return (f"{self.name}.conv1", f"{self.name}.conv2")

    def params_per_channel(self) -> int:
        """Parameters removed with one internal channel (conv1 filter + bias, conv2 input slice,
        time-embedding row(s), norm2 weight + bias)."""
        c1, c2 = self.conv1, self.conv2
        n = c1.in_channels * c1.kernel_size[0] * c1.kernel_size[1] + (1 if c1.bias is not None else 0)
        n += c2.out_channels * c2.kernel_size[0] * c2.kernel_size[1]
        proj = self.time_emb_proj
        if proj is not None:
            n += (2 if self.scale_shift else 1) * (proj.in_features + (1 if proj.bias is not None else 0))
        n += 2 if self.norm2.affine else 0
        return n


def _why_not_internal(block: nn.Module) -> Optional[str]:
    conv1, conv2, norm2 = getattr(block, "conv1", None), getattr(block, "conv2", None), getattr(block, "norm2", None)
    if not isinstance(conv1, nn.Conv2d) or not isinstance(conv2, nn.Conv2d):
        return "conv1/conv2 are not Conv2d"
    if not isinstance(norm2, nn.GroupNorm):
        return "norm2 is not a GroupNorm"
    if conv1.groups != 1 or conv2.groups != 1:
        return "grouped convolution"
    n = conv1.out_channels
    if norm2.num_channels != n or conv2.in_channels != n:
        return "conv1 / norm2 / conv2 channel counts disagree"
    if n % norm2.num_groups:
        return "norm2 channels not divisible by its groups"
    if getattr(block, "time_embedding_norm", "default") not in ("default", "scale_shift"):
        return f"time_embedding_norm={block.time_embedding_norm!r}"
    proj = getattr(block, "time_emb_proj", None)
    if proj is not None:
        want = 2 * n if getattr(block, "time_embedding_norm", "default") == "scale_shift" else n
        if not isinstance(proj, nn.Linear) or proj.out_features != want:
            return "time_emb_proj shape does not match conv1"
    return None


def find_internal_groups(unet: nn.Module) -> list[InternalGroup]:
    """Every ResnetBlock2D of `unet` whose internal channels can be pruned, in module order."""
    from diffusers.models.resnet import ResnetBlock2D

    groups = []
    for name, module in unet.named_modules():
        if isinstance(module, ResnetBlock2D) and _why_not_internal(module) is None:
            groups.append(InternalGroup(name, module))
    return groups


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


def _meta_twin(unet: nn.Module) -> nn.Module:
    """A copy of `unet` on the meta device (same module shapes, no data)."""
    import copy

    if all(p.device.type == "meta" for p in unet.parameters()):
        return unet
    # deepcopy with every parameter / buffer pre-mapped to an empty meta tensor: no data is copied
    memo = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
            for p in unet.parameters()}
    for b in unet.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(unet, memo)


@torch.no_grad()
def layer_profile(unet: nn.Module, sample_size: Optional[int] = None, seq_len: int = 77) -> dict[str, LayerStat]:
    """Per Conv2d / Linear: parameters, output shape and MACs for one sample at `sample_size`
    (default: the UNet's config), from one forward pass on the meta device (no compute).

    MACs count convolutions and linear layers; the attention score / value matmuls are not
    included (pruning internal ResNet channels does not change them).
    """
    model = _meta_twin(unet)
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
        emb = torch.zeros(1, seq_len, cfg.cross_attention_dim, device="meta")
        kwargs = {}
        if getattr(cfg, "time_cond_proj_dim", None):
            kwargs["timestep_cond"] = torch.zeros(1, cfg.time_cond_proj_dim, device="meta")
        model(x, t, encoder_hidden_states=emb, **kwargs)
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


# --------------------------------------------------------------------------------------
# Target selection
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Selection:
    groups: list[InternalGroup]  # groups to prune, module order
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
    groups = find_internal_groups(unet)
    owner = {}
    for g in groups:
        for cname in g.conv_names:
            owner[cname] = g
    chosen: dict[str, InternalGroup] = {}
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
# How many channels a group may keep
# --------------------------------------------------------------------------------------

def keep_options(channels: int, num_groups: int, mode: str, round_to: int) -> list[int]:
    """Allowed kept-channel counts of a group, ascending (never fewer channels than groups)."""
    if mode not in GROUPNORM_MODES:
        raise PocketdiffError(f"prune.groupnorm must be one of {GROUPNORM_MODES}, got {mode!r}")
    gs = channels // num_groups
    if mode == "whole_groups":
        cands = [k * gs for k in range(1, num_groups + 1)]
    else:
        cands = [num_groups * m for m in range(1, gs + 1)]
    return [c for c in cands if c % round_to == 0 and c >= num_groups or c == channels]


def nearest_option(options: list[int], target: float) -> int:
    """The allowed count nearest to `target` (ties: keep more)."""
    return min(options, key=lambda c: (abs(c - target), -c))


def check_ratio(group_name: str, channels: int, num_groups: int, ratio: float, mode: str, round_to: int) -> int:
    """Kept channels for a uniform `ratio`; PocketdiffError when the ratio leaves fewer channels than groups."""
    target = channels * (1.0 - ratio)
    if round(target) < num_groups:
        raise PocketdiffError(
            f"prune.ratio={ratio} would leave {round(target)} of {channels} channels in {group_name}, "
            f"fewer than its {num_groups} GroupNorm groups (lower the ratio or exclude the block)"
        )
    return nearest_option(keep_options(channels, num_groups, mode, round_to), target)


# --------------------------------------------------------------------------------------
# Which channels to keep
# --------------------------------------------------------------------------------------

def unit_scores(scores: torch.Tensor, num_groups: int, mode: str) -> torch.Tensor:
    """whole_groups: one score per GroupNorm group (sum of its channels)."""
    if mode == "whole_groups":
        return scores.reshape(num_groups, -1).sum(dim=1)
    return scores


def choose_keep(scores: torch.Tensor, num_groups: int, keep: int, mode: str) -> torch.Tensor:
    """Sorted indices of the `keep` channels to keep, respecting the GroupNorm mode.

    whole_groups: the `keep / group_size` groups with the largest summed score;
    per_group: in every group, the `keep / num_groups` channels with the largest score.
    Ties break towards lower indices (deterministic).
    """
    scores = scores.detach().to("cpu", torch.float64)
    n = scores.numel()
    gs = n // num_groups
    if keep == n:
        return torch.arange(n)
    if mode == "whole_groups":
        if keep % gs:
            raise PocketdiffError(f"internal error: keep={keep} is not a multiple of the group size {gs}")
        g_scores = scores.reshape(num_groups, gs).sum(dim=1)
        order = _stable_desc(g_scores)
        kept_groups = torch.sort(order[: keep // gs]).values
        return (kept_groups[:, None] * gs + torch.arange(gs)[None, :]).reshape(-1)
    if keep % num_groups:
        raise PocketdiffError(f"internal error: keep={keep} is not a multiple of the group count {num_groups}")
    m = keep // num_groups
    idx = []
    for g in range(num_groups):
        order = _stable_desc(scores[g * gs : (g + 1) * gs])
        idx.append(torch.sort(order[:m]).values + g * gs)
    return torch.cat(idx)


def _stable_desc(x: torch.Tensor) -> torch.Tensor:
    """Indices by decreasing value, ties by increasing index."""
    return torch.sort(-x, stable=True).indices


# --------------------------------------------------------------------------------------
# Surgery
# --------------------------------------------------------------------------------------

def _new_like(module: nn.Module, factory) -> nn.Module:
    p = next(module.parameters())
    with torch.device(p.device):
        new = factory()
    return new.to(dtype=p.dtype)


@torch.no_grad()
def prune_internal(group: InternalGroup, keep: torch.Tensor, mode: str) -> None:
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


def iter_convs(unet: nn.Module) -> Iterable[tuple[str, nn.Conv2d]]:
    return ((n, m) for n, m in unet.named_modules() if isinstance(m, nn.Conv2d))


# --------------------------------------------------------------------------------------
# Allocation: how many channels each group keeps
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class GroupBudget:
    """What allocation needs to know about one group."""

    name: str
    channels: int
    num_groups: int
    cost: float  # targeted-conv parameters removed per channel
    scores: Optional[torch.Tensor] = None  # per channel (global allocation only)


def _removal_units(scores: torch.Tensor, num_groups: int, mode: str) -> list[torch.Tensor]:
    """Channel scores in the order `choose_keep` gives channels up: one tensor per unit
    (whole_groups: a GroupNorm group; per_group: the next-weakest channel of every group)."""
    n = scores.numel()
    gs = n // num_groups
    s = scores.detach().to("cpu", torch.float64).reshape(num_groups, gs)
    if mode == "whole_groups":
        order = torch.sort(s.sum(1), stable=True).indices
        return [s[g] for g in order.tolist()]
    ranked = torch.sort(s, dim=1, stable=True).values  # ascending inside each group
    return [ranked[:, j] for j in range(gs)]


def _uniform(budgets: Sequence[GroupBudget], ratio: float, mode: str, round_to: int) -> dict[str, int]:
    """Each group keeps one of the two allowed counts around ``channels * (1 - ratio)``: the
    nearest first, then single groups switch to the other one while that brings the removed
    fraction of the targeted parameters closer to `ratio` (rounding errors do not add up)."""
    keep = {b.name: check_ratio(b.name, b.channels, b.num_groups, ratio, mode, round_to) for b in budgets}
    brackets = {}
    for b in budgets:
        opts = keep_options(b.channels, b.num_groups, mode, round_to)
        t = b.channels * (1.0 - ratio)
        below = [c for c in opts if c <= t]
        above = [c for c in opts if c >= t]
        brackets[b.name] = {c for c in (max(below) if below else None, min(above) if above else None) if c is not None}
    total = sum(b.cost * b.channels for b in budgets)
    target = ratio * total
    removed = sum(b.cost * (b.channels - keep[b.name]) for b in budgets)
    for _ in range(4 * len(budgets)):
        best = None
        for b in budgets:
            for c in brackets[b.name] - {keep[b.name]}:
                new = removed + b.cost * (keep[b.name] - c)
                gain = abs(removed - target) - abs(new - target)
                if gain > 1e-9 and (best is None or gain > best[0]):
                    best = (gain, b.name, c, new)
        if best is None:
            break
        _, name, c, removed = best
        keep[name] = c
    return keep


def allocate(
    budgets: Sequence[GroupBudget],
    ratio: float,
    mode: str,
    round_to: int,
    allocation: str = "uniform",
    max_layer_ratio: float = 1.0,
) -> dict[str, int]:
    """Kept channels per group so that about `ratio` of the targeted conv parameters go.

    uniform: every group keeps the allowed count nearest to ``channels * (1 - ratio)``.
    global: groups give up units (see `_removal_units`) in order of increasing normalised
    importance (score / group mean), greedily, until the removed targeted parameters reach
    ``ratio``; no group loses more than `max_layer_ratio` of its channels.
    Raises PocketdiffError when the ratio would leave fewer channels than groups.
    """
    if not 0.0 < ratio < 1.0:
        raise PocketdiffError(f"prune.ratio must be in (0, 1), got {ratio}")
    if allocation == "uniform":
        return _uniform(budgets, ratio, mode, round_to)
    if allocation != "global":
        raise PocketdiffError(f"prune.allocation must be 'uniform' or 'global', got {allocation!r}")
    import heapq

    total = sum(b.cost * b.channels for b in budgets)
    target = ratio * total
    state = {}
    capacity = 0.0
    for b in budgets:
        floor_c = max(b.num_groups, math.ceil(b.channels * (1.0 - max_layer_ratio) - 1e-9))
        opts = sorted((c for c in keep_options(b.channels, b.num_groups, mode, round_to) if c >= floor_c), reverse=True)
        if not opts or opts[0] != b.channels:
            opts = [b.channels] + opts
        capacity += b.cost * (b.channels - opts[-1])
        state[b.name] = {"budget": b, "opts": opts, "pos": 0}
    if capacity < target - 1e-6:
        raise PocketdiffError(
            f"prune.ratio={ratio} cannot be reached: even keeping the fewest channels allowed in every group "
            f"(never fewer channels than GroupNorm groups, max_layer_ratio={max_layer_ratio}) removes "
            f"{capacity / max(total, 1):.3f} of the targeted conv parameters"
        )

    def step_priority(name):
        st = state[name]
        b, opts, pos = st["budget"], st["opts"], st["pos"]
        if pos + 1 >= len(opts):
            return None
        if b.scores is None:
            raise PocketdiffError("global allocation needs importance scores")
        units = st.setdefault("units", _removal_units(b.scores, b.num_groups, mode))
        unit = b.channels // len(units)
        mean = float(b.scores.double().mean()) or 1.0
        lo, hi = (b.channels - opts[pos]) // unit, (b.channels - opts[pos + 1]) // unit
        removed = torch.cat(units[lo:hi])
        return float(removed.mean()) / abs(mean)

    heap = []
    for i, name in enumerate(state):
        p = step_priority(name)
        if p is not None:
            heapq.heappush(heap, (p, i, name))
    removed = 0.0
    while heap and removed < target:
        _, i, name = heapq.heappop(heap)
        st = state[name]
        b, opts = st["budget"], st["opts"]
        gain = b.cost * (opts[st["pos"]] - opts[st["pos"] + 1])
        if removed + gain > target and (removed + gain - target) > (target - removed):
            break  # stopping here is closer to the target than taking this step
        st["pos"] += 1
        removed += gain
        p = step_priority(name)
        if p is not None:
            heapq.heappush(heap, (p, i, name))
    return {name: st["opts"][st["pos"]] for name, st in state.items()}
