"""pocketdiff.evaluate: FD / FID and CLIP score (torchmetrics), grids and reports; domain CLIPs.

Verbs: `pocketdiff evaluate` (`pocketdiff.evaluate.run`) and `pocketdiff train-clip`
(`pocketdiff.evaluate.train_clip`).

Library API for other stages (distill / prune / calibrate / demo call it per round):

    from pocketdiff.config import DataConfig
    from pocketdiff.evaluate import MetricConfig, MetricSetup, ModelSpec, evaluate_pipelines, SHAPES_CLIP

    setup = MetricSetup(MetricConfig(features="clip", clip=SHAPES_CLIP),          # built once:
                        reference=DataConfig(source="shapes", shapes_count=2048, resolution=32))
    results = evaluate_pipelines(
        [ModelSpec(name="teacher", path="out/teacher/pipeline"),                    # folders,
         ("student", student_pipe),                                               # pipelines,
         {"name": "pruned", "pipe": pipe, "unet": pruned_unet}],                  # or dicts
        prompts=setup.reference_captions()[:256], steps_list=[4, 8, 16], metric_setup=setup,
        out_dir="out/eval-round-1", seeds=[0, 1000], guidance_scale=3.0)
    # results: [{"model", "steps", "fd", "fd_std", "clip_score", "clip_score_std", "features",
    #            "num_samples", "num_seeds", "guidance_mode", "seconds_per_image", ...}, ...]

- `MetricSetup` loads the feature extractor and CLIP once and computes (or reads from the
  cache) the reference statistics once; reuse it across rounds.
- Images come from `pocketdiff.sampling.generate` (image i seeded seed + i). Guidance per
  model: `ModelSpec.guidance_mode` = auto | cfg | embedded | none (see `generation`).
- `compare_images(images, prompts, reference_images=None, setup=None)`: metrics for images a
  stage already generated (e.g. a student's grid against the teacher's images).
- `retrieval_accuracy(model, processor, images, captions)`: image<->text top-k of a CLIP.

Names are honest: "FID (Inception-v3 pool3, 2048-d)" only for Inception features with the
standard weights (`inception.py`; other Inception weights give "FD (Inception-v3 ...)"); a
domain CLIP gives "FD (shapes-CLIP)" and "CLIP score (shapes-CLIP)".
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from pocketdiff.shipped import ASSETS, PREFIX

SHAPES_CLIP = str(ASSETS / "clip-shapes")  # the shipped shapes CLIP folder (pocketdiff:clip-shapes)


def shipped_shapes_clip() -> str:
    """Folder of the small shapes CLIP shipped with pocketdiff (package data); also reachable
    in configs as ``clip: pocketdiff:clip-shapes``. Missing: a one-line error."""
    from .features import resolve_clip_source

    return resolve_clip_source(PREFIX + "clip-shapes")


from .features import load_clip  # noqa: E402
from .generation import ModelSpec  # noqa: E402
from .metrics import MetricConfig, MetricSetup  # noqa: E402
from .retrieval import retrieval_accuracy  # noqa: E402
from .run import evaluate_pipelines  # noqa: E402


def compare_images(
    images: torch.Tensor,
    prompts: Sequence[str],
    reference_images: Optional[torch.Tensor] = None,
    setup: Optional[MetricSetup] = None,
    clip: Optional[str] = None,
) -> dict:
    """Metrics of already generated images ([N, 3, H, W] floats in [0, 1] or uint8).

    - CLIP score against `prompts`;
    - FD against `reference_images` (e.g. the teacher's images for the same prompts and
      seeds) when given, else against `setup`'s reference statistics when it has a reference.
    Without `setup`, a CLIP-feature setup is built on `clip` (default: the shipped shapes
    CLIP); pass a setup to reuse it between calls.
    """
    if setup is None:
        setup = MetricSetup(MetricConfig(features="clip", clip=clip or shipped_shapes_clip(), fd=reference_images is not None,
                                         reference_clip_samples=0))
    out: dict = {"num_samples": int(len(images)), "features": setup.fd_label, "clip_model_label": setup.clip_label}
    if setup.cfg.clip_score:
        out["clip_score"] = setup.clip_score(images, list(prompts))
    if setup.cfg.fd and reference_images is not None:
        out["fd"] = setup.fd_between(images, reference_images)
        out["fd_against"] = f"{len(reference_images)} given reference images"
    elif setup.cfg.fd and setup.reference is not None:
        out["fd"] = setup.fd(images)
        out["fd_against"] = (setup.reference_info or {}).get("data")
    if setup.cfg.fd and "fd" in out and setup.feature_dim and len(images) <= setup.feature_dim:
        out["warning"] = f"{len(images)} samples <= {setup.feature_dim} feature dimensions: FD is dominated by sample-size bias"
    return out


__all__ = [
    "MetricConfig", "MetricSetup", "ModelSpec", "evaluate_pipelines", "compare_images", "retrieval_accuracy",
    "load_clip", "SHAPES_CLIP", "shipped_shapes_clip",
]
