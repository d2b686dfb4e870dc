"""Parity of a component's output with its reference: cosine, PSNR, max-abs; NaN/Inf fails.

PSNR is taken against the reference's own peak-to-peak range, so it means the same for an
image in [0, 1], a noise prediction and a hidden state. A bundle's golden tolerances
({cosine_min, psnr_min_db} per precision) are `Thresholds`; `check` names the component, the
precision, the metric, its value and the threshold key. The converter's parity config and its
hard stop are in pocketdiff.export.parity.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from pocketdiff.errors import ParityError, require


def metrics(reference: np.ndarray, output: np.ndarray) -> dict:
    ref = np.asarray(reference, dtype=np.float64).reshape(-1)
    out = np.asarray(output, dtype=np.float64).reshape(-1)
    if ref.shape != out.shape:
        raise ParityError(f"output has {out.size} values, reference {ref.size}")
    finite = bool(np.isfinite(out).all())
    n_nonfinite = int((~np.isfinite(out)).sum())
    if not finite:
        return {"finite": False, "nonfinite": n_nonfinite, "cosine": float("nan"), "psnr_db": float("nan"), "max_abs": float("inf")}
    diff = out - ref
    denom = np.linalg.norm(ref) * np.linalg.norm(out)
    cosine = float(ref @ out / denom) if denom > 0 else (1.0 if np.linalg.norm(diff) == 0 else 0.0)
    mse = float(np.mean(diff**2))
    peak = float(ref.max() - ref.min()) if ref.size else 0.0
    if mse == 0:
        psnr = float("inf")
    elif peak == 0:
        psnr = float("-inf")
    else:
        psnr = 10 * math.log10(peak**2 / mse)
    return {"finite": True, "nonfinite": 0, "cosine": cosine, "psnr_db": psnr, "max_abs": float(np.abs(diff).max())}


@dataclasses.dataclass
class Thresholds:
    cosine_min: float
    psnr_min_db: float

    def __post_init__(self) -> None:
        require(-1.0 <= self.cosine_min <= 1.0, "parity.cosine_min", f"must be in [-1, 1], got {self.cosine_min}")


def check(component: str, precision: str, m: dict, th: Thresholds) -> list[str]:
    """Failure messages (empty when `m` passes `th`)."""
    fails = []
    key = f"parity.{precision}"
    if not m["finite"]:
        fails.append(f"{component}: {m['nonfinite']} NaN/Inf values in the delegate's {precision} output")
        return fails
    if not m["cosine"] >= th.cosine_min:
        fails.append(f"{component}: {precision} cosine {m['cosine']:.6f} < {key}.cosine_min={th.cosine_min}")
    if not m["psnr_db"] >= th.psnr_min_db:
        fails.append(f"{component}: {precision} PSNR {m['psnr_db']:.2f} dB < {key}.psnr_min_db={th.psnr_min_db}")
    return fails
