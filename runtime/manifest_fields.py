"""The manifest's own fields, checked against themselves (runtime/manifest_check.py checks the components and
files): image / latent sizes (latent x vae_factor = image), guidance mode and UNet batch, the scheduler block
(pocketdiff/scheduler_blocks.py's `block_problems`: the one reader of it, beside its writer and timestep
rules), tokenizer lengths and ids.

Each check appends a `Problem` (field, check, message) to a `Found` list; `FIELD_CHECKS` is their order.
numpy only.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from pocketdiff.names import GUIDANCE_MODES
from pocketdiff.scheduler_blocks import block_problems
GUIDANCE_BATCH = dict(zip(GUIDANCE_MODES, (2, 1, 1)))  # cfg, embedded, none


@dataclasses.dataclass(frozen=True)
class Problem:
    where: str  # manifest field (scheduler.timesteps[3]) or file (unet.tflite)
    check: str  # short name of the check (range, order, signature, size, ...)
    message: str

    def line(self, bundle: str | Path) -> str:
        return f"bundle {bundle}: {self.where}: {self.message} ({self.check} check)"


class Found:
    def __init__(self):
        self.items: list[Problem] = []

    def add(self, where: str, check: str, message: str) -> None:
        self.items.append(Problem(where, check, message))


# ------------------------------------------------------------------------------- helpers


def is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.number)) and not isinstance(v, bool)


def section(man: dict, key: str, found: Found) -> Optional[dict]:
    sec = man.get(key)
    if not isinstance(sec, dict):
        found.add(key, "present", "missing or not an object")
        return None
    return sec


def expect_shape(found: Found, where: str, got: list, want: list, what: str) -> None:
    """A declared shape against the one the manifest's sizes give (`what` names them)."""
    if got != want:
        found.add(where, "consistency", f"shape {got}, but {what} gives {want}")


def positive_ints(sec: dict, prefix: str, keys: Iterable[str], found: Found) -> bool:
    ok = True
    for k in keys:
        v = sec.get(k)
        if not is_int(v) or v <= 0:
            found.add(f"{prefix}.{k}", "type", f"must be a positive integer, got {v!r}")
            ok = False
    return ok


# ------------------------------------------------------------------------------- field checks


def _check_sizes(man: dict, found: Found) -> None:
    image, latent = section(man, "image", found), section(man, "latent", found)
    if image is None or latent is None:
        return
    img_ok = positive_ints(image, "image", ("height", "width", "channels"), found)
    lat_ok = positive_ints(latent, "latent", ("channels", "height", "width", "vae_factor"), found)
    if img_ok and image["channels"] != 3:
        found.add("image.channels", "value", f"must be 3 (RGB), got {image['channels']}")
    if img_ok and lat_ok:
        for k in ("height", "width"):
            if latent[k] * latent["vae_factor"] != image[k]:
                found.add(f"latent.{k}", "consistency", f"{latent[k]} x vae_factor {latent['vae_factor']} != image.{k} {image[k]}")


def _check_guidance(man: dict, found: Found) -> None:
    g = section(man, "guidance", found)
    if g is None:
        return
    mode = g.get("mode")
    if mode not in GUIDANCE_BATCH:
        found.add("guidance.mode", "value", f"must be one of {', '.join(GUIDANCE_BATCH)}, got {mode!r}")
    elif g.get("unet_batch") != GUIDANCE_BATCH[mode]:
        found.add("guidance.unet_batch", "consistency", f"must be {GUIDANCE_BATCH[mode]} with mode {mode}, got {g.get('unet_batch')!r}")
    scale = g.get("scale")
    if not is_num(scale) or not math.isfinite(scale):
        found.add("guidance.scale", "value", f"must be a finite number, got {scale!r}")


def _check_scheduler(man: dict, found: Found) -> None:
    s = section(man, "scheduler", found)
    if s is not None:
        found.items += [Problem(*p) for p in block_problems(s)]


def tokenizer_blocks(man: dict) -> list[str]:
    """The manifest's tokenizer blocks: `tokenizer`, and every other one an encode stage of the pipeline names (an SDXL
    bundle's `tokenizer_2`) that the manifest holds."""
    stages = (man.get("pipeline") or {}).get("stages") if isinstance(man.get("pipeline"), dict) else None
    named = [s.get("tokenizer") for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []
    return ["tokenizer"] + [k for k in dict.fromkeys(named) if isinstance(k, str) and k != "tokenizer" and isinstance(man.get(k), dict)]


def _check_tokenizer(man: dict, found: Found) -> None:
    for key in tokenizer_blocks(man):
        tok = section(man, key, found)
        if tok is None:
            continue
        positive_ints(tok, key, ("max_length",), found)
        for k in ("pad_id", "bos_id", "eos_id"):
            if k in tok or k == "pad_id":
                v = tok.get(k)
                if not is_int(v) or v < 0:
                    found.add(f"{key}.{k}", "type", f"must be a non-negative integer, got {v!r}")
        files = tok.get("files")
        if not isinstance(files, dict) or "tokenizer.json" not in files:
            found.add(f"{key}.files", "present", "must list tokenizer.json")


FIELD_CHECKS: tuple[Callable[[dict, Found], None], ...] = (_check_sizes, _check_guidance, _check_scheduler, _check_tokenizer)
