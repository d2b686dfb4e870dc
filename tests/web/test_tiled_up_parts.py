"""The page's one-pass tiled decode (web/static/tiled.js) with the up path split in parts (vae_tiling.components:
vae_decoder_head, vae_up_tile.0 ... vae_up_tile.K-1, issue 50), under node with plain JS functions (no GPU): part-major
runs give the whole up tile's image (and runtime/onepass_decode.py's), a part returning the wrong tiles is refused, and
the tiling validator and the split path's manifest check refuse what the page cannot run, naming the field."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

HARNESS = Path(__file__).resolve().parent / "tiled_parts_harness.mjs"
HEAD, UP = "vae_decoder_head", "vae_up_tile"
CASES = [  # (h, w, tile, overlap, margin, factor, first part's scale)
    (10, 10, 6, 2, 1, 4, 2),  # 2 x 2 tiles
    (9, 13, [5, 7], 2, 1, 4, 2),  # rectangular tiles, 3 x 2
    (8, 8, 8, 0, 0, 2, 1),  # one tile
]


def _run(node: str, tmp_path: Path, request: dict) -> dict:
    req = tmp_path / "request.json"
    req.write_text(json.dumps(request))
    res = subprocess.run([node, str(HARNESS), str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def _case(h, w, tile, overlap, margin, factor, scale, seed=0, **extra) -> dict:
    lat = np.random.default_rng(seed).standard_normal((1, 4, h, w)).astype(np.float32)
    return {"height": h, "width": w, "tile": tile, "overlap": overlap, "margin": margin, "factor": factor, "first_scale": scale,
            "channels": 4, "latents": lat.ravel().tolist(), **extra}


def _numpy_decode(case: dict) -> np.ndarray:
    """runtime/onepass_decode.py with the harness's head (2 x latents) and whole up tile (nearest x f of the first 3
    channels + 0.01 x (row + column) in the tile)."""
    from pocketdiff.runtime.onepass_decode import one_pass_decode

    f = case["factor"]

    def up(t):
        th, tw = t.shape[-2:]
        base = np.kron(t[:, :3], np.ones((f, f), dtype=np.float32))
        return base + 0.01 * np.add.outer(np.arange(th * f), np.arange(tw * f)).astype(np.float32)

    lat = np.asarray(case["latents"], dtype=np.float32).reshape(1, 4, case["height"], case["width"])
    return one_pass_decode(lat, lambda z: 2 * z, up, case["tile"], case["overlap"], f, case["margin"])


def _tiles(case: dict) -> int:
    from pocketdiff.runtime.onepass_decode import tile_hw
    from pocketdiff.runtime.tiled_decode import tile_starts

    th, tw = tile_hw(case["tile"])
    return len(tile_starts(case["height"], th, case["overlap"])) * len(tile_starts(case["width"], tw, case["overlap"]))


def test_a_split_up_path_run_part_major_gives_the_whole_up_tiles_image(node, tmp_path):
    cases = [_case(*c, seed=i, parts=parts) for i, c in enumerate(CASES) for parts in (0, 1, 2, 3)]
    out = _run(node, tmp_path, {"decodes": cases})
    for case, got in zip(cases, out["decodes"]):
        assert "error" not in got, got.get("error")
        want = _numpy_decode(case)
        assert got["shape"] == list(want.shape)
        np.testing.assert_allclose(np.asarray(got["image"], dtype=np.float32).reshape(want.shape), want, rtol=0, atol=1e-5)
        n = _tiles(case)
        assert got["calls"] == n  # tiles, not tiles x parts
        parts = max(case["parts"], 1)
        assert got["log"] == [f"{k}:{i}" for k in range(parts) for i in range(n)]  # every tile through part k, then k + 1
    for i in range(len(CASES)):  # the same arithmetic in the same order: bit for bit the whole up tile's image
        whole, *split = out["decodes"][4 * i:4 * i + 4]
        assert all(s["image"] == whole["image"] for s in split)


@pytest.mark.parametrize("extra, says, ran", [
    ({"parts": 2, "wrong_count": 0}, "up part 0 of 2 returned 3 tiles for 4 tiles", ["0:0", "0:1", "0:2", "0:3"]),
    ({"parts": 3, "wrong_count": 1}, "up part 1 of 3 returned 3 tiles for 4 tiles", [f"{k}:{i}" for k in (0, 1) for i in range(4)]),
    ({"parts": 2, "last_shape_wrong": True}, "the up path's last part (of 3) returned [1,3,1,", None),
    ({"parts": 0, "last_shape_wrong": True}, "the up tile returned [1,3,1,", None),
    ({"parts": 2, "no_parts": True}, "the up path must be a function or a non-empty array of part functions", []),
    ({"parts": 2, "not_a_function": True}, "the up path must be a function or a non-empty array of part functions", []),
])
def test_an_up_part_returning_the_wrong_tiles_is_refused(node, tmp_path, extra, says, ran):
    out = _run(node, tmp_path, {"decodes": [_case(*CASES[0], **extra)]})
    got = out["decodes"][0]
    assert got.get("error", "").startswith("TilingError: one-pass decode: "), got
    assert says in got["error"]
    if ran is not None:
        assert got["log"] == ran  # refused at once: no later part runs


ONE_PASS = {"scheme": "one_pass", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 1}
STATS = {"scheme": "control_variate", "tile": 6, "overlap": 2, "margin": 1, "factor": 4, "passes": 3, "norms": [3, 2]}
SPLIT = [HEAD, f"{UP}.0", f"{UP}.1"]


def test_the_tiling_validator_checks_the_components_list(node, tmp_path):
    blocks = [
        ONE_PASS,  # no key: the classic two
        {**ONE_PASS, "components": [HEAD, UP]},
        {**ONE_PASS, "components": SPLIT},
        {**ONE_PASS, "components": [HEAD, *(f"{UP}.{k}" for k in range(4))]},
        {**STATS, "components": [HEAD, UP]},
        {**STATS, "components": SPLIT},  # refused from here on
        {**ONE_PASS, "components": [HEAD]},
        {**ONE_PASS, "components": [HEAD, f"{UP}.1", f"{UP}.0"]},
        {**ONE_PASS, "components": [f"{UP}.0", f"{UP}.1", HEAD]},
        {**ONE_PASS, "components": [HEAD, f"{UP}.0"]},  # one part is the classic name
        {**ONE_PASS, "components": [HEAD, UP, f"{UP}.0"]},
        {**ONE_PASS, "components": f"{HEAD},{UP}"},
        {**ONE_PASS, "components": [HEAD, f"{UP}.0", f"{UP}.2"]},
    ]
    out = _run(node, tmp_path, {"blocks": blocks})
    assert out["problems"][:5] == [None] * 5
    assert out["components"][:4] == [[HEAD, UP], [HEAD, UP], SPLIT, [HEAD, *(f"{UP}.{k}" for k in range(4))]]
    stats, *bad = out["problems"][5:]
    assert stats.startswith("bundle: vae_tiling.components ") and "only scheme one_pass" in stats and "control_variate" in stats
    for block, problem in zip(blocks[6:], bad):
        assert problem is not None and problem.startswith("bundle: vae_tiling.components must be "), block
        assert json.dumps(block["components"], separators=(",", ":")) in problem and "\n" not in problem


def _io(name: str, shape: list) -> list:
    return [{"name": name, "shape": shape, "dtype": "float32"}]


def _split_manifest(edits: dict | None = None) -> dict:
    """A manifest with the up path in two parts: features [1, 64, 6, 6] -> hidden [1, 32, 12, 12] -> pixels [1, 3, 24, 24]."""
    comps = {HEAD: {"inputs": _io("latents", [1, 4, 8, 8]), "outputs": _io("output_0", [1, 64, 8, 8])},
             f"{UP}.0": {"inputs": _io("features", [1, 64, 6, 6]), "outputs": _io("output_0", [1, 32, 12, 12])},
             f"{UP}.1": {"inputs": _io("hidden", [1, 32, 12, 12]), "outputs": _io("output_0", [1, 3, 24, 24])}}
    for (name, key), value in (edits or {}).items():
        comps[name][key] = value
    return {"vae_tiling": {**ONE_PASS, "components": SPLIT}, "components": comps}


def test_a_split_up_paths_manifest_entries_must_chain(node, tmp_path):
    manifests = [
        _split_manifest(),
        {"vae_tiling": ONE_PASS, "components": {}},  # unsplit: nothing to chain
        _split_manifest({(f"{UP}.1", "inputs"): _io("features", [1, 32, 12, 12])}),
        _split_manifest({(f"{UP}.1", "inputs"): _io("hidden", [1, 32, 6, 6])}),
        _split_manifest({(f"{UP}.0", "inputs"): _io("hidden", [1, 64, 6, 6])}),
        _split_manifest({(f"{UP}.0", "inputs"): _io("features", [1, 64, 8, 8])}),
        _split_manifest({(f"{UP}.0", "outputs"): [*_io("a", [1, 32, 12, 12]), *_io("b", [1, 32, 12, 12])]}),
        _split_manifest({(f"{UP}.1", "outputs"): _io("output_0", [1, 3, 12, 12])}),
        {"vae_tiling": {**ONE_PASS, "components": SPLIT}, "components": {f"{UP}.0": _split_manifest()["components"][f"{UP}.0"]}},
    ]
    ok, unsplit, *bad = _run(node, tmp_path, {"manifests": manifests})["chains"]
    assert ok is None and unsplit is None
    says = [
        "bundle: vae_up_tile.1's input must be named hidden, got \"features\"",
        "bundle: vae_up_tile.1's input hidden [1,32,6,6] must be vae_up_tile.0's output shape [1,32,12,12]",
        "bundle: vae_up_tile.0's input must be named features, got \"hidden\"",
        "bundle: vae_up_tile.0's input features must be [1, F, 6, 6] (the tile), got [1,64,8,8]",
        "bundle: vae_up_tile.0.outputs must be exactly one tensor",
        "bundle: vae_up_tile.1's output (the pixels) must be [1, C, 24, 24], got [1,3,12,12]",
        "bundle: vae_tiling.components names vae_up_tile.1, which manifest.components lacks",
    ]
    assert len(bad) == len(says)
    for got, want in zip(bad, says):
        assert got is not None and got.startswith(want), (got, want)
