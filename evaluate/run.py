"""`pocketdiff evaluate`: FD / FID and CLIP score of one or more models at given step counts,
with grids, plots and a report (see `pocketdiff.evaluate` for the library API).

1. prompts (file, list, or the reference set's own captions), cycled to `prompts.num_samples`
2. metric setup: feature extractor + CLIP model; reference statistics from the cache or
   computed once (content hash of data + extractor weights)
3. for each model, step count and seed: images through `pocketdiff.sampling.generate`
   (image i seeded seed + i), FD against the reference, CLIP score against the prompts
4. report.json (`results`: model, steps, fd, clip_score, features, num_samples, ...) and
   index.html (tables with sample counts, warnings, metric-vs-steps plots, grids with the same
   prompt and seed across models); `compare:` adds earlier runs to the page
"""
from __future__ import annotations

import dataclasses
import html
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from pocketdiff.config import DataConfig, renamed_value
from pocketdiff.errors import PocketdiffError, require
from pocketdiff.names import OLD_PRECISIONS
from pocketdiff.outputs import write_json
from pocketdiff.device import resolve_device

from .generation import DTYPES, LoadedModel, ModelSpec, generate_images, resolve_model
from .metrics import MetricConfig, MetricSetup, iter_reference_batches
from .pages import compare_section, grid_section, img, load_run, metric_table, plot_metric, write_index

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PromptConfig:
    """Prompts: a text file (one per line), a list, or the first N captions of the reference set."""

    file: Optional[str] = None
    texts: list[str] = dataclasses.field(default_factory=list)
    from_reference: int = 0  # N > 0: the first N captions of `reference` (their own images are the FD reference)
    num_samples: Optional[int] = None  # images per seed; prompts are cycled to reach it (default: one per prompt)

    def __post_init__(self) -> None:
        require(self.from_reference >= 0, "prompts.from_reference", "must be >= 0")
        require(self.num_samples is None or self.num_samples >= 1, "prompts.num_samples", "must be >= 1")


@dataclasses.dataclass
class Config:
    models: list[ModelSpec] = dataclasses.field(default_factory=list)
    prompts: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    reference: Optional[DataConfig] = None  # real images for FD (and real-data CLIP score)
    metrics: MetricConfig = dataclasses.field(default_factory=MetricConfig)
    steps: list[int] = dataclasses.field(default_factory=lambda: [25])
    guidance_scale: float = 3.0
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])  # repeated runs for the spread
    resolution: Optional[int] = None  # default: each model's own
    batch_size: int = 16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "fp32"  # fp32 | fp16 | bf16 (pipelines; metrics run in fp32)
    grid_prompts: int = 8  # prompts shown in the grids (the first ones, first seed)
    compare: list[str] = dataclasses.field(default_factory=list)  # earlier evaluate output folders

    def __post_init__(self) -> None:
        require(bool(self.models) or bool(self.compare), "models", "list at least one model (or compare: earlier runs)")
        require(all(int(s) >= 1 for s in self.steps) and bool(self.steps), "steps", "a non-empty list of step counts >= 1")
        require(bool(self.seeds), "seeds", "at least one seed")
        require(len(set(self.seeds)) == len(self.seeds), "seeds", "must be distinct")
        require(self.guidance_scale >= 0, "guidance_scale", "must be >= 0")
        require(self.batch_size >= 1, "batch_size", "must be >= 1")
        self.dtype = renamed_value(self.dtype, "dtype", OLD_PRECISIONS)
        require(self.dtype in DTYPES, "dtype", f"must be one of {tuple(DTYPES)}")
        require(self.grid_prompts >= 0, "grid_prompts", "must be >= 0")


# ----------------------------------------------------------------------------- prompts


def read_prompt_file(path: str | Path) -> list[str]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise PocketdiffError(f"prompts.file: {p} not found")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise PocketdiffError(f"prompts.file: {p} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise PocketdiffError(f"prompts.file: {p} is empty (no prompts; one prompt per line)")
    return prompts


def resolve_prompts(cfg: PromptConfig, reference_captions=None) -> list[str]:
    prompts: list[str] = []
    if cfg.file:
        prompts += read_prompt_file(cfg.file)
    prompts += [str(t) for t in cfg.texts]
    if cfg.from_reference:
        if reference_captions is None:
            raise PocketdiffError("prompts.from_reference: needs a reference data set (reference.source ...)")
        caps = list(reference_captions())
        if not caps:
            raise PocketdiffError("prompts.from_reference: the reference set has no captions")
        prompts += caps[: cfg.from_reference]
    if any(not p.strip() for p in prompts):
        raise PocketdiffError("prompts.texts: contains an empty prompt")
    if not prompts:
        raise PocketdiffError("prompts: none given (set prompts.file, prompts.texts or prompts.from_reference)")
    if cfg.num_samples:
        prompts = [prompts[i % len(prompts)] for i in range(cfg.num_samples)]
    return prompts


# ----------------------------------------------------------------------------- core


def _mean_std(values: list[float]) -> tuple[Optional[float], Optional[float]]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def sample_warnings(setup: MetricSetup, num_samples: int, num_seeds: int, prompts: Optional[Sequence[str]] = None,
                    seeds: Optional[Sequence[int]] = None) -> list[str]:
    out = []
    if setup.cfg.fd:
        dim = setup.feature_dim or 0
        if num_samples <= dim:
            out.append(f"{setup.fd_label}: {num_samples} samples per seed <= {dim} feature dimensions: the sample covariance "
                       "is rank-deficient, FD is dominated by sample-size bias; compare only runs with equal sample counts")
        elif num_samples < setup.fd_min_samples:
            out.append(f"{setup.fd_label}: {num_samples} samples per seed is small (< {setup.fd_min_samples}); FD is biased "
                       "upward at small N, compare only runs with equal sample counts and see the real-data floor")
        ref_n = (setup.reference_info or {}).get("num_images")
        if ref_n is not None and ref_n < setup.fd_min_samples:
            out.append(f"{setup.fd_label}: reference has only {ref_n} images (< {setup.fd_min_samples})")
    if setup.cfg.clip_score and prompts is not None:
        n_long = setup.too_long(prompts)
        if n_long:
            out.append(f"{setup.clip_label}: {n_long} of {len(prompts)} prompts exceed the CLIP text length "
                       f"({setup.clip.model.config.text_config.max_position_embeddings} tokens) and are truncated")
    if seeds is not None and len(seeds) > 1:
        ordered = sorted(seeds)
        if any(b - a < num_samples for a, b in zip(ordered, ordered[1:])):
            out.append(f"seeds {list(seeds)} are closer than {num_samples} (image i of seed s uses noise seed s + i): "
                       "the repeated runs share noise and their spread is understated; space seeds >= num_samples apart")
    if num_seeds < 2:
        out.append("one seed only: no spread over seeds is reported (add seeds: [0, 1000, ...])")
    return out


def evaluate_pipelines(
    models: Sequence[Any],
    prompts: Sequence[str],
    steps_list: Sequence[int],
    metric_setup: MetricSetup,
    out_dir: Optional[str | Path] = None,
    *,
    seeds: Sequence[int] = (0,),
    guidance_scale: float = 3.0,
    batch_size: int = 16,
    resolution: Optional[int] = None,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
    grid_prompts: int = 8,
    compare: Sequence[str | Path] = (),
    extra_report: Optional[dict] = None,
    progress: bool = False,
) -> list[dict]:
    """Evaluate `models` (ModelSpec / folder / pipeline / (name, pipeline) / dict) on `prompts`
    at every step count; returns the `results` list (also written to `out_dir` with the page).

    Per model the step counts are its own (`ModelSpec.steps`, a distilled student's
    `num_inference_steps`) when set, else `steps_list`. One result per (model, steps):
    mean and std over `seeds` of FD and CLIP score, per-seed values, `num_samples` per seed.
    """
    prompts = list(prompts)
    if not prompts:
        raise PocketdiffError("prompts: empty prompt list")
    if metric_setup.cfg.fd and len(prompts) < 2:
        raise PocketdiffError(f"prompts: {len(prompts)} prompt(s) give {len(prompts)} image(s) per seed; FD needs at least 2")
    dev = torch.device(device) if device is not None else metric_setup.device
    seeds = [int(s) for s in seeds]
    out = Path(out_dir) if out_dir is not None else None
    metric_setup.prepare()
    n_grid = min(grid_prompts, len(prompts))
    chunk = max(batch_size, 64)  # images generated and measured at a time (image i still seeded seed + i)

    results: list[dict] = []
    grids: dict[int, dict[str, torch.Tensor]] = {}
    model_names: list[str] = []
    for index, m in enumerate(models):
        loaded: LoadedModel = resolve_model(m, index, dev, dtype)
        name = loaded.name
        while name in model_names:
            name += "'"
        model_names.append(name)
        steps_for_model = loaded.default_steps or [int(s) for s in steps_list]
        w = loaded.default_guidance if loaded.default_guidance is not None else float(guidance_scale)
        for steps in steps_for_model:
            fds, clips, secs = [], [], 0.0
            for si, seed in enumerate(seeds):
                timing = [0.0]

                def batches(seed=seed, keep=(si == 0 and n_grid > 0), timing=timing, steps=steps):
                    kept = []
                    with tqdm(total=len(prompts), desc=f"{name}, {steps} steps, seed {seed}", unit="img",
                              disable=not progress, leave=False, dynamic_ncols=True) as bar:  # closed on errors too
                        for start in range(0, len(prompts), chunk):
                            part = prompts[start : start + chunk]
                            images, seconds = generate_images(loaded, part, steps, w, seed + start, resolution, batch_size)
                            timing[0] += seconds
                            bar.update(len(part))
                            if keep and start < n_grid:
                                kept.append(images[: n_grid - start].clone())
                                if sum(len(k) for k in kept) >= n_grid:
                                    grids.setdefault(steps, {})[name] = torch.cat(kept)[:n_grid]
                            yield images, part

                got = metric_setup.measure(batches())
                secs += timing[0]
                if got["fd"] is not None:
                    fds.append(got["fd"])
                if got["clip_score"] is not None:
                    clips.append(got["clip_score"])
                log.info("evaluate %s %d steps seed %d: %s", name, steps, seed, got)
                if progress:
                    print(f"evaluate: {name} {steps} steps seed {seed}: FD {got['fd']} CLIP score {got['clip_score']} "
                          f"({got['num_samples']} images, {timing[0]:.1f} s sampling)", file=sys.stderr, flush=True)
            fd, fd_std = _mean_std(fds)
            cs, cs_std = _mean_std(clips)
            results.append({
                "model": name, "path": loaded.spec.path, "unet": loaded.spec.unet, "kind": loaded.spec.kind,
                "steps": int(steps), "guidance_scale": w if loaded.guidance_mode != "none" else 1.0,
                "guidance_mode": loaded.guidance_mode,
                "fd": fd, "fd_std": fd_std, "fd_per_seed": fds or None,
                "clip_score": cs, "clip_score_std": cs_std, "clip_score_per_seed": clips or None,
                "features": metric_setup.fd_label, "clip_model_label": metric_setup.clip_label,
                "num_samples": len(prompts), "num_seeds": len(seeds), "seeds": seeds,
                "seconds_per_image": secs / (len(prompts) * len(seeds)),
            })

    if out is not None:
        write_evaluation(out, results, metric_setup, prompts, seeds, grids, model_names, compare, extra_report)
    return results


def write_evaluation(out: Path, results: list[dict], setup: Optional[MetricSetup], prompts: list[str], seeds: list[int],
                     grids: dict, model_names: list[str], compare: Sequence[str | Path] = (), extra_report: Optional[dict] = None) -> dict:
    """report.json + index.html for `results` (and earlier runs in `compare`)."""
    out.mkdir(parents=True, exist_ok=True)
    warnings = sample_warnings(setup, len(prompts), len(seeds), prompts, seeds) if (setup is not None and results) else []
    report: dict = {
        "results": results,
        "metrics": setup.describe() if setup is not None else None,
        "prompts": {"count": len(prompts), "distinct": len(set(prompts)), "first": prompts[:8]},
        "seeds": seeds,
        "warnings": warnings,
    }
    if extra_report:
        report.update(extra_report)
    sections: list[tuple[str, str]] = []
    if results and setup is not None:
        ref = setup.reference_info or {}
        esc = html.escape
        what = [f"<li>FD features: <b>{esc(str(setup.fd_label or 'off'))}</b>" + (f" ({setup.feature_dim}-d)" if setup.feature_dim else "") + "</li>",
                f"<li>CLIP score: <b>{esc(str(setup.clip_label or 'off'))}</b> (torchmetrics CLIPScore: 100 x cosine, clamped at 0)</li>",
                f"<li>reference: {esc(str(ref.get('data', '-')))} ({ref.get('num_images', '-')} images; statistics cache {ref.get('cache', '-')})</li>",
                f"<li>{len(prompts)} prompts ({len(set(prompts))} distinct) per seed; seeds {seeds}; image i of a seed s uses seed s + i</li>"]
        sections.append(("What was measured", "<ul>" + "".join(what) + "</ul>"))
        if warnings:
            sections.append(("Warnings", "<ul>" + "".join(f"<li>{html.escape(w)}</li>" for w in warnings) + "</ul>"))
        body = metric_table(results, setup.fd_label, setup.clip_label)
        floor = []
        if ref.get("clip_score_real") is not None:
            floor.append(f"real images vs their own captions: {setup.clip_label} = {ref['clip_score_real']:.4g} "
                         f"({ref['clip_score_real_samples']} images)")
        if ref.get("fd_real_subset") is not None:
            floor.append(f"{ref['fd_real_subset_samples']} real images drawn from the reference itself: {setup.fd_label} = "
                         f"{ref['fd_real_subset']:.4g} (the FD a perfect model could reach at this sample count)")
        if floor:
            body += "<p>Real-data reference points: " + html.escape("; ".join(floor)) + ".</p>"
        sections.append(("Metrics (mean ± std over seeds)", body))
        plots = []
        for key, label in (("fd", setup.fd_label), ("clip_score", setup.clip_label)):
            if label and plot_metric(results, key, out / f"{key}_vs_steps.png", label, f"{label} vs sampling steps"):
                plots.append(img(f"{key}_vs_steps.png"))
        if plots:
            sections.append(("Metrics against steps", "".join(plots)))
        for steps in sorted(grids):
            names = [m for m in model_names if m in grids[steps]]
            n = min(len(grids[steps][m]) for m in names)
            sections.append((f"Samples at {steps} steps (same prompt and seed across models)",
                             grid_section(out, steps, names, prompts[:n], seeds[0], grids[steps])))
    if compare:
        runs = [(Path(c).name or str(c), load_run(c)) for c in compare]
        if results:
            runs.append(("this run", {"results": results, "metrics": report["metrics"]}))
        html_body, rows = compare_section(out, runs)
        report["compare"] = [{"run": r["run"], "model": r["model"], "steps": r["steps"], "fd": r.get("fd"),
                              "clip_score": r.get("clip_score"), "features": r.get("features"),
                              "num_samples": r.get("num_samples")} for r in rows]
        if not results:
            report["results"] = []
        sections.append(("Compare runs", html_body))
    write_json(out / "report.json", report)
    write_index(out, report, sections)
    return report


def run(cfg: Config, out: Path, resume: Optional[str] = None) -> dict:
    if resume is not None:
        raise PocketdiffError("evaluate has nothing to resume: run it again (reference statistics are cached)")
    out = Path(out)
    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype] if cfg.dtype != "fp32" else None
    t0 = time.time()
    if not cfg.models:  # compare-only
        report = write_evaluation(out, [], None, [], list(cfg.seeds), {}, [], cfg.compare)
        return report
    setup = MetricSetup(cfg.metrics, cfg.reference, device)
    prompts = resolve_prompts(cfg.prompts, setup.reference_captions if cfg.reference is not None else None)
    if cfg.metrics.fd and cfg.reference is not None:
        setup.prepare()
        add_real_floor(setup, len(prompts))
    results = evaluate_pipelines(
        cfg.models, prompts, cfg.steps, setup, out, seeds=cfg.seeds, guidance_scale=cfg.guidance_scale,
        batch_size=cfg.batch_size, resolution=cfg.resolution, device=device, dtype=dtype,
        grid_prompts=cfg.grid_prompts, compare=cfg.compare, progress=True,
    )
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    report["results"] = results
    report["device"] = str(device)
    report["seconds"] = round(time.time() - t0, 2)
    return report


def add_real_floor(setup: MetricSetup, n: int) -> None:
    """FD of `n` real images drawn from the reference set itself: what a perfect model would
    score at this sample count (optimistic: those images are part of the reference)."""
    ds = setup.reference_dataset()
    m = min(n, len(ds))
    if m < 2:
        return
    g = torch.Generator().manual_seed(12345)
    idx = torch.randperm(len(ds), generator=g)[:m].tolist()
    batches = (b for b, _ in iter_reference_batches(ds.select(idx), setup.cfg.batch_size))
    setup.reference_info["fd_real_subset"] = setup.fd(batches)
    setup.reference_info["fd_real_subset_samples"] = m
