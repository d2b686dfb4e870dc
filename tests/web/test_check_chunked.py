"""The page's check mode on the chunked-UNet smoke bundle (tests/web/smoke_bundle_chunked: export
unet_chunks=2, schema_version 2) in headless Chromium: unet.0 and unet.1 compile one after another, run
in sequence with their tensors passed by name (web/static/chunks.js), each passes its golden (every
output of unet.0: the stream and the skip connections), and the image matches run-bundle's from the same
latents at >= 40 dB, kept resident or streamed (`unet=streamed`: each chunk compiled for each step and
released after it); a malformed chunk block is refused naming the field."""
from __future__ import annotations

import pytest

MIN_IMAGE_PSNR_DB = 40.0
ORDER = ["text_encoder", "unet.0", "unet.1", "vae_decoder"]  # loaded (and reported) in this order


@pytest.fixture(scope="module")
def checked(tmp_path_factory, assemble_chunked, check_against_reference):
    # the reference image: run-bundle's, the chunks in sequence
    return check_against_reference(assemble_chunked(tmp_path_factory.mktemp("web_chunked") / "bundle"), MIN_IMAGE_PSNR_DB)


def test_chunked_bundle_check_mode_passes_on_webgpu(checked):
    r, man = checked["result"], checked["manifest"]
    assert man["schema_version"] == 2 and man["unet_chunks"]["components"] == ["unet.0", "unet.1"]
    assert "unet" not in man["components"] and len(man["components"]["unet.0"]["outputs"]) > 1
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["accelerator"] == "webgpu"
    assert list(r["components"]) == ORDER
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"] is True, name
        assert c["golden"]["pass"] is True, (name, c["golden"])
    assert len(r["latency_ms"]["unet_steps_ms"]) == man["scheduler"]["steps"]


def test_chunked_page_image_matches_run_bundle_at_40_db(checked):
    img = checked["result"]["image"]
    assert img["min_psnr_db"] == MIN_IMAGE_PSNR_DB
    assert img["finite"] and img["psnr_db"] >= MIN_IMAGE_PSNR_DB, img


def test_streamed_chunks_compile_for_every_step_and_give_the_same_image(checked, check_against_reference):
    """The page option for UNets whose chunks do not fit together (LiteRT.js's 2 GB wasm heap at SD size)."""
    steps = checked["manifest"]["scheduler"]["steps"]
    r = check_against_reference(checked["bundle"], MIN_IMAGE_PSNR_DB, unet="streamed")["result"]
    assert r["ok"] is True and r["unet"] == "streamed", r.get("failures") or r.get("error")
    assert list(r["components"]) == ORDER
    for name in ("unet.0", "unet.1"):
        c = r["components"][name]
        assert c["compiles"] == steps + 1 and c["golden"]["pass"] is True, (name, c)  # once for its golden, then once a step
    assert r["image"]["psnr_db"] >= MIN_IMAGE_PSNR_DB and len(r["latency_ms"]["unet_steps_ms"]) == steps


@pytest.mark.parametrize("edit, message", [
    (lambda man: man["unet_chunks"].update(components=["unet.1", "unet.0"]), "unet_chunks.components must list unet.0, unet.1"),
    (lambda man: man.update(schema_version=1), "a bundle with unet_chunks has schema version 2, got 1"),
])
def test_page_refuses_a_malformed_chunk_block_naming_the_field(checked, check_with_manifest, edit, message):
    r = check_with_manifest(checked["bundle"], edit)
    assert r["ok"] is False and message in r["error"], r["error"]
