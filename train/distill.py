"""`pocketdiff distill`: guided distillation, then progressive distillation, in the shared Accelerate loop.

1. check the recipe (round plan, guidance range), load the teacher pipeline (or build a tiny
   random one when `model.pretrained` is null), build the students' DDIM scheduler
2. encode the training images once (VAE mean and std, cached in DIR/cache) and the empty prompt
3. stage A, round 0 (guided distillation, Meng et al.): a student with a zero-initialised
   w embedding (`time_cond_proj_dim`) learns the teacher's classifier-free-guided prediction
   for w drawn from [guidance.w_min, guidance.w_max], in x space
4. stage B, rounds 1..K (progressive distillation, Salimans & Ho): N -> N/2 steps per round,
   each student starting from the previous one, which is its frozen teacher; targets from two
   teacher DDIM steps, loss in x space with truncated-SNR weighting, v-prediction students
5. after each round: a stock diffusers pipeline folder DIR/round-K (scheduler set for its step
   count; written under a temporary name, then renamed: the folder existing means the round is
   complete), a sample grid against the teacher's DDIM at the same count, metrics through
   `pocketdiff.evaluate` when it offers them
6. report.json (`rounds`, `final_steps`, `pipeline_dir`) and index.html

Each round is one `train_loop` call with its own checkpoint folder DIR/checkpoints/round-K, so
`--resume latest` skips complete rounds and continues the interrupted one at its step and
data position, bit-exact on CPU.

How w reaches a w-conditioned student: see `pocketdiff.train.guidance_embedding` (a stock
`StableDiffusionPipeline` passes it itself: `pipe(prompt, num_inference_steps=N, guidance_scale=w)`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.config import DataConfig
from pocketdiff.data import ImageCaptionDataset, collate, load_captioned_dataset
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.models import DISTILL_META, ModelConfig, check_resolution, count_params, load_or_build, save_pipeline
from pocketdiff.outputs import atomic_path, commit_folder, read_json, write_json
from pocketdiff.report import img, plot_curves, save_grid, table, write_page
from pocketdiff.sampling import encode_prompts, generate

from .distill_targets import (
    DTYPES,
    WEIGHTINGS,
    GuidedTeacher,
    RoundPlan,
    guided_x_target,
    noisy_latents,
    round_plan,
    set_student_layout,
    student_forward,
    two_step_x_target,
    x_space_loss,
)
from .guidance_embedding import DEFAULT_EMBED_DIM, USAGE, add_guidance_embedding, is_w_conditioned, w_condition, w_embedding_fn
from .checkpoints import read_state, resolve_resume
from .loop import BatchRandom, LoopConfig, make_accelerator, train_loop

log = logging.getLogger(__name__)

__all__ = ["Config", "run", "w_condition", "w_embedding_fn", "round_schedule", "plan_rounds", "completed_rounds"]

STUDENT_PREDICTION = ("v_prediction", "epsilon", "teacher")
SPACINGS = ("trailing", "leading", "teacher")
TEACHER_DTYPES = ("auto", "fp32", "bf16", "fp16")

# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------

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
    """The guided stage's learning-rate multiplier for the w embedding (train_loop's `lr_scale`)."""
    if spec.stage == "guided" and cfg.guidance.conditioned and cfg.guidance.embed_lr_scale != 1.0:
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

    def __post_init__(self) -> None:
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
    gradient_checkpointing: bool = False
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

    def __post_init__(self) -> None:
        require(self.reference_steps >= 0, "eval.reference_steps", "must be >= 0")
        require(self.num_images >= 2, "eval.num_images", "must be >= 2 (FD needs two images)")
        require(self.batch_size > 0, "eval.batch_size", "must be positive")
        require(self.features in ("clip", "inception"), "eval.features", "must be clip or inception")
        require(len(self.metric_seeds) > 0, "eval.metric_seeds", "must not be empty")


@dataclasses.dataclass
class Config:
    seed: int = 0
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # the teacher
    student_prediction_type: str = "v_prediction"  # v_prediction | epsilon | teacher
    timestep_spacing: str = "trailing"  # students' DDIM spacing: trailing | leading | teacher
    loss_weighting: str = "truncated_snr"  # truncated_snr (x space, max(SNR, 1)) | snr_plus_one (= v space)
    cache_latents: bool = True
    max_time_s: float = 0.0  # > 0: wall-time budget of this invocation; the round in progress stops with a checkpoint (--resume latest continues)
    guidance: GuidanceConfig = dataclasses.field(default_factory=GuidanceConfig)
    guided: GuidedStageConfig = dataclasses.field(default_factory=GuidedStageConfig)
    progressive: ProgressiveConfig = dataclasses.field(default_factory=ProgressiveConfig)
    speed: SpeedConfig = dataclasses.field(default_factory=SpeedConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        require(self.student_prediction_type in STUDENT_PREDICTION, "student_prediction_type", f"must be one of {STUDENT_PREDICTION}")
        require(self.timestep_spacing in SPACINGS, "timestep_spacing", f"must be one of {SPACINGS}")
        require(self.max_time_s >= 0, "max_time_s", f"must be >= 0, got {self.max_time_s}")
        require(self.loss_weighting in WEIGHTINGS, "loss_weighting", f"must be one of {WEIGHTINGS}")
        require(self.guided.train.mixed_precision == self.progressive.train.mixed_precision, "guided.train.mixed_precision",
                f"must equal progressive.train.mixed_precision ({self.progressive.train.mixed_precision}): one Accelerator runs every round")
        require(self.guided.enabled or len(plan_rounds(self)) > 0, "progressive.final_steps",
                "equals progressive.start_steps and guided.enabled is false: there is nothing to distill")


# --------------------------------------------------------------------------------------
# Round bookkeeping
# --------------------------------------------------------------------------------------

def round_schedule(start_steps: int, final_steps: int) -> list[int]:
    """Step counts of the progressive rounds: [start/2, start/4, ..., final] (empty when equal)."""
    if final_steps > start_steps:
        raise PocketdiffError(f"progressive.final_steps={final_steps} is above progressive.start_steps={start_steps}")
    counts, n = [], start_steps
    while n > final_steps:
        if n % 2:
            raise PocketdiffError(
                f"progressive.final_steps={final_steps} cannot be reached from start_steps={start_steps} by halving "
                f"({n} is odd); start_steps must be final_steps * 2^k")
        n //= 2
        counts.append(n)
    if n != final_steps:
        raise PocketdiffError(f"progressive.final_steps={final_steps} cannot be reached from start_steps={start_steps} by halving")
    return counts


@dataclasses.dataclass
class RoundSpec:
    index: int  # 0 = guided stage, 1.. = progressive rounds
    stage: str  # "guided" | "progressive"
    steps: int  # the student's sampling steps
    teacher_steps: Optional[int]  # the teacher's grid (None for the guided stage: any timestep)
    max_steps: int  # optimizer steps

    @property
    def name(self) -> str:
        return f"round-{self.index}"


def plan_rounds(cfg: Config) -> list[RoundSpec]:
    """Every round of the recipe, in order."""
    rounds = []
    if cfg.guided.enabled:
        rounds.append(RoundSpec(0, "guided", cfg.progressive.start_steps, None, cfg.guided.train.max_steps))
    teacher = cfg.progressive.start_steps
    overrides = list(cfg.progressive.round_max_steps)
    for i, n in enumerate(round_schedule(cfg.progressive.start_steps, cfg.progressive.final_steps)):
        max_steps = overrides[i] if overrides else cfg.progressive.train.max_steps
        rounds.append(RoundSpec(i + 1, "progressive", n, teacher, max_steps))
        teacher = n
    return rounds


def completed_rounds(out: Path, plan: list[RoundSpec]) -> int:
    """How many leading rounds are complete (their pipeline folder exists, with its metadata)."""
    done = 0
    for spec in plan:
        if not (out / spec.name / DISTILL_META).is_file():
            break
        done += 1
    return done


def _plan_record(cfg: Config, plan: list[RoundSpec]) -> dict:
    return {
        "teacher": cfg.model.pretrained or f"built:{cfg.model.arch}",
        "rounds": [dataclasses.asdict(s) for s in plan],
        "student_prediction_type": cfg.student_prediction_type,
        "timestep_spacing": cfg.timestep_spacing,
        "guidance": dataclasses.asdict(cfg.guidance),
        "seed": cfg.seed,
    }


def _check_resume(out: Path, cfg: Config, plan: list[RoundSpec], resume: Optional[str]) -> int:
    """Number of complete rounds to skip; refuses a resume whose recipe changed."""
    record_path = out / "distill_plan.json"
    record = _plan_record(cfg, plan)
    done = completed_rounds(out, plan)
    if resume is None:
        if done or record_path.exists():
            raise PocketdiffError(f"{out} already holds a distillation run; pass --resume latest to continue it (or --overwrite)")
        return 0
    if record_path.is_file():
        old = read_json(record_path, "--resume")
        if old != json.loads(json.dumps(record)):
            raise PocketdiffError(f"{out}: the recipe changed since the interrupted run (rounds, guidance, teacher or seed differ); "
                                  "resume with the same config or start a new output folder")
    if resume != "latest":
        ckpt = Path(resume)
        owner = ckpt.parent.name if ckpt.parent.name.startswith("round-") else None
        if owner is None:
            raise PocketdiffError(f"--resume {resume}: expected 'latest' or DIR/checkpoints/round-K/checkpoint-S")
        k = int(owner.split("-")[1])
        if k < done:
            raise PocketdiffError(f"--resume {resume}: {owner} is already complete ({out / owner} exists)")
        if k > done:
            raise PocketdiffError(f"--resume {resume}: round-{done} is not complete yet")
    return done


# --------------------------------------------------------------------------------------
# Data: latents cached once
# --------------------------------------------------------------------------------------

class LatentDataset(torch.utils.data.Dataset):
    """Items {"mean", "std", "text"}: the VAE posterior of each training image."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, texts: list[str]):
        self.mean, self.std, self.texts = mean, std, texts

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        return {"mean": self.mean[i], "std": self.std[i], "text": self.texts[i]}


@torch.no_grad()
def _encode(vae, pixels: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    dist = vae.encode(pixels.to(device=device, dtype=vae.dtype)).latent_dist
    return dist.mean.float().cpu(), dist.std.float().cpu()


def build_latent_dataset(cfg: Config, pipe, images: ImageCaptionDataset, out: Path, acc) -> LatentDataset:
    """Encode every training image once (main process), save to DIR/cache, load everywhere."""
    from safetensors.torch import load_file, save_file

    texts = list(images.dataset["text"])
    fingerprint = hashlib.sha256(json.dumps({
        "data": dataclasses.asdict(cfg.data), "teacher": cfg.model.pretrained, "vae": cfg.model.vae,
        "arch": cfg.model.arch, "n": len(texts), "texts": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
    }, sort_keys=True).encode()).hexdigest()
    path = out / "cache" / "latents.safetensors"
    if acc.is_main_process:
        fresh = True
        if path.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(path), "pt") as f:
                    fresh = (f.metadata() or {}).get("fingerprint") != fingerprint
            except Exception:  # noqa: BLE001 - an unreadable cache is rebuilt, like a stale one
                fresh = True
        if fresh:
            vae = pipe.vae.to(acc.device)
            means, stds = [], []
            for start in range(0, len(images), 64):
                pix = collate([images[i] for i in range(start, min(start + 64, len(images)))])["pixel_values"]
                m, s = _encode(vae, pix, acc.device)
                means.append(m)
                stds.append(s)
            with atomic_path(path) as tmp:
                save_file({"mean": torch.cat(means).contiguous(), "std": torch.cat(stds).contiguous()}, str(tmp),
                          metadata={"fingerprint": fingerprint})
    acc.wait_for_everyone()
    tensors = load_file(str(path))
    return LatentDataset(tensors["mean"], tensors["std"], texts)


class PixelDataset(torch.utils.data.Dataset):
    """`cache_latents: false`: items keep their pixels; the loss encodes them per batch."""

    def __init__(self, images: ImageCaptionDataset):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        return self.images[i]


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------

def student_scheduler(cfg: Config, teacher_scheduler):
    """The students' DDIMScheduler: the teacher's noise schedule, the student's prediction type and spacing."""
    from diffusers import DDIMScheduler

    ptype = teacher_scheduler.config.prediction_type if cfg.student_prediction_type == "teacher" else cfg.student_prediction_type
    spacing = teacher_scheduler.config.get("timestep_spacing", "leading") if cfg.timestep_spacing == "teacher" else cfg.timestep_spacing
    return DDIMScheduler.from_config(teacher_scheduler.config, prediction_type=ptype, timestep_spacing=spacing)


def _check_teacher(cfg: Config, pipe, plan: list[RoundSpec]) -> None:
    """Problems that would only show mid-training: raise before any step."""
    sched = pipe.scheduler
    if not hasattr(sched, "alphas_cumprod"):
        raise PocketdiffError(f"the teacher's scheduler {type(sched).__name__} has no alphas_cumprod (need a DDPM-family schedule)")
    if sched.config.get("thresholding", False):
        raise PocketdiffError("the teacher's scheduler uses dynamic thresholding, which distillation does not support")
    if sched.config.get("prediction_type", "epsilon") not in ("epsilon", "v_prediction"):
        raise PocketdiffError(f"teacher prediction_type {sched.config.prediction_type!r} is not supported (epsilon | v_prediction)")
    T = sched.config.num_train_timesteps
    if cfg.progressive.start_steps > T // 2 and any(s.stage == "progressive" for s in plan):
        raise PocketdiffError(f"progressive.start_steps={cfg.progressive.start_steps} is above half the teacher's {T} training timesteps")
    check_resolution(pipe, cfg.data.resolution)
    if is_w_conditioned(pipe.unet):
        raise PocketdiffError("the teacher UNet is already guidance-conditioned (time_cond_proj_dim set); distill from a classifier-free-guided model")


def _load_unet(folder: Path):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(str(folder / "unet"), use_safetensors=True, local_files_only=True)


def _teacher_dtype(cfg: Config, device) -> torch.dtype:
    if cfg.speed.teacher_dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[cfg.speed.teacher_dtype]


def _prepare_student(student, cfg: Config):
    student.requires_grad_(True).train()
    if cfg.speed.gradient_checkpointing:
        student.enable_gradient_checkpointing()
    set_student_layout(student, cfg.speed.channels_last, cfg.speed.compile_student)
    if cfg.speed.compile_student:
        student.compile(mode=None if cfg.speed.student_compile_mode == "default" else cfg.speed.student_compile_mode)
    return student


# --------------------------------------------------------------------------------------
# One round
# --------------------------------------------------------------------------------------

def make_loss_fn(cfg: Config, spec: RoundSpec, teacher: GuidedTeacher, plan: Optional[RoundPlan], pipe, sched,
                 uncond: Optional[torch.Tensor], student_embed: Optional[int], device):
    """loss_fn(model, batch, rng) of one round; every random draw comes from `rng`."""
    T = sched.config.num_train_timesteps
    alphas = sched.alphas_cumprod.to(device=device, dtype=torch.float32)
    sf = pipe.vae.config.scaling_factor
    ptype = sched.config.prediction_type
    g = cfg.guidance
    clip = float(sched.config.get("clip_sample_range", 1.0)) if sched.config.get("clip_sample", False) else None
    if plan is not None:
        p_t, p_mid, p_at, p_amid, p_aprev = (v.to(device) for v in (plan.t, plan.t_mid, plan.a_t, plan.a_mid, plan.a_prev))

    def loss_fn(model, batch, rng: BatchRandom):
        if "mean" in batch:
            mean, std = batch["mean"].to(device), batch["std"].to(device)
        else:
            mean, std = _encode(pipe.vae, batch["pixel_values"], device)
            mean, std = mean.to(device), std.to(device)
        x0 = (mean + std * rng.randn(*mean.shape[1:])) * sf
        eps = rng.randn(*mean.shape[1:])
        u = rng.rand()
        w = g.w_min + (g.w_max - g.w_min) * u if g.conditioned else torch.full_like(u, g.scale)
        cond = encode_prompts(pipe, batch["text"], device)
        unc = uncond.to(device).expand(cond.shape[0], -1, -1) if uncond is not None else None
        if spec.stage == "guided":
            t = rng.randint(0, T)
            a_t = alphas[t]
            z_t = noisy_latents(x0, eps, a_t)
            target = guided_x_target(teacher, z_t, t, a_t, cond, unc, w)
        else:
            k = rng.randint(0, plan.steps)
            t, a_t = p_t[k], p_at[k]
            z_t = noisy_latents(x0, eps, a_t)
            target = two_step_x_target(teacher, z_t, t, p_mid[k], a_t, p_amid[k], p_aprev[k], cond, unc, w, clip)
        out = student_forward(model, z_t, t, cond, w, cfg.speed.channels_last, student_embed)
        return x_space_loss(out, z_t, a_t, target, ptype, cfg.loss_weighting)

    return loss_fn


def _write_round_folder(pipe, student, sched, folder: Path, meta: dict) -> Path:
    """Save a stock pipeline folder under a temporary name, fsync, rename: atomic completion."""
    from diffusers import StableDiffusionPipeline

    tmp = folder.parent / f".{folder.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    student = student.to(memory_format=torch.contiguous_format)
    sp = StableDiffusionPipeline(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, unet=student,
                                 scheduler=sched, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    save_pipeline(sp, tmp)
    (tmp / DISTILL_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    (tmp / "README.md").write_text(_readme(meta), encoding="utf-8")
    return commit_folder(tmp, folder)


def _readme(meta: dict) -> str:
    n, g = meta["num_inference_steps"], meta["guidance"]
    if g["conditioned"]:
        call = f"pipe(prompt, num_inference_steps={n}, guidance_scale=w)  # w in [{g['w_min']}, {g['w_max']}], e.g. {g['scale']}"
        how = USAGE
    else:
        call = f"pipe(prompt, num_inference_steps={n}, guidance_scale=1.0)  # guidance {g['scale']} is folded in"
        how = f"This student folds classifier-free guidance w = {g['scale']} into one pass: call it with guidance_scale=1."
    return (
        f"# pocketdiff distilled student: {meta['stage']} round {meta['round']}, {n} DDIM steps\n\n"
        f"```python\nfrom diffusers import StableDiffusionPipeline\npipe = StableDiffusionPipeline.from_pretrained(\"{{this folder}}\")\n"
        f"{call}\n```\n\n"
        f"- Sample with exactly {n} steps: the student learnt the jumps of this folder's DDIMScheduler "
        f"(timestep_spacing={meta['timestep_spacing']!r}, prediction_type={meta['prediction_type']!r}) at {n} steps.\n"
        f"- Guidance: {how}\n"
        f"- In pocketdiff: `pocketdiff.sampling.generate(pipe, prompts, steps={n}, guidance_scale=w)`, or "
        f"`ddim_sample(..., w_embedding_fn=pocketdiff.train.distill.w_embedding_fn(unet))`.\n"
        f"- Teacher: {meta['teacher']}; parent: {meta.get('parent') or 'the teacher'}.\n"
    )


def _student_pipe(pipe, unet, sched):
    from diffusers import StableDiffusionPipeline

    sp = StableDiffusionPipeline(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, unet=unet,
                                 scheduler=sched, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    sp.set_progress_bar_config(disable=True)
    return sp


# --------------------------------------------------------------------------------------
# Evaluation after each round
# --------------------------------------------------------------------------------------

class RoundEvaluator:
    """Grids (and metrics when pocketdiff.evaluate provides them) on fixed prompts and seeds."""

    def __init__(self, cfg: Config, pipe, teacher_sched, out: Path, device):
        self.cfg, self.pipe, self.out, self.device = cfg, pipe, out, device
        self.teacher_sched = teacher_sched
        self.prompts = list(cfg.eval.prompts)
        self.ref_steps = cfg.eval.reference_steps or cfg.progressive.start_steps
        self.captions: list[str] = []
        self._setup = None

    def set_default_prompts(self, captions: list[str]) -> None:
        self.captions = list(captions)
        if not self.prompts:
            self.prompts = list(dict.fromkeys(captions))[:8]

    def check(self) -> None:
        """Metric prerequisites that would only fail after a round: check them first."""
        if not self.cfg.eval.metrics:
            return
        clip = self.cfg.eval.clip
        if clip and not Path(clip).exists() and (clip.startswith((".", "/", "~")) or clip.count("/") != 1):
            raise PocketdiffError(f"eval.clip: {clip}: no such folder (train one with `pocketdiff train-clip`, or set eval.metrics=false)")
        try:
            import pocketdiff.evaluate  # noqa: F401
        except Exception as e:  # noqa: BLE001
            raise PocketdiffError(f"eval.metrics: pocketdiff.evaluate cannot be imported ({type(e).__name__}: {e}); set eval.metrics=false") from None

    def _metric_setup(self):
        if self._setup is None:
            from pocketdiff.evaluate import MetricConfig, MetricSetup

            kw = {"clip": self.cfg.eval.clip} if self.cfg.eval.clip else {}
            if not self.cfg.eval.clip:
                from pocketdiff.evaluate import SHAPES_CLIP

                kw = {"clip": SHAPES_CLIP}
            self._setup = MetricSetup(MetricConfig(features=self.cfg.eval.features, **kw), reference=self.cfg.data, device=self.device)
        return self._setup

    def _evaluate(self, models, steps: int, out_dir: Path) -> list[dict]:
        from pocketdiff.evaluate import evaluate_pipelines

        prompts = self.captions[: self.cfg.eval.num_images]
        return evaluate_pipelines(models, prompts, [steps], self._metric_setup(), out_dir, seeds=self.cfg.eval.metric_seeds,
                                  guidance_scale=self.cfg.guidance.scale, batch_size=self.cfg.eval.batch_size,
                                  resolution=self.cfg.data.resolution, device=self.device)

    def teacher_metrics(self, steps: int) -> dict:
        path = self.out / "eval" / f"teacher-{steps}steps.json"
        if path.is_file():
            return read_json(path, "--resume")
        from pocketdiff.evaluate import ModelSpec  # noqa: F401 (API check)

        self.pipe.unet.to(self.device)
        sp = _student_pipe(self.pipe, self.pipe.unet, self.teacher_sched)
        result = self._evaluate([("teacher DDIM", sp)], steps, self.out / "eval" / f"teacher-{steps}steps")[0]
        write_json(path, result)
        return result

    def metrics(self, spec: RoundSpec, folder: Path) -> dict:
        from pocketdiff.evaluate import ModelSpec

        student = self._evaluate([ModelSpec(name=f"student {spec.steps}", path=str(folder))], spec.steps,
                                 self.out / "eval" / spec.name)[0]
        return {"student": student, "teacher_same_steps": self.teacher_metrics(spec.steps),
                "teacher_reference": self.teacher_metrics(self.ref_steps)}

    def _images(self, sp, steps: int, w: float) -> torch.Tensor:
        return generate(sp, self.prompts, steps=steps, guidance_scale=w, seed=self.cfg.eval.seed,
                        resolution=self.cfg.data.resolution, batch_size=self.cfg.eval.batch_size)

    def teacher_images(self, steps: int) -> torch.Tensor:
        path = self.out / "samples" / f"teacher-{steps}steps.pt"
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except Exception:  # noqa: BLE001 - a damaged cache (e.g. torn by an older version) is rebuilt
                pass
        self.pipe.unet.to(self.device)
        sp = _student_pipe(self.pipe, self.pipe.unet, self.teacher_sched)
        images = self._images(sp, steps, self.cfg.guidance.scale)
        with atomic_path(path) as tmp:  # a kill mid-write must not leave a torn file that --resume loads
            torch.save(images, tmp)
        save_grid(images, self.out / "samples" / f"teacher-{steps}steps.png", ncols=min(8, len(images)),
                  labels=self.prompts, cell=96)
        return images

    def __call__(self, spec: RoundSpec, student, student_sched) -> dict:
        w = self.cfg.guidance.scale if is_w_conditioned(student) else 1.0
        student.eval()
        sp = _student_pipe(self.pipe, student.to(self.device), student_sched)
        images = self._images(sp, spec.steps, w)
        teacher = self.teacher_images(spec.steps)
        reference = self.teacher_images(self.ref_steps)
        grid = self.out / "samples" / f"{spec.name}-{spec.steps}steps.png"
        labels = [f"teacher {self.ref_steps}: {p}" for p in self.prompts] + [f"teacher {spec.steps}: {p}" for p in self.prompts] \
            + [f"student {spec.steps}: {p}" for p in self.prompts]
        save_grid(torch.cat([reference, teacher, images]), grid, ncols=len(self.prompts), labels=labels, cell=96)
        result = {"grid": str(grid.relative_to(self.out)), "prompts": self.prompts, "seed": self.cfg.eval.seed,
                  "guidance_scale": self.cfg.guidance.scale,
                  "rows": [f"teacher DDIM {self.ref_steps} steps", f"teacher DDIM {spec.steps} steps", f"student {spec.steps} steps"],
                  "metrics": None}
        if self.cfg.eval.metrics:
            try:
                result["metrics"] = self.metrics(spec, self.out / spec.name)
            except Exception as e:  # noqa: BLE001 - the round's model stands; the metric failure is reported
                log.exception("metrics of %s failed", spec.name)
                result["metrics_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        else:
            result["metrics_note"] = "eval.metrics=false: run `pocketdiff evaluate` on the round folders for FD / CLIP score"
        return result


# --------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------

def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    out = Path(out)
    # 1. recipe, teacher, schedulers (every check before any training)
    plan = plan_rounds(cfg)
    started = time.time()
    acc = make_accelerator(cfg.progressive.train, out)
    done = _check_resume(out, cfg, plan, resume)
    acc.wait_for_everyone()  # every process has read the folder before the main one writes the plan
    device = acc.device
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.speed.cudnn_benchmark
        torch.backends.cuda.matmul.allow_tf32 = cfg.speed.tf32
        torch.backends.cudnn.allow_tf32 = cfg.speed.tf32
    torch.manual_seed(cfg.seed)
    hf_ds = load_captioned_dataset(cfg.data)
    captions = list(hf_ds["text"])
    pipe = load_or_build(cfg.model, captions=captions, resolution=cfg.data.resolution)
    _check_teacher(cfg, pipe, plan)
    pipe.vae.requires_grad_(False).eval()
    pipe.text_encoder.requires_grad_(False).eval().to(device)
    teacher_unet = pipe.unet.requires_grad_(False).eval()
    t_sched = pipe.scheduler
    s_sched = student_scheduler(cfg, t_sched)
    eval_t_sched = type(s_sched).from_config(s_sched.config, prediction_type=t_sched.config.prediction_type)
    tdtype = _teacher_dtype(cfg, device)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "distill_plan.json", _plan_record(cfg, plan))

    # 2. data
    images = ImageCaptionDataset(hf_ds, cfg.data.resolution)
    dataset = build_latent_dataset(cfg, pipe, images, out, acc) if cfg.cache_latents else PixelDataset(images)
    pipe.vae.to(device)
    uncond = encode_prompts(pipe, [""], device)

    evaluator = RoundEvaluator(cfg, pipe, eval_t_sched, out, device)
    evaluator.set_default_prompts(captions)
    evaluator.check()
    report: dict = {
        "teacher": {"source": cfg.model.pretrained or f"built {cfg.model.arch} (random weights)",
                    "prediction_type": t_sched.config.prediction_type, "unet_params": count_params(teacher_unet)},
        "data": {"source": cfg.data.source, "items": len(dataset), "resolution": cfg.data.resolution},
        "student": {"prediction_type": s_sched.config.prediction_type, "timestep_spacing": s_sched.config.timestep_spacing,
                    "loss_weighting": cfg.loss_weighting},
        "guidance": {**dataclasses.asdict(cfg.guidance), "how": USAGE if cfg.guidance.conditioned else
                     f"folded: guidance {cfg.guidance.scale} baked in, call with guidance_scale=1"},
        "rounds": [],
    }

    # 3-5. rounds, each followed by its evaluation
    prev_folder: Optional[Path] = None
    for position, spec in enumerate(plan):
        folder = out / spec.name
        if position < done:  # complete: reuse
            meta = read_json(folder / DISTILL_META, "--resume")
            report["rounds"].append(meta["report"])
        else:
            budget = None
            if cfg.max_time_s > 0:
                budget = cfg.max_time_s - (time.time() - started)
                if budget <= 0:
                    report["stopped_early"] = f"max_time_s={cfg.max_time_s} reached before {spec.name}; --resume latest continues"
                    break
            # a named checkpoint belongs to the first round trained here; later rounds continue their own
            round_resume = resume if position == done or resume is None else "latest"
            entry = _train_round(cfg, spec, acc, pipe, teacher_unet, t_sched, s_sched, tdtype, uncond,
                                 dataset, prev_folder, out, round_resume, budget)
            if entry is None:
                report["stopped_early"] = f"max_time_s={cfg.max_time_s} reached during {spec.name}; --resume latest continues"
                break
            report["rounds"].append(entry)
        prev_folder = folder
        entry = report["rounds"][-1]
        eval_path = out / "eval" / f"{spec.name}.json"
        if acc.is_main_process and cfg.eval.enabled:
            if eval_path.is_file():
                entry["eval"] = read_json(eval_path, "--resume")
            else:
                entry["eval"] = evaluator(spec, _load_unet(folder), s_sched)
                write_json(eval_path, entry["eval"])
        acc.wait_for_everyone()

    # 6. report
    last = report["rounds"][-1] if report["rounds"] else None
    report["final_steps"] = last["steps"] if last else None
    report["pipeline_dir"] = last["pipeline_dir"] if last else None
    report["complete"] = len(report["rounds"]) == len(plan)
    if acc.is_main_process:
        _write_page(out, report)
    return report


def _train_round(cfg: Config, spec: RoundSpec, acc, pipe, teacher_unet, t_sched, s_sched, tdtype, uncond, dataset,
                 prev_folder: Optional[Path], out: Path, resume: Optional[str], budget: Optional[float] = None) -> Optional[dict]:
    """Train one round (one `train_loop` call), write its pipeline folder atomically, return its report
    (None when the time budget stopped the round: its checkpoint is kept, no folder is written)."""
    device = acc.device
    compile_mode = cfg.speed.teacher_compile_mode if cfg.speed.compile_teacher else None
    if prev_folder is None:  # first round: the original model teaches, with classifier-free guidance
        teacher = GuidedTeacher(_copy_unet(teacher_unet), t_sched.config.prediction_type, dtype=tdtype,
                                fused_cfg=cfg.speed.fused_cfg, channels_last=cfg.speed.channels_last,
                                compile_mode=compile_mode, device=device)
        t_uncond = uncond
        base = _copy_unet(teacher_unet)
        base = base if base.dtype == torch.float32 else base.float()
        student = add_guidance_embedding(base, cfg.guidance.embed_dim) if cfg.guidance.conditioned else base
    else:  # the previous student teaches (guidance already folded in: one pass per step)
        teacher = GuidedTeacher(_load_unet(prev_folder), s_sched.config.prediction_type, dtype=tdtype,
                                fused_cfg=cfg.speed.fused_cfg, channels_last=cfg.speed.channels_last,
                                compile_mode=compile_mode, device=device)
        t_uncond = None
        student = _load_unet(prev_folder)
    student = _prepare_student(student, cfg)
    rplan = round_plan(s_sched, spec.steps, spec.teacher_steps) if spec.stage == "progressive" else None
    embed = cfg.guidance.embed_dim if cfg.guidance.conditioned else None
    loss_fn = make_loss_fn(cfg, spec, teacher, rplan, pipe, s_sched, t_uncond, embed, device)
    loop_cfg = dataclasses.replace(cfg.guided.train if spec.stage == "guided" else cfg.progressive.train, max_steps=spec.max_steps)
    if budget is not None:
        loop_cfg = dataclasses.replace(loop_cfg, max_time_s=max(budget, 1e-3))
    acc.print(f"[distill] {spec.name}: {spec.stage}, student {spec.steps} steps"
              + (f" from a {spec.teacher_steps}-step teacher" if spec.teacher_steps else " from the guided teacher"))
    ckpt = resolve_resume(out / "checkpoints" / spec.name, resume)
    start_step = read_state(ckpt)["step"] if ckpt is not None else 0
    t0 = time.time()
    result = train_loop(loop_cfg, model=student, loss_fn=loss_fn, dataset=dataset, collate=collate,
                        ckpt_dir=out / "checkpoints" / spec.name, seed=cfg.seed + 1000 * spec.index, resume=resume,
                        desc=spec.name, log_path=out / "logs.jsonl", accelerator=acc,
                        extra_state={"round": spec.index, "stage": spec.stage, "student_steps": spec.steps},
                        lr_scale=embed_lr_scale(cfg, spec))
    seconds = time.time() - t0
    acc.free_memory()
    del teacher, loss_fn
    if getattr(result, "stopped_early", False):
        return None
    if result.ema is not None:
        result.ema.copy_to(student)
    student.eval()
    folder = out / spec.name
    round_report = {
        "round": spec.index, "stage": spec.stage, "steps": spec.steps, "teacher_steps": spec.teacher_steps,
        "train_steps": result.steps, "final_loss": result.final_loss, "losses": result.losses,
        "skipped_steps": result.skipped_steps, "pipeline_dir": str(folder),
        "train_seconds": seconds, "processes": acc.num_processes,
        "samples_per_s": loop_cfg.batch_size * loop_cfg.grad_accum * max(result.steps - start_step, 1) / max(seconds, 1e-9),
        "transitions": rplan.rows() if rplan is not None else None,
    }
    meta = {
        "pocketdiff_distill": 1, "round": spec.index, "stage": spec.stage, "num_inference_steps": spec.steps,
        "prediction_type": s_sched.config.prediction_type, "timestep_spacing": s_sched.config.timestep_spacing,
        "guidance": {**dataclasses.asdict(cfg.guidance), "how": USAGE if cfg.guidance.conditioned else "folded"},
        "teacher": cfg.model.pretrained or f"built {cfg.model.arch}", "parent": prev_folder.name if prev_folder else None,
        "report": round_report,
    }
    if acc.is_main_process:
        _write_round_folder(pipe, student, s_sched, folder, meta)
    acc.wait_for_everyone()
    del student
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return round_report


def _copy_unet(unet):
    from diffusers import UNet2DConditionModel

    copy = UNet2DConditionModel.from_config(unet.config)
    copy.load_state_dict(unet.state_dict())
    return copy if unet.dtype == torch.float32 else copy.to(dtype=unet.dtype)


def _write_page(out: Path, report: dict) -> None:
    sections = []
    curves = {f"{r['stage']} {r['steps']} steps": r["losses"] for r in report["rounds"] if r["losses"]}
    if curves:
        plot_curves(curves, out / "loss.png", "step", "loss", "distillation loss (x space, weighted)", logy=True)
        sections.append(("Loss per round", img("loss.png")))
    rows = [[r["round"], r["stage"], r["steps"], r["teacher_steps"] or "-", r["train_steps"], r["final_loss"], Path(r["pipeline_dir"]).name]
            for r in report["rounds"]]
    sections.append(("Rounds", table(["round", "stage", "student steps", "teacher steps", "train steps", "final loss", "folder"], rows)))
    mrows = []
    for r in report["rounds"]:
        m = (r.get("eval") or {}).get("metrics")
        if m:
            for key, label in (("student", f"student {r['steps']} steps"), ("teacher_same_steps", f"teacher DDIM {r['steps']} steps"),
                               ("teacher_reference", f"teacher DDIM {m['teacher_reference'].get('steps')} steps")):
                mrows.append([r["round"], label, m[key].get("fd"), m[key].get("clip_score"), m[key].get("num_samples")])
    if mrows:
        first = next(r["eval"]["metrics"]["student"] for r in report["rounds"] if (r.get("eval") or {}).get("metrics"))
        sections.append(("Metrics", table(["round", "model", first.get("features") or "FD", first.get("clip_model_label") or "CLIP score", "images"], mrows)))
    for r in report["rounds"]:
        ev = r.get("eval") or {}
        if ev.get("grid"):
            sections.append((f"Round {r['round']}: rows = " + ", ".join(ev["rows"]), img(ev["grid"])))
    sections.append(("How to sample a student", f"<p>{report['guidance']['how']}</p>"))
    write_page(out / "index.html", "pocketdiff distill", sections, report)
