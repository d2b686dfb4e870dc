"""The VAE encoder (export `tasks: [image_to_image | inpaint]`) against the device profile, at config time.

The encoder's largest activations are at full resolution: the first down block's resnets (channels x H x W) and its
downsampler's input, padded by one row and column before the stride-2 conv (channels x (H + 1) x (W + 1)): SD's at
512 px, 128 x 513 x 513 at fp16 = 64.3 MB, over the phone profile's 64 MB; at 768 px the resnets are 144 MB. Conv
inputs are split by `rewrites.conv_budget_mb`, but these tensors are not; so when the device profile holds a
`max_tensor_mb` they exceed, the export runs the leading down blocks in row bands inside the one graph
(export/banded_encoder.py: the whole encoder's values, every tensor one band's size). `precheck_encoder` plans the
bands from the VAE's config alone (export/up_parts_check.vae_shape) before any model is built, and refuses only a size
no band count fits; an unreadable config is left to the plan at graph time and the check after conversion
(export/device_profile.check_component), which measures the converted graph's tensors.
"""
from __future__ import annotations

from typing import Optional

from .banded_encoder import plan_for_budget
from .up_parts_check import vae_shape


def precheck_encoder(model_cfg, int8_checkpoint: Optional[str], resolution: Optional[int], budgets: dict,
                     activation_bytes: int = 2) -> Optional[dict]:
    """The encoder's band plan under the enforced max_tensor_mb (None: resolution or budget or config not known yet);
    a size no band count fits raises PocketdiffError naming device_profile.max_tensor_mb."""
    limit = budgets.get("max_tensor_mb")
    conf = vae_shape(model_cfg, int8_checkpoint) if resolution and limit else None
    if conf is None:
        return None
    return plan_for_budget(conf["block_out_channels"], resolution, resolution, limit, activation_bytes)
