"""benchmarks/decoder_paths.py's pooled-statistics estimator (the unadopted option (a) of the decoder study)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.tiled_decode import first_pass_corrections

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("decoder_paths_bench", ROOT / "benchmarks" / "decoder_paths.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_lowres_stats_pool_the_features_and_refuse_a_factor_that_does_not_divide(bench):
    norms = (2, 4)  # two norms of four groups
    seen = {}

    def up_low(features, weight, stats, own):  # an up path whose norm sums are those of its input, per group
        seen["shape"], seen["own"] = features.shape, own
        np.testing.assert_array_equal(stats, first_pass_corrections(norms))
        g = features.reshape(4, -1).astype(np.float64)
        sums = np.stack([np.stack([g.sum(1), (g * g).sum(1), np.full(4, g.shape[1] * 1.0)])] * 2)  # (sum, squares, weight)
        return features, sums

    feats = np.arange(1 * 8 * 4 * 6, dtype=np.float32).reshape(1, 8, 4, 6)
    stats = bench.lowres_stats(feats, up_low, 2, norms)
    assert seen["shape"] == (1, 8, 2, 3) and seen["own"].tolist() == [1.0]
    pooled = feats.reshape(1, 8, 2, 2, 3, 2).mean(axis=(3, 5)).reshape(4, -1)
    np.testing.assert_allclose(stats[0, 0], pooled.mean(1), rtol=1e-6)  # per-group means of the pooled features
    with pytest.raises(PocketdiffError, match="lowres_stats: features 3x6 do not divide by the statistics pass's factor 2"):
        bench.lowres_stats(feats[:, :, :3], up_low, 2, norms)
