"""`pocketdiff web BUNDLE`: write the bundle's static page folder, BUNDLE/web/.

The page (web/static/: index.html, app.js and its modules) runs the bundle in a browser with
LiteRT.js on WebGPU (wasm CPU when the browser has no WebGPU). LiteRT.js is vendored: setup
installs the pinned npm package into web/node_modules (scripts/setup.sh), and this copies its
ESM build and the two non-threaded wasm builds next to the page, so the page works offline
and any static file server that serves the bundle folder serves the page with it.

With a reference (the default), the folder also gets `reference/`: the initial latents of
one prompt and seed (numpy's, as run-bundle draws them) and run-bundle's image from them, so
the page's check mode can compare its image with the Python runner's. From a picture (PageConfig init_image, mask,
strength: run-bundle's --init-image, --mask, --strength) the reference is run-bundle's image-to-image or inpainting
run, the picture and mask copied beside it (reference/init_image.png, mask.png) for the check mode's
`?init_image=reference/init_image.png&mask=reference/mask.png&strength=S`. With a LoRA (PageConfig lora, lora_scale:
run-bundle's --lora, --lora-scale, for a bundle exported with lora_slots) the reference is run-bundle's image with it, the
file copied to reference/lora.safetensors for the check mode's `?lora=reference/lora.safetensors&lora_scale=S`.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError, require

PAGE_DIR = "web"
STATIC = Path(__file__).resolve().parent / "static"
PAGE_FILES = ("index.html", "style.css", "app.js", "generate.js", "pipeline.js", "stages.js", "chunks.js", "prepare.js", "tiled.js", "lcm.js", "schedulers.js", "bpe.js", "npy.js", "sha256.js",
              "png.js", "image_input.js", "picture_ui.js", "lora.js", "lora_ui.js",
              "gpu_device.js", "limits.js", "tflite.js")
LITERTJS_VERSION = "2.5.3"  # pinned in web/package.json
# what the page loads from @litertjs: the ESM build, its wasm-utils import, and the wasm
# builds loadLiteRt() picks without threads/JSPI (relaxed SIMD or the compat one)
LITERTJS_FILES = (
    "core/package.json",
    "core/dist/index.js",
    "core/wasm/litert_wasm_internal.js",
    "core/wasm/litert_wasm_internal.wasm",
    "core/wasm/litert_wasm_compat_internal.js",
    "core/wasm/litert_wasm_compat_internal.wasm",
    "wasm-utils/package.json",
    "wasm-utils/dist/bundle.js",
)


def default_litertjs_dir() -> Path:
    """web/node_modules/@litertjs, where scripts/setup.sh installs the pinned package."""
    return Path(__file__).resolve().parent / "node_modules" / "@litertjs"


@dataclasses.dataclass
class PageConfig:
    bundle: str
    reference: bool = True  # write reference/ (latents + run-bundle's image) for the check mode
    prompt: Optional[str] = None  # reference prompt; default: the manifest's golden prompt
    seed: int = 0
    reference_accelerator: str = "cpu"  # run-bundle's accelerator for the reference image: cpu | gpu
    litertjs: Optional[str] = None  # folder with core/ and wasm-utils/; default: web/node_modules/@litertjs
    overwrite: bool = False
    # the reference from a picture (img2img; with a mask, inpainting): run-bundle's --init-image, --mask, --strength
    # (None: the task's default); the files are copied into reference/ for the check mode's URL parameters
    init_image: Optional[str] = None
    mask: Optional[str] = None
    strength: Optional[float] = None
    # the reference with a LoRA fed to the bundle's slots (run-bundle's --lora, --lora-scale; None: 1.0), copied into reference/
    lora: Optional[str] = None
    lora_scale: Optional[float] = None

    def __post_init__(self) -> None:
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        require(self.reference_accelerator in ("cpu", "gpu"), "reference_accelerator", f"must be cpu or gpu, got {self.reference_accelerator!r}")
        if not Path(self.bundle).is_dir():
            raise PocketdiffError(f"bundle {self.bundle}: not a folder")
        from pocketdiff.runtime.image_tasks import check_image_flags

        check_image_flags(self)  # a mask or strength without a picture, a strength outside (0, 1]
        from pocketdiff.runtime.lora_slots import check_lora_flags

        check_lora_flags(self)  # a scale without a LoRA, a pickle (never opened), a file that is not there


def litertjs_files(folder: Optional[str | Path] = None) -> dict[str, Path]:
    """The vendored LiteRT.js files by their path under web/litertjs/; a clear error when missing."""
    root = Path(folder) if folder else default_litertjs_dir()
    missing = [f for f in LITERTJS_FILES if not (root / f).is_file()]
    if missing:
        raise PocketdiffError(
            f"LiteRT.js files missing under {root} ({missing[0]}{' and more' if len(missing) > 1 else ''}): "
            f"run `bash scripts/setup.sh` (npm install of @litertjs/core@{LITERTJS_VERSION} into web/node_modules)")
    version = json.loads((root / "core/package.json").read_text())["version"]
    if version != LITERTJS_VERSION:
        raise PocketdiffError(f"{root}/core: @litertjs/core {version} found, the page is tested with {LITERTJS_VERSION}: rerun `bash scripts/setup.sh`")
    return {f: root / f for f in LITERTJS_FILES}


def _reference_run(bundle: Path, man: dict, prompt: str, seed: int, accelerator: str, latents: np.ndarray, cfg: PageConfig):
    """run-bundle's image from `latents`; from `cfg`'s picture (and mask, strength) as `run-bundle --init-image` makes it,
    with `cfg`'s LoRA as `--lora --lora-scale` feeds it: (image, stats, the reference's picture and LoRA fields)."""
    import argparse

    from pocketdiff.runtime.image_tasks import image_inputs
    from pocketdiff.runtime.run_bundle import BundleRunner

    picture, fields = {}, {}
    if cfg.init_image is not None:
        args = argparse.Namespace(bundle=str(bundle), init_image=cfg.init_image, mask=cfg.mask, strength=cfg.strength)
        picture = image_inputs(args, man)  # the bundle's tasks, the strength's steps, the picture and mask read and checked
        fields = {"init_image": "init_image" + Path(cfg.init_image).suffix.lower(), "strength": picture["strength"],
                  "mask": "mask" + Path(cfg.mask).suffix.lower() if cfg.mask else None}
    scale = 1.0 if cfg.lora_scale is None else float(cfg.lora_scale)
    # the LoRA read and checked against the bundle's slots when the runner is made, before anything runs
    with BundleRunner(bundle, accelerator, manifest=man, image_input=bool(picture), lora=cfg.lora, lora_scale=scale) as runner:
        image, stats = runner.run(prompt, seed=seed, init_latents=latents, **picture)
    if cfg.lora is not None:
        fields.update(lora="lora.safetensors", lora_scale=scale)
    return image, stats, fields


def _reference(bundle: Path, man: dict, prompt: str, seed: int, accelerator: str, folder: Path, cfg: PageConfig) -> dict:
    """run-bundle's image from numpy's seeded latents (exactly as `run-bundle --seed` draws them; an lcm
    bundle's re-noising draws, the same generator's next ones, go to noise.bin); from `cfg`'s picture when it gives one
    (the latents are then the noise it is noised with; the picture and mask copied next to it)."""
    from PIL import Image

    lat = man["latent"]
    shape = (1, int(lat["channels"]), int(lat["height"]), int(lat["width"]))
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal(shape).astype(np.float32)
    sched = man["scheduler"]
    renoisings = len(sched["timesteps"]) - 1 if sched.get("type", "ddim") == "lcm" else 0
    noise = np.stack([rng.standard_normal(shape).astype(np.float32) for _ in range(renoisings)]) if renoisings else None
    t0 = time.perf_counter()
    image, stats, picture = _reference_run(bundle, man, prompt, seed, accelerator, latents, cfg)
    if not stats["finite"]:
        raise PocketdiffError(f"bundle {bundle}: run-bundle's reference image has NaN/Inf values ({accelerator})")
    folder.mkdir(parents=True)
    latents.tofile(folder / "latents.bin")
    for key, src in (("init_image", cfg.init_image), ("mask", cfg.mask), ("lora", cfg.lora)):
        if picture.get(key):  # the check mode's ?init_image=reference/... (&mask=...) (&lora=...)
            shutil.copyfile(src, folder / picture[key])
    if noise is not None:  # an lcm bundle's re-noising draws, as run-bundle takes them after the latents
        noise.tofile(folder / "noise.bin")
    image.astype(np.float32).tofile(folder / "image.bin")  # HWC in [0, 1], as run-bundle clips it
    Image.fromarray((image * 255).round().astype(np.uint8)).save(folder / "image.png")
    ref = {
        "prompt": prompt,
        "seed": seed,
        "latents": "latents.bin",
        "latents_shape": list(shape),
        **({"noise": "noise.bin", "noise_shape": list(noise.shape)} if noise is not None else {}),
        "image": "image.bin",
        "image_shape": list(image.shape),
        "png": "image.png",
        **picture,  # init_image, mask, strength, lora, lora_scale: the files under reference/ and what run-bundle ran
        "dtype": "float32 little-endian",
        "made_by": {"runner": "pocketdiff run-bundle", "accelerator": accelerator, "driver": stats["driver"],
                    "fully_accelerated": stats["fully_accelerated"], "seconds": round(time.perf_counter() - t0, 3)},
    }
    (folder / "reference.json").write_text(json.dumps(ref, indent=1))
    return ref


def write_page(cfg: PageConfig) -> dict:
    """Write BUNDLE/web/ (replacing an earlier one only with overwrite); returns page.json's content."""
    from pocketdiff.runtime.bundle import load_manifest

    bundle = Path(cfg.bundle)
    man = load_manifest(bundle)  # refuses a bad bundle (sha256, truncated files, escaping paths) first
    vendor = litertjs_files(cfg.litertjs)
    out = bundle / PAGE_DIR
    if out.exists() and not cfg.overwrite and (not out.is_dir() or any(out.iterdir())):
        raise PocketdiffError(f"{out} exists; pass --overwrite to replace it")
    tmp = bundle / f".{PAGE_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for name in PAGE_FILES:
            shutil.copyfile(STATIC / name, tmp / name)
        for rel, src in vendor.items():
            dst = tmp / "litertjs" / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        ref = None
        if cfg.reference:
            prompt = cfg.prompt if cfg.prompt is not None else (man["tokenizer"].get("golden") or {}).get("prompt", "")
            ref = _reference(bundle, man, prompt, cfg.seed, cfg.reference_accelerator, tmp / "reference", cfg)
        info = {
            "made_by": "pocketdiff web",
            "litertjs": LITERTJS_VERSION,
            "bundle": str(bundle.resolve()),
            "reference": ref,
            "open": "serve the bundle folder (pocketdiff serve BUNDLE) and open /web/index.html",
        }
        (tmp / "page.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info
