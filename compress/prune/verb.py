"""`pocketdiff prune`: dependency-aware structured pruning of the large UNet convolutions,
then recovery distillation from the unpruned model.

1. load data and the teacher pipeline (`model.pretrained`, or a built `model.arch`)
2. select target convs (name patterns + weight-size / activation-volume thresholds) and
   map them to their dependency groups: ResNet-block internal channels (`graph`) and,
   with ``prune.scope: stream`` or ``all``, the residual-stream (block-output) channels
   shared through identity residuals and skip concatenations (`stream`)
3. score channels with the importance callable (`importance`; Taylor accumulates
   denoising-loss gradients over stratified timesteps first)
4. allocate kept channels per group (uniform or global), remove them physically, save the
   pruned UNet (`pruned_unet/`, pocketdiff format: stock config + pruning.json + safetensors)
5. recovery: knowledge distillation from the unpruned UNet through the shared training
   loop (`recovery`, `--resume latest`)
6. measure: params and MACs per conv and in total, teacher-relative error on fixed probes,
   FD / CLIP (through `pocketdiff.evaluate` when available), sample grids; save the
   pipeline folder (`pipeline/`, stock components + pruned unet) and report.json + index.html

Loading the result: `pocketdiff.compress.prune.load_pruned_pipeline(dir)` (or
`load_pruned_unet(dir/unet)`); see `model`.

Bad input is refused while the config is validated, before the output folder is touched:
a ratio outside (0, 1), a target pattern matching no conv, targets with nothing prunable,
an unknown `prune.scope`, and a ratio that would leave a group or stream with fewer channels
than its GroupNorm groups.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.models import DISTILL_META, ModelConfig, count_params, read_distill_meta
from pocketdiff.device import resolve_device
from pocketdiff.outputs import commit_folder, read_json, write_json
from pocketdiff.train.loop import LoopConfig

from . import graph as pg
from . import stream as ps
from .importance import (
    accumulate_diffusion_gradients,
    group_parameters,
    needs_gradients,
    resolve_importance,
    score_group,
    score_stream,
)
from .model import (  # noqa: F401  (re-exported: the loader hooks other stages call)
    PrunedUNet2DConditionModel,
    is_pruned_pipeline,
    load_pruned_pipeline,
    load_pruned_unet,
    to_pruned,
)
from .recovery import RecoveryConfig, recover

log = logging.getLogger(__name__)

__all__ = ["Config", "run", "load_pruned_pipeline", "load_pruned_unet", "is_pruned_pipeline", "prune_unet"]

ALLOCATIONS = ("uniform", "global")


@dataclasses.dataclass
class TargetConfig:
    """Which convs are pruned: name patterns (fnmatch) and size thresholds.

    A conv is a target when it matches an `include` pattern, no `exclude` pattern, and (if
    any threshold is set) its weight has >= `min_weight_params` elements OR its output has
    >= `min_activation` elements per sample at the UNet's sample size. Targets that no
    internal ResNet group covers (conv_in, shortcuts, samplers, 1x1 projections) are listed
    in the report as not prunable.
    """

    include: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    exclude: list[str] = dataclasses.field(default_factory=list)
    min_weight_params: Optional[int] = None
    min_activation: Optional[int] = None

    def __post_init__(self) -> None:
        require(len(self.include) > 0, "prune.targets.include", "needs at least one pattern")
        require(self.min_weight_params is None or self.min_weight_params >= 0, "prune.targets.min_weight_params", "must be >= 0")
        require(self.min_activation is None or self.min_activation >= 0, "prune.targets.min_activation", "must be >= 0")


@dataclasses.dataclass
class TaylorConfig:
    """Gradient accumulation for `importance: taylor` (Diff-Pruning)."""

    samples: int = 256  # calibration samples; timesteps are stratified over all of them
    batch_size: int = 16
    t_min: float = 0.0  # timestep range, as fractions of the training timesteps
    t_max: float = 1.0

    def __post_init__(self) -> None:
        require(self.samples > 0, "prune.taylor.samples", "must be positive")
        require(self.batch_size > 0, "prune.taylor.batch_size", "must be positive")
        require(0.0 <= self.t_min < self.t_max <= 1.0, "prune.taylor", "needs 0 <= t_min < t_max <= 1")


@dataclasses.dataclass
class PruneSettings:
    """The `prune:` section."""

    ratio: float = 0.3  # fraction of the targeted convs' parameters to remove
    # which channels: internal (ResNet conv1 -> norm2 -> conv2 channels; block widths kept) |
    # stream (the residual-stream / block-output channels of every level, skip concatenations,
    # samplers, conv_in / conv_out and attention proj_in / proj_out with them) | all (both)
    scope: str = "internal"
    importance: str = "l1"  # l1 | l2 | taylor | random | "module:function"
    groupnorm: str = "whole_groups"  # internal channels: whole_groups (exact) | per_group (keeps num_groups); streams always lose whole groups
    allocation: str = "uniform"  # uniform | global
    round_to: int = 8  # kept channel counts are multiples of this
    max_layer_ratio: float = 0.9  # global allocation: most any group may lose
    targets: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    taylor: TaylorConfig = dataclasses.field(default_factory=TaylorConfig)

    def __post_init__(self) -> None:
        require(0.0 < self.ratio < 1.0, "prune.ratio", f"must be in (0, 1) (fraction of targeted conv parameters to remove), got {self.ratio}")
        require(self.scope in ps.SCOPES, "prune.scope", f"must be one of {ps.SCOPES}, got {self.scope!r}")
        require(self.groupnorm in pg.GROUPNORM_MODES, "prune.groupnorm", f"must be one of {pg.GROUPNORM_MODES}, got {self.groupnorm!r}")
        require(self.allocation in ALLOCATIONS, "prune.allocation", f"must be one of {ALLOCATIONS}, got {self.allocation!r}")
        require(self.round_to >= 1, "prune.round_to", f"must be >= 1, got {self.round_to}")
        require(0.0 < self.max_layer_ratio < 1.0, "prune.max_layer_ratio", "must be in (0, 1)")
        try:
            resolve_importance(self.importance)
        except PocketdiffError as e:
            raise type(e)(str(e)) from None


@dataclasses.dataclass
class EvalSettings:
    """What is measured before pruning, after pruning and after recovery.

    Always: the teacher-relative error on fixed probes and a sample grid. With
    `metrics: true`, FD and CLIP score through `pocketdiff.evaluate` (its library API:
    `MetricSetup` + `evaluate_pipelines`): `num_samples` images per model for the first
    captions of the `data:` set, FD against that set's images, same prompts and seeds for the
    three models. `features: clip` needs a (domain) CLIP folder in `clip`, and names the
    score "FD (<domain>-CLIP)"; `features: inception` is Inception FID.
    """

    probe_samples: int = 64  # teacher-relative error on fixed (x_t, t, caption) probes
    metrics: bool = False  # FD / CLIP score through pocketdiff.evaluate
    features: str = "clip"  # clip | inception
    clip: Optional[str] = None  # CLIP folder or hub id (FD features when features=clip, and CLIP score)
    inception_weights: Optional[str] = None  # local Inception weights for features=inception
    num_samples: int = 1024  # images per model and seed for FD / CLIP
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    batch_size: int = 64
    prompts: list[str] = dataclasses.field(default_factory=list)  # sample grid (default: first captions)
    steps: Optional[int] = None  # DDIM steps (grid and metrics); default: distill.json's, else 25
    guidance_scale: Optional[float] = None  # default: distill.json's guidance scale, else 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.probe_samples >= 0, "eval.probe_samples", "must be >= 0")
        require(self.num_samples >= 2, "eval.num_samples", "must be >= 2 (FD needs two images)")
        require(self.steps is None or self.steps >= 1, "eval.steps", "must be >= 1")
        require(self.guidance_scale is None or self.guidance_scale >= 0, "eval.guidance_scale", "must be >= 0")
        require(self.features in ("clip", "inception"), "eval.features", f"must be clip or inception, got {self.features!r}")
        require(bool(self.seeds), "eval.seeds", "needs at least one seed")
        if self.metrics and self.features == "clip":
            require(bool(self.clip), "eval.clip", "a CLIP folder is needed for features=clip (e.g. outputs/clip-openmoji/clip)")


@dataclasses.dataclass
class Config:
    seed: int = 0
    device: str = "auto"  # importance, probes and sampling (recovery uses Accelerate's device)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    prune: PruneSettings = dataclasses.field(default_factory=PruneSettings)
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)
    train: LoopConfig = dataclasses.field(default_factory=lambda: LoopConfig(max_steps=500, batch_size=16, lr=5e-5))
    eval: EvalSettings = dataclasses.field(default_factory=EvalSettings)

    def __post_init__(self) -> None:
        require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"), "device",
                f"must be auto, cpu, cuda[:N] or mps, got {self.device!r}")
        precheck(self)  # model-dependent bad input, refused before anything is written


# --------------------------------------------------------------------------------------
# Planning (also run on a meta-device model to validate the config)
# --------------------------------------------------------------------------------------

def _unet_config_for(cfg: Config) -> Optional[tuple[dict, Optional[dict]]]:
    """(UNet config, pruning spec or None) without loading weights; None when unknown here
    (hub ids, separate VAEs): then `run` checks the same things after loading."""
    from pocketdiff.models import unet_config, vae_config

    if cfg.model.pretrained:
        from pocketdiff.shipped import resolve_shipped

        folder = Path(resolve_shipped(str(cfg.model.pretrained))).expanduser() / "unet"
        if not (folder / "config.json").is_file():
            return None
        try:
            conf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            spec = json.loads((folder / "pruning.json").read_text(encoding="utf-8")) if (folder / "pruning.json").is_file() else None
        except (OSError, json.JSONDecodeError):
            return None
        return conf, spec
    if cfg.model.vae:
        return None
    factor = 2 ** (len(vae_config(cfg.model.arch)["block_out_channels"]) - 1)
    return unet_config(cfg.model.arch, cfg.model.prediction_type, cfg.data.resolution, vae_factor=factor), None


def precheck(cfg: Config) -> None:
    """Targets and ratio against the model's shapes, on the meta device (no weights, ~1 s)."""
    found = _unet_config_for(cfg)
    if found is None:
        return
    from .model import build_pruned_unet

    conf, spec = found
    unet = build_pruned_unet(conf, spec or {"format": "pocketdiff-pruned-unet", "version": 1, "modules": {}})
    plan_shapes(unet, cfg.prune)


def _budgets(selection: pg.Selection, scores: Optional[dict[str, torch.Tensor]] = None) -> list[pg.GroupBudget]:
    out = []
    for g in selection.groups:
        cost = 0.0
        c1, c2 = g.conv_names
        if c1 in selection.targeted:
            cost += g.conv1.in_channels * g.conv1.kernel_size[0] * g.conv1.kernel_size[1] + (1 if g.conv1.bias is not None else 0)
        if c2 in selection.targeted:
            cost += g.conv2.out_channels * g.conv2.kernel_size[0] * g.conv2.kernel_size[1]
        out.append(pg.GroupBudget(g.name, g.channels, g.num_groups, cost, None if scores is None else scores[g.name]))
    return out


def plan_shapes(unet, p: PruneSettings, profile: Optional[dict] = None):
    """Target selection + (for uniform allocation) kept channels per group; raises on bad input.
    Scope internal: (graph.Selection, keep); stream / all: (stream.Coupled, keep)."""
    profile = profile if profile is not None else pg.layer_profile(unet)
    if p.scope != "internal":
        sel = _select_coupled(unet, profile, p)
        keep = ps.allocate_coupled(sel, p.ratio, p.groupnorm, p.round_to, p.allocation, p.max_layer_ratio, scope=p.scope)
        return sel, keep
    sel = pg.select_targets(unet, profile, p.targets.include, p.targets.exclude, p.targets.min_weight_params, p.targets.min_activation)
    budgets = _budgets(sel)
    if p.allocation == "uniform":
        keep = pg.allocate(budgets, p.ratio, p.groupnorm, p.round_to, "uniform")
    else:  # feasibility only: scores are needed to decide
        fake = {b.name: torch.ones(b.channels) for b in budgets}
        keep = pg.allocate(_budgets(sel, fake), p.ratio, p.groupnorm, p.round_to, "global", p.max_layer_ratio)
    return sel, keep


# --------------------------------------------------------------------------------------
# The pruning itself (usable without the CLI)
# --------------------------------------------------------------------------------------

def _select_coupled(unet, profile, p: PruneSettings) -> ps.Coupled:
    t = p.targets
    return ps.select_coupled(unet, profile, p.scope, t.include, t.exclude, t.min_weight_params, t.min_activation)


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
    profile = pg.layer_profile(work)
    if p.scope != "internal":
        return _prune_coupled(work, profile, p, generator, gradient_fn, scores)
    sel = pg.select_targets(work, profile, p.targets.include, p.targets.exclude, p.targets.min_weight_params, p.targets.min_activation)
    importance = resolve_importance(p.importance)
    if scores is None:
        scores = _scores(work, sel.groups, [], importance, p, generator, gradient_fn)
    keep_counts = pg.allocate(_budgets(sel, scores), p.ratio, p.groupnorm, p.round_to, p.allocation, p.max_layer_ratio)
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
        keep = pg.choose_keep(scores[g.name], g.num_groups, counts[g.name], p.groupnorm)
        pg.prune_internal(g, keep, p.groupnorm)
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
    counts = ps.allocate_coupled(sel, p.ratio, p.groupnorm, p.round_to, p.allocation, p.max_layer_ratio,
                                 scores=scores, scope=p.scope)
    # streams first (input / output dimensions of many modules at once), then the internal channels
    keeps, streams_plan = {}, []
    for st in sel.streams:
        order = ps.removal_order(st, scores[st.name])
        ladder = dict(ps.stream_ladder(st, order, p.round_to))
        keeps[st.name] = ps.stream_keep(st, order, ladder[counts[st.name]])
    ps.prune_streams(work, sel.graph, keeps)
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


# --------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------

def macs_table(before: dict, after: dict, targeted: list[str]) -> dict:
    per_conv, tot = [], {"conv_before": 0, "conv_after": 0, "linear_before": 0, "linear_after": 0}
    for name, sb in before.items():
        sa = after[name]
        tot[f"{sb.kind}_before"] += sb.macs
        tot[f"{sb.kind}_after"] += sa.macs
        if sb.kind == "conv":
            per_conv.append({"name": name, "targeted": name in targeted, "params_before": sb.params, "params_after": sa.params,
                             "macs_before": sb.macs, "macs_after": sa.macs, "out_shape": list(sb.out_shape)})
    tot["total_before"] = tot["conv_before"] + tot["linear_before"]
    tot["total_after"] = tot["conv_after"] + tot["linear_after"]
    tot["note"] = "multiply-accumulates per sample at the UNet's sample size; convolutions + linear layers (attention score/value matmuls excluded, unchanged by pruning)"
    tot["per_conv"] = per_conv
    return tot


@torch.no_grad()
def _encode(pipe, items: list[dict], generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    from pocketdiff.data import collate
    from pocketdiff.train.losses import tokenize

    batch = collate(items)
    x = batch["pixel_values"].to(device)
    dist = pipe.vae.encode(x).latent_dist
    eps = torch.randn(dist.mean.shape, generator=generator).to(device)
    latents = (dist.mean + dist.std * eps) * pipe.vae.config.scaling_factor
    emb = pipe.text_encoder(tokenize(pipe.tokenizer, list(batch["text"])).to(device))[0]
    return latents, emb


def _calibration_batches(pipe, dataset, n: int, batch_size: int, generator: torch.Generator, device):
    order = torch.randperm(len(dataset), generator=generator).tolist()
    while len(order) < n:
        order += order
    order = order[:n]
    for start in range(0, n, batch_size):
        items = [dataset[i] for i in order[start : start + batch_size]]
        yield _encode(pipe, items, generator, device)


class Probe:
    """Fixed (x_t, t, text) inputs and the teacher's outputs on them: the teacher-relative
    error of a student is mean((s - t)^2) and its ratio to mean(t^2)."""

    def __init__(self, pipe, teacher, dataset, n: int, seed: int, device, batch_size: int = 16, guidance_scale: float = 3.0):
        from pocketdiff.sampling import default_w_embedding_fn

        g = torch.Generator().manual_seed(seed * 31 + 17)
        w_fn = default_w_embedding_fn(teacher)
        T = pipe.scheduler.config.num_train_timesteps
        self.batches = []
        idx = list(range(len(dataset)))[-n:] if n <= len(dataset) else [i % len(dataset) for i in range(n)]
        ts = ((torch.arange(n, dtype=torch.float64) + torch.rand(n, generator=g, dtype=torch.float64)) * T / n).long().clamp(0, T - 1)
        for s in range(0, n, batch_size):
            items = [dataset[i] for i in idx[s : s + batch_size]]
            lat, emb = _encode(pipe, items, g, device)
            noise = torch.randn(lat.shape, generator=g).to(device)
            t = ts[s : s + len(items)].to(device)
            x = pipe.scheduler.add_noise(lat, noise, t)
            kw = {}
            if w_fn is not None:  # guidance-conditioned: the evaluation guidance scale
                kw["timestep_cond"] = w_fn(torch.full((len(items),), float(guidance_scale))).to(device, emb.dtype)
            with torch.no_grad():
                ref = teacher(x, t, encoder_hidden_states=emb, **kw).sample.float()
            self.batches.append((x, t, emb, kw, ref))

    @torch.no_grad()
    def error(self, unet) -> dict:
        if not self.batches:
            return {}
        se, ref2, n = 0.0, 0.0, 0
        for x, t, emb, kw, ref in self.batches:
            out = unet(x, t, encoder_hidden_states=emb, **kw).sample.float()
            se += float(((out - ref) ** 2).sum())
            ref2 += float((ref ** 2).sum())
            n += ref.numel()
        return {"mse_to_teacher": se / n, "relative_mse": se / max(ref2, 1e-12), "samples": sum(b[0].shape[0] for b in self.batches)}


def external_metrics(cfg: Config, pipe, unets: dict, out: Path, device, steps: int = 25, guidance_scale: float = 3.0) -> dict:
    """FD and CLIP score of each named UNet (same pipeline otherwise) through pocketdiff.evaluate."""
    if not cfg.eval.metrics:
        return {"available": False, "reason": "eval.metrics is false"}
    try:
        from pocketdiff.evaluate import MetricConfig, MetricSetup, evaluate_pipelines
    except ImportError as e:
        return {"available": False, "reason": f"pocketdiff.evaluate is not importable: {e}"}
    e = cfg.eval
    mcfg = MetricConfig(fd=True, clip_score=bool(e.clip), features=e.features, clip=e.clip,
                        inception_weights=e.inception_weights, batch_size=e.batch_size)
    setup = MetricSetup(mcfg, cfg.data, device)
    captions = list(setup.reference_captions())
    prompts = [captions[i % len(captions)] for i in range(e.num_samples)]
    models = [{"name": name, "pipe": pipe, "unet": unet} for name, unet in unets.items()]
    results = evaluate_pipelines(models, prompts, [steps], setup, out / "eval", seeds=e.seeds,
                                 guidance_scale=guidance_scale, batch_size=e.batch_size,
                                 resolution=cfg.data.resolution, device=device, grid_prompts=8)
    by_name = {r["model"]: {k: r.get(k) for k in ("fd", "fd_std", "clip_score", "clip_score_std", "features",
                                                   "clip_model_label", "num_samples", "num_seeds", "steps")}
               for r in results}
    res: dict = {"available": True, "results": by_name, "page": "eval/index.html"}
    fd0 = by_name.get("before_pruning", {}).get("fd")
    for key in ("after_pruning", "after_recovery"):
        fd = by_name.get(key, {}).get("fd")
        if fd0 and fd is not None:
            res[f"fd_ratio_{key}"] = fd / fd0
    return res


# --------------------------------------------------------------------------------------
# Report helpers
# --------------------------------------------------------------------------------------

def plot_importance(plan: list[dict], path: Path, title: str, mode: str = "per_group") -> Path:
    """Left: sorted normalised scores per group; right: histogram of kept vs pruned units
    (whole_groups: one unit = one GroupNorm group, scored by its channels' sum)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    kept_all, pruned_all = [], []
    for g in plan:
        s = torch.tensor(g["scores"], dtype=torch.float64)
        mask = torch.zeros(len(s), dtype=torch.bool)
        mask[torch.tensor(g["keep"], dtype=torch.long)] = True
        if mode == "whole_groups":
            G = g["groupnorm_groups_before"]
            s = s.reshape(G, -1).sum(1)
            mask = mask.reshape(G, -1).all(1)
        s = s / (float(s.abs().mean()) or 1.0)
        order = torch.argsort(s)
        xs = torch.linspace(0, 1, len(s))
        a1.plot(xs.tolist(), s[order].tolist(), lw=1, alpha=0.7)
        kept_all += s[mask].tolist()
        pruned_all += s[~mask].tolist()
    unit = "GroupNorm groups" if mode == "whole_groups" else "channels"
    a1.set_xlabel(f"rank / {unit} (per ResNet block)")
    a1.set_ylabel("importance / block mean")
    a1.set_title(f"sorted importance of {unit}")
    a1.grid(alpha=0.3)
    if kept_all:
        a2.hist(kept_all, bins=40, alpha=0.6, label=f"kept ({len(kept_all)})")
    if pruned_all:
        a2.hist(pruned_all, bins=40, alpha=0.6, label=f"pruned ({len(pruned_all)})")
    a2.set_xlabel("importance / block mean")
    a2.set_ylabel(unit)
    a2.set_title(title)
    a2.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _save_unet_atomic(unet, folder: Path) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    unet.save_pretrained(str(tmp))
    commit_folder(tmp, folder)


# --------------------------------------------------------------------------------------
# The verb
# --------------------------------------------------------------------------------------

def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    from pocketdiff.data import ImageCaptionDataset, InMemoryImageCaptionDataset, collate, load_captioned_dataset
    from pocketdiff.models import check_resolution, load_or_build, save_pipeline
    from pocketdiff.report import img, plot_curves, save_grid, table, write_page
    from pocketdiff.sampling import default_w_embedding_fn, generate

    out = Path(out)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)

    # 1. data and teacher
    hf_ds = load_captioned_dataset(cfg.data)
    captions = list(hf_ds["text"])
    dataset = InMemoryImageCaptionDataset(ImageCaptionDataset(hf_ds))  # decoded once: recovery reads items many times
    pipe = load_or_build(cfg.model, captions=captions, resolution=cfg.data.resolution)
    if isinstance(pipe.unet, PrunedUNet2DConditionModel):
        log.info("model.pretrained is already pruned: pruning it further")
    check_resolution(pipe, cfg.data.resolution)  # before any work
    teacher = pipe.unet.to(device).eval().requires_grad_(False)
    pipe.vae.to(device).eval().requires_grad_(False)
    pipe.text_encoder.to(device).eval().requires_grad_(False)
    report: dict[str, Any] = {"data": {"source": cfg.data.source, "items": len(dataset), "resolution": cfg.data.resolution},
                              "teacher": cfg.model.pretrained or f"built {cfg.model.arch} (random weights)"}
    meta = read_distill_meta(cfg.model.pretrained)
    guid = meta.get("guidance") or {}
    w_fn = default_w_embedding_fn(teacher)  # guidance-conditioned teacher (time_cond_proj_dim), else None
    w_range = (float(cfg.recovery.w_min if cfg.recovery.w_min is not None else guid.get("w_min", 1.0)),
               float(cfg.recovery.w_max if cfg.recovery.w_max is not None else guid.get("w_max", 8.0)))
    if w_range[0] > w_range[1]:
        raise PocketdiffError(f"recovery.w_min={w_range[0]} > recovery.w_max={w_range[1]}")
    eval_steps = int(cfg.eval.steps or meta.get("num_inference_steps") or 25)
    eval_w = float(cfg.eval.guidance_scale if cfg.eval.guidance_scale is not None else (guid.get("scale") or 3.0))
    report["model_kind"] = {"guidance_conditioned": w_fn is not None, "distilled_steps": meta.get("num_inference_steps"),
                            "prediction_type": pipe.scheduler.config.prediction_type}

    # 2-4. plan and prune (reused on --resume)
    pruned_dir, plan_path = out / "pruned_unet", out / "plan.json"
    if resume is not None and (pruned_dir / "pruning.json").is_file() and plan_path.is_file():
        student = load_pruned_unet(pruned_dir).to(device)
        plan = read_json(plan_path, "--resume")
        report["resumed_pruning"] = True
    else:
        gen = torch.Generator().manual_seed(cfg.seed)
        importance = resolve_importance(cfg.prune.importance)
        gradient_fn = None
        if needs_gradients(importance):
            tc = cfg.prune.taylor

            def cond_fn(b):  # guidance-conditioned models: w ~ U[w_range] per sample
                w = w_range[0] + torch.rand(b, generator=gen) * (w_range[1] - w_range[0])
                return w_fn(w)

            def gradient_fn(work, params):
                batches = _calibration_batches(pipe, dataset, tc.samples, tc.batch_size, gen, device)
                report["taylor"] = accumulate_diffusion_gradients(work, pipe.scheduler, batches, tc.samples, params, gen,
                                                                  (tc.t_min, tc.t_max), cond_fn if w_fn is not None else None)

        student, plan = prune_unet(teacher, cfg.prune, generator=gen, gradient_fn=gradient_fn)
        _save_unet_atomic(student, pruned_dir)
        write_json(plan_path, plan)
    student = student.to(device).eval()

    # measurements before recovery
    prof_before = pg.layer_profile(teacher)
    prof_after = pg.layer_profile(student)
    targeted = plan["targeted"]
    tp_before = sum(prof_before[n].params for n in targeted)
    tp_after = sum(prof_after[n].params for n in targeted)
    report.update({
        "params_before": count_params(teacher),
        "params_after": count_params(student),
        "targeted_conv_params_before": tp_before,
        "targeted_conv_params_after": tp_after,
        "targeted_conv_params_removed_fraction": 1.0 - tp_after / max(tp_before, 1),
        "requested_ratio": cfg.prune.ratio,
        "scope": cfg.prune.scope,
        "importance": cfg.prune.importance, "groupnorm": cfg.prune.groupnorm, "allocation": cfg.prune.allocation,
        "round_to": cfg.prune.round_to,
        "groups": [{k: v for k, v in g.items() if k not in ("keep", "scores")} for g in plan["groups"]],
        "streams": [{k: v for k, v in st.items() if k not in ("keep", "scores")} for st in plan.get("streams", [])],
        "targeted_convs": targeted,
        "unprunable_targets": plan["unprunable"],
        "macs": macs_table(prof_before, prof_after, targeted),
    })
    probe = (Probe(pipe, teacher, dataset, cfg.eval.probe_samples, cfg.seed, device, guidance_scale=eval_w)
             if cfg.eval.probe_samples else None)
    quality = {"before_pruning": {"mse_to_teacher": 0.0, "relative_mse": 0.0}}
    if probe:
        quality["after_pruning"] = probe.error(student)

    # 5. recovery
    if cfg.recovery.enabled:
        report["recovery"] = recover(cfg.recovery, cfg.train, student=student, teacher=teacher, pipe=pipe, dataset=dataset,
                                     collate=collate, ckpt_dir=out / "checkpoints" / "recovery", seed=cfg.seed,
                                     resume=resume, log_path=out / "logs.jsonl", w_range=w_range,
                                     feature_channels=plan.get("feature_channels"))
        student = student.to(device).eval()
        if probe:
            quality["after_recovery"] = probe.error(student)
    else:
        report["recovery"] = {"enabled": False}
    report["teacher_relative_error"] = quality

    # 6. outputs
    components = dict(pipe.components)
    components["unet"] = student
    final = type(pipe)(**components, requires_safety_checker=False)
    pipeline_dir = save_pipeline(final, out / "pipeline")
    if meta:  # a pruned distilled student keeps its sampling recipe (steps, guidance) for evaluate / export
        meta = {**meta, "pruned_by": "pocketdiff prune", "report": None}
        write_json(pipeline_dir / DISTILL_META, meta)
    report["pipeline_dir"] = str(pipeline_dir)
    report["loader"] = "pocketdiff.compress.prune.load_pruned_pipeline(pipeline_dir)"

    unets = {"before_pruning": teacher, "after_pruning": load_pruned_unet(pruned_dir).to(device)}
    if cfg.recovery.enabled:
        unets["after_recovery"] = student
    report["metrics"] = external_metrics(cfg, pipe, unets, out, device, eval_steps, eval_w)

    sections = []
    rows = [["UNet params", report["params_before"], report["params_after"], report["params_after"] / report["params_before"]],
            ["targeted conv params", tp_before, tp_after, tp_after / max(tp_before, 1)],
            ["conv MACs / sample", report["macs"]["conv_before"], report["macs"]["conv_after"],
             report["macs"]["conv_after"] / max(report["macs"]["conv_before"], 1)],
            ["conv + linear MACs / sample", report["macs"]["total_before"], report["macs"]["total_after"],
             report["macs"]["total_after"] / max(report["macs"]["total_before"], 1)]]
    sections.append(("Size", table(["", "before", "after", "after / before"], rows)))
    sections.append(("Groups (ResNet internal channels)", table(
        ["group", "channels", "GroupNorm groups", "targeted convs"],
        [[g["group"], f"{g['channels_before']} -> {g['channels_after']}",
          f"{g['groupnorm_groups_before']} -> {g['groupnorm_groups_after']}", ", ".join(g["targeted_convs"])] for g in plan["groups"]])))
    if plan.get("streams"):
        sections.append(("Streams (residual / block-output channels, whole GroupNorm groups of every norm over them)", table(
            ["stream", "channels", "removable units", "producers", "consumers"],
            [[st["stream"], f"{st['channels_before']} -> {st['channels_after']}", st["removable_units"],
              ", ".join(st["producers"]), ", ".join(st["consumers"])] for st in plan["streams"]])))
    if plan.get("streams"):  # streams and groups per channel (stream atoms vary in size)
        plotted = [{"scores": g["scores"], "keep": g["keep"], "groupnorm_groups_before": len(g["scores"])}
                   for g in list(plan["groups"]) + list(plan["streams"])]
        plot_importance(plotted, out / "importance.png", f"importance: {cfg.prune.importance} (groups and streams)", "per_group")
    else:
        plot_importance(plan["groups"], out / "importance.png", f"importance: {cfg.prune.importance}", cfg.prune.groupnorm)
    sections.append((f"Importance distribution ({cfg.prune.importance})", img("importance.png")))
    qrows = [[k, v.get("mse_to_teacher", ""), v.get("relative_mse", "")] for k, v in quality.items()]
    sections.append(("Teacher-relative error on fixed probes", table(["model", "MSE to teacher", "relative MSE"], qrows)))
    if report["metrics"].get("available"):
        m = report["metrics"]
        mrows = [[k, v.get("fd"), v.get("clip_score"), v.get("features") or "", v.get("num_samples")] for k, v in m["results"].items()]
        ratio = "".join(f"<p>{k.replace('_', ' ')}: {v:.4g}</p>" for k, v in m.items() if k.startswith("fd_ratio"))
        sections.append(("FD / CLIP score (pocketdiff.evaluate; details in eval/index.html)",
                         table(["model", "FD", "CLIP score", "features", "samples per seed"], mrows) + ratio))
    else:
        sections.append(("FD / CLIP score", f"<p>not measured: {report['metrics']['reason']}</p>"))
    if cfg.recovery.enabled and report["recovery"]["losses"]:
        plot_curves({"recovery": report["recovery"]["losses"]}, out / "recovery_loss.png", "step", "loss", "recovery loss", logy=True)
        sections.append(("Recovery loss", img("recovery_loss.png")))
    prompts = list(cfg.eval.prompts) or captions[:4]
    if prompts:
        grids = []
        for label, unet in unets.items():
            grids.append(generate(pipe, prompts, steps=eval_steps, guidance_scale=eval_w,
                                  seed=cfg.eval.seed, resolution=cfg.data.resolution, unet=unet))
        images = torch.cat(grids)
        labels = [f"{label}: {p}" for label in unets for p in prompts]
        save_grid(images, out / "samples.png", ncols=len(prompts), labels=labels, cell=128)
        report["samples"] = {"grid": "samples.png", "rows": list(unets), "prompts": prompts, "steps": eval_steps,
                             "guidance_scale": eval_w}
        sections.append((f"Samples, rows: {', '.join(unets)} (DDIM {eval_steps} steps, guidance {eval_w})",
                         img("samples.png")))
    per_conv = [c for c in report["macs"]["per_conv"] if c["targeted"] or c["params_before"] != c["params_after"]]
    sections.append(("Per conv (targeted or changed)", table(
        ["conv", "targeted", "params before", "params after", "MACs before", "MACs after"],
        [[c["name"], c["targeted"], c["params_before"], c["params_after"], c["macs_before"], c["macs_after"]] for c in per_conv])))
    write_page(out / "index.html", "pocketdiff prune", sections, report)
    return report
