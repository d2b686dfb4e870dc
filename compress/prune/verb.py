"""`pocketdiff prune`: dependency-aware structured pruning of the large UNet convolutions,
then recovery distillation from the unpruned model.

1. load data and the teacher pipeline (`model.pretrained`, or a built `model.arch`)
2. with `blocks:` (preset base | small | tiny, or a list), remove whole blocks first (`blocks`): the slim stock
   UNet starts from the teacher's kept blocks; then (unless ``prune.ratio: 0``)
   select target convs (name patterns + weight-size / activation-volume thresholds) and
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

Where each step lives: the recipe in `config`; 2 in `targets`, `graph` and `stream`; 3 in
`importance`; 4 in `allocation` and `slicing`, driven by `pruning.prune_unet`; 5 in
`recovery`; 6 in `measure`. This module runs them in order (`run`).

Loading the result: `pocketdiff.compress.prune.load_pruned_pipeline(dir)` (or
`load_pruned_unet(dir/unet)`); see `model`.

Bad input is refused while the config is validated, before the output folder is touched:
a ratio outside (0, 1), a target pattern matching no conv, targets with nothing prunable,
an unknown `prune.scope`, and a ratio that would leave a group or stream with fewer channels
than its GroupNorm groups.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pocketdiff.conditioning import text_encoders
from pocketdiff.errors import PocketdiffError
from pocketdiff.models import DISTILL_META, count_params, read_distill_meta
from pocketdiff.device import resolve_device
from pocketdiff.outputs import commit_folder, read_json, write_json
from pocketdiff.runtime.memory import host_peak_mb

from . import targets as pt
from .config import Config
from .importance import accumulate_diffusion_gradients, needs_gradients, resolve_importance
from .model import (  # noqa: F401  (re-exported: the loader hooks other stages call)
    PrunedUNet2DConditionModel,
    is_pruned_pipeline,
    load_pruned_pipeline,
    load_pruned_unet,
)
from .blocks import blocks_report, remove_blocks
from .recovery import recover
from .measure import Probe, _calibration_batches, external_metrics, plot_importance
from .pruning import macs_table, prune_unet

log = logging.getLogger(__name__)

__all__ = ["Config", "run", "load_pruned_pipeline", "load_pruned_unet", "is_pruned_pipeline", "prune_unet"]


def _save_unet_atomic(unet, folder: Path) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    unet.save_pretrained(str(tmp))
    commit_folder(tmp, folder)


@dataclasses.dataclass
class _Teacher:
    """Step 1's results: the data, the teacher pipeline and its sampling recipe."""

    captions: list[str]
    dataset: Any
    pipe: Any
    teacher: Any  # pipe.unet, on the device, frozen
    meta: dict  # the teacher's distill.json (empty for an undistilled model)
    w_fn: Optional[Callable]  # guidance-conditioned teacher (time_cond_proj_dim), else None
    w_range: tuple[float, float]
    eval_steps: int
    eval_w: float


def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    out = Path(out)
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)

    # 1. data and teacher
    t, report = _load_teacher(cfg, device)

    # 2-4. plan and prune (reused on --resume)
    student, plan = _pruned_student(cfg, out, resume, device, t, report)
    student = student.to(device).eval()

    # measurements before recovery
    sizes = _measure_sizes(cfg, report, t.teacher, student, plan)
    probe = (Probe(t.pipe, t.teacher, t.dataset, cfg.eval.probe_samples, cfg.seed, device, guidance_scale=t.eval_w)
             if cfg.eval.probe_samples else None)
    quality = {"before_pruning": {"mse_to_teacher": 0.0, "relative_mse": 0.0}}
    if probe:
        quality["after_pruning"] = probe.error(student)

    # 5. recovery
    student = _recover(cfg, out, resume, device, t, report, student, plan, probe, quality)

    # 6. outputs
    pruned_dir = out / "pruned_unet"
    _save_pipeline(out, t, report, student)
    unets = {"before_pruning": t.teacher, "after_pruning": _load_saved(pruned_dir).to(device)}
    if cfg.recovery.enabled:
        unets["after_recovery"] = student
    report["metrics"] = external_metrics(cfg, t.pipe, unets, out, device, t.eval_steps, t.eval_w)
    _write_page(cfg, out, report, plan, quality, sizes, t, unets)
    return report


def _load_teacher(cfg: Config, device) -> tuple[_Teacher, dict]:
    """Step 1: the data set (decoded once), the teacher pipeline on the device, its recipe; the report's first fields."""
    from pocketdiff.data import ImageCaptionDataset, InMemoryImageCaptionDataset, load_captioned_dataset
    from pocketdiff.models import check_resolution, load_or_build
    from pocketdiff.sampling import default_w_embedding_fn

    hf_ds = load_captioned_dataset(cfg.data)
    captions = list(hf_ds["text"])
    dataset = InMemoryImageCaptionDataset(ImageCaptionDataset(hf_ds))  # decoded once: recovery reads items many times
    pipe = load_or_build(cfg.model, captions=captions, resolution=cfg.data.resolution)
    if isinstance(pipe.unet, PrunedUNet2DConditionModel):
        log.info("model.pretrained is already pruned: pruning it further")
    check_resolution(pipe, cfg.data.resolution)  # before any work
    teacher = pipe.unet.to(device).eval().requires_grad_(False)
    pipe.vae.to(device).eval().requires_grad_(False)
    for encoder in text_encoders(pipe):  # SDXL: text_encoder_2 too
        encoder.to(device).eval().requires_grad_(False)
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
    return _Teacher(captions, dataset, pipe, teacher, meta, w_fn, w_range, eval_steps, eval_w), report


def _load_saved(folder: Path):
    """pruned_unet/: a channel-pruned UNet (pruning.json), or a stock one (block removal alone)."""
    if (folder / "pruning.json").is_file():
        return load_pruned_unet(folder)
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(str(folder)).eval()


def _pruned_student(cfg: Config, out: Path, resume: Optional[str], device, t: _Teacher, report: dict):
    """Steps 2-4: remove blocks, then select, score, allocate and cut (saved as pruned_unet/ + plan.json); both
    reloaded on --resume (refused when the block recipe changed)."""
    pruned_dir, plan_path = out / "pruned_unet", out / "plan.json"
    if resume is not None and (pruned_dir / "config.json").is_file() and plan_path.is_file():
        plan = read_json(plan_path, "--resume")
        before = (plan.get("blocks") or {}).get("recipe") or {"preset": None, "remove": []}
        if before != cfg.blocks.recipe() or bool(plan.get("groups")) != (cfg.prune.ratio > 0):
            raise PocketdiffError(f"{out}: the recipe changed since the interrupted run (blocks {before} -> {cfg.blocks.recipe()}, "
                                  "or prune.ratio 0 vs not); resume with the same config or start a new output folder")
        report["resumed_pruning"] = True
        return _load_saved(pruned_dir).to(device), plan
    slim, blocks_plan = t.teacher, None
    if cfg.blocks.active:
        slim, blocks_plan = remove_blocks(t.teacher, cfg.blocks)
        slim = slim.to(device)
    student, plan = _channel_pruned(cfg, t, report, slim, device)
    if blocks_plan is not None:
        plan["blocks"] = blocks_plan
    _save_unet_atomic(student, pruned_dir)
    write_json(plan_path, plan)
    return student, plan


def _channel_pruned(cfg: Config, t: _Teacher, report: dict, unet, device):
    """Step 3-4's channel pruning of `unet` (the teacher, or its block-removed copy); `unet` as it is at ratio 0."""
    if cfg.prune.ratio == 0:
        return unet, {"groups": [], "unprunable": [], "targeted": []}
    gen = torch.Generator().manual_seed(cfg.seed)
    importance = resolve_importance(cfg.prune.importance)
    gradient_fn: Optional[Callable] = None
    if needs_gradients(importance):
        tc = cfg.prune.taylor
        w_range, w_fn = t.w_range, t.w_fn

        def cond_fn(b):  # guidance-conditioned models: w ~ U[w_range] per sample
            w = w_range[0] + torch.rand(b, generator=gen) * (w_range[1] - w_range[0])
            return w_fn(w)

        def taylor_gradients(work, params):
            batches = _calibration_batches(t.pipe, t.dataset, tc.samples, tc.batch_size, gen, device)
            report["taylor"] = accumulate_diffusion_gradients(work, t.pipe.scheduler, batches, tc.samples, params, gen,
                                                              (tc.t_min, tc.t_max), cond_fn if w_fn is not None else None)

        gradient_fn = taylor_gradients

    return prune_unet(unet, cfg.prune, generator=gen, gradient_fn=gradient_fn)


def _measure_sizes(cfg: Config, report: dict, teacher, student, plan: dict) -> tuple[int, int]:
    """Params and MACs before and after (into the report); returns the targeted conv params (before, after)."""
    prof_before = pt.layer_profile(teacher)
    prof_after = pt.layer_profile(student)
    targeted = plan["targeted"]
    rename, prof_slim = None, prof_before
    if plan.get("blocks"):
        rename, prof_slim = blocks_report(cfg.blocks, plan["blocks"], teacher, student, prof_before, prof_after, report)
    tp_before = sum(prof_slim[n].params for n in targeted)
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
        "macs": macs_table(prof_before, prof_after, targeted, rename),
    })
    return tp_before, tp_after


def _recover(cfg: Config, out: Path, resume: Optional[str], device, t: _Teacher, report: dict, student, plan: dict,
             probe, quality: dict):
    """Step 5: recovery distillation from the unpruned teacher (resumable), then the probe error again."""
    from pocketdiff.data import collate

    if cfg.recovery.enabled:
        report["recovery"] = recover(cfg.recovery, cfg.train, student=student, teacher=t.teacher, pipe=t.pipe, dataset=t.dataset,
                                     collate=collate, ckpt_dir=out / "checkpoints" / "recovery", seed=cfg.seed,
                                     resume=resume, log_path=out / "logs.jsonl", w_range=t.w_range,
                                     feature_channels=plan.get("feature_channels"),
                                     feature_pairs=(plan.get("blocks") or {}).get("feature_pairs"))
        student = student.to(device).eval()
        if probe:
            quality["after_recovery"] = probe.error(student)
    else:
        report["recovery"] = {"enabled": False}
    report["teacher_relative_error"] = quality
    return student


def _save_pipeline(out: Path, t: _Teacher, report: dict, student) -> None:
    """Step 6a: pipeline/ with the pruned UNet (a distilled teacher's distill.json carried over)."""
    from pocketdiff.models import pipeline_like, save_pipeline

    final = pipeline_like(t.pipe, unet=student)  # the teacher's family (SDXL: text_encoder_2, its config flags)
    pipeline_dir = save_pipeline(final, out / "pipeline")
    if t.meta:  # a pruned distilled student keeps its sampling recipe (steps, guidance) for evaluate / export
        meta = {**t.meta, "pruned_by": "pocketdiff prune", "report": None}
        write_json(pipeline_dir / DISTILL_META, meta)
    report["pipeline_dir"] = str(pipeline_dir)
    report["loader"] = "pocketdiff.compress.prune.load_pruned_pipeline(pipeline_dir)"
    report["host_peak_rss_gb"] = round((host_peak_mb() or 0.0) / 1024, 3)  # GiB, this process's VmHWM (runtime/memory.py)


def _write_page(cfg: Config, out: Path, report: dict, plan: dict, quality: dict, sizes: tuple[int, int], t: _Teacher,
                unets: dict) -> None:
    """Step 6b: index.html (sizes, groups, streams, importance, errors, metrics, recovery loss, samples, per conv)."""
    from pocketdiff.report import table, write_page

    sections = _result_sections(cfg, out, report, plan, quality, sizes)
    prompts = list(cfg.eval.prompts) or t.captions[:4]
    if prompts:
        sections.append(_sample_grid(cfg, out, report, t, unets, prompts))
    per_conv = [c for c in report["macs"]["per_conv"] if c["targeted"] or c["params_before"] != c["params_after"]]
    sections.append(("Per conv (targeted or changed)", table(
        ["conv", "targeted", "params before", "params after", "MACs before", "MACs after"],
        [[c["name"], c["targeted"], c["params_before"], c["params_after"], c["macs_before"], c["macs_after"]] for c in per_conv])))
    write_page(out / "index.html", "pocketdiff prune", sections, report)


def _result_sections(cfg: Config, out: Path, report: dict, plan: dict, quality: dict, sizes: tuple[int, int]) -> list:
    from pocketdiff.report import img, table

    tp_before, tp_after = sizes
    sections = []
    rows = [["UNet params", report["params_before"], report["params_after"], report["params_after"] / report["params_before"]],
            ["targeted conv params", tp_before, tp_after, tp_after / max(tp_before, 1)],
            ["conv MACs / sample", report["macs"]["conv_before"], report["macs"]["conv_after"],
             report["macs"]["conv_after"] / max(report["macs"]["conv_before"], 1)],
            ["conv + linear MACs / sample", report["macs"]["total_before"], report["macs"]["total_after"],
             report["macs"]["total_after"] / max(report["macs"]["total_before"], 1)]]
    sections.append(("Size", table(["", "before", "after", "after / before"], rows)))
    if report.get("blocks"):
        b = report["blocks"]
        sections.append((f"Blocks removed ({b['preset'] or 'list'}: {', '.join(b['removed'])}); stages "
                         f"{b['stages']['before']} -> {b['stages']['after']}",
                         table(["slim UNet", "from the teacher's"], [[s, t] for s, t in b["block_map"].items()])))
    sections.append(("Groups (ResNet internal channels)", table(
        ["group", "channels", "GroupNorm groups", "targeted convs"],
        [[g["group"], f"{g['channels_before']} -> {g['channels_after']}",
          f"{g['groupnorm_groups_before']} -> {g['groupnorm_groups_after']}", ", ".join(g["targeted_convs"])] for g in plan["groups"]])))
    if plan.get("streams"):
        sections.append(("Streams (residual / block-output channels, whole GroupNorm groups of every norm over them)", table(
            ["stream", "channels", "removable units", "producers", "consumers"],
            [[st["stream"], f"{st['channels_before']} -> {st['channels_after']}", st["removable_units"],
              ", ".join(st["producers"]), ", ".join(st["consumers"])] for st in plan["streams"]])))
    if not plan["groups"] and not plan.get("streams"):  # block removal alone: no channel scores
        return sections + _quality_sections(cfg, out, report, quality)
    if plan.get("streams"):  # streams and groups per channel (stream atoms vary in size)
        plotted = [{"scores": g["scores"], "keep": g["keep"], "groupnorm_groups_before": len(g["scores"])}
                   for g in list(plan["groups"]) + list(plan["streams"])]
        plot_importance(plotted, out / "importance.png", f"importance: {cfg.prune.importance} (groups and streams)", "per_group")
    else:
        plot_importance(plan["groups"], out / "importance.png", f"importance: {cfg.prune.importance}", cfg.prune.groupnorm)
    sections.append((f"Importance distribution ({cfg.prune.importance})", img("importance.png")))
    return sections + _quality_sections(cfg, out, report, quality)


def _quality_sections(cfg: Config, out: Path, report: dict, quality: dict) -> list:
    from pocketdiff.report import img, plot_curves, table

    sections = []
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
    return sections


def _sample_grid(cfg: Config, out: Path, report: dict, t: _Teacher, unets: dict, prompts: list[str]) -> tuple[str, str]:
    """samples.png: one row per UNet (before / after pruning, after recovery), same prompts and seed."""
    from pocketdiff.report import img, save_grid
    from pocketdiff.sampling import generate

    grids = []
    for label, unet in unets.items():
        grids.append(generate(t.pipe, prompts, steps=t.eval_steps, guidance_scale=t.eval_w,
                              seed=cfg.eval.seed, resolution=cfg.data.resolution, unet=unet))
    images = torch.cat(grids)
    labels = [f"{label}: {p}" for label in unets for p in prompts]
    save_grid(images, out / "samples.png", ncols=len(prompts), labels=labels, cell=128)
    report["samples"] = {"grid": "samples.png", "rows": list(unets), "prompts": prompts, "steps": t.eval_steps,
                         "guidance_scale": t.eval_w}
    return (f"Samples, rows: {', '.join(unets)} (DDIM {t.eval_steps} steps, guidance {t.eval_w})", img("samples.png"))
