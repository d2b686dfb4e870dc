"""An inpainting UNet (StableDiffusionInpaintPipeline folders: in_channels = latents + mask + masked-picture latents)
against the export config: it serves inpaint only (`tasks: [inpaint]`), is exported whole (`unet_chunks: 1`) and without
the fp16 scan (`fp16_scan.enabled: false`: the scan samples text to image), refused in one line otherwise, at config time where the folder's unet/config.json says so, else once the model is loaded."""
from __future__ import annotations

import json
from pathlib import Path

from pocketdiff.errors import require


def inpaints(unet_config) -> bool:
    """A diffusers UNet config (its unet/config.json, or a loaded UNet's .config) of an inpainting UNet: in_channels =
    latents + mask + masked-picture latents (2 x out_channels + 1)."""
    return int(unet_config.get("in_channels", 4)) == 2 * int(unet_config.get("out_channels", 4)) + 1


def check_inpainting_export(cfg) -> None:
    """An inpainting UNet (9 channels) serves inpaint only, and runs whole: refused in one line otherwise."""
    require(list(cfg.tasks) == ["inpaint"], "tasks", f"the model's UNet inpaints (latents + mask + masked-picture latents): "
                                                     f"it serves inpaint only, set tasks: [inpaint], got {cfg.tasks!r}")
    require(cfg.unet_chunks == 1, "unet_chunks", f"an inpainting UNet is exported whole (its mask inputs feed the first "
                                                 f"chunk only), got {cfg.unet_chunks}")
    require(not cfg.fp16_scan.enabled, "fp16_scan.enabled", "must be false for an inpainting UNet: the scan samples text "
                                                            "to image, which it cannot (it draws from a picture and a mask)")


def precheck_inpainting(cfg) -> None:
    """check_inpainting_export at config time, where the model is a folder whose unet/config.json says it inpaints."""
    from pocketdiff.shipped import resolve_shipped

    if not cfg.model.pretrained:
        return
    try:
        conf = json.loads((Path(resolve_shipped(str(cfg.model.pretrained))).expanduser() / "unet" / "config.json").read_text())
        inpainting = inpaints(conf)
    except (OSError, ValueError, TypeError, AttributeError):
        return  # a hub id or an unreadable config: checked once the model is loaded
    if inpainting:
        check_inpainting_export(cfg)
