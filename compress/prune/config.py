"""The `pocketdiff prune` recipe: dataclasses validated on construction (`Config` and its parts)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.models import ModelConfig
from pocketdiff.train.loop import LoopConfig

from . import graph as pg
from . import stream as ps
from .importance import resolve_importance
from .recovery import RecoveryConfig


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
        from .pruning import precheck  # (pruning reads these dataclasses)

        precheck(self)  # model-dependent bad input, refused before anything is written
