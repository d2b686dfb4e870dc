"""The manifest's `scheduler` block, in one place (numpy only: the runtime imports it).

Per scheduler type (`ddim`, `lcm`): the timestep rule, the block written from a diffusers scheduler config
(`block_for`), the block read back and checked (`block_problems`), img2img's `strength` and `add_noise`.
Export writes the block through `block_for`; the torch samplers (pocketdiff.sampling, consistency_sampling)
take their timesteps from `ddim_timesteps` / `lcm_timesteps`; the runtime's field check
(runtime/manifest_fields.py) calls `block_problems` and its schedulers (runtime/schedulers.py, run-bundle,
verify-bundle) `timesteps_for`. web/static/schedulers.js + lcm.js are the page's twin; the vectors in
tests/data/scheduler_vectors.json (scripts/make_scheduler_vectors.py, from diffusers) check all three.

Rules, as diffusers' schedulers give them:
- ddim: `leading` (i * (T // N) + steps_offset), `trailing` (round(T - i * T / N) - 1) or `linspace`
  (round(linspace(0, T - 1, N))), descending. `steps_offset` has no default here: diffusers' DDIMScheduler
  config says 0, SD checkpoints ship 1, so a block carries it and `ddim_timesteps` takes it by keyword. Read
  from a diffusers config (`ddim_fields`), a missing value is diffusers' own default (what that scheduler
  object runs with).
- lcm: N evenly spaced points, from the top down, of the K-point training grid t_n = (n + 1) (T // K) - 1
  (K = `original_inference_steps`).
- img2img (`strength` s in (0, 1]): ddim keeps the last int(N s) of the N timesteps (diffusers' img2img
  `get_timesteps`; the step keeps T // N as its stride); lcm takes its N points from the grid's first
  int(K s) points (LCMScheduler.set_timesteps(strength=s)); timesteps given as a list (a manifest's) keep
  their last int(n s), as diffusers does with custom timesteps. The start is
  `add_noise(x0, noise, a_t) = sqrt(a_t) x0 + sqrt(1 - a_t) noise` at the first kept timestep.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .errors import PocketdiffError
from .names import MODEL_PREDICTION_TYPES, PREDICTION_TYPES

DDIM, LCM = "ddim", "lcm"
SCHEDULER_TYPES = (DDIM, LCM)
SPACINGS = ("leading", "trailing", "linspace")
LCM_SIGMA_DATA = 0.5  # fixed in diffusers' LCMScheduler and in pocketdiff's consistency sampler

Problem = tuple[str, str, str]  # (field, check, message), e.g. ("scheduler.timesteps[3]", "order", "...")


# ------------------------------------------------------------------------------- timestep rules


def ddim_timesteps(num_train_timesteps: int, steps: int, *, spacing: str, steps_offset: int) -> list[int]:
    """Descending DDIM timesteps, as `DDIMScheduler.set_timesteps(steps)` gives them."""
    T, n, offset = int(num_train_timesteps), int(steps), int(steps_offset)
    if not 1 <= n <= T:
        raise PocketdiffError(f"steps must be in [1, {T}] (num_train_timesteps), got {n}")
    if spacing == "leading":
        ts = (np.arange(0, n) * (T // n)).round()[::-1].astype(np.int64) + offset
    elif spacing == "trailing":
        ts = np.round(np.arange(T, 0, -T / n)).astype(np.int64) - 1
    elif spacing == "linspace":
        ts = np.linspace(0, T - 1, n).round()[::-1].astype(np.int64)
    else:
        raise PocketdiffError(f"timestep_spacing must be one of {', '.join(SPACINGS)}, got {spacing!r}")
    if ts.max() >= T or ts.min() < 0:  # a large offset; numpy's float arange gives trailing one step too many (61 of 1000)
        bad = int(ts.max()) if ts.max() >= T else int(ts.min())
        raise PocketdiffError(f"{n} {spacing} steps with steps_offset {offset} give timestep {bad}, outside [0, {T})")
    return [int(t) for t in ts]


def _strength(strength: Any) -> float:
    if not (_is_num(strength) and math.isfinite(strength) and 0 < strength <= 1):
        raise PocketdiffError(f"strength must be a number in (0, 1], got {strength!r}")
    return float(strength)


def lcm_timesteps(num_train_timesteps: int, original_inference_steps: int, steps: int, strength: float = 1.0) -> list[int]:
    """Descending timesteps of an N-step run on the K-point training grid; with strength s < 1 on its first
    int(K s) points (LCMScheduler.set_timesteps(N, original_inference_steps=K, strength=s))."""
    T, K, N, s = int(num_train_timesteps), int(original_inference_steps), int(steps), _strength(strength)
    if not 1 <= K <= T:
        raise PocketdiffError(f"original_inference_steps must be in [1, {T}], got {K}")
    if not 1 <= N <= K:
        raise PocketdiffError(f"a consistency student trained on a {K}-point grid samples with 1 to {K} steps, got {N}")
    usable = int(K * s)
    if usable < N:
        raise PocketdiffError(f"strength {s} keeps {usable} of the {K}-point grid's points, fewer than the {N} steps")
    grid = (np.arange(1, usable + 1, dtype=np.int64) * (T // K) - 1)[::-1]
    idx = np.floor(np.linspace(0, usable, num=N, endpoint=False)).astype(np.int64)
    return [int(t) for t in grid[idx]]


def strength_timesteps(timesteps: Sequence[int], strength: float) -> list[int]:
    """The last min(int(n s), n) of n timesteps (diffusers' img2img `get_timesteps`); none kept is refused."""
    n, s = len(timesteps), _strength(strength)
    keep = min(int(n * s), n)
    if keep < 1:
        raise PocketdiffError(f"strength {s} keeps none of the {n} steps (int({n} x {s}) = 0): raise strength or steps")
    return [int(t) for t in list(timesteps)[n - keep:]]


def timesteps_for(block: Mapping, steps: int, strength: float = 1.0) -> list[int]:
    """The timesteps of a `steps`-step run (img2img: `strength` < 1) under a scheduler block's rule."""
    kind, T = block.get("type", DDIM), int(block["num_train_timesteps"])
    if kind == LCM:
        return lcm_timesteps(T, int(block["original_inference_steps"]), steps, strength)
    if kind != DDIM:
        raise PocketdiffError(f"bundle: scheduler type {kind!r} is not supported (the runtime runs {', '.join(SCHEDULER_TYPES)})")
    for key in ("timestep_spacing", "steps_offset"):
        if key not in block:
            raise PocketdiffError(f"scheduler.{key}: a ddim block carries it (no default)")
    full = ddim_timesteps(T, steps, spacing=block["timestep_spacing"], steps_offset=block["steps_offset"])
    return strength_timesteps(full, strength)


def add_noise(x0: np.ndarray, noise: np.ndarray, alpha_cumprod_t: float) -> np.ndarray:
    """x0 noised to a timestep whose alphas_cumprod is a_t: sqrt(a_t) x0 + sqrt(1 - a_t) noise (float32)."""
    a = float(alpha_cumprod_t)
    return (math.sqrt(a) * np.asarray(x0, np.float32) + math.sqrt(1.0 - a) * np.asarray(noise, np.float32)).astype(np.float32)


# ------------------------------------------------------------------------------- writing a block


def _get(config: Any, key: str, default: Any) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def ddim_fields(config: Any) -> dict:
    """A diffusers scheduler config's DDIM timestep fields, explicit: its own values, diffusers' defaults
    (`leading`, offset 0) where it has none."""
    return {"timestep_spacing": str(_get(config, "timestep_spacing", "leading")),
            "steps_offset": int(_get(config, "steps_offset", 0))}


def clip_sample_range(config: Any, what: str) -> Optional[float]:
    """A diffusers scheduler config's x0 clipping: its `clip_sample_range` when `clip_sample` is on, else None (no
    clipping). Dynamic thresholding, which no runner implements, is refused naming WHAT (the scheduler's owner)."""
    if _get(config, "thresholding", False):
        raise PocketdiffError(f"{what}: the scheduler uses dynamic thresholding, which the bundle's runners do not implement; "
                              "set thresholding: false in its scheduler_config.json")
    return float(_get(config, "clip_sample_range", 1.0)) if _get(config, "clip_sample", False) else None


def lcm_fields(config: Any) -> dict:
    """A diffusers LCMScheduler config's fields the bundle's consistency step reads (LCMScheduler's defaults
    where it has none); a scheduler the step does not implement (dynamic thresholding) is refused."""
    clip = clip_sample_range(config, "model.pretrained: the consistency student")
    return {"original_inference_steps": int(_get(config, "original_inference_steps", 50)),
            "timestep_scaling": float(_get(config, "timestep_scaling", 10.0)),
            "sigma_data": float(LCM_SIGMA_DATA), "clip_sample_range": clip}


def config_timesteps(scheduler_type: str, config: Any, steps: int) -> list[int]:
    """The timesteps `block_for` writes for `steps` (export's golden inputs take theirs from here); a step
    count off the scheduler's range is refused naming `steps`."""
    T = int(_get(config, "num_train_timesteps", 1000))
    fields = lcm_fields(config) if scheduler_type == LCM else ddim_fields(config)
    try:
        return timesteps_for({"type": scheduler_type, "num_train_timesteps": T, **fields}, steps)
    except PocketdiffError as e:
        raise PocketdiffError(f"steps: {e}") from None


def block_for(scheduler_type: str, config: Any, steps: int, alphas_cumprod: Sequence[float],
              final_alpha_cumprod: Optional[float] = None) -> dict:
    """manifest.json's `scheduler` from a diffusers scheduler config (`scheduler.config`), the step count and
    the scheduler's alphas_cumprod. ddim's `final_alpha_cumprod`: as given, else DDIMScheduler's rule
    (1 with `set_alpha_to_one`, its default, else alphas_cumprod[0])."""
    if scheduler_type not in SCHEDULER_TYPES:
        raise PocketdiffError(f"scheduler type {scheduler_type!r} has no manifest block (types: {', '.join(SCHEDULER_TYPES)})")
    alphas = [float(a) for a in np.asarray(alphas_cumprod, dtype=np.float64)]
    head = {"type": scheduler_type, "prediction_type": str(_get(config, "prediction_type", "epsilon")),
            "num_train_timesteps": int(_get(config, "num_train_timesteps", 1000)), "steps": int(steps),
            "timesteps": config_timesteps(scheduler_type, config, steps), "alphas_cumprod": alphas}
    if scheduler_type == LCM:
        return {**head, **lcm_fields(config)}
    if final_alpha_cumprod is None:
        final_alpha_cumprod = 1.0 if _get(config, "set_alpha_to_one", True) else alphas[0]
    clip = clip_sample_range(config, "model.pretrained")  # written only when on: blocks of non-clipping DDIMs unchanged
    return {**head, "final_alpha_cumprod": float(final_alpha_cumprod), **ddim_fields(config), "eta": 0.0,
            **({} if clip is None else {"clip_sample_range": clip})}


# ------------------------------------------------------------------------------- reading a block


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float, np.number)) and not isinstance(v, bool)


def _is_positive(v: Any) -> bool:
    return _is_num(v) and math.isfinite(v) and v > 0


def _first_difference(ts: list, want: list) -> int:
    return next(i for i, (a, b) in enumerate(zip(ts, want)) if a != b)


def _head(want: list) -> str:
    return f"{want[:8]}{' ...' if len(want) > 8 else ''}"


def block_problems(s: Mapping) -> list[Problem]:
    """Every problem of a manifest's `scheduler` block, in order: type, prediction type, eta, T, steps, the
    timesteps (integers in [0, T), strictly decreasing, `steps` of them, exactly the type's rule), the
    type's own fields, alphas_cumprod (and ddim's final_alpha_cumprod)."""
    out: list[Problem] = []
    stype = s.get("type", DDIM)
    if stype not in SCHEDULER_TYPES:
        out.append(("scheduler.type", "value", f"must be one of {', '.join(SCHEDULER_TYPES)}, got {stype!r}"))
        stype = DDIM  # the remaining fields checked as ddim's
    ptypes = PREDICTION_TYPES if stype == LCM else MODEL_PREDICTION_TYPES
    if s.get("prediction_type") not in ptypes:
        out.append(("scheduler.prediction_type", "value", f"must be {' or '.join(ptypes)}, got {s.get('prediction_type')!r}"))
    if stype == DDIM and s.get("eta", 0.0) != 0:
        out.append(("scheduler.eta", "value", f"the runner is deterministic DDIM (eta 0), got {s.get('eta')!r}"))
    T, steps = s.get("num_train_timesteps"), s.get("steps")
    if not _is_int(T) or T <= 0:
        out.append(("scheduler.num_train_timesteps", "type", f"must be a positive integer, got {T!r}"))
        T = None
    if not _is_int(steps) or steps <= 0:
        out.append(("scheduler.steps", "type", f"must be a positive integer, got {steps!r}"))
        steps = None
    ts_ok = _timestep_problems(s.get("timesteps"), T, steps, out)
    out += (lcm_field_problems if stype == LCM else ddim_field_problems)(s, T, steps, ts_ok)
    out += _alpha_problems(s, T, stype)
    return out


def _timestep_problems(ts: Any, T: Optional[int], steps: Optional[int], out: list[Problem]) -> bool:
    """Appends the timesteps' own problems; True when they are fit to compare with the rule."""
    if not isinstance(ts, list) or not ts:
        out.append(("scheduler.timesteps", "present", f"must be a non-empty list, got {ts!r}"))
        return False
    ok = True
    for i, t in enumerate(ts):
        if not _is_int(t):
            out.append((f"scheduler.timesteps[{i}]", "type", f"must be an integer, got {t!r}"))
            ok = False
        elif T is not None and not 0 <= t < T:
            out.append((f"scheduler.timesteps[{i}]", "range", f"{t} is outside [0, {T}) (num_train_timesteps)"))
            ok = False
    if ok and any(a <= b for a, b in zip(ts, ts[1:])):
        i = next(i for i, (a, b) in enumerate(zip(ts, ts[1:])) if a <= b)
        out.append((f"scheduler.timesteps[{i + 1}]", "order", f"{ts[i + 1]} after {ts[i]}: timesteps must strictly decrease"))
        ok = False
    if ok and steps is not None and len(ts) != steps:
        out.append(("scheduler.timesteps", "consistency", f"{len(ts)} timesteps but scheduler.steps is {steps}"))
        ok = False
    return ok


def ddim_field_problems(s: Mapping, T: Optional[int], steps: Optional[int], ts_ok: bool) -> list[Problem]:
    """timestep_spacing and steps_offset (both carried, no default), the timesteps they give, clip_sample_range."""
    missing = [k for k in ("timestep_spacing", "steps_offset") if k not in s]
    if missing:
        return [(f"scheduler.{missing[0]}", "present", "missing: a ddim block carries it (no default; diffusers' DDIMScheduler "
                 "says steps_offset 0, SD checkpoints 1)")]
    spacing, offset = s["timestep_spacing"], s["steps_offset"]
    if spacing not in SPACINGS:
        return [("scheduler.timestep_spacing", "value", f"must be one of {', '.join(SPACINGS)}, got {spacing!r}")]
    if not _is_int(offset) or offset < 0:
        return [("scheduler.steps_offset", "type", f"must be a non-negative integer, got {offset!r}")]
    clip = _clip_problems(s)
    if clip:
        return clip
    if not (ts_ok and T is not None and steps is not None and steps <= T):
        return []
    ts = list(s["timesteps"])
    try:
        want = ddim_timesteps(T, steps, spacing=spacing, steps_offset=offset)
    except PocketdiffError as e:
        return [("scheduler.steps_offset", "range", str(e))]
    if ts == want:
        return []
    i = _first_difference(ts, want)
    return [(f"scheduler.timesteps[{i}]", "spacing",
             f"{ts[i]}, but {spacing} spacing over {T} with steps_offset {offset} gives {want[i]} ({_head(want)})")]


def lcm_field_problems(s: Mapping, T: Optional[int], steps: Optional[int], ts_ok: bool) -> list[Problem]:
    """original_inference_steps, the timesteps on its grid, timestep_scaling, sigma_data, clip_sample_range."""
    out: list[Problem] = []
    K = s.get("original_inference_steps")
    if not _is_int(K) or K <= 0 or (T is not None and K > T):
        out.append(("scheduler.original_inference_steps", "type",
                    f"must be an integer in [1, num_train_timesteps={T}] (the student's training grid), got {K!r}"))
    elif steps is not None and steps > K:
        out.append(("scheduler.steps", "range", f"{steps} steps, but a student trained on a {K}-point grid samples with 1 to {K}"))
    elif ts_ok and T is not None and steps is not None:
        want, ts = lcm_timesteps(T, K, steps), list(s["timesteps"])
        if ts != want:
            i = _first_difference(ts, want)
            out.append((f"scheduler.timesteps[{i}]", "spacing",
                        f"{ts[i]}, but {steps} lcm steps on the {K}-point grid over {T} give {want[i]} ({_head(want)})"))
    for key in ("timestep_scaling", "sigma_data"):
        if not _is_positive(s.get(key)):
            out.append((f"scheduler.{key}", "value", f"must be a finite number > 0 (the boundary scalings), got {s.get(key)!r}"))
    return out + _clip_problems(s)


def _clip_problems(s: Mapping) -> list[Problem]:
    """clip_sample_range: null or absent (no clipping; ddim blocks written before it was carried) or a number > 0."""
    clip = s.get("clip_sample_range")
    if clip is not None and not _is_positive(clip):
        return [("scheduler.clip_sample_range", "value", f"must be null (no clipping) or a finite number > 0, got {clip!r}")]
    return []


def _alpha_problems(s: Mapping, T: Optional[int], stype: str) -> list[Problem]:
    """alphas_cumprod: T numbers, finite, in (0, 1], non-increasing; ddim's final_alpha_cumprod in (0, 1]."""
    out: list[Problem] = []
    alphas = s.get("alphas_cumprod")
    if not isinstance(alphas, list) or not alphas:
        out.append(("scheduler.alphas_cumprod", "present", "must be a non-empty list"))
    else:
        bad = next((i for i, a in enumerate(alphas) if not _is_num(a)), None)
        if bad is not None:
            out.append((f"scheduler.alphas_cumprod[{bad}]", "type", f"must be a number, got {alphas[bad]!r}"))
        else:
            a = np.asarray(alphas, dtype=np.float64)
            wrong = np.flatnonzero(~np.isfinite(a) | (a <= 0) | (a > 1))
            if wrong.size:
                i = int(wrong[0])
                more = f" ({wrong.size} such values)" if wrong.size > 1 else ""
                out.append((f"scheduler.alphas_cumprod[{i}]", "range", f"{alphas[i]!r} is not finite in (0, 1]{more}"))
            elif np.any(np.diff(a) > 0):
                i = int(np.flatnonzero(np.diff(a) > 0)[0]) + 1
                out.append((f"scheduler.alphas_cumprod[{i}]", "order",
                            f"{alphas[i]} rises above {alphas[i - 1]}: a cumulative product never increases"))
            if T is not None and len(alphas) != T:
                out.append(("scheduler.alphas_cumprod", "consistency", f"{len(alphas)} values, num_train_timesteps is {T}"))
    final = s.get("final_alpha_cumprod")
    if stype == DDIM and (not _is_num(final) or not math.isfinite(final) or not 0 < final <= 1):
        out.append(("scheduler.final_alpha_cumprod", "range", f"must be finite in (0, 1], got {final!r}"))
    return out
