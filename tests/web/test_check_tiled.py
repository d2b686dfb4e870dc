"""The page's check mode on the one-pass tiled smoke bundle (tests/web/smoke_bundle_tiled) in headless
Chromium: the decoder's head and up tile run in JS (web/static/tiled.js) and the image matches
run-bundle's from the same latents at >= 40 dB; an unknown scheme is refused by name."""
from __future__ import annotations

import json

import pytest

from pocketdiff.web.headless import check_page

MIN_IMAGE_PSNR_DB = 40.0
ORDER = ["text_encoder", "unet", "vae_decoder_head", "vae_up_tile"]  # loaded (and reported) in this order


@pytest.fixture(scope="module")
def checked(tmp_path_factory, assemble_tiled, check_against_reference):
    # the reference image: run-bundle's one-pass decode (runtime/onepass_decode.py)
    return check_against_reference(assemble_tiled(tmp_path_factory.mktemp("web_tiled") / "bundle"), MIN_IMAGE_PSNR_DB)


def test_tiled_bundle_check_mode_passes_on_webgpu(checked):
    r, man = checked["result"], checked["manifest"]
    assert man["vae_tiling"]["scheme"] == "one_pass" and "vae_decoder" not in man["components"]
    assert r["ok"] is True, r["failures"]
    assert r["accelerator"] == "webgpu"
    assert list(r["components"]) == ORDER
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"] is True, name
        assert c["golden"]["pass"] is True, (name, c["golden"])
    assert r["components"]["vae_up_tile"]["calls"] == r["latency_ms"]["vae_up_tile_calls"] == 4  # 2 x 2 tiles, each once


def test_tiled_page_image_matches_run_bundle_at_40_db(checked):
    img = checked["result"]["image"]
    assert img["reference"] == "reference/image.bin" and img["min_psnr_db"] == MIN_IMAGE_PSNR_DB
    assert img["finite"] and img["psnr_db"] >= MIN_IMAGE_PSNR_DB, img
    assert (img["height"], img["width"]) == (checked["manifest"]["image"]["height"], checked["manifest"]["image"]["width"])


def test_tiled_wasm_path_matches_run_bundle_closely(checked, chromium):
    """fp32 on both sides (wasm CPU here, LiteRT's CPU in run-bundle): what is left is summation
    order, so a blend mistake shows (ignoring the margin's zero weights gives 40.7 dB on this
    bundle, still above the contract's 40; a correct page 81.8 dB)."""
    ref = json.loads((checked["bundle"] / "web/reference/reference.json").read_text())
    r = check_page(checked["bundle"], prompt=ref["prompt"], seed=ref["seed"], timeout_s=600, executable=chromium,
                   accelerator="wasm", min_image_psnr=60.0)
    assert r["failures"] == ["ran on wasm, not WebGPU (chosen on the page)"]  # only the accelerator
    assert list(r["components"]) == ORDER and all(c["golden"]["precision"] == "fp32" for c in r["components"].values())
    assert r["image"]["psnr_db"] >= 60.0


def test_page_refuses_an_unknown_scheme_by_name(checked, check_with_manifest):
    r = check_with_manifest(checked["bundle"], lambda man: man["vae_tiling"].update(scheme="per_tile"))
    assert r["ok"] is False
    assert 'vae_tiling.scheme "per_tile"' in r["error"] and "one_pass, plain, control_variate" in r["error"]
