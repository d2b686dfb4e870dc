"""The VAE encoder (export `tasks: [image_to_image | inpaint]`) against the device profile, at config time.

The encoder is exported whole: there is no tiled encoder. Its largest activations are at full resolution: the first
down block's resnets (channels x H x W) and its downsampler's input, padded by one row and column before the stride-2
conv (channels x (H + 1) x (W + 1)). Conv inputs are split by `rewrites.conv_budget_mb`, but these tensors are not; so
when `device_profile.enforce` holds a `max_tensor_mb` they exceed, the export is refused here, before any conversion,
naming the size (SD's encoder at 512 px: 128 x 513 x 513 at fp16 = 64.3 MB, over the phone profile's 64 MB). Shapes come
from the VAE's config (export/up_parts_check.vae_shape); an unreadable one is left to the check after conversion
(export/device_profile.check_component), which refuses the same graph by its measured tensors.
"""
from __future__ import annotations

from typing import Optional

from pocketdiff.errors import PocketdiffError

from .up_parts_check import vae_shape


def largest_encoder_tensor(vae_conf: dict, resolution: int) -> tuple[int, str]:
    """(elements, what) of the encoder's largest activation at `resolution` px (square)."""
    chans = [int(c) for c in vae_conf["block_out_channels"]]
    best, what, side, prev = 0, "", int(resolution), chans[0]
    for i, c in enumerate(chans):
        for n, label in ((max(prev, c) * side * side, f"down_blocks.{i} resnets [{max(prev, c)}, {side}, {side}]"),
                         ((c * (side + 1) ** 2, f"down_blocks.{i} downsampler's padded input [{c}, {side + 1}, {side + 1}]")
                          if i < len(chans) - 1 else (0, ""))):
            if n > best:
                best, what = n, label
        prev, side = c, side // 2
    return best, what


def precheck_encoder(model_cfg, int8_checkpoint: Optional[str], resolution: Optional[int], budgets: dict,
                     activation_bytes: int = 2) -> None:
    """Refuse image tasks whose whole encoder is over an enforced max_tensor_mb (resolution None: not known yet)."""
    limit = budgets.get("max_tensor_mb")
    conf = vae_shape(model_cfg, int8_checkpoint) if resolution and limit else None
    if conf is None:
        return
    n, what = largest_encoder_tensor(conf, resolution)
    mb = n * activation_bytes / 2**20
    if mb > limit:
        raise PocketdiffError(f"tasks: the image tasks' vae_encoder at {resolution} px holds {what}, {mb:.1f} MB at fp16, over "
                              f"device_profile.max_tensor_mb={limit}; the encoder is not tiled: export the image tasks at a "
                              "lower resolution, or with device_profile.enforce: false (the report then lists it over budget)")
