"""run-bundle on the tiled smoke bundles (one-pass: tests/web/smoke_bundle_tiled; iterated statistics:
smoke_bundle_tiled_stats), the reference the page's tiled decode is compared with: pipelined, the decoder head
runs and is released before the up tile loads (never both on the GPU), and the image is plain's."""
from __future__ import annotations

import json

import numpy as np
import pytest

HEAD, UP = "vae_decoder_head", "vae_up_tile"


@pytest.fixture(scope="module", params=["one_pass", "control_variate"])
def tiled_bundle(request, tmp_path_factory, assemble_tiled, assemble_tiled_stats):
    assemble = assemble_tiled if request.param == "one_pass" else assemble_tiled_stats
    bundle = assemble(tmp_path_factory.mktemp(f"runner_{request.param}"))
    assert json.loads((bundle / "manifest.json").read_text())["vae_tiling"]["scheme"] == request.param
    return bundle


def test_pipelined_tiled_decode_holds_one_decoder_graph_at_a_time(tiled_bundle, gpu_delegate):
    from pocketdiff.runtime.run_bundle import BundleRunner

    images, reports = {}, {}
    for pipelined in (False, True):
        with BundleRunner(tiled_bundle, pipelined=pipelined, gpu_cache=False) as runner:
            images[pipelined], reports[pipelined] = runner.run("a red circle", seed=3)
    assert np.array_equal(images[True], images[False])
    phases = [(p["component"], p["phase"]) for p in reports[True]["memory"]["phases"]]
    assert phases.index((HEAD, "first_run")) < phases.index((HEAD, "released")) < phases.index((UP, "opened")), phases
    assert phases.index((UP, "first_run")) < phases.index((UP, "released"))
    lat = reports[True]["latency_s"]
    assert lat["vae_decoder_head_run"] > 0 and lat["vae_tiled_decode"] >= lat["vae_decoder_head_run"] + lat["vae_up_tiles_run"]
    assert reports[True]["vae_up_tile_calls"] == reports[False]["vae_up_tile_calls"] > 1
