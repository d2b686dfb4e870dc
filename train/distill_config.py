"""The `pocketdiff distill` recipe: one dataclass per section, each validated on construction."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.models import ModelConfig

from .consistency_config import ConsistencyConfig
from .distill_lora import StudentConfig, check_lora_config
from .distill_targets import WEIGHTINGS
from .guidance_embedding import DEFAULT_EMBED_DIM
from .loop import LoopConfig

STUDENT_PREDICTION = ("v_prediction", "epsilon", "teacher")
SPACINGS = ("trailing", "leading", "teacher")
TEACHER_DTYPES = ("auto", "fp32", "bf16", "fp16")
# progressive: guided stage, then halving rounds (Salimans & Ho) | consistency: one LCM stage (consistency_targets)
METHODS = ("progressive", "consistency")
TOP_STEP_INPUTS = ("data", "noise")


def round_schedule(start_steps: int, final_steps: int) -> list[int]:
    """Step counts of the progressive rounds: [start/2, start/4, ..., final] (empty when equal).
    Each round halves the count, so start_steps must be final_steps * 2^k (1 and 2 steps included)."""
    if final_steps > start_steps:
        raise PocketdiffError(f"progressive.final_steps: {final_steps} is above progressive.start_steps={start_steps}")
    counts, n = [], start_steps
    while n > final_steps and n % 2 == 0:
        n //= 2
        counts.append(n)
    if n != final_steps:
        raise PocketdiffError(
            f"progressive.final_steps: {final_steps} cannot be reached from progressive.start_steps={start_steps} by halving "
            f"(the halving rounds pass from {n * 2} to {n}); start_steps must be final_steps * 2^k, e.g. {final_steps * 2 ** max(1, (start_steps // final_steps).bit_length() - 1)}")
    return counts


@dataclasses.dataclass
class GuidanceConfig:
    """Classifier-free guidance folded into the student."""

    conditioned: bool = True  # student takes w as input (w embedding); false: it folds the fixed w = `scale`
    w_min: float = 1.0  # training range of w (diffusers' guidance_scale convention: 1 = no guidance)
    w_max: float = 8.0
    embed_dim: int = DEFAULT_EMBED_DIM  # time_cond_proj_dim of the student
    scale: float = 4.0  # w of the sample grids and metrics (and of training when conditioned=false)
    # learning-rate multiplier of the w embedding (time_embedding.cond_proj, zero-initialised) in
    # the guided stage: at 1, short guided stages leave it near zero and the student ignores w
    embed_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        for key in ("w_min", "w_max", "scale"):
            require(math.isfinite(getattr(self, key)), f"guidance.{key}", f"must be finite, got {getattr(self, key)}")
        require(self.w_min <= self.w_max, "guidance.w_min",
                f"guidance range is empty: w_min={self.w_min} > w_max={self.w_max}")
        require(self.w_min >= 0, "guidance.w_min", f"must be >= 0, got {self.w_min}")
        require(self.embed_dim >= 2 and self.embed_dim % 2 == 0, "guidance.embed_dim", f"must be even and >= 2, got {self.embed_dim}")
        require(self.scale >= 0, "guidance.scale", f"must be >= 0, got {self.scale}")
        require(math.isfinite(self.embed_lr_scale) and self.embed_lr_scale > 0, "guidance.embed_lr_scale",
                f"must be a finite number > 0, got {self.embed_lr_scale}")


def embed_lr_scale(cfg, spec) -> dict:
    """The learning-rate multiplier of the w embedding in the stage that creates it (guided or
    consistency; train_loop's `lr_scale`)."""
    if spec.stage in ("guided", "consistency") and cfg.guidance.conditioned and cfg.guidance.embed_lr_scale != 1.0:
        return {"time_embedding.cond_proj": cfg.guidance.embed_lr_scale}
    return {}


def _loop(**kw) -> LoopConfig:
    return dataclasses.field(default_factory=lambda: LoopConfig(**kw))


@dataclasses.dataclass
class GuidedStageConfig:
    """Stage A (round 0). Disabled: round 1's teacher is the original model with classifier-free guidance."""

    enabled: bool = True
    train: LoopConfig = _loop(max_steps=2000, lr=1e-5, checkpoint_every=500)


@dataclasses.dataclass
class ProgressiveConfig:
    """Stage B: rounds start_steps -> start_steps/2 -> ... -> final_steps."""

    start_steps: int = 64  # the step count of round 0's student (the teacher grid of round 1)
    final_steps: int = 4
    train: LoopConfig = _loop(max_steps=2000, lr=1e-5, checkpoint_every=500)
    round_max_steps: list[int] = dataclasses.field(default_factory=list)  # optional, one per round: overrides train.max_steps
    # the student's input at its top timestep (trailing: t = T - 1), what the few-step rounds train most:
    # data = z_t of a training image, as at every other timestep; noise = pure Gaussian noise, what the
    # sampler starts from (the PD paper's schedules end at SNR 0, so there they are the same; SD's
    # scaled-linear schedule keeps alpha_bar(T - 1) ~ 0.005, a sliver of the image that a 1-step student
    # would learn to read and never gets at sampling time)
    top_step_input: str = "data"

    def __post_init__(self) -> None:
        require(self.top_step_input in TOP_STEP_INPUTS, "progressive.top_step_input", f"must be one of {TOP_STEP_INPUTS}, got {self.top_step_input!r}")
        require(self.start_steps >= 1, "progressive.start_steps", f"must be >= 1, got {self.start_steps}")
        require(self.final_steps >= 1, "progressive.final_steps", f"must be >= 1, got {self.final_steps}")
        round_schedule(self.start_steps, self.final_steps)  # raises on an unreachable count
        n = len(round_schedule(self.start_steps, self.final_steps))
        require(not self.round_max_steps or len(self.round_max_steps) == n, "progressive.round_max_steps",
                f"has {len(self.round_max_steps)} entries for {n} rounds")
        require(all(s > 0 for s in self.round_max_steps), "progressive.round_max_steps", "entries must be positive")


@dataclasses.dataclass
class SpeedConfig:
    """Throughput switches (see benchmarks/distill_step.py for what each buys)."""

    teacher_dtype: str = "auto"  # auto: bf16 on CUDA, fp32 elsewhere; weights cast once, no autocast copies
    fused_cfg: bool = True  # teacher's unconditional and conditional passes as one batch
    channels_last: bool = False
    compile_student: bool = False
    student_compile_mode: str = "default"
    compile_teacher: bool = False
    teacher_compile_mode: str = "max-autotune-no-cudagraphs"  # or "reduce-overhead" (CUDA graphs), "default"
    gradient_checkpointing: bool = False  # the student's (as train.gradient_checkpointing, for every round)
    cudnn_benchmark: bool = True
    tf32: bool = True

    def __post_init__(self) -> None:
        require(self.teacher_dtype in TEACHER_DTYPES, "speed.teacher_dtype", f"must be one of {TEACHER_DTYPES}")
        modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        require(self.student_compile_mode in modes, "speed.student_compile_mode", f"must be one of {modes}")
        require(self.teacher_compile_mode in modes, "speed.teacher_compile_mode", f"must be one of {modes}")


@dataclasses.dataclass
class EvalConfig:
    """Sample grids (and metrics through pocketdiff.evaluate) after each round."""

    enabled: bool = True
    prompts: list[str] = dataclasses.field(default_factory=list)  # default: the first 8 distinct captions
    seed: int = 0
    reference_steps: int = 0  # the teacher's reference DDIM count (0: progressive.start_steps)
    batch_size: int = 16
    # FD and CLIP score per round (student at N vs teacher DDIM at N and at reference_steps),
    # through pocketdiff.evaluate.evaluate_pipelines; FD against the training data's images.
    metrics: bool = False
    features: str = "clip"  # clip: FD on a (domain) CLIP's image embeddings | inception: FID
    clip: Optional[str] = None  # CLIP folder or hub id (null: pocketdiff.evaluate's shipped shapes CLIP)
    num_images: int = 256  # images per model and seed: the first num_images captions of the data
    metric_seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    # consistency stage: FD and CLIP score of the EMA student at these step counts at every checkpoint
    # (consistency.train.checkpoint_every), with the training seconds so far: the round report's `curve`
    # of quality against GPU time. Needs metrics: true; [] = only at the end.
    curve_steps: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        require(self.reference_steps >= 0, "eval.reference_steps", "must be >= 0")
        require(self.num_images >= 2, "eval.num_images", "must be >= 2 (FD needs two images)")
        require(self.batch_size > 0, "eval.batch_size", "must be positive")
        require(self.features in ("clip", "inception"), "eval.features", "must be clip or inception")
        require(len(self.metric_seeds) > 0, "eval.metric_seeds", "must not be empty")
        for n in self.curve_steps:
            require(isinstance(n, int) and n >= 1, "eval.curve_steps", f"must be step counts >= 1, got {self.curve_steps}")
        require(not self.curve_steps or self.metrics, "eval.curve_steps", "needs eval.metrics: true")


@dataclasses.dataclass
class Config:
    seed: int = 0
    method: str = "progressive"  # progressive | consistency (sections guided + progressive, or consistency)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # the teacher
    student_prediction_type: str = "v_prediction"  # v_prediction | epsilon | teacher
    student: StudentConfig = dataclasses.field(default_factory=StudentConfig)  # lora_rank: the student as a LoRA over its teacher
    timestep_spacing: str = "trailing"  # students' DDIM spacing: trailing | leading | teacher
    loss_weighting: str = "truncated_snr"  # truncated_snr (x space, max(SNR, 1)) | snr_plus_one (= v space)
    cache_latents: bool = True
    # keep DIR/checkpoints/round-K after round K's folder is written (false: deleted then; resume
    # never needs them again, and at SD size each checkpoint is several GB)
    keep_round_checkpoints: bool = False
    max_time_s: float = 0.0  # > 0: wall-time budget of this invocation; the round in progress stops with a checkpoint (--resume latest continues)
    guidance: GuidanceConfig = dataclasses.field(default_factory=GuidanceConfig)
    guided: GuidedStageConfig = dataclasses.field(default_factory=GuidedStageConfig)
    progressive: ProgressiveConfig = dataclasses.field(default_factory=ProgressiveConfig)
    consistency: ConsistencyConfig = dataclasses.field(default_factory=ConsistencyConfig)
    speed: SpeedConfig = dataclasses.field(default_factory=SpeedConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        require(self.method in METHODS, "method", f"must be one of {METHODS}, got {self.method!r}")
        require(self.student_prediction_type in STUDENT_PREDICTION, "student_prediction_type", f"must be one of {STUDENT_PREDICTION}")
        require(self.timestep_spacing in SPACINGS, "timestep_spacing", f"must be one of {SPACINGS}")
        require(self.max_time_s >= 0, "max_time_s", f"must be >= 0, got {self.max_time_s}")
        require(self.loss_weighting in WEIGHTINGS, "loss_weighting", f"must be one of {WEIGHTINGS}")
        require(not self.eval.curve_steps or self.method == "consistency", "eval.curve_steps",
                "is for method: consistency (a progressive run's rounds are its points)")
        check_lora_config(self)
        if self.method == "consistency":
            for n in self.eval.curve_steps:
                require(n <= self.consistency.solver_steps, "eval.curve_steps",
                        f"{n} is more than consistency.solver_steps ({self.consistency.solver_steps}) can sample")
            return  # one stage: the guided and progressive sections are not used
        require(self.guided.train.mixed_precision == self.progressive.train.mixed_precision, "guided.train.mixed_precision",
                f"must equal progressive.train.mixed_precision ({self.progressive.train.mixed_precision}): one Accelerator runs every round")
        require(self.guided.train.memory_cap_gib == self.progressive.train.memory_cap_gib, "guided.train.memory_cap_gib",
                f"must equal progressive.train.memory_cap_gib ({self.progressive.train.memory_cap_gib}): the cap is per process")
        rounds = round_schedule(self.progressive.start_steps, self.progressive.final_steps)
        require(self.guided.enabled or len(rounds) > 0, "progressive.final_steps",
                "equals progressive.start_steps and guided.enabled is false: there is nothing to distill")


def accelerator_section(cfg: Config) -> LoopConfig:
    """The train section the run's one Accelerator is made from (mixed precision, DDP hook, memory cap)."""
    return cfg.consistency.train if cfg.method == "consistency" else cfg.progressive.train
