"""The export package's interface to other stages: what a bundle was exported for, and
images from it.

`pocketdiff.evaluate` (``kind: bundle``) comes through here, never through the CLI's verb
table or the runner's internals. Both functions take a bundle folder made by
`pocketdiff export`; the images come from the reference runner (`run_bundle.BundleRunner`,
which loads the models once for all prompts: the bundle's .tflite files on ai-edge-litert, the
LiteRT GPU delegate by default).

A bundle is fixed at export: its step count, resolution and, for an ``embedded`` or ``none``
guidance bundle, its guidance scale. Asking for another one is an error naming the value
the bundle holds, not a silent substitute. A ``cfg`` bundle applies its guidance outside
the graph, so any scale runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pocketdiff.errors import PocketdiffError

from .bundle import load_manifest


@dataclass(frozen=True)
class BundleInfo:
    """What a bundle was exported for (read from its manifest)."""

    path: str
    steps: int  # denoising steps (the manifest's fixed timesteps)
    resolution: int  # image side in pixels
    guidance_mode: str  # cfg | embedded | none
    guidance_scale: float  # the scale given at export (cfg bundles take any at run time)


def bundle_info(bundle: str | Path) -> BundleInfo:
    """The bundle's fixed settings; refuses a folder that is not a readable bundle.
    Checksums are not verified here (`generate_images` does, before running)."""
    man = load_manifest(bundle, verify_sha=False)
    try:
        lat, guidance = man["latent"], man["guidance"]
        return BundleInfo(path=str(Path(bundle)), steps=len(man["scheduler"]["timesteps"]),
                          resolution=int(lat["height"]) * int(lat["vae_factor"]),
                          guidance_mode=str(guidance["mode"]), guidance_scale=float(guidance["scale"]))
    except (KeyError, TypeError, ValueError) as e:
        raise PocketdiffError(f"bundle {bundle}: manifest lacks or mangles {e} (export it again)") from None


def _check_request(info: BundleInfo, steps: int, guidance_scale: float, resolution: Optional[int]) -> None:
    where = f"bundle {info.path}"
    if int(steps) != info.steps:
        raise PocketdiffError(f"{where}: exported for {info.steps} steps, asked for {steps} (export again with steps: {steps})")
    if resolution is not None and int(resolution) != info.resolution:
        raise PocketdiffError(f"{where}: exported at {info.resolution}x{info.resolution}, asked for {resolution} "
                              f"(export again with resolution: {resolution})")
    if info.guidance_mode == "embedded" and abs(float(guidance_scale) - info.guidance_scale) > 1e-6:
        raise PocketdiffError(f"{where}: guidance {info.guidance_scale:g} is embedded in the bundle, asked for "
                              f"{guidance_scale:g} (export again with guidance_scale: {guidance_scale:g})")


def generate_images(bundle: str | Path, prompts: Sequence[str], *, steps: int, guidance_scale: float, seed: int,
                    resolution: Optional[int] = None, accelerator: str = "gpu") -> np.ndarray:
    """Float32 images [N, 3, H, W] in [0, 1], image i from initial noise seeded seed + i.

    `steps` and `resolution` must be the bundle's (see `bundle_info`); `guidance_scale`
    is applied by a ``cfg`` bundle, must equal the embedded one for ``embedded``, and is
    ignored by ``none`` (one conditional pass, as for pipelines). Noise comes from numpy's
    generator (the runner's), so a seed gives other noise than the torch pipelines.
    Raises PocketdiffError when an image is not finite."""
    from .run_bundle import BundleRunner

    info = bundle_info(bundle)
    _check_request(info, steps, guidance_scale, resolution)
    man = load_manifest(bundle)  # verifies checksums once for all prompts
    if info.guidance_mode == "cfg":
        man["guidance"] = {**man["guidance"], "scale": float(guidance_scale)}
    images = []
    with BundleRunner(bundle, accelerator, manifest=man) as runner:  # the models load once for all prompts
        for i, prompt in enumerate(prompts):
            image, stats = runner.run(prompt, seed=seed + i)
            if not stats["finite"]:
                raise PocketdiffError(f"bundle {info.path}: NaN/Inf in the image of prompt {i} ({prompt!r}, {accelerator})")
            images.append(np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32))
    if not images:
        return np.zeros((0, 3, info.resolution, info.resolution), np.float32)
    return np.stack(images)
