"""web/node_runner.mjs: the page's pipeline in Node.js on WebGPU through Dawn's Node bindings (npm webgpu),
here on the lavapipe Vulkan driver of setup (on a GPU machine the real one): the smoke bundle's image against
run-bundle's reference, the goldens, the report, the PNG, and its refusals."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py

RUNNER = Path(__file__).resolve().parents[2] / "web" / "node_runner.mjs"


@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


def _run(node: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return run_node_runner(node, *args, timeout=timeout)


def test_the_smoke_bundle_through_the_pages_pipeline_on_webgpu_matches_run_bundle(dawn, smoke_bundle, tmp_path):
    from pocketdiff.web.page import PageConfig, write_page

    write_page(PageConfig(bundle=str(smoke_bundle)))  # web/reference/: run-bundle's image from the same latents
    out, png = tmp_path / "report.json", tmp_path / "image.png"
    p = run_node_runner(dawn, str(smoke_bundle), "--out", str(out), "--image", str(png), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == []
    assert report["runner"] == "node" and report["adapter"]["vendor"]
    assert report["tokenizer"]["golden_ids_match"] is True
    assert set(report["components"]) == {"text_encoder", "unet", "vae_decoder"}
    for name, c in report["components"].items():
        assert c["accelerator"] == "webgpu" and c["fully_accelerated"], name
        assert c["golden"]["pass"], (name, c["golden"])
    assert report["image"]["psnr_db"] >= 40  # the same latents as run-bundle's reference, fp16 on the GPU
    assert report["latency_ms"]["unet_steps_ms"] and len(report["latency_ms"]["unet_steps_ms"]) == report["steps"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_without_a_manifest_is_refused_with_exit_2(dawn, tmp_path):
    p = _run(dawn, str(tmp_path), timeout=60)
    assert p.returncode == 2
    assert "has no manifest.json" in p.stderr and str(tmp_path) in p.stderr


def test_an_unknown_unet_mode_is_refused_naming_the_option(dawn, smoke_bundle):
    p = _run(dawn, str(smoke_bundle), "--unet", "sideways", timeout=60)
    assert p.returncode == 2
    assert "--unet: sideways" in p.stderr


def test_streamed_chunks_devices_are_destroyed_let_go_of_and_collected(dawn, assemble_tiny, tmp_path):
    """The tiny bundle's four UNet chunks streamed: every model's device is destroyed at its release, LiteRT.js's wasm
    object table lets go of it (before: every device, queue, pipeline and pipeline layout it was handed stayed there,
    so no device was ever garbage-collected, forced GC or not), and the runner's forced GC collects it; memory is
    sampled at each model's open, compiled and close."""
    bundle = assemble_tiny(tmp_path / "tiny")
    out = tmp_path / "report.json"
    p = _run(dawn, str(bundle), "--unet", "streamed", "--no-goldens", "--out", str(out))
    if p.returncode == 2 and "no WebGPU adapter" in p.stderr:
        pytest.skip("Dawn found no Vulkan device here (scripts/setup_vulkan.sh unpacks lavapipe)")
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    devices, events = report["devices"], report["memory_events"]
    compiles = [e["model"] for e in events if e["event"] == "compiled"]
    steps = report["steps"]
    # text encoder, each chunk once for its stage and once per step, decoder: a device each
    assert len(compiles) == devices["created"] == devices["destroyed"] == 1 + 4 * (steps + 1) + 1
    assert devices["wasm_refs_dropped"] >= 4 * devices["created"]  # a device, its queue, and its pipelines at least
    assert devices["collected"] >= devices["created"] - 2 and devices["forced_gc"]["runs"] >= devices["created"] - 2
    assert [e["event"] for e in events[:4]] == ["open", "compiled", "uploads_done", "close"]  # uploads settled first
    for e in events:
        alive = e["event"] in ("compiled", "uploads_done")
        assert e["devices_alive"] == (1 if alive else 0)
        assert {"epoch_s", "rss_mb", "wasm_heap_mb", "webgpu_live_mb", "devices_uncollected"} <= set(e)
        if not alive:
            assert e["webgpu_live_mb"] == 0
    assert events[-1]["devices_uncollected"] <= 2  # FinalizationRegistry reports a collection a task after it


def test_a_malformed_dawn_toggle_is_refused_naming_it(dawn, smoke_bundle):
    p = _run(dawn, str(smoke_bundle), "--dawn-toggle", "disable resource;rm", timeout=60)
    assert p.returncode == 2
    assert "--dawn-toggle" in p.stderr and "disable resource;rm" in p.stderr


def test_a_tiled_decoders_head_is_released_before_its_up_tile_compiles(dawn, assemble_tiled, tmp_path):
    """The page's pipeline runs the head once on the whole latent and gives its GPU memory back before the up tile
    compiles (as run-bundle --pipelined), so the two decoder graphs are never on the GPU together; the image still
    matches run-bundle's."""
    from pocketdiff.web.page import PageConfig, write_page

    bundle = assemble_tiled(tmp_path / "bundle")
    write_page(PageConfig(bundle=str(bundle)))
    out = tmp_path / "report.json"
    p = _run(dawn, str(bundle), "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    seen = [(e["event"], e["model"]) for e in report["memory_events"]]
    assert seen.index(("close", "vae_decoder_head")) < seen.index(("open", "vae_up_tile"))
    assert ("uploads_done", "vae_up_tile") in seen and report["settle_uploads"] is True
    assert report["components"]["vae_up_tile"]["calls"] == 4 and report["image"]["psnr_db"] >= 40


def test_fp16_precision_halves_the_weights_webgpu_holds_and_keeps_the_image(dawn, smoke_bundle, tmp_path):
    """--precision fp16: the text encoder and UNet at half precision on LiteRT.js's WebGPU path, their weight textures
    rgba16float instead of rgba32float, so the WebGPU bytes alive at the peak (the ledger, static/gpu_device.js) fall
    to about half; the decoder stays fp32 (at fp16 LiteRT.js returns zeros for it here); goldens and the image against
    run-bundle's reference pass as at fp32."""
    from pocketdiff.web.page import PageConfig, write_page

    write_page(PageConfig(bundle=str(smoke_bundle)))  # web/reference/: run-bundle's image from the same latents
    peaks = {}
    for precision in ("fp32", "fp16"):
        out = tmp_path / f"{precision}.json"
        p = _run(dawn, str(smoke_bundle), "--precision", precision, "--out", str(out), timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        rep = json.loads(out.read_text())
        assert rep["ok"] and rep["precision"] == precision and rep["decoder_precision"] == "fp32"
        assert rep["image"]["psnr_db"] >= 40, rep["image"]
        peaks[precision] = {d["models"][0]: d["peak_mb"] for d in rep["gpu_memory"]["per_device"]}
    assert peaks["fp16"]["text_encoder"] < 0.8 * peaks["fp32"]["text_encoder"], peaks


def test_a_decoder_with_lowered_convs_runs_at_fp16_too(dawn, lowered_decoder_bundle, tmp_path):
    """--decoder-precision fp16 on a decoder exported with its 3x3 convs as 1x1 taps (LiteRT.js's half-precision
    3x3 kernel is what breaks the plain smoke decoder): every component at fp16, goldens and the image against
    run-bundle's reference pass."""
    from pocketdiff.web.page import PageConfig, write_page

    write_page(PageConfig(bundle=str(lowered_decoder_bundle)))
    out = tmp_path / "fp16all.json"
    p = _run(dawn, str(lowered_decoder_bundle), "--precision", "fp16", "--decoder-precision", "fp16", "--out", str(out), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["precision"] == "fp16" and rep["decoder_precision"] == "fp16"
    assert {n: c["precision"] for n, c in rep["components"].items()} == dict.fromkeys(["text_encoder", "unet", "vae_decoder"], "fp16")
    assert rep["image"]["psnr_db"] >= 40, rep["image"]


@pytest.mark.parametrize("option", ["--precision", "--decoder-precision"])
def test_an_unknown_precision_is_refused_naming_the_option(dawn, smoke_bundle, option):
    p = _run(dawn, str(smoke_bundle), option, "fp8", timeout=120)
    assert p.returncode == 2 and f"{option}: fp8, expected fp32 or fp16" in p.stderr
