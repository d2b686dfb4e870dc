"""The manifest's own fields, checked against themselves (runtime/manifest_check.py checks the components and
files): image / latent sizes (latent x vae_factor = image), guidance mode and UNet batch, the DDIM schedule
(timesteps non-empty integers strictly inside [0, num_train_timesteps), `steps` of them, exactly as
`timestep_spacing` + `steps_offset` give them; an lcm one's on its training grid, runtime/lcm_step.py;
alphas_cumprod finite, in (0, 1], non-increasing, one per train timestep), tokenizer lengths and ids.

Each check appends a `Problem` (field, check, message) to a `Found` list; `FIELD_CHECKS` is their order.
numpy only.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from pocketdiff.names import GUIDANCE_MODES, MODEL_PREDICTION_TYPES, PREDICTION_TYPES

from .lcm_step import LCM, check_lcm_block

SPACINGS = ("leading", "trailing", "linspace")
SCHEDULER_TYPES = ("ddim", LCM)
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


def positive_ints(sec: dict, prefix: str, keys: Iterable[str], found: Found) -> bool:
    ok = True
    for k in keys:
        v = sec.get(k)
        if not is_int(v) or v <= 0:
            found.add(f"{prefix}.{k}", "type", f"must be a positive integer, got {v!r}")
            ok = False
    return ok


def spacing_timesteps(num_train_timesteps: int, steps: int, spacing: str, steps_offset: int = 0) -> list[int]:
    """Descending DDIM timesteps as `DDIMScheduler.set_timesteps` gives them (numpy only; the
    same rule as pocketdiff.sampling.ddim_timesteps)."""
    T = int(num_train_timesteps)
    if spacing == "leading":
        ts = (np.arange(0, steps) * (T // steps)).round()[::-1].astype(np.int64) + int(steps_offset)
    elif spacing == "trailing":
        ts = np.round(np.arange(T, 0, -T / steps)).astype(np.int64) - 1
    elif spacing == "linspace":
        ts = np.linspace(0, T - 1, steps).round()[::-1].astype(np.int64)
    else:
        raise ValueError(f"unknown timestep spacing {spacing!r}")
    return [int(t) for t in ts]


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
    if s is None:
        return
    stype = s.get("type", "ddim")
    if stype not in SCHEDULER_TYPES:
        found.add("scheduler.type", "value", f"must be one of {', '.join(SCHEDULER_TYPES)}, got {stype!r}")
        stype = "ddim"  # the remaining fields checked as ddim's
    ptypes = PREDICTION_TYPES if stype == LCM else MODEL_PREDICTION_TYPES
    if s.get("prediction_type") not in ptypes:
        found.add("scheduler.prediction_type", "value", f"must be {' or '.join(ptypes)}, got {s.get('prediction_type')!r}")
    if stype == "ddim" and s.get("eta", 0.0) != 0:
        found.add("scheduler.eta", "value", f"the runner is deterministic DDIM (eta 0), got {s.get('eta')!r}")
    T, steps = s.get("num_train_timesteps"), s.get("steps")
    if not is_int(T) or T <= 0:
        found.add("scheduler.num_train_timesteps", "type", f"must be a positive integer, got {T!r}")
        T = None
    if not is_int(steps) or steps <= 0:
        found.add("scheduler.steps", "type", f"must be a positive integer, got {steps!r}")
        steps = None

    ts = s.get("timesteps")
    ts_ok = False
    if not isinstance(ts, list) or not ts:
        found.add("scheduler.timesteps", "present", f"must be a non-empty list, got {ts!r}")
    else:
        ts_ok = True
        for i, t in enumerate(ts):
            if not is_int(t):
                found.add(f"scheduler.timesteps[{i}]", "type", f"must be an integer, got {t!r}")
                ts_ok = False
            elif T is not None and not 0 <= t < T:
                found.add(f"scheduler.timesteps[{i}]", "range", f"{t} is outside [0, {T}) (num_train_timesteps)")
                ts_ok = False
        if ts_ok and any(a <= b for a, b in zip(ts, ts[1:])):
            i = next(i for i, (a, b) in enumerate(zip(ts, ts[1:])) if a <= b)
            found.add(f"scheduler.timesteps[{i + 1}]", "order", f"{ts[i + 1]} after {ts[i]}: timesteps must strictly decrease")
            ts_ok = False
        if ts_ok and steps is not None and len(ts) != steps:
            found.add("scheduler.timesteps", "consistency", f"{len(ts)} timesteps but scheduler.steps is {steps}")
            ts_ok = False
    if stype == LCM:
        found.items += [Problem(*p) for p in check_lcm_block(s, T, steps, ts_ok)]
    else:
        _check_ddim_spacing(s, T, steps, ts_ok, found)
    _check_alphas(s, T, stype, found)


def _check_ddim_spacing(s: dict, T: Optional[int], steps: Optional[int], ts_ok: bool, found: Found) -> None:
    ts = s.get("timesteps")
    spacing, offset = s.get("timestep_spacing", "leading"), s.get("steps_offset", 0)
    if spacing not in SPACINGS:
        found.add("scheduler.timestep_spacing", "value", f"must be one of {', '.join(SPACINGS)}, got {spacing!r}")
    elif not is_int(offset) or offset < 0:
        found.add("scheduler.steps_offset", "type", f"must be a non-negative integer, got {offset!r}")
    elif ts_ok and T is not None and steps is not None and steps <= T:
        want = spacing_timesteps(T, steps, spacing, offset)
        if list(ts) != want:
            i = next(i for i, (a, b) in enumerate(zip(ts, want)) if a != b)
            found.add(f"scheduler.timesteps[{i}]", "spacing", f"{ts[i]}, but {spacing} spacing over {T} with steps_offset {offset} "
                      f"gives {want[i]} ({want[:8]}{' ...' if len(want) > 8 else ''})")


def _check_alphas(s: dict, T: Optional[int], stype: str, found: Found) -> None:
    alphas = s.get("alphas_cumprod")
    if not isinstance(alphas, list) or not alphas:
        found.add("scheduler.alphas_cumprod", "present", "must be a non-empty list")
    else:
        bad = next((i for i, a in enumerate(alphas) if not is_num(a)), None)
        if bad is not None:
            found.add(f"scheduler.alphas_cumprod[{bad}]", "type", f"must be a number, got {alphas[bad]!r}")
        else:
            a = np.asarray(alphas, dtype=np.float64)
            wrong = np.flatnonzero(~np.isfinite(a) | (a <= 0) | (a > 1))
            if wrong.size:
                i = int(wrong[0])
                more = f" ({wrong.size} such values)" if wrong.size > 1 else ""
                found.add(f"scheduler.alphas_cumprod[{i}]", "range", f"{alphas[i]!r} is not finite in (0, 1]{more}")
            elif np.any(np.diff(a) > 0):
                i = int(np.flatnonzero(np.diff(a) > 0)[0]) + 1
                found.add(f"scheduler.alphas_cumprod[{i}]", "order", f"{alphas[i]} rises above {alphas[i - 1]}: a cumulative product never increases")
            if T is not None and len(alphas) != T:
                found.add("scheduler.alphas_cumprod", "consistency", f"{len(alphas)} values, num_train_timesteps is {T}")
    final = s.get("final_alpha_cumprod")
    if stype == "ddim" and (not is_num(final) or not math.isfinite(final) or not 0 < final <= 1):
        found.add("scheduler.final_alpha_cumprod", "range", f"must be finite in (0, 1], got {final!r}")


def _check_tokenizer(man: dict, found: Found) -> None:
    tok = section(man, "tokenizer", found)
    if tok is None:
        return
    positive_ints(tok, "tokenizer", ("max_length",), found)
    for k in ("pad_id", "bos_id", "eos_id"):
        if k in tok or k == "pad_id":
            v = tok.get(k)
            if not is_int(v) or v < 0:
                found.add(f"tokenizer.{k}", "type", f"must be a non-negative integer, got {v!r}")
    files = tok.get("files")
    if not isinstance(files, dict) or "tokenizer.json" not in files:
        found.add("tokenizer.files", "present", "must list tokenizer.json")


FIELD_CHECKS: tuple[Callable[[dict, Found], None], ...] = (_check_sizes, _check_guidance, _check_scheduler, _check_tokenizer)
