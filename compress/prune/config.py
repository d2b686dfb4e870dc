"""The `pocketdiff prune` recipe: dataclasses validated on construction (`Config` and its parts;
the `prune:` section's live in `settings`)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from pocketdiff.config import DataConfig
from pocketdiff.errors import require
from pocketdiff.models import ModelConfig
from pocketdiff.train.loop import LoopConfig

from .blocks import BlocksSettings
from .pruning import precheck
from .recovery import RecoveryConfig
from .settings import ALLOCATIONS, PruneSettings, TargetConfig, TaylorConfig

__all__ = ["ALLOCATIONS", "BlocksSettings", "Config", "EvalSettings", "PruneSettings", "TargetConfig", "TaylorConfig"]


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
    blocks: BlocksSettings = dataclasses.field(default_factory=BlocksSettings)  # block removal (BK-SDM), before channel pruning
    prune: PruneSettings = dataclasses.field(default_factory=PruneSettings)
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)
    train: LoopConfig = dataclasses.field(default_factory=lambda: LoopConfig(max_steps=500, batch_size=16, lr=5e-5))
    eval: EvalSettings = dataclasses.field(default_factory=EvalSettings)

    def __post_init__(self) -> None:
        require(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"), "device",
                f"must be auto, cpu, cuda[:N] or mps, got {self.device!r}")
        require(self.prune.ratio > 0 or self.blocks.active, "prune.ratio",
                f"must be in (0, 1) (fraction of targeted conv parameters to remove), got {self.prune.ratio}; 0 only with "
                "blocks.preset or blocks.remove (block removal alone)")
        precheck(self.model, self.data.resolution, self.prune, self.blocks)  # model-dependent bad input, refused before anything is written
