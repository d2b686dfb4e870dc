"""Pruning a UNet in memory, usable without the CLI: `plan_shapes` (also on a meta-device
model, to validate a config before anything runs) and `prune_unet` (select, score,
allocate, slice; returns the pruned copy and its plan), plus `macs_table`."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import ModelConfig

from . import allocation as pa
from . import slicing as psl
from . import targets as pt
from .settings import PruneSettings
from .importance import group_parameters, needs_gradients, resolve_importance, score_group, score_stream
from .model import to_pruned



# --------------------------------------------------------------------------------------
# Planning (also run on a meta-device model to validate the config)
# --------------------------------------------------------------------------------------

def _unet_config_for(model: ModelConfig, resolution: int) -> Optional[tuple[dict, Optional[dict]]]:
    """(UNet config, pruning spec or None) without loading weights; None when unknown here
    (hub ids, separate VAEs): then `run` checks the same things after loading."""
    from pocketdiff.models import built_unet_config, vae_config

    if model.pretrained:
        from pocketdiff.shipped import resolve_shipped

        folder = Path(resolve_shipped(str(model.pretrained))).expanduser() / "unet"
        if not (folder / "config.json").is_file():
            return None
        try:
            conf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            spec = json.loads((folder / "pruning.json").read_text(encoding="utf-8")) if (folder / "pruning.json").is_file() else None
        except (OSError, json.JSONDecodeError):
            return None
        return conf, spec
    if model.vae:
        return None
    factor = 2 ** (len(vae_config(model.arch)["block_out_channels"]) - 1)
    return built_unet_config(model, resolution, vae_factor=factor), None


def precheck(model: ModelConfig, resolution: int, p: PruneSettings, blocks=None) -> None:
    """Blocks to remove (`blocks`, a BlocksSettings), targets and ratio (the `prune:` section `p`) against the
    shapes of `model` at `resolution`, on the meta device (no weights, ~1 s). A stock UNet folder's config.json
    is checked against its weights' shapes (safetensors header) first."""
    from .blocks import check_unet_folder, precheck_blocks

    found = _unet_config_for(model, resolution)
    if found is None:
        return
    from .model import build_pruned_unet

    conf, spec = found
    if model.pretrained and spec is None:
        from pocketdiff.shipped import resolve_shipped

        check_unet_folder(Path(resolve_shipped(str(model.pretrained))).expanduser() / "unet", conf)
    unet = build_pruned_unet(conf, spec or {"format": "pocketdiff-pruned-unet", "version": 1, "modules": {}})
    if blocks is not None and blocks.active:
        if (spec or {}).get("modules"):
            raise PocketdiffError("blocks: model.pretrained is channel-pruned; remove blocks from the unpruned model "
                                  "(one prune run removes blocks and then channels)")
        unet = precheck_blocks(conf, blocks, {k: tuple(v.shape) for k, v in unet.state_dict().items()})
    if p.ratio > 0:
        plan_shapes(unet, p)


def _budgets(selection: pt.Selection, scores: Optional[dict[str, torch.Tensor]] = None) -> list[pa.GroupBudget]:
    out = []
    for g in selection.groups:
        cost = 0.0
        c1, c2 = g.conv_names
        if c1 in selection.targeted:
            cost += g.conv1.in_channels * g.conv1.kernel_size[0] * g.conv1.kernel_size[1] + (1 if g.conv1.bias is not None else 0)
        if c2 in selection.targeted:
            cost += g.conv2.out_channels * g.conv2.kernel_size[0] * g.conv2.kernel_size[1]
        out.append(pa.GroupBudget(g.name, g.channels, g.num_groups, cost, None if scores is None else scores[g.name]))
    return out


def plan_shapes(unet, p: PruneSettings, profile: Optional[dict] = None):
    """Target selection + (for uniform allocation) kept channels per group; raises on bad input.
    Scope internal: (targets.Selection, keep); stream / all: (targets.Coupled, keep)."""
    profile = profile if profile is not None else pt.layer_profile(unet)
    if p.scope != "internal":
        sel = _select_coupled(unet, profile, p)
        keep = pa.allocate_coupled(sel, p.ratio, p.groupnorm, p.round_to, p.allocation, p.max_layer_ratio, scope=p.scope)
        return sel, keep
    sel = pt.select_targets(unet, profile, p.targets.include, p.targets.exclude, p.targets.min_weight_params, p.targets.min_activation)
    budgets = _budgets(sel)
    if p.allocation == "uniform":
        keep = pa.allocate(budgets, p.ratio, p.groupnorm, p.round_to, "uniform")
    else:  # feasibility only: scores are needed to decide
        fake = {b.name: torch.ones(b.channels) for b in budgets}
        keep = pa.allocate(_budgets(sel, fake), p.ratio, p.groupnorm, p.round_to, "global", p.max_layer_ratio)
    return sel, keep


# --------------------------------------------------------------------------------------
# The pruning itself
# --------------------------------------------------------------------------------------

def _select_coupled(unet, profile, p: PruneSettings) -> pt.Coupled:
    t = p.targets
    return pt.select_coupled(unet, profile, p.scope, t.include, t.exclude, t.min_weight_params, t.min_activation)


def prune_unet(unet, p: PruneSettings, *, generator: Optional[torch.Generator] = None, gradient_fn=None, scores=None):
    """Prune a copy of `unet` (a UNet2DConditionModel) and return (PrunedUNet2DConditionModel, plan).

    `gradient_fn(unet_copy, params)` accumulates gradients when the importance needs them
    (Taylor); `scores` ({group or stream name: Tensor}) skips the importance callable. `plan`
    lists per group the channels and GroupNorm groups before/after, kept indices and the
    scores; with ``p.scope`` stream / all also per stream (``plan["streams"]``) and, per
    down / mid / up block, the kept channels of its output (``plan["feature_channels"]``,
    for feature distillation against the unpruned teacher).
    """
    generator = generator or torch.Generator().manual_seed(0)
    work = copy.deepcopy(unet)
    profile = pt.layer_profile(work)
    if p.scope != "internal":
        return _prune_coupled(work, profile, p, generator, gradient_fn, scores)
    sel = pt.select_targets(work, profile, p.targets.include, p.targets.exclude, p.targets.min_weight_params, p.targets.min_activation)
    importance = resolve_importance(p.importance)
    if scores is None:
        scores = _scores(work, sel.groups, [], importance, p, generator, gradient_fn)
    keep_counts = pa.allocate(_budgets(sel, scores), p.ratio, p.groupnorm, p.round_to, p.allocation, p.max_layer_ratio)
    plan = _prune_groups(sel, scores, keep_counts, p)
    pruned = to_pruned(work)
    return pruned, {"groups": plan, "unprunable": sel.unprunable, "targeted": sorted(sel.targeted)}


def _scores(work, groups, streams, importance, p: PruneSettings, generator, gradient_fn) -> dict:
    """Importance of every internal group and stream, by name."""
    if needs_gradients(importance):
        if gradient_fn is None:
            raise PocketdiffError(f"importance {p.importance!r} needs gradients: pass gradient_fn")
        gradient_fn(work, group_parameters(groups, streams, work))
    scores = {g.name: score_group(importance, g, work, generator) for g in groups}
    scores.update({st.name: score_stream(importance, st, work, generator) for st in streams})
    for prm in work.parameters():
        prm.grad = None
    return scores


def _prune_groups(sel, scores: dict, counts: dict, p: PruneSettings) -> list[dict]:
    """Cut the internal channels of every group of `sel` to its count; the plan rows."""
    plan = []
    for g in sel.groups:
        before_c, before_g = g.channels, g.num_groups
        keep = pa.choose_keep(scores[g.name], g.num_groups, counts[g.name], p.groupnorm)
        psl.prune_internal(g, keep, p.groupnorm)
        plan.append({
            "group": g.name, "channels_before": before_c, "channels_after": g.channels,
            "groupnorm_groups_before": before_g, "groupnorm_groups_after": g.num_groups,
            "targeted_convs": [c for c in g.conv_names if c in sel.targeted],
            "keep": keep.tolist(), "scores": [float(s) for s in scores[g.name].tolist()],
        })
    return plan


def _prune_coupled(work, profile, p: PruneSettings, generator, gradient_fn, scores):
    """`prune_unet` for scope stream / all: internal groups and streams allocated together."""
    sel = _select_coupled(work, profile, p)
    importance = resolve_importance(p.importance)
    if scores is None:
        scores = _scores(work, sel.groups, sel.streams, importance, p, generator, gradient_fn)
    missing = [n for n in [g.name for g in sel.groups] + [st.name for st in sel.streams] if n not in scores]
    if missing:
        raise PocketdiffError(f"prune_unet: no scores for {missing[:3]}")
    counts = pa.allocate_coupled(sel, p.ratio, p.groupnorm, p.round_to, p.allocation, p.max_layer_ratio,
                                 scores=scores, scope=p.scope)
    # streams first (input / output dimensions of many modules at once), then the internal channels
    keeps, streams_plan = {}, []
    for st in sel.streams:
        order = pa.removal_order(st, scores[st.name])
        ladder = dict(pa.stream_ladder(st, order, p.round_to))
        keeps[st.name] = pa.stream_keep(st, order, ladder[counts[st.name]])
    psl.prune_streams(work, sel.graph, keeps)
    mods = dict(work.named_modules())
    for st in sel.streams:
        norms = [m for m in st.members if m.role == "norm"]
        streams_plan.append({
            "stream": st.name, "channels_before": st.channels, "channels_after": int(keeps[st.name].numel()),
            "removable_units": len(st.atoms), "min_channels": st.min_keep,
            "groupnorms": {m.module: mods[m.module].num_groups for m in norms},
            "producers": sorted({m.module for m in st.members if m.role == "out"}),
            "consumers": sorted({m.module for m in st.members if m.role != "out"}),
            "targeted_convs": sorted(m for m in st.member_modules() if m in sel.targeted),
            "keep": keeps[st.name].tolist(), "scores": [float(x) for x in scores[st.name].tolist()],
        })
    plan = _prune_groups(sel, scores, counts, p)
    features = {b: (keeps[s].tolist() if s in keeps else None) for b, s in sel.graph.block_outputs.items()}
    pruned = to_pruned(work)
    return pruned, {"scope": p.scope, "groups": plan, "streams": streams_plan, "feature_channels": features,
                    "fixed_streams": sel.graph.fixed, "unprunable": sel.unprunable, "targeted": sorted(sel.targeted)}


def macs_table(before: dict, after: dict, targeted: list[str], rename=None) -> dict:
    """Params and MACs per conv and in total. `rename(name before) -> name after, or None for a removed
    layer` (block removal renumbers blocks; default: the same name); `targeted` holds names after."""
    per_conv, tot = [], {"conv_before": 0, "conv_after": 0, "linear_before": 0, "linear_after": 0}
    for sa in after.values():
        tot[f"{sa.kind}_after"] += sa.macs
    for name, sb in before.items():
        new = rename(name) if rename is not None else name
        sa = after.get(new) if new is not None else None
        tot[f"{sb.kind}_before"] += sb.macs
        if sb.kind == "conv":
            row = {"name": name, "targeted": new in targeted, "params_before": sb.params, "params_after": sa.params if sa else 0,
                   "macs_before": sb.macs, "macs_after": sa.macs if sa else 0, "out_shape": list(sb.out_shape)}
            if rename is not None:
                row["name_after"] = new  # None: removed with its block
            per_conv.append(row)
    tot["total_before"] = tot["conv_before"] + tot["linear_before"]
    tot["total_after"] = tot["conv_after"] + tot["linear_after"]
    tot["note"] = "multiply-accumulates per sample at the UNet's sample size; convolutions + linear layers (attention score/value matmuls excluded, unchanged by pruning)"
    tot["per_conv"] = per_conv
    return tot
