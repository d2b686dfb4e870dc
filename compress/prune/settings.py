"""The `prune:` section of the `pocketdiff prune` recipe (`PruneSettings` and its parts): what
`prune_unet` needs, apart from the rest of the recipe in `config` (which reads `pruning`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from pocketdiff.errors import PocketdiffError, require

from . import graph as pg
from . import stream as ps
from .importance import resolve_importance


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

    ratio: float = 0.3  # fraction of the targeted convs' parameters to remove (0: none, block removal only)
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
        require(0.0 <= self.ratio < 1.0, "prune.ratio",
                f"must be in (0, 1) (fraction of targeted conv parameters to remove; 0: no channel pruning), got {self.ratio}")
        require(self.scope in ps.SCOPES, "prune.scope", f"must be one of {ps.SCOPES}, got {self.scope!r}")
        require(self.groupnorm in pg.GROUPNORM_MODES, "prune.groupnorm", f"must be one of {pg.GROUPNORM_MODES}, got {self.groupnorm!r}")
        require(self.allocation in ALLOCATIONS, "prune.allocation", f"must be one of {ALLOCATIONS}, got {self.allocation!r}")
        require(self.round_to >= 1, "prune.round_to", f"must be >= 1, got {self.round_to}")
        require(0.0 < self.max_layer_ratio < 1.0, "prune.max_layer_ratio", "must be in (0, 1)")
        try:
            resolve_importance(self.importance)
        except PocketdiffError as e:
            raise type(e)(str(e)) from None
