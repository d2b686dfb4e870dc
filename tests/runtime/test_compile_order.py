"""The order a pipelined runner compiles a chunked UNet in (runtime/compile_order.py): largest compile excess first,
from the runner's own marks of an earlier launch; the call order without them; the image the same either way."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pocketdiff.runtime.compile_order import CALL_ORDER, CHUNK_FIGURES, MEASURED, ChunkOrder, chunk_figures, compile_order
from pocketdiff.runtime.overlap import MemoryFigures, UnitFigures

SMOKE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_tiny"  # text encoder, 4 UNet chunks, decoder


def _figures(excess: dict[str, tuple[float, float]]) -> MemoryFigures:
    return MemoryFigures("b", "d", 0.0, {n: UnitFigures(peak, held, peak) for n, (peak, held) in excess.items()})


def _peak_at_once(order, figures) -> float:
    """The largest (what the chunks compiled before hold + this chunk's compile peak) over the loads."""
    held, worst = 0.0, 0.0
    for n in order:
        worst = max(worst, held + figures.units[n].peak_mb)
        held += figures.units[n].resident_mb
    return worst


def test_largest_excess_first_and_no_order_peaks_lower():
    import itertools

    figures = _figures({"unet.0": (800, 600), "unet.1": (370, 340), "unet.2": (380, 70), "unet.3": (730, 400)})
    order, source = compile_order(["unet.0", "unet.1", "unet.2", "unet.3"], figures)
    assert source == MEASURED and order == ["unet.3", "unet.2", "unet.0", "unet.1"]  # excess 330, 310, 200, 30
    best = min(_peak_at_once(p, figures) for p in itertools.permutations(order))
    assert _peak_at_once(order, figures) == best < _peak_at_once(["unet.0", "unet.1", "unet.2", "unet.3"], figures)


def test_call_order_without_figures_for_every_chunk():
    parts = ["unet.0", "unet.1", "unet.2"]
    assert compile_order(parts, None) == (parts, CALL_ORDER)
    assert compile_order(parts, _figures({"unet.0": (5, 1), "unet.2": (9, 1)})) == (parts, CALL_ORDER)


def test_figures_from_marks_rise_over_opened_and_skip_incomplete_chunks():
    marks = {"unet.0": [{"phase": "opened", "host_rss_mb": 100.0, "gpu_mb": 10.0},
                        {"phase": "compiled", "host_rss_mb": 300.0, "host_peak_mb": 400.0, "gpu_mb": 500.0, "gpu_peak_mb": 500.0},
                        {"phase": "settled", "host_rss_mb": 150.0, "host_peak_mb": 310.0, "gpu_mb": 300.0, "gpu_peak_mb": 520.0}],
             "unet.1": [{"phase": "opened", "host_rss_mb": 100.0, "gpu_mb": 10.0}]}
    got = chunk_figures(marks)
    assert list(got) == ["unet.0"]
    f = got["unet.0"]
    assert (f.peak_mb, f.resident_mb, f.host_peak_mb, f.gpu_peak_mb) == (790.0, 340.0, 300.0, 510.0)


def test_a_record_of_another_bundle_is_ignored_with_one_warning(tmp_path):
    (tmp_path / CHUNK_FIGURES).write_text(json.dumps(_figures({"unet.0": (9, 1), "unet.1": (5, 1)}).to_json()))
    said = []
    order = ChunkOrder(["unet.0", "unet.1"], tmp_path, ("another", "d"), said.append)
    assert (order.order, order.source) == (["unet.0", "unet.1"], CALL_ORDER)
    assert len(said) == 1 and "another bundle" in said[0]
    assert ChunkOrder(["unet.0", "unet.1"], tmp_path, ("b", "d"), said.append).order == ["unet.0", "unet.1"]  # 8 > 4: same


def test_a_second_pipelined_launch_compiles_in_the_measured_order_and_draws_the_same_image(gpu_delegate, tmp_path):
    from pocketdiff.runtime.run_bundle import BundleRunner

    def launch():
        with BundleRunner(SMOKE, pipelined=True, gpu_cache=tmp_path / "cache") as runner:
            image, stats = runner.run("a red circle", seed=5)
        opened = [p["component"] for p in stats["memory"]["phases"] if p["phase"] == "opened" and p["component"].startswith("unet.")]
        return image, stats["memory"]["unet_compile_order"], opened

    first, rep1, opened1 = launch()
    assert rep1["source"] == CALL_ORDER and opened1 == ["unet.0", "unet.1", "unet.2", "unet.3"]
    record = json.loads((tmp_path / "cache" / CHUNK_FIGURES).read_text())
    assert sorted(record["units"]) == opened1 and all(u["peak_mb"] >= u["resident_mb"] for u in record["units"].values())
    second, rep2, opened2 = launch()
    assert rep2["source"] == MEASURED and opened2 == rep2["order"] and sorted(opened2) == opened1
    np.testing.assert_array_equal(first, second)
