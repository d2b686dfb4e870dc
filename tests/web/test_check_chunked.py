"""The page's check mode on the chunked smoke bundle (tests/web/smoke_bundle_chunked: export unet_chunks=2
text_encoder_chunks=2, schema_version 2) in headless Chromium: text_encoder.0 and text_encoder.1 compile,
run on the prompt and the empty prompt, and are released one after another (web/static/chunks.js
runPartsOnEach); unet.0 and unet.1 compile one after another and run in sequence with their tensors passed
by name; each chunk passes its golden (every output: unet.0's stream and skip connections), and the image
matches run-bundle's from the same latents at >= 40 dB, the UNet's chunks kept resident or streamed
(`unet=streamed`: each compiled for each step and released after it); a malformed chunk block is refused
naming the field."""
from __future__ import annotations

import pytest

MIN_IMAGE_PSNR_DB = 40.0
TE_CHUNKS = ["text_encoder.0", "text_encoder.1"]
UNET_CHUNKS = ["unet.0", "unet.1"]
ORDER = [*TE_CHUNKS, *UNET_CHUNKS, "vae_decoder"]  # loaded (and reported) in this order


@pytest.fixture(scope="module")
def checked(tmp_path_factory, assemble_chunked, check_against_reference):
    # the reference image: run-bundle's, the chunks in sequence
    return check_against_reference(assemble_chunked(tmp_path_factory.mktemp("web_chunked") / "bundle"), MIN_IMAGE_PSNR_DB)


def test_the_smoke_bundle_holds_both_models_in_chunks(checked):
    man = checked["manifest"]
    assert man["schema_version"] == 2 and man["unet_chunks"]["components"] == UNET_CHUNKS
    assert man["text_encoder_chunks"]["components"] == TE_CHUNKS and man["guidance"]["unet_batch"] == 2  # both prompts
    assert "unet" not in man["components"] and len(man["components"]["unet.0"]["outputs"]) > 1
    assert "text_encoder" not in man["components"]
    assert [i["name"] for i in man["components"]["text_encoder.0"]["inputs"]] == ["input_ids"]
    assert [i["name"] for i in man["components"]["text_encoder.1"]["inputs"]] == ["hidden"]
    assert [o["name"] for o in man["components"]["text_encoder.1"]["outputs"]] == ["out"]


def test_chunked_bundle_check_mode_passes_on_webgpu(checked):
    r, man = checked["result"], checked["manifest"]
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["accelerator"] == "webgpu"
    assert list(r["components"]) == ORDER
    for name, c in r["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"] is True, name
        assert "skipped" not in c["golden"] and c["golden"]["pass"] is True, (name, c["golden"])
    for name in TE_CHUNKS:  # each chunk's own golden, at the manifest's tolerances, and its runs (two prompts)
        c = r["components"][name]
        assert c["golden"]["tolerances"] == man["components"][name]["golden"]["tolerances"]["fp16"], name
        assert c["golden"]["cosine"] >= 0.999 and c["run_ms"] > 0 and c["compile_ms"] > 0, (name, c)
    assert len(r["latency_ms"]["unet_steps_ms"]) == man["scheduler"]["steps"]


def test_chunked_page_image_matches_run_bundle_at_40_db(checked):
    img = checked["result"]["image"]
    assert img["min_psnr_db"] == MIN_IMAGE_PSNR_DB
    assert img["finite"] and img["psnr_db"] >= MIN_IMAGE_PSNR_DB, img


def test_streamed_chunks_compile_for_every_step_and_give_the_same_image(checked, check_against_reference):
    """The page option for UNets whose chunks do not fit together (LiteRT.js's 2 GB wasm heap at SD size); the
    text encoder's chunks are compiled once each either way (one at a time)."""
    steps = checked["manifest"]["scheduler"]["steps"]
    r = check_against_reference(checked["bundle"], MIN_IMAGE_PSNR_DB, unet="streamed")["result"]
    assert r["ok"] is True and r["unet"] == "streamed", r.get("failures") or r.get("error")
    assert list(r["components"]) == ORDER
    for name in UNET_CHUNKS:
        c = r["components"][name]
        assert c["compiles"] == steps + 1 and c["golden"]["pass"] is True, (name, c)  # once for its golden, then once a step
    for name in TE_CHUNKS:
        assert "compiles" not in r["components"][name] and r["components"][name]["golden"]["pass"] is True, name
    assert r["image"]["psnr_db"] >= MIN_IMAGE_PSNR_DB and len(r["latency_ms"]["unet_steps_ms"]) == steps
    # issue 50: each streamed chunk on a WebGPU device of its own, destroyed on release: nothing left alive
    assert r["gpu_device"] == "per-model" and r["gpu_memory"]["live_mb"] == 0 and r["gpu_memory"]["peak_mb"] > 0
    assert [d["models"] for d in r["gpu_memory"]["per_device"]].count(["unet.0"]) == steps + 1


def _drop_text_encoder_block(man: dict) -> None:
    del man["text_encoder_chunks"]


@pytest.mark.parametrize("edit, message", [
    (lambda man: man["unet_chunks"].update(components=["unet.1", "unet.0"]), "unet_chunks.components must list unet.0, unet.1"),
    (lambda man: man.update(schema_version=1), "a bundle with unet_chunks has schema version 2, got 1"),
    (lambda man: man["text_encoder_chunks"].update(components=["text_encoder.1", "text_encoder.0"]),
     "text_encoder_chunks.components must list text_encoder.0, text_encoder.1"),
    (lambda man: man["text_encoder_chunks"].update(components=["text_encoder.0"]),
     'text_encoder_chunks.components must list text_encoder.0, text_encoder.1, ... (at least two), got ["text_encoder.0"]'),
    (lambda man: (man.pop("unet_chunks"), man.update(schema_version=1)), "a bundle with text_encoder_chunks has schema version 2, got 1"),
    (lambda man: man["text_encoder_chunks"].update(components=[*TE_CHUNKS, "text_encoder.2"]), "bundle: has no text_encoder.2"),
    (_drop_text_encoder_block, "bundle: has no text_encoder (exported with components="),
])
def test_page_refuses_a_malformed_chunk_block_naming_the_field(checked, check_with_manifest, edit, message):
    r = check_with_manifest(checked["bundle"], edit)
    assert r["ok"] is False and message in r["error"], r["error"]
