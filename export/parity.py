"""The converter's parity thresholds: `ParityConfig` (the `parity:` config block, per precision
the delegate ran at) and `enforce`, which raises ParityError. The metrics and the check are the
runtime's (`pocketdiff.runtime.parity`), the same ones verify-bundle applies to a bundle's goldens.
"""
from __future__ import annotations

import dataclasses

from pocketdiff.errors import ParityError
from pocketdiff.runtime.parity import Thresholds, check


@dataclasses.dataclass
class ParityConfig:
    """Named thresholds per precision the delegate ran at (fp16: its default; fp32: enforce_f32)."""

    fp16: Thresholds = dataclasses.field(default_factory=lambda: Thresholds(cosine_min=0.999, psnr_min_db=30.0))
    fp32: Thresholds = dataclasses.field(default_factory=lambda: Thresholds(cosine_min=0.99999, psnr_min_db=60.0))
    enforce: bool = True  # False: report only
    encoder_bands_psnr_db: float = 60.0  # the banded VAE encoder vs the whole one, both torch fp32 (export/banded_encoder.py)

    def for_precision(self, precision: str) -> Thresholds:
        return self.fp16 if precision == "fp16" else self.fp32


def enforce(component: str, precision: str, m: dict, th: Thresholds) -> None:
    fails = check(component, precision, m, th)
    if fails:
        raise ParityError("; ".join(fails))
