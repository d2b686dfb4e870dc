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

`method: consistency` replaces steps 3-4 with one stage (round-0, `consistency_targets`): latent
consistency distillation with w as an input, straight from the classifier-free-guided teacher
(skipping-step DDIM solver, target network = EMA of the student, pseudo-Huber loss). Its folder
holds an `LCMScheduler` (the student samples with 1..consistency.solver_steps steps) and is
evaluated at each of `consistency.sample_steps`. With `student.lora_rank` that student is a LoRA over the
frozen teacher (`distill_lora`: peft layers, only the factors train and checkpoint); its folder then also holds
`pytorch_lora_weights.safetensors` (diffusers' format), and its UNet is the teacher with that file fused.

Each round is one `train_loop` call with its own checkpoint folder DIR/checkpoints/round-K, so
`--resume latest` skips complete rounds and continues the interrupted one at its step and
data position, bit-exact on CPU.

How w reaches a w-conditioned student: see `pocketdiff.train.guidance_embedding` (a stock
`StableDiffusionPipeline` passes it itself: `pipe(prompt, num_inference_steps=N, guidance_scale=w)`).

The recipe's dataclasses are in `distill_config`, the round plan and resume checks in
`distill_rounds`, the cached latents in `distill_data`, the loss in `distill_loss` (targets in
`distill_targets`), round folders / grids / metrics / the page in `distill_report`.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.conditioning import encode_unconditional, text_encoders
from pocketdiff.data import ImageCaptionDataset, collate, load_captioned_dataset
from pocketdiff.errors import PocketdiffError
from pocketdiff.models import DISTILL_META, check_resolution, count_params, load_or_build
from pocketdiff.outputs import read_json, write_json
from pocketdiff.sampling import scheduler_timesteps
from pocketdiff.shipped import resolve_shipped

from .checkpoints import read_state, resolve_resume
from .consistency_config import ConsistencyConfig  # noqa: F401  (re-exported: a recipe section)
from .consistency_loss import make_consistency_loss_fn
from .consistency_targets import TargetNetwork, skipping_plan
from .distill_config import (  # noqa: F401  (re-exported: the recipe's sections)
    Config,
    EvalConfig,
    GuidanceConfig,
    GuidedStageConfig,
    ProgressiveConfig,
    SpeedConfig,
    accelerator_section,
    embed_lr_scale,
)
from .distill_lora import LORA_FILE, add_lora, check_lora_teacher, is_lora_unet, write_lora_outputs
from .distill_data import LatentDataset, PixelDataset, build_latent_dataset  # noqa: F401
from .distill_loss import make_loss_fn
from .distill_report import RoundEvaluator, _write_page, _write_round_folder
from .distill_rounds import RoundSpec, _check_resume, _plan_record, completed_rounds, plan_rounds, round_schedule  # noqa: F401
from .distill_targets import DTYPES, GuidedTeacher, round_plan, set_student_layout
from .guidance_embedding import USAGE, add_guidance_embedding, is_w_conditioned, w_condition, w_embedding_fn  # noqa: F401
from .loop import CheckpointHook, make_accelerator, train_loop, use_ema_weights

log = logging.getLogger(__name__)

__all__ = ["Config", "run", "w_condition", "w_embedding_fn", "round_schedule", "plan_rounds", "completed_rounds"]


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------

def student_scheduler(cfg: Config, teacher_scheduler):
    """The students' DDIMScheduler: the teacher's noise schedule, the student's prediction type and spacing."""
    from diffusers import DDIMScheduler

    ptype = teacher_scheduler.config.prediction_type if cfg.student_prediction_type == "teacher" else cfg.student_prediction_type
    spacing = teacher_scheduler.config.get("timestep_spacing", "leading") if cfg.timestep_spacing == "teacher" else cfg.timestep_spacing
    return DDIMScheduler.from_config(teacher_scheduler.config, prediction_type=ptype, timestep_spacing=spacing)


def consistency_scheduler(cfg: Config, ddim_scheduler):
    """The consistency student's LCMScheduler: the same noise schedule and prediction type, the
    skipping grid of consistency.solver_steps and the boundary scalings' timestep_scaling."""
    from diffusers import LCMScheduler

    return LCMScheduler.from_config(ddim_scheduler.config, original_inference_steps=cfg.consistency.solver_steps,
                                    timestep_scaling=cfg.consistency.timestep_scaling)


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
        raise PocketdiffError(f"progressive.start_steps: {cfg.progressive.start_steps} is above half the teacher's {T} training timesteps")
    if any(s.stage == "progressive" for s in plan):
        _check_student_grid(cfg, sched)
    if cfg.method == "consistency" and cfg.consistency.solver_steps > T:
        raise PocketdiffError(f"consistency.solver_steps: {cfg.consistency.solver_steps} is above the teacher's {T} training timesteps")
    check_resolution(pipe, cfg.data.resolution)
    check_lora_teacher(cfg, pipe.unet, sched.config.prediction_type)
    if is_w_conditioned(pipe.unet):
        raise PocketdiffError("the teacher UNet is already guidance-conditioned (time_cond_proj_dim set); distill from a classifier-free-guided model")


def _check_student_grid(cfg: Config, teacher_scheduler) -> None:
    """The last round's student must start where the sampler's noise belongs: near T. Leading spacing
    starts a 2-step DDIM at t = 501 and a 1-step one at t = 1 (SD's grid: pure noise read as an almost
    clean latent), a step count that spacing cannot serve."""
    s_sched = student_scheduler(cfg, teacher_scheduler)
    T, n = int(s_sched.config.num_train_timesteps), cfg.progressive.final_steps
    top = int(scheduler_timesteps(s_sched, n)[0])
    if top < (3 * T) // 4:
        raise PocketdiffError(f"timestep_spacing: {s_sched.config.timestep_spacing!r} starts the {n}-step student at t={top} of {T} "
                              f"(its sampler starts from pure noise there); use trailing for progressive.final_steps={n}")


def _load_unet(folder: Path):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(str(folder / "unet"), use_safetensors=True, local_files_only=True)


def _teacher_dtype(cfg: Config, device) -> torch.dtype:
    if cfg.speed.teacher_dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[cfg.speed.teacher_dtype]


def _prepare_student(student, cfg: Config):
    if not is_lora_unet(student):  # a LoRA student trains its factors alone (add_lora froze the rest)
        student.requires_grad_(True)
    student.train()
    if cfg.speed.gradient_checkpointing:
        student.enable_gradient_checkpointing()
    set_student_layout(student, cfg.speed.channels_last, cfg.speed.compile_student)
    if cfg.speed.compile_student:
        student.compile(mode=None if cfg.speed.student_compile_mode == "default" else cfg.speed.student_compile_mode)
    return student


# --------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------

def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    out = Path(out)
    # 1. recipe, teacher, schedulers (every check before any training)
    plan = plan_rounds(cfg)
    started = time.time()
    acc = make_accelerator(accelerator_section(cfg), out)
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
    for encoder in text_encoders(pipe):  # SDXL: text_encoder_2 too
        encoder.requires_grad_(False).eval().to(device)
    teacher_unet = pipe.unet.requires_grad_(False).eval()
    t_sched = pipe.scheduler
    s_sched = student_scheduler(cfg, t_sched)
    eval_t_sched = type(s_sched).from_config(s_sched.config, prediction_type=t_sched.config.prediction_type)  # the teacher's DDIM
    if cfg.method == "consistency":
        s_sched = consistency_scheduler(cfg, s_sched)
    tdtype = _teacher_dtype(cfg, device)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "distill_plan.json", _plan_record(cfg, plan))

    # 2. data
    images = ImageCaptionDataset(hf_ds, cfg.data.resolution)
    dataset = build_latent_dataset(cfg, pipe, images, out, acc) if cfg.cache_latents else PixelDataset(images)
    pipe.vae.to(device)
    uncond = encode_unconditional(pipe, [""], device, resolution=cfg.data.resolution)  # zeros under the folder's flag

    evaluator = RoundEvaluator(cfg, pipe, eval_t_sched, out, device)
    evaluator.set_default_prompts(captions)
    evaluator.check()
    report: dict = {
        "teacher": {"source": cfg.model.pretrained or f"built {cfg.model.arch} (random weights)",
                    "prediction_type": t_sched.config.prediction_type, "unet_params": count_params(teacher_unet)},
        "data": {"source": cfg.data.source, "items": len(dataset), "resolution": cfg.data.resolution},
        "method": cfg.method,
        "student": {"prediction_type": s_sched.config.prediction_type, "timestep_spacing": s_sched.config.timestep_spacing,
                    "loss_weighting": cfg.loss_weighting, "scheduler": type(s_sched).__name__,
                    **({"lora": cfg.student.record()} if cfg.student.enabled else {})},
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
            hook = _curve_hook(cfg, spec, evaluator, s_sched, out) if acc.is_main_process else None
            entry = _train_round(cfg, spec, acc, pipe, teacher_unet, t_sched, s_sched, tdtype, uncond,
                                 dataset, prev_folder, out, round_resume, budget, hook)
            if entry is None:
                report["stopped_early"] = f"max_time_s={cfg.max_time_s} reached during {spec.name}; --resume latest continues"
                break
            report["rounds"].append(entry)
        prev_folder = folder
        if acc.is_main_process and cfg.eval.enabled:
            _evaluate_round(cfg, spec, evaluator, report["rounds"][-1], folder, s_sched, out)
        acc.wait_for_everyone()

    # 6. report
    last = report["rounds"][-1] if report["rounds"] else None
    report["final_steps"] = last["steps"] if last else None
    report["pipeline_dir"] = last["pipeline_dir"] if last else None
    report["complete"] = len(report["rounds"]) == len(plan)
    if cfg.student.enabled:  # the LoRA's file, sha256, rank and size (the round's entry)
        report["lora"] = last.get("lora") if last else None
    if acc.is_main_process:
        _write_page(out, report)
    return report


def _evaluate_round(cfg: Config, spec: RoundSpec, evaluator: RoundEvaluator, entry: dict, folder: Path, s_sched, out: Path) -> None:
    """entry["eval"]: the round's grid (and metrics) at its step count; a consistency student's at
    each of consistency.sample_steps (entry["eval"] then maps the count to its result). Kept in
    DIR/eval, which --resume reads instead of evaluating again."""
    counts = cfg.consistency.sample_steps if spec.stage == "consistency" else [spec.steps]
    results = {}
    for n in counts:
        eval_path = out / "eval" / (f"{spec.name}.json" if spec.stage != "consistency" else f"{spec.name}-{n}steps.json")
        if eval_path.is_file():
            results[n] = read_json(eval_path, "--resume")
        else:
            results[n] = evaluator(dataclasses.replace(spec, steps=n), _load_unet(folder), s_sched)
            write_json(eval_path, results[n])
    entry["eval"] = results[spec.steps] if spec.stage != "consistency" else {str(n): r for n, r in results.items()}


def _curve_hook(cfg: Config, spec: RoundSpec, evaluator: RoundEvaluator, s_sched, out: Path) -> Optional[CheckpointHook]:
    """eval.curve_steps: at each checkpoint of a consistency stage, FD and CLIP score of its EMA weights at those
    counts, one JSON per checkpoint and count in DIR/eval/<round>-curve/ (what `_curve_points` gathers)."""
    if spec.stage != "consistency" or not cfg.eval.curve_steps:
        return None

    def hook(step: int, model, ema, train_s: float) -> None:
        unet = copy.deepcopy(model)
        if ema is not None:
            ema.copy_to(unet)
        for n in cfg.eval.curve_steps:
            metrics = evaluator.checkpoint_metrics(f"{spec.name}-curve", unet, s_sched, n, step)
            write_json(out / "eval" / f"{spec.name}-curve" / f"step{step}-{n}steps.json",
                       {"step": step, "train_seconds": train_s, "steps": n, "metrics": metrics})
        del unet

    return hook


def _curve_points(out: Path, spec: RoundSpec) -> Optional[list]:
    """The round's curve points (by training step, then count), or None when it has none."""
    folder = out / "eval" / f"{spec.name}-curve"
    if not folder.is_dir():
        return None
    points = [read_json(p, "the curve") for p in folder.glob("step*-*steps.json")]
    return sorted(points, key=lambda p: (p["step"], p["steps"]))


def _round_models(cfg: Config, spec: RoundSpec, teacher_unet, t_sched, s_sched, tdtype, uncond, prev_folder: Optional[Path], device):
    """(teacher, student, the teacher's unconditional `Conditioning` or None) of one round."""
    compile_mode = cfg.speed.teacher_compile_mode if cfg.speed.compile_teacher else None
    speed = dict(dtype=tdtype, fused_cfg=cfg.speed.fused_cfg, channels_last=cfg.speed.channels_last, compile_mode=compile_mode, device=device)
    if prev_folder is None:  # first round (or the consistency stage): the original model teaches, with classifier-free guidance
        teacher = GuidedTeacher(_copy_unet(teacher_unet), t_sched.config.prediction_type, **speed)
        base = _copy_unet(teacher_unet)
        base = base if base.dtype == torch.float32 else base.float()
        if cfg.student.enabled:  # a LoRA over the teacher (guidance folded: check_lora_config)
            student = add_lora(base, cfg.student)
        else:
            student = add_guidance_embedding(base, cfg.guidance.embed_dim) if cfg.guidance.conditioned else base
        return teacher, student, uncond
    # the previous student teaches (guidance already folded in: one pass per step)
    return GuidedTeacher(_load_unet(prev_folder), s_sched.config.prediction_type, **speed), _load_unet(prev_folder), None


def _round_loss(cfg: Config, spec: RoundSpec, teacher, student, pipe, s_sched, t_uncond, device):
    """(loss_fn, loop config, companion) of one round; the consistency stage's companion is its target network."""
    embed = cfg.guidance.embed_dim if cfg.guidance.conditioned else None
    if spec.stage == "consistency":
        target = TargetNetwork(student, cfg.consistency.target_ema_decay, device=device)
        loss_fn = make_consistency_loss_fn(cfg, teacher, target, skipping_plan(s_sched, cfg.consistency.solver_steps), pipe, s_sched,
                                           t_uncond, embed, device)
        return loss_fn, cfg.consistency.train, None if target.live else target, None  # a live target has no state of its own
    rplan = round_plan(s_sched, spec.steps, spec.teacher_steps) if spec.stage == "progressive" else None
    loss_fn = make_loss_fn(cfg, spec, teacher, rplan, pipe, s_sched, t_uncond, embed, device)
    return loss_fn, cfg.guided.train if spec.stage == "guided" else cfg.progressive.train, None, rplan


def _train_round(cfg: Config, spec: RoundSpec, acc, pipe, teacher_unet, t_sched, s_sched, tdtype, uncond, dataset,
                 prev_folder: Optional[Path], out: Path, resume: Optional[str], budget: Optional[float] = None,
                 on_checkpoint: Optional[CheckpointHook] = None) -> Optional[dict]:
    """Train one round (one `train_loop` call), write its pipeline folder atomically, return its report
    (None when the time budget stopped the round: its checkpoint is kept, no folder is written)."""
    device = acc.device
    teacher, student, t_uncond = _round_models(cfg, spec, teacher_unet, t_sched, s_sched, tdtype, uncond, prev_folder, device)
    loss_fn, section, companion, rplan = _round_loss(cfg, spec, teacher, student, pipe, s_sched, t_uncond, device)
    student = _prepare_student(student, cfg)
    loop_cfg = dataclasses.replace(section, max_steps=spec.max_steps)
    if budget is not None:
        loop_cfg = dataclasses.replace(loop_cfg, max_time_s=max(budget, 1e-3))
    acc.print(f"[distill] {spec.name}: {spec.stage}, student {spec.steps} steps"
              + (f" on the teacher's {spec.teacher_steps}-point skipping grid" if spec.stage == "consistency" else
                 f" from a {spec.teacher_steps}-step teacher" if spec.teacher_steps else " from the guided teacher"))
    ckpt = resolve_resume(out / "checkpoints" / spec.name, resume)
    start_step = read_state(ckpt)["step"] if ckpt is not None else 0
    t0 = time.time()
    result = train_loop(loop_cfg, model=student, loss_fn=loss_fn, dataset=dataset, collate=collate,
                        ckpt_dir=out / "checkpoints" / spec.name, seed=cfg.seed + 1000 * spec.index, resume=resume,
                        desc=spec.name, log_path=out / "logs.jsonl", accelerator=acc,
                        extra_state={"round": spec.index, "stage": spec.stage, "student_steps": spec.steps},
                        lr_scale=embed_lr_scale(cfg, spec), companion=companion, on_checkpoint=on_checkpoint,
                        trainable_only=cfg.student.enabled)
    # this invocation's seconds without the curve's evaluations; the round's: the loop's time over every
    # invocation (from its checkpoints) plus this invocation's set-up before the loop
    elapsed, timing = time.time() - t0, result.timing
    here_s = elapsed - timing["paused_s"]
    seconds = timing["train_s"] + max(0.0, elapsed - timing["wall_s"])
    acc.free_memory()
    del teacher, loss_fn, companion
    if getattr(result, "stopped_early", False):
        return None
    use_ema_weights(result, student)
    student.eval()
    folder = out / spec.name
    round_report = {
        "round": spec.index, "stage": spec.stage, "steps": spec.steps, "teacher_steps": spec.teacher_steps,
        "train_steps": result.steps, "final_loss": result.final_loss, "losses": result.losses,
        "skipped_steps": result.skipped_steps, "pipeline_dir": str(folder),
        "train_seconds": seconds, "processes": acc.num_processes,
        "samples_per_s": loop_cfg.batch_size * loop_cfg.grad_accum * max(result.steps - start_step, 1) / max(here_s, 1e-9),
        "curve": _curve_points(out, spec) if on_checkpoint is not None else None,
        # the loop's own clock: first step (compilation) apart, steady-state rate without checkpoint saves
        "timing": result.timing,
        "transitions": rplan.rows() if rplan is not None else None,
    }
    meta = {
        "pocketdiff_distill": 1, "round": spec.index, "stage": spec.stage, "num_inference_steps": spec.steps,
        **({"method": "consistency", "sampling_steps": list(cfg.consistency.sample_steps), "scheduler": "LCMScheduler",
            "solver_steps": cfg.consistency.solver_steps} if spec.stage == "consistency" else {}),
        "prediction_type": s_sched.config.prediction_type, "timestep_spacing": s_sched.config.timestep_spacing,
        "guidance": {**dataclasses.asdict(cfg.guidance), "how": USAGE if cfg.guidance.conditioned else "folded"},
        "teacher": cfg.model.pretrained or f"built {cfg.model.arch}", "parent": prev_folder.name if prev_folder else None,
        "report": round_report,
    }
    if acc.is_main_process:
        saved, extra, staging = student, {}, out / f".{spec.name}.lora"
        if cfg.student.enabled:  # the LoRA file (staged), and the teacher with it fused as the folder's UNet
            saved, round_report["lora"], extra[LORA_FILE] = write_lora_outputs(student, teacher_unet, cfg.student, staging, folder)
            meta["lora"] = {"file": LORA_FILE, **cfg.student.record()}
        _write_round_folder(pipe, saved, s_sched, folder, meta, share_from=prev_folder or _teacher_folder(cfg), extra_files=extra)
        if extra:
            shutil.rmtree(staging, ignore_errors=True)  # emptied by the move into the round folder
        if not cfg.keep_round_checkpoints:  # the round folder is its result: resume never reads these again
            shutil.rmtree(out / "checkpoints" / spec.name, ignore_errors=True)
    acc.wait_for_everyone()
    del student
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return round_report


def _teacher_folder(cfg: Config) -> Optional[Path]:
    """The teacher's local pipeline folder, whose text encoder, tokenizer and VAE round 0 can
    hardlink (None for a built teacher, a hub id, a VAE replaced by model.vae, or a LoRA fused into its text encoder)."""
    if not cfg.model.pretrained or cfg.model.vae or cfg.model.lora:
        return None
    path = Path(resolve_shipped(cfg.model.pretrained)).expanduser()
    return path if (path / "model_index.json").is_file() else None


def _copy_unet(unet):
    from diffusers import UNet2DConditionModel

    copy = UNet2DConditionModel.from_config(unet.config)
    copy.load_state_dict(unet.state_dict())
    return copy if unet.dtype == torch.float32 else copy.to(dtype=unet.dtype)
