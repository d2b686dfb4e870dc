"""The page's check mode on the iterated-statistics tiled smoke bundle (tests/web/smoke_bundle_tiled_stats,
vae_tiling.scheme control_variate, 3 passes) in headless Chromium: the up tile's two outputs (pixels and
the norms' sums) go back into the next pass in JS (web/static/tiled.js `statsDecode`), and the image
matches run-bundle's from the same latents at >= 40 dB."""
from __future__ import annotations

import pytest

MIN_IMAGE_PSNR_DB = 40.0
ORDER = ["text_encoder", "unet", "vae_decoder_head", "vae_up_tile"]


@pytest.fixture(scope="module")
def checked(tmp_path_factory, assemble_tiled_stats, check_against_reference):
    # the reference image: run-bundle's tiled decode (runtime/tiled_decode.tiled_decode_with_stats)
    return check_against_reference(assemble_tiled_stats(tmp_path_factory.mktemp("web_tiled_stats") / "bundle"), MIN_IMAGE_PSNR_DB)


def test_iterated_statistics_bundle_check_mode_passes_on_webgpu(checked):
    r, man = checked["result"], checked["manifest"]
    block = man["vae_tiling"]
    assert block["scheme"] == "control_variate" and block["passes"] == 3 and "vae_decoder" not in man["components"]
    assert r["ok"] is True, r["failures"]
    assert list(r["components"]) == ORDER
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["golden"]["pass"] is True, (name, c["golden"])
    assert r["latency_ms"]["vae_up_tile_calls"] == 3 * 4  # 3 passes x 2 x 2 tiles


def test_iterated_statistics_page_image_matches_run_bundle_at_40_db(checked):
    img = checked["result"]["image"]
    assert img["reference"] == "reference/image.bin" and img["min_psnr_db"] == MIN_IMAGE_PSNR_DB
    assert img["finite"] and img["psnr_db"] >= MIN_IMAGE_PSNR_DB, img
