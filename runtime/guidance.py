"""Classifier-free guidance as one declared step (the manifest's `guidance` block), applied the same way by every runner
(the page's twin: web/static/stages.js `Guidance`).

- `cfg` (`unet_batch` 2): each prompt role is encoded for the prompt and for the empty prompt, and the UNet's batch is
  `[unconditional, conditional]`; the latents and every per-sample role are repeated to the batch; the output is
  `out[0] + scale * (out[1] - out[0])`.
- `embedded` (the guidance is baked into the student) and `none` (`unet_batch` 1): the prompt alone, the output as it is.
- The unconditional rows: with `zero_unconditional` (the manifest's `pipeline.conditioning.zero_unconditional`, an SDXL
  base folder's `force_zeros_for_empty_prompt`), every prompt role's unconditional row is zeros of the conditional row's
  shape and the empty prompt is not encoded (diffusers' StableDiffusionXLPipeline with no negative prompt).
numpy only.
"""
from __future__ import annotations

import numpy as np


class Guidance:
    def __init__(self, block: dict, zero_unconditional: bool = False):
        self.mode, self.scale, self.batch = str(block["mode"]), float(block["scale"]), int(block["unet_batch"])
        self.zero_unconditional = bool(zero_unconditional)

    @property
    def unconditional(self) -> bool:
        """Whether the empty prompt is encoded too (its row goes first in the UNet's batch)."""
        return self.batch == 2 and not self.zero_unconditional

    def prompts(self, prompt: str) -> list[str]:
        """The prompts each encode stage runs on, in order: the prompt, then (cfg) the empty prompt."""
        return [prompt, ""] if self.unconditional else [prompt]

    def stack(self, rows: list[np.ndarray]) -> np.ndarray:
        """A prompt role's rows (in `prompts` order) as the UNet's batch: [uncond, cond] for cfg (uncond zeros under
        `zero_unconditional`)."""
        if self.batch == 2 and self.zero_unconditional:
            return np.concatenate([np.zeros_like(rows[0]), rows[0]])
        return rows[0] if len(rows) == 1 else np.concatenate([rows[1], rows[0]])

    def repeat(self, x: np.ndarray) -> np.ndarray:
        """A per-sample value ([1, ...]) repeated to the UNet's batch."""
        return np.concatenate([x] * self.batch) if self.batch > 1 else x

    def combine(self, out: np.ndarray) -> np.ndarray:
        """The UNet's batch output as the scheduler's model output."""
        return out[0:1] + self.scale * (out[1:2] - out[0:1]) if self.batch == 2 else out
