"""Image-to-image and inpainting in the runner (numpy; PIL reads the pictures): the user's picture and mask, read and
checked against the bundle, and the denoise loop's start and per-step blend (runtime/pipeline.py runs them).

- The picture (`--init-image`) is RGB in [0, 1] at the bundle's image size. Another size of the same aspect ratio is
  resized (Lanczos, as diffusers' image processor) with one warning line naming both sizes; another aspect ratio is
  refused: stretching or cropping it would change the picture the user chose.
- The mask (`--mask`, white = repaint) must have the picture's size (as given); it is read as grey (PIL's "L"),
  resized with the picture, binarized at 0.5 and taken to the latent grid by nearest sampling: the pixel at each
  latent cell's top-left corner, as diffusers' `F.interpolate(mask, size)` does.
- The start (diffusers' img2img pipelines): the scheduler keeps the last steps of its schedule (`scheduler_for(block,
  strength)`), and the loop starts from `add_noise(image_latents, noise, timesteps[0])`; inpainting at strength 1 starts
  from the noise itself (StableDiffusionInpaintPipeline). Inpainting blends after every step, as diffusers' inpaint
  pipeline does with a 4-channel UNet: `x = mask * x + (1 - mask) * add_noise(image_latents, noise, t_next)`, and
  after the last step the picture's latents themselves outside the mask.
- An inpainting UNet (9 input channels: StableDiffusionInpaintPipeline folders) repaints by itself: it takes the mask on
  the latent grid and the latents of the masked picture (the repainted part grey, 0.5) as inputs every step, and the
  loop does not blend; such a bundle serves inpaint only (run-bundle needs --init-image and --mask).
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import numpy as np

from pocketdiff.errors import PocketdiffError

from .schedulers import Scheduler, scheduler_for

IMAGE_TO_IMAGE, INPAINT = "image_to_image", "inpaint"
DEFAULT_STRENGTH = {IMAGE_TO_IMAGE: 0.8, INPAINT: 1.0}  # diffusers' img2img and inpaint pipelines' defaults


def check_strength(strength, flag: str = "--strength") -> float:
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) or not 0 < strength <= 1:
        raise PocketdiffError(f"{flag} {strength}: must be a number in (0, 1] (the part of the schedule run from the picture)")
    return float(strength)


def _open(path: str, flag: str, mode: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            return im.convert(mode)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise PocketdiffError(f"{flag} {path}: not an image PIL can read ({type(e).__name__}: {e})") from None


def _fitted(im, path: str, flag: str, width: int, height: int):
    """`im` at the bundle's size: as it is, or resized (same aspect ratio, one warning), else refused."""
    from PIL import Image

    w, h = im.size
    if (w, h) == (width, height):
        return im
    if w * height != h * width:
        raise PocketdiffError(f"{flag} {path}: {w}x{h} px has another aspect ratio than the bundle's {width}x{height} image; "
                              f"crop it to {width}:{height} (a picture is never stretched)")
    return im.resize((width, height), Image.LANCZOS)


def load_init_image(path: str, man: dict) -> tuple[np.ndarray, tuple[int, int]]:
    """(pixels [1, 3, H, W] float32 in [0, 1] at the bundle's size, the picture's own (width, height)); the caller warns
    when the two sizes differ (after every other check, so a refused run prints one line)."""
    im = _open(path, "--init-image", "RGB")
    size = im.size
    im = _fitted(im, path, "--init-image", int(man["image"]["width"]), int(man["image"]["height"]))
    pixels = np.asarray(im, dtype=np.float32) / 255.0
    return pixels.transpose(2, 0, 1)[None].copy(), size


def load_mask_pixels(path: str, man: dict, picture_size: tuple[int, int], picture: str) -> np.ndarray:
    """The binary mask at the bundle's image size [1, 1, H, W]: 1 = repaint (grey >= 0.5), 0 = keep the picture."""
    im = _open(path, "--mask", "L")
    if im.size != tuple(picture_size):
        raise PocketdiffError(f"--mask {path}: {im.size[0]}x{im.size[1]} px, but --init-image {picture} is "
                              f"{picture_size[0]}x{picture_size[1]}: give a mask of the picture's size")
    im = _fitted(im, path, "--mask", int(man["image"]["width"]), int(man["image"]["height"]))
    return (np.asarray(im, dtype=np.float32) / 255.0 >= 0.5).astype(np.float32)[None, None]


def latent_grid(binary: np.ndarray, man: dict) -> np.ndarray:
    """A binary pixel mask [1, 1, H, W] on the latent grid [1, 1, h, w]: each latent cell's top-left pixel."""
    f = int(man["latent"]["vae_factor"])
    return binary[..., ::f, ::f].copy()


def load_mask(path: str, man: dict, picture_size: tuple[int, int], picture: str) -> np.ndarray:
    """The mask on the latent grid [1, 1, h, w]: 1 = repaint, 0 = keep the picture."""
    return latent_grid(load_mask_pixels(path, man, picture_size, picture), man)


def masked_picture(pixels: np.ndarray, binary: np.ndarray) -> np.ndarray:
    """An inpainting UNet's masked picture: the repainted part grey (0.5; diffusers' 0 in [-1, 1]), the rest kept."""
    return (pixels * (1.0 - binary) + 0.5 * binary).astype(np.float32)


def strength_scheduler(block: dict, strength: float) -> Scheduler:
    """The bundle's scheduler on img2img's partial schedule; a strength that keeps no step is refused naming it."""
    try:
        return scheduler_for(block, check_strength(strength))
    except PocketdiffError as e:
        raise PocketdiffError(f"--strength {strength}: {e}") from None


class ImageStart:
    """The denoise loop from the user's picture: its start latents, then the scheduler's steps (blended under a mask)."""

    def __init__(self, scheduler: Scheduler, image_latents: np.ndarray, noise: np.ndarray, mask: Optional[np.ndarray] = None,
                 strength: float = 1.0, unet_inputs: Optional[dict] = None):
        self.scheduler, self.image_latents, self.noise, self.mask = scheduler, image_latents, noise, mask
        self.strength = strength
        # an inpainting UNet's mask and masked-picture latents (role -> [1, ...]): it repaints by itself, no blend
        self.unet_inputs = dict(unet_inputs or {})

    def start(self) -> np.ndarray:
        if self.mask is not None and self.strength == 1.0:  # inpainting from scratch: pure noise, as diffusers
            return self.noise
        return self.scheduler.add_noise(self.image_latents, self.noise, self.scheduler.timesteps[0])

    def blend(self, i: int, x: np.ndarray) -> np.ndarray:
        """After step i: the picture's latents, noised to the next timestep (none after the last), outside the mask."""
        if self.mask is None or self.unet_inputs:
            return x
        ts = self.scheduler.timesteps
        kept = self.image_latents if i + 1 == len(ts) else self.scheduler.add_noise(self.image_latents, self.noise, ts[i + 1])
        return (self.mask * x + (1.0 - self.mask) * kept).astype(np.float32)


# ------------------------------------------------------------------------------- run-bundle's flags


def check_image_flags(args) -> None:
    """--init-image / --strength / --mask that contradict each other or say nothing, before anything is read."""
    init, strength, mask = (getattr(args, k, None) for k in ("init_image", "strength", "mask"))
    if mask is not None and init is None:
        raise PocketdiffError(f"--mask {mask} masks the picture of --init-image: add --init-image PATH, or drop --mask")
    if strength is not None and init is None:
        raise PocketdiffError(f"--strength {strength} is how far a run from --init-image goes: add --init-image PATH, or drop it")
    if strength is not None:
        check_strength(strength)


def image_inputs(args, man: dict) -> dict:
    """run-bundle's picture, strength and mask ({} for text to image), read and checked against the bundle (its tasks,
    sizes and schedule) before --output is made: `BundleRunner.run(..., **image_inputs(args, man))`."""
    from .pipeline_spec import inpainting_unet, pipeline_of

    path = getattr(args, "init_image", None)
    if path is None:
        if inpainting_unet(man):
            raise PocketdiffError(f"bundle {args.bundle}: its UNet inpaints (a 9-channel StableDiffusionInpaintPipeline UNet): "
                                  "give --init-image PATH and --mask PATH")
        return {}
    mask_path = getattr(args, "mask", None)
    task, flag = (INPAINT, f"--mask {mask_path}") if mask_path is not None else (IMAGE_TO_IMAGE, f"--init-image {path}")
    tasks = pipeline_of(man).get("tasks") or []
    if task not in tasks and inpainting_unet(man):
        raise PocketdiffError(f"{flag}: bundle {args.bundle} serves inpaint only (its UNet inpaints): add --mask PATH")
    if task not in tasks:
        raise PocketdiffError(f"{flag}: bundle {args.bundle} serves {', '.join(tasks)}, not {task} (it has no image encoder "
                              f"stage): export it with tasks: [text_to_image, image_to_image, inpaint]")
    strength = DEFAULT_STRENGTH[task] if getattr(args, "strength", None) is None else args.strength
    strength_scheduler(man["scheduler"], strength)  # a strength that keeps none of the bundle's steps is refused here
    pixels, size = load_init_image(path, man)
    binary = load_mask_pixels(mask_path, man, size, path) if mask_path is not None else None
    mask = latent_grid(binary, man) if binary is not None else None
    width, height = int(man["image"]["width"]), int(man["image"]["height"])
    if size != (width, height):
        print(f"warning: --init-image {path} is {size[0]}x{size[1]} px; resized to the bundle's {width}x{height}", file=sys.stderr)
    out = {"init_image": pixels, "strength": float(strength), "mask": mask}
    if mask is not None and inpainting_unet(man):
        out["masked_image"] = masked_picture(pixels, binary)
    return out
