"""What `pocketdiff distill` writes besides checkpoints: round folders, sample grids and metrics, the page."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import DISTILL_META, pipeline_like
from pocketdiff.outputs import atomic_path, commit_folder, read_json, write_json
from pocketdiff.report import img, plot_curves, save_grid, table, write_page
from pocketdiff.sampling import generate

from .distill_config import Config
from .folders import SHAREABLE, pipeline_bytes_to_write, shareable_component, write_pipeline_folder
from .memory import check_free_space
from .distill_rounds import RoundSpec
from .guidance_embedding import USAGE, is_w_conditioned

log = logging.getLogger(__name__)


def _write_round_folder(pipe, student, sched, folder: Path, meta: dict, share_from: Optional[Path] = None,
                        extra_files: Optional[dict] = None) -> Path:
    """Save a stock pipeline folder under a temporary name, fsync, rename: atomic completion.
    The unchanged components (text encoder, tokenizer, VAE) are hardlinked (else copied) from
    `share_from` when it holds them as safetensors, else written; the free space is checked first.
    `extra_files` ({name: path}) are moved in beside them (a LoRA student's pytorch_lora_weights.safetensors)."""
    tmp = folder.parent / f".{folder.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    student = student.to(memory_format=torch.contiguous_format)
    sp = pipeline_like(pipe, unet=student, scheduler=sched)  # the teacher's family (SDXL: text_encoder_2 too)
    shared = {name: share_from for name in SHAREABLE if shareable_component(share_from, name) is not None}
    check_free_space(folder.parent, pipeline_bytes_to_write(sp, set(shared)), f"the {folder.name} pipeline folder")
    meta["report"]["folder_files"] = write_pipeline_folder(sp, tmp, shared)
    for name, path in (extra_files or {}).items():
        shutil.move(str(path), str(tmp / name))
    (tmp / DISTILL_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    (tmp / "README.md").write_text(_readme(meta).replace("StableDiffusionPipeline", type(sp).__name__), encoding="utf-8")
    return commit_folder(tmp, folder)


def _readme(meta: dict) -> str:
    n, g = meta["num_inference_steps"], meta["guidance"]
    if meta["stage"] == "consistency":
        return _consistency_readme(meta)
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


def _consistency_readme(meta: dict) -> str:
    n, g, counts = meta["num_inference_steps"], meta["guidance"], meta["sampling_steps"]
    w = f"guidance_scale=w)  # w in [{g['w_min']}, {g['w_max']}], e.g. {g['scale']}" if g["conditioned"] else \
        f"guidance_scale=1.0)  # guidance {g['scale']} is folded in"
    return (
        f"# pocketdiff consistency-distilled student (LCM), 1 to {meta['solver_steps']} steps\n\n"
        f"```python\nfrom diffusers import StableDiffusionPipeline\npipe = StableDiffusionPipeline.from_pretrained(\"{{this folder}}\")\n"
        f"pipe(prompt, num_inference_steps={n}, {w}\n```\n\n"
        f"- The folder's scheduler is diffusers' LCMScheduler (original_inference_steps={meta['solver_steps']}): any step count "
        f"from 1 to {meta['solver_steps']} works; measured at {counts}. Multi-step sampling re-noises between steps.\n"
        f"- Guidance: {USAGE if g['conditioned'] else 'folded in at the fixed scale'}\n"
        f"- In pocketdiff: `pocketdiff.sampling.generate(pipe, prompts, steps=N, guidance_scale=w)` (it follows the LCMScheduler).\n"
        f"- Teacher: {meta['teacher']}.\n" + (_lora_readme(meta) if meta.get("lora") else "")
    )


def _lora_readme(meta: dict) -> str:
    lora = meta["lora"]
    return (
        f"\n## The same student as a LoRA ({lora['file']}, rank {lora['lora_rank']})\n\n"
        f"This folder's UNet is the teacher with `{lora['file']}` fused. The LoRA alone turns the teacher (or another "
        f"fine-tune of the same base) into this few-step student:\n\n"
        f"```python\nfrom diffusers import LCMScheduler, StableDiffusionPipeline\n"
        f"pipe = StableDiffusionPipeline.from_pretrained(TEACHER)\n"
        f"pipe.scheduler = LCMScheduler.from_pretrained(\"{{this folder}}\", subfolder=\"scheduler\")\n"
        f"pipe.load_lora_weights(\"{{this folder}}\")  # {lora['file']}\npipe.fuse_lora()\n"
        f"pipe(prompt, num_inference_steps=4, guidance_scale=1.0)  # guidance {meta['guidance']['scale']} is folded in\n```\n\n"
        f"In pocketdiff: `model.lora: [{{path: {{this folder}}/{lora['file']}, scale: 1.0}}]` on the teacher, with this "
        f"folder's scheduler.\n"
    )


def _student_pipe(pipe, unet, sched):
    return pipeline_like(pipe, unet=unet, scheduler=sched)


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
        try:
            result = self._evaluate([("teacher DDIM", sp)], steps, self.out / "eval" / f"teacher-{steps}steps")[0]
        finally:  # the float32 teacher must not hold GPU memory through the next round
            self.pipe.unet.to("cpu")
        write_json(path, result)
        return result

    def metrics(self, spec: RoundSpec, folder: Path) -> dict:
        from pocketdiff.evaluate import ModelSpec

        where = spec.name if spec.stage != "consistency" else f"{spec.name}-{spec.steps}steps"
        student = self._evaluate([ModelSpec(name=f"student {spec.steps}", path=str(folder), steps=[spec.steps])], spec.steps,
                                 self.out / "eval" / where)[0]
        return {"student": student, "teacher_same_steps": self.teacher_metrics(spec.steps),
                "teacher_reference": self.teacher_metrics(self.ref_steps)}

    def checkpoint_metrics(self, where: str, unet, sched, steps: int, step: int) -> dict:
        """FD and CLIP score of an in-memory student (a checkpoint's weights) at `steps` (eval.curve_steps)."""
        unet.eval()
        with torch.no_grad():
            return self._evaluate([(f"step {step}", _student_pipe(self.pipe, unet, sched))], steps,
                                  self.out / "eval" / where / f"step{step}-{steps}steps")[0]

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
        try:
            images = self._images(sp, steps, self.cfg.guidance.scale)
        finally:  # the float32 teacher must not hold GPU memory through the next round
            self.pipe.unet.to("cpu")
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


def _round_evals(r: dict) -> list[tuple[int, dict]]:
    """(steps, eval) of a round report: one for a progressive round, one per count for a consistency stage."""
    ev = r.get("eval") or {}
    if r["stage"] == "consistency":
        return [(int(n), e) for n, e in ev.items()]
    return [(r["steps"], ev)] if ev else []


def _write_page(out: Path, report: dict) -> None:
    sections = []
    curves = {f"{r['stage']} {r['steps']} steps": r["losses"] for r in report["rounds"] if r["losses"]}
    if curves:
        plot_curves(curves, out / "loss.png", "step", "loss", "distillation loss (x space, weighted; consistency: pseudo-Huber)", logy=True)
        sections.append(("Loss per round", img("loss.png")))
    fd_curves = {f"{r['stage']} at {n} steps": [(p["train_seconds"], p["metrics"]["fd"]) for p in r["curve"] if p["steps"] == n]
                 for r in report["rounds"] if r.get("curve") for n in sorted({p["steps"] for p in r["curve"]})}
    if fd_curves:  # eval.curve_steps
        plot_curves(fd_curves, out / "curve.png", "training seconds", "FD", "FD at every checkpoint (eval.curve_steps)")
        sections.append(("FD against training time", img("curve.png")))
    rows = [[r["round"], r["stage"], r["steps"], r["teacher_steps"] or "-", r["train_steps"], r["final_loss"], Path(r["pipeline_dir"]).name]
            for r in report["rounds"]]
    sections.append(("Rounds", table(["round", "stage", "student steps", "teacher steps", "train steps", "final loss", "folder"], rows)))
    mrows, first = [], None
    for r in report["rounds"]:
        for steps, ev in _round_evals(r):
            m = ev.get("metrics")
            if not m:
                continue
            first = first or m["student"]
            for key, label in (("student", f"student {steps} steps"), ("teacher_same_steps", f"teacher DDIM {steps} steps"),
                               ("teacher_reference", f"teacher DDIM {m['teacher_reference'].get('steps')} steps")):
                mrows.append([r["round"], label, m[key].get("fd"), m[key].get("clip_score"), m[key].get("num_samples")])
    if mrows:
        sections.append(("Metrics", table(["round", "model", first.get("features") or "FD", first.get("clip_model_label") or "CLIP score", "images"], mrows)))
    for r in report["rounds"]:
        for steps, ev in _round_evals(r):
            if ev.get("grid"):
                sections.append((f"Round {r['round']} ({steps} steps): rows = " + ", ".join(ev["rows"]), img(ev["grid"])))
    lora = report.get("lora")
    if lora:  # student.lora_rank: the few-step student as a LoRA file
        sections.append(("The student as a LoRA", table(["file", "sha256", "rank", "alpha", "layers", "parameters", "bytes", "dtype"],
                         [[Path(lora["file"]).name, lora["sha256"], lora["rank"], lora["alpha"], lora["layers"], lora["params"],
                           lora["bytes"], lora["dtype"]]])))
    sections.append(("How to sample a student", f"<p>{report['guidance']['how']}</p>"))
    write_page(out / "index.html", "pocketdiff distill", sections, report)
