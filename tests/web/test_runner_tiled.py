"""run-bundle on the tiled smoke bundles (one-pass: tests/web/smoke_bundle_tiled; iterated statistics:
smoke_bundle_tiled_stats; one-pass with the up path in two graphs: smoke_bundle_tiled_parts), the reference the
page's tiled decode is compared with: pipelined, the decoder head runs and is released before the up tile loads
(never both on the GPU), each up-path part before the next, and the image is plain's."""
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


def test_up_path_in_parts_loads_one_part_at_a_time_and_decodes_as_one_graph(tmp_path, assemble_tiled, assemble_tiled_parts, gpu_delegate):
    """vae_up_tile.0 runs every tile and is released before vae_up_tile.1 opens; the image is the one-graph
    twin's up to the delegate's fp16 rounding of the hand-over between the parts (same weights, same tiles)."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    images, reports = {}, {}
    for name, assemble in (("one", assemble_tiled), ("parts", assemble_tiled_parts)):
        with BundleRunner(assemble(tmp_path / name), pipelined=True, gpu_cache=False) as runner:
            images[name], reports[name] = runner.run("a red circle", seed=3)
    phases = [(p["component"], p["phase"]) for p in reports["parts"]["memory"]["phases"]]
    assert phases.index((HEAD, "released")) < phases.index(("vae_up_tile.0", "opened"))
    assert phases.index(("vae_up_tile.0", "released")) < phases.index(("vae_up_tile.1", "opened")), phases
    assert (UP, "opened") not in phases
    lat = reports["parts"]["latency_s"]
    assert lat["vae_up_tile.0_run"] > 0 and lat["vae_up_tile.1_run"] > 0
    assert reports["parts"]["vae_up_tile_calls"] == reports["one"]["vae_up_tile_calls"] == 4
    err = np.abs(images["parts"].astype(np.float64) - images["one"]).max()
    assert err < 0.02, err


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
