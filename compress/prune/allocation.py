"""How many channels each group or stream keeps, and which ones.

Internal groups (`graph`): the keep options a group's GroupNorm allows, the choice of kept
channels from importance scores, and `allocate` (uniform or global over groups).
Streams (`stream`): atoms given up in order of importance, the ladder of kept counts, and
`allocate_coupled` over internal groups and streams together (``prune.scope: stream / all``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from pocketdiff.errors import PocketdiffError

from . import graph as pg
from . import stream as ps
from . import targets as pt

# --------------------------------------------------------------------------------------
# How many channels a group may keep
# --------------------------------------------------------------------------------------

def keep_options(channels: int, num_groups: int, mode: str, round_to: int) -> list[int]:
    """Allowed kept-channel counts of a group, ascending (never fewer channels than groups)."""
    if mode not in pg.GROUPNORM_MODES:
        raise PocketdiffError(f"prune.groupnorm must be one of {pg.GROUPNORM_MODES}, got {mode!r}")
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

# --------------------------------------------------------------------------------------
# Which channels a stream keeps
# --------------------------------------------------------------------------------------

def removal_order(stream: ps.Stream, scores: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """The stream's atoms in the order they are given up: lowest mean channel score first
    (ties: lower channel index first); channel order without scores."""
    if scores is None:
        return list(stream.atoms)
    s = scores.detach().to("cpu", torch.float64)
    means = torch.tensor([float(s[a].mean()) for a in stream.atoms], dtype=torch.float64)
    order = torch.sort(means, stable=True).indices.tolist()
    return [stream.atoms[i] for i in order]


def stream_ladder(stream: ps.Stream, order: list[torch.Tensor], round_to: int, floor: int = 0) -> list[tuple[int, int]]:
    """Allowed (kept channels, atoms removed) pairs, descending: removing a prefix of `order`,
    kept a multiple of `round_to` and >= max(min_keep, floor); (channels, 0) always."""
    out = [(stream.channels, 0)]
    kept = stream.channels
    for k, a in enumerate(order, start=1):
        kept -= a.numel()
        if kept % round_to == 0 and kept >= max(stream.min_keep, floor):
            out.append((kept, k))
    return out


def stream_keep(stream: ps.Stream, order: list[torch.Tensor], n_atoms: int) -> torch.Tensor:
    """Sorted kept channel indices after removing the first `n_atoms` atoms of `order`."""
    mask = torch.ones(stream.channels, dtype=torch.bool)
    for a in order[:n_atoms]:
        mask[a] = False
    return torch.nonzero(mask).reshape(-1)

# --------------------------------------------------------------------------------------
# Allocation over internal groups and streams together
# --------------------------------------------------------------------------------------

def _params(convs, counts: dict[str, int]) -> float:
    total = 0.0
    for kk, bias, outs, ins in convs.values():
        o = sum(counts.get(g, n) if g else n for g, n in outs)
        i = sum(counts.get(g, n) if g else n for g, n in ins)
        total += o * i * kk + (o if bias else 0)
    return total


@dataclasses.dataclass
class _Ladder:
    name: str
    channels: int
    min_keep: int
    what: str  # for messages: "8 GroupNorm groups"
    counts: list[int]  # allowed kept counts, descending, counts[0] == channels
    removed: list[torch.Tensor]  # scores of the channels given up between counts[i] and counts[i+1]
    mean: float


def _ladders(sel: pt.Coupled, scores: Optional[dict], mode: str, round_to: int, floor_ratio: Optional[float]) -> list[_Ladder]:
    out = []
    for g in sel.groups:
        C = g.channels
        s = scores[g.name] if scores is not None else torch.ones(C, dtype=torch.float64)
        floor = max(g.num_groups, math.ceil(C * (1.0 - floor_ratio) - 1e-9)) if floor_ratio is not None else g.num_groups
        opts = sorted({c for c in keep_options(C, g.num_groups, mode, round_to) if c >= floor} | {C}, reverse=True)
        units = _removal_units(s, g.num_groups, mode)
        u = C // len(units)
        removed = [torch.cat(units[(C - a) // u:(C - b) // u]) for a, b in zip(opts, opts[1:])]
        out.append(_Ladder(g.name, C, g.num_groups, f"{g.num_groups} GroupNorm groups", opts, removed,
                           float(s.double().abs().mean()) or 1.0))
    for st in sel.streams:
        C = st.channels
        s = scores[st.name] if scores is not None else None
        order = removal_order(st, s)
        floor = math.ceil(C * (1.0 - floor_ratio) - 1e-9) if floor_ratio is not None else 0
        steps = stream_ladder(st, order, round_to, floor)
        sv = s if s is not None else torch.ones(C, dtype=torch.float64)
        removed = [torch.cat([sv[a] for a in order[k0:k1]]) for (_, k0), (_, k1) in zip(steps, steps[1:])]
        out.append(_Ladder(st.name, C, st.min_keep, f"{st.norm_groups} GroupNorm groups", [c for c, _ in steps], removed,
                           float(sv.double().abs().mean()) or 1.0))
    return out


def allocate_coupled(sel: pt.Coupled, ratio: float, mode: str, round_to: int, allocation: str = "uniform",
                     max_layer_ratio: float = 0.9, scores: Optional[dict] = None, scope: str = "all") -> dict[str, int]:
    """Kept channels per internal group and stream so that about `ratio` of the targeted conv
    parameters go. A conv loses parameters along both dimensions (conv1: stream inputs x
    internal outputs), so costs are recomputed from the kept counts, not added per channel.

    uniform: every group and stream keeps the allowed count nearest to ``channels * (1 - r)``,
    with one per-channel fraction `r` found by bisection. global: units leave in order of
    increasing normalised importance (as `allocate`) until the ratio is reached.
    """
    if not 0.0 < ratio < 1.0:
        raise PocketdiffError(f"prune.ratio must be in (0, 1), got {ratio}")
    full = _params(sel.convs, {})
    if full <= 0:
        raise PocketdiffError("prune.targets: the targeted convs have no parameters")
    if allocation == "uniform":
        return _coupled_uniform(sel, _ladders(sel, scores, mode, round_to, None), full, ratio, scope)
    if allocation != "global":
        raise PocketdiffError(f"prune.allocation must be 'uniform' or 'global', got {allocation!r}")
    if scores is None:
        scores = {}
        for g in sel.groups:
            scores[g.name] = torch.ones(g.channels, dtype=torch.float64)
        for st in sel.streams:
            scores[st.name] = torch.ones(st.channels, dtype=torch.float64)
    ladders = _ladders(sel, scores, mode, round_to, max_layer_ratio)
    return _coupled_global(sel, ladders, full, ratio, max_layer_ratio, scope)


def _coupled_uniform(sel: pt.Coupled, ladders: list[_Ladder], full: float, ratio: float, scope: str) -> dict[str, int]:
    """`allocate_coupled`'s uniform allocation: 1. the largest per-channel fraction every ladder
    allows (refused when even that cannot reach the ratio); 2. bisection on that fraction with
    rounded counts; 3. single groups / streams moved to their other neighbouring count."""
    r_max = min((1.0 - (l.min_keep - 0.5) / l.channels for l in ladders), default=0.0)

    def cont(r):  # removed fraction with unrounded counts
        return 1.0 - _params(sel.convs, {l.name: l.channels * (1.0 - r) for l in ladders}) / full

    if cont(r_max) < ratio:
        limit = [l for l in ladders if abs((1.0 - (l.min_keep - 0.5) / l.channels) - r_max) < 1e-12]
        names = ", ".join(f"{l.name} ({l.channels} channels, {l.what})" for l in limit[:3])
        raise PocketdiffError(
            f"prune.ratio={ratio} would leave fewer channels than GroupNorm groups in {names} "
            f"(prune.scope={scope}: at most {cont(r_max):.3f} of the targeted conv parameters can go; "
            f"lower the ratio or exclude those blocks)")

    def counts_at(r):
        return {l.name: nearest_option(l.counts, l.channels * (1.0 - r)) for l in ladders}

    def frac(r):
        return 1.0 - _params(sel.convs, counts_at(r)) / full

    lo, hi = 0.0, r_max
    best = (abs(frac(0.0) - ratio), 0.0)
    for _ in range(50):
        mid = (lo + hi) / 2
        f = frac(mid)
        best = min(best, (abs(f - ratio), mid))
        if f < ratio:
            lo = mid
        else:
            hi = mid
    for r in (lo, hi):
        best = min(best, (abs(frac(r) - ratio), r))
    return _single_moves(sel, ladders, full, ratio, best[1], counts_at(best[1]))


def _single_moves(sel: pt.Coupled, ladders: list[_Ladder], full: float, ratio: float, r: float,
                  counts: dict[str, int]) -> dict[str, int]:
    """Single groups / streams switch to the other allowed count around their target at fraction
    `r` while that brings the removed fraction closer to the ratio (coarse units do not add up)."""
    brackets = {}
    for l in ladders:
        t = l.channels * (1.0 - r)
        below = [c for c in l.counts if c <= t]
        above = [c for c in l.counts if c >= t]
        brackets[l.name] = {c for c in (max(below) if below else None, min(above) if above else None) if c is not None}
    err = abs(1.0 - _params(sel.convs, counts) / full - ratio)
    for _ in range(4 * len(ladders)):
        move = None
        for l in ladders:
            for c in brackets[l.name] - {counts[l.name]}:
                e = abs(1.0 - _params(sel.convs, {**counts, l.name: c}) / full - ratio)
                if e < err - 1e-12 and (move is None or e < move[0]):
                    move = (e, l.name, c)
        if move is None:
            break
        err, name, c = move
        counts[name] = c
    return counts


def _coupled_global(sel: pt.Coupled, ladders: list[_Ladder], full: float, ratio: float, max_layer_ratio: float,
                    scope: str) -> dict[str, int]:
    """`allocate_coupled`'s global allocation: removal steps leave in order of increasing normalised
    importance until the ratio is reached (refused when the floors cannot reach it)."""
    import heapq

    target = ratio * full
    floor_counts = {l.name: l.counts[-1] for l in ladders}
    capacity = full - _params(sel.convs, floor_counts)
    if capacity < target - 1e-6:
        raise PocketdiffError(
            f"prune.ratio={ratio} cannot be reached: even keeping the fewest channels allowed in every group and "
            f"stream (never fewer channels than GroupNorm groups, max_layer_ratio={max_layer_ratio}, "
            f"prune.scope={scope}) removes {capacity / full:.3f} of the targeted conv parameters")
    pos = {l.name: 0 for l in ladders}
    by = {l.name: l for l in ladders}

    def priority(name):
        l = by[name]
        if pos[name] + 1 >= len(l.counts):
            return None
        return float(l.removed[pos[name]].mean()) / abs(l.mean)

    heap = []
    for i, l in enumerate(ladders):
        p = priority(l.name)
        if p is not None:
            heapq.heappush(heap, (p, i, l.name))
    counts = {l.name: l.channels for l in ladders}
    removed = 0.0
    while heap and removed < target:
        _, i, name = heapq.heappop(heap)
        trial = dict(counts)
        trial[name] = by[name].counts[pos[name] + 1]
        new = full - _params(sel.convs, trial)
        if new > target and (new - target) > (target - removed):
            break
        counts, removed = trial, new
        pos[name] += 1
        p = priority(name)
        if p is not None:
            heapq.heappush(heap, (p, i, name))
    return counts
